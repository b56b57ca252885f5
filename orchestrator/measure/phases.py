"""The phases a step's wall time is split into (they tile it; runtime/meter.py's docstring says
what each holds): the rank's meter marks them by index, the reports read their names."""

PHASES = ("other", "data", "h2d", "compute", "comm", "optimizer")
OTHER, DATA, H2D, COMPUTE, COMM, OPTIMIZER = range(len(PHASES))  # what `StepMeter.mark` takes
BUSY = ("compute", "optimizer")  # the busy phases: utilization counts them
