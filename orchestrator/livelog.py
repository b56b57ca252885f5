"""The ranks' events, read live while a job runs: MLflow metrics (rank and job level, each
window's job figure), the live progress line, and the caller's monitor of the windows (the
tuner's pruner), which can ask the job to stop."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from .measure.results import WindowFigures, job_window, pooled_in_time
from .progress import JobProgress
from .rundir import Event
from .stores import store_error
from .tracking import Tracker, eval_points


# monitor(window ordinal, job-level window metrics) -> True to stop the job
Monitor = Callable[[int, Dict[str, float]], bool]


class LiveLog:
    """Turns the ranks' events into MLflow metrics and the live progress (progress.JobProgress:
    step/total, loss, samples/s, ETA) while the job runs. The metrics go to MLflow in one batch
    every FLUSH_S seconds and at the job's end (`flush`), not at every event: one write to a
    SQLite store takes ~29 ms of the parent's CPU on 2 cores, and a write per event would take
    about a quarter of a study's wall time from the ranks it measures."""

    FLUSH_S = 5.0
    # a point of the window metrics (the job's, each rank's) pools its windows' figures until they
    # span this many measured seconds: windows of 20 steps of a sub-millisecond step would write
    # hundreds of points a second (pooled_in_time; the pruner and the progress line see every window)
    POINT_S = 1.0

    def __init__(self, tracker: Tracker, world_size: int, progress: Optional[JobProgress] = None,
                 monitor: Optional[Monitor] = None) -> None:
        self.tracker, self.world, self.progress, self.monitor = tracker, world_size, progress, monitor
        self.pending: List[tuple[str, float, int]] = []
        self.flushed = time.monotonic()
        self.stop = False
        self.windows: Dict[int, Dict[int, Event]] = {}  # window ordinal -> rank -> event
        self.seen: Dict[int, int] = {}  # rank -> windows seen
        self.loader: Dict[str, float] = {}  # the loader autotune's current settings, logged with each window
        self.measured = [0.0, 0.0]  # samples and seconds of the job's measured windows so far
        self.pools: Dict[int, List[WindowFigures]] = {}  # rank (-1: the job) -> its windows not logged yet
        # a resume redoes the steps after its checkpoint, to the same losses (the same RNG and data
        # order): the earlier attempt's points there stand, none is logged twice
        self.logged_until = -1

    def __call__(self, batch: List[tuple[int, Event]]) -> None:
        points: List[tuple[str, float, int]] = []
        for rank, ev in batch:
            kind, step = ev.get("type"), int(ev.get("step", 0))  # type: ignore[arg-type]
            if kind == "start" and rank == 0 and self.progress is not None:
                self.progress.start(int(ev["total_steps"]))  # type: ignore[typeddict-item]
            elif kind == "resume" and rank == 0 and self.progress is not None:
                self.progress.resumed(step)
            elif kind == "loader" and rank == 0:  # the loader autotune's settings, from this step on
                self.loader = {"loader/num_workers": float(ev["num_workers"]),  # type: ignore[typeddict-item]
                               "loader/prefetch_factor": float(ev["effective_prefetch"])}  # type: ignore[typeddict-item]
                points += [(k, v, step) for k, v in self.loader.items()]
            elif kind == "log":
                if step > self.logged_until:
                    points.append(("loss" if rank == 0 else f"rank{rank}/loss", ev["loss"], step))  # type: ignore[arg-type]
                if rank == 0 and self.progress is not None:
                    self.progress.update(step, loss=float(ev["loss"]))  # type: ignore[typeddict-item]
            elif kind == "eval":  # rank 0's evaluation over the validation set: val/loss, val/<metric>
                points += eval_points(ev, step)  # type: ignore[arg-type]
                if self.progress is not None:
                    self.progress.update(val_loss=float(ev["val_loss"]))  # type: ignore[typeddict-item]
            elif kind == "balance":
                points += [(f"rank{r}/share", share, step) for r, share in enumerate(ev["shares"])]  # type: ignore[typeddict-item]
            elif kind == "window":
                if self.world > 1:
                    points += self._pooled(rank, WindowFigures.from_event(ev))
                n = self.seen.get(rank, 0)
                self.seen[rank] = n + 1
                group = self.windows.setdefault(n, {})
                group[rank] = ev
                if len(group) == self.world:  # every rank closed this window: job-level point
                    del self.windows[n]
                    fig = job_window([WindowFigures.from_event(e) for e in group.values()])
                    job = fig.metrics()
                    points += self._pooled(-1, fig)
                    if self.progress is not None:
                        self.progress.update(throughput=self._measured_rate(fig))
                    if self.monitor is not None and self.monitor(n, job):
                        self.stop = True
        self.pending += points
        if self.pending and time.monotonic() - self.flushed >= self.FLUSH_S:
            self.flush()

    def _pooled(self, key: int, fig: WindowFigures) -> List[tuple[str, float, int]]:
        """The points of `key`'s pool (a rank, -1: the job) with `fig` in it once it spans POINT_S
        seconds (or `fig`'s seconds are not known); else none."""
        pool = self.pools.setdefault(key, [])
        pool.append(fig)
        if fig.wall_s > 0 and sum(w.wall_s for w in pool) < self.POINT_S:
            return []
        return self._emit(key)

    def _emit(self, key: int) -> List[tuple[str, float, int]]:
        """`key`'s pool as one point of its window metrics (the job's carries the loader's settings)."""
        got = pooled_in_time(self.pools.pop(key))
        if key < 0:
            return [(k, v, got.step) for k, v in {**got.metrics(), **self.loader}.items()]
        return [(f"rank{key}/{k}", v, got.step) for k, v in got.metrics().items()]

    def close(self) -> None:
        """The job ended: the windows not logged yet as their pooled points, then everything to MLflow."""
        for key in list(self.pools):
            self.pending += self._emit(key)
        self.flush()

    def _measured_rate(self, fig: WindowFigures) -> float:
        """The job's samples/s over its measured windows so far (each window's samples over their
        seconds), the figure its summary reports at the end; the progress line shows it rather than
        the last window's rate, which can read several times the whole run's (a window of batches
        the workers had queued)."""
        if fig.wall_s <= 0:  # an event without its window's seconds
            return fig.throughput
        self.measured[0] += fig.throughput * fig.wall_s
        self.measured[1] += fig.wall_s
        return self.measured[0] / self.measured[1]

    def flush(self) -> None:
        """Log the metrics not logged yet (tracking trouble is printed: it must not kill a job)."""
        points, self.pending, self.flushed = self.pending, [], time.monotonic()
        if points:
            try:
                self.tracker.log_metrics(points)
            except Exception as exc:
                print(f"[tracking] could not log metrics: {store_error(exc, self.tracker.uri)}")
