"""What a person sees while a job or a study runs: on a terminal a live rich line (step/total,
loss, samples/s, ETA; a study's trial k/N, the running trial's knobs and elapsed time, the best
so far with its interval), otherwise one plain line every few seconds; and the console the
summaries print on (wide when piped, so rich never splits a path or a table row).

livelog.LiveLog feeds a JobProgress from the ranks' events; tune/study.py feeds a StudyProgress.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional

PLAIN_EVERY_S = 5.0  # seconds between a job's plain progress lines (stdout not a terminal)
# a study's plain lines come at each trial's and confirmation run's start; between them, a line
# this often says a long one is still running
STUDY_PLAIN_EVERY_S = 60.0
PIPE_WIDTH = 240  # rich's width when stdout is a pipe or a file (its default there is 80)


def is_terminal() -> bool:
    return sys.stdout.isatty()


def console() -> Any:
    """A rich Console for summaries: the terminal's width, or PIPE_WIDTH when piped."""
    from rich.console import Console

    return Console() if is_terminal() else Console(width=PIPE_WIDTH)


def clock(seconds: Optional[float]) -> str:
    """h:mm:ss (or m:ss), '?' when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Ticker:
    """Calls `fn` every `every_s` seconds on a daemon thread until stopped (the plain lines: the
    caller may be blocked in a job)."""

    def __init__(self, every_s: float, fn: Callable[[], None]) -> None:
        self.every_s, self.fn, self.done = every_s, fn, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="progress")
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.wait(self.every_s):
            self.fn()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=2)


class JobProgress:
    """A running job: steps done of the total, the last loss, the job's samples/s (its last
    measured window) and the ETA from the step rate since the ranks started."""

    def __init__(self, live: Optional[bool] = None, every_s: float = PLAIN_EVERY_S) -> None:
        self.live = is_terminal() if live is None else live
        self.every_s = every_s
        self.total: Optional[int] = None
        self.step = self.first = 0
        self.loss: Optional[float] = None
        self.val_loss: Optional[float] = None  # the last evaluation's (runtime/evaluate.py)
        self.throughput: Optional[float] = None
        self.t0 = time.monotonic()
        self.bar: Any = None
        self.task: Any = None
        self.ticker: Optional[_Ticker] = None
        self.said_at = -1  # the step of the last plain line
        self.lock = threading.Lock()

    def start(self, total: int, at: int = 0) -> None:
        """The ranks started: `total` steps, from step `at` (a resume)."""
        with self.lock:
            self.total, self.step, self.first, self.t0 = int(total), int(at), int(at), time.monotonic()
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[figs]}"),
                                TextColumn("ETA"), TimeRemainingColumn())
            self.task = self.bar.add_task("training", total=total, completed=at, figs="")
            self.bar.start()
        else:
            self.ticker = _Ticker(self.every_s, self._say)

    def resumed(self, step: int) -> None:
        """A resumed job continues from `step`: the ETA counts from there."""
        with self.lock:
            self.step = self.first = int(step)
            self.t0 = time.monotonic()
        if self.bar is not None:
            self.bar.update(self.task, completed=self.step)

    def update(self, step: Optional[int] = None, loss: Optional[float] = None,
               throughput: Optional[float] = None, val_loss: Optional[float] = None) -> None:
        with self.lock:
            self.val_loss = self.val_loss if val_loss is None else float(val_loss)
            first = self.step == self.first and step is not None and step > self.first
            self.step = self.step if step is None else max(self.step, int(step))
            self.loss = self.loss if loss is None else float(loss)
            self.throughput = self.throughput if throughput is None else float(throughput)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.step, figs=self._figures())
        elif first and self.total is not None:
            self._say()  # the first step: say it at once, then every every_s

    def eta_s(self) -> Optional[float]:
        done, elapsed = self.step - self.first, time.monotonic() - self.t0
        if self.total is None or done <= 0 or elapsed <= 0:
            return None
        return (self.total - self.step) * elapsed / done

    def _figures(self) -> str:
        parts = [f"loss {self.loss:.4g}" if self.loss is not None else "",
                 f"val loss {self.val_loss:.4g}" if self.val_loss is not None else "",
                 f"{self.throughput:.1f} samples/s" if self.throughput is not None else ""]
        return "  ".join(p for p in parts if p)

    def line(self) -> str:
        pct = f" ({100 * self.step / self.total:.0f}%)" if self.total else ""
        figs = self._figures()
        return (f"[progress] step {self.step}/{self.total if self.total is not None else '?'}{pct}"
                + (f"  {figs}" if figs else "") + f"  elapsed {clock(time.monotonic() - self.t0)}  ETA {clock(self.eta_s())}")

    def _say(self) -> None:
        with self.lock:
            if self.total is None or self.step == self.said_at:
                return
            self.said_at = self.step
            text = self.line()
        print(text, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.ticker is not None:
            self.ticker.stop()
            self._say()  # where it ended


class StudyProgress:
    """A running study: trial k of N, the running trial's knobs and elapsed time, the best so far
    with its interval, the ETA from this process's mean trial time; then the confirmation runs."""

    def __init__(self, name: str, n_trials: int, live: Optional[bool] = None,
                 every_s: float = STUDY_PLAIN_EVERY_S) -> None:
        self.live = is_terminal() if live is None else live
        self.name, self.n, self.every_s = name, n_trials, every_s
        self.phase, self.k, self.knobs, self.best = "trial", 0, "", ""
        self.number: Optional[int] = None  # the running trial's number (Optuna's, from 0)
        self.said_at = float("-inf")  # when the last plain line was printed
        self.total = n_trials
        self.t_trial = self.t0 = time.monotonic()
        self.durations: list = []
        self.bar: Any = None
        self.task: Any = None
        self.ticker: Optional[_Ticker] = None

    def start(self) -> None:
        if self.live:
            from rich.progress import Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description}"), redirect_stdout=True, redirect_stderr=True,
                                refresh_per_second=2, transient=True)  # gone at the end: the summary follows
            self.task = self.bar.add_task(self.line())
            self.bar.start()
            self.ticker = _Ticker(1.0, lambda: self.bar.update(self.task, description=self.line()))
        else:
            self.ticker = _Ticker(self.every_s, self._tick)

    def trial(self, k: int, knobs: str, number: Optional[int] = None) -> None:
        """The `k`th counted trial (1-based, of tune.n_trials), Optuna's trial `number`, starts with these knobs."""
        self.phase, self.k, self.knobs, self.total, self.t_trial = "trial", k, knobs, self.n, time.monotonic()
        self.number = number
        self._show()

    def confirm(self, k: int, total: int, knobs: str) -> None:
        """Confirmation run `k` of `total` starts (a candidate's knobs)."""
        self.phase, self.k, self.knobs, self.total, self.t_trial = "confirm", k, knobs, total, time.monotonic()
        self.number = None
        self._show()

    def ended(self, best: str) -> None:
        """A trial or confirmation run ended; `best`: the best so far, in words."""
        self.durations.append(time.monotonic() - self.t_trial)
        self.best = best

    def eta_s(self) -> Optional[float]:
        if not self.durations:
            return None
        mean = sum(self.durations) / len(self.durations)
        return max(0.0, (self.total - self.k + 1) * mean - (time.monotonic() - self.t_trial))

    def line(self) -> str:
        if self.phase == "confirm":
            what = f"confirmation run {self.k}/{self.total}"
        else:  # Optuna's number, as the trial's own line and the study name it, and the count
            what = f"trial {self.k}/{self.total}" if self.number is None else f"trial {self.number} ({self.k}/{self.total})"
        # while the candidates are re-measured, the leader is still judged on its trial's figures: the
        # pick is made from the confirmed ones at the end (the study's last lines)
        best = "leader before confirmation" if self.phase == "confirm" else "best so far"
        return (f"[tune] {what} {clock(time.monotonic() - self.t_trial)}: {self.knobs}"
                + (f" | {best}: {self.best}" if self.best else "") + f" | ETA {clock(self.eta_s())}")

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=self.line())
        else:
            self._say()

    def _say(self) -> None:
        if self.k:
            self.said_at = time.monotonic()
            print(self.line(), flush=True)

    def _tick(self) -> None:
        """The plain heartbeat: only when no line was said for most of an interval (a run that just
        started said its own)."""
        if time.monotonic() - self.said_at >= 0.9 * self.every_s:
            self._say()

    def stop(self) -> None:
        if self.ticker is not None:
            self.ticker.stop()
        if self.bar is not None:
            self.bar.stop()
