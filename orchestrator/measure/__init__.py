"""Measurement arithmetic that every floor reads: statistics of windows (stats.py), the warmup
plan from a config (plan.py), and the typed results with the job's figure of a window
(results.py). It imports no torch and nothing of runtime/, so the parent's merge, the tuner and
the benchmarks use it without the rank's hot path."""
