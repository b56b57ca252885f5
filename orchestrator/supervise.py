"""Runs a job's launcher process and watches it: streams rank output, tails the ranks' event
files, applies the timeout, and ends every process of the job when one rank fails, on Ctrl-C
or SIGTERM. Nothing of a job is left running when `supervise` returns or raises."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol

import psutil

from .launch import Launch
from .rundir import CANNOT_WRITE, OWNER_ENV, Event, owner_tag, rank_of, ranks_dir



@dataclass
class Outcome:
    returncode: Optional[int]
    timed_out: bool = False
    stopped: bool = False  # should_stop() asked for it (a pruned trial)
    over_memory: str = ""  # which process passed the memory cap
    failed_rank: Optional[int] = None
    error: str = ""  # the failing rank's traceback, or the launcher's last lines
    output_tail: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.returncode == 0 and not self.timed_out and not self.stopped and not self.over_memory
                and self.failed_rank is None)


class EventTail:
    """Reads new complete lines from every `ranks/rank*.jsonl` as they are written."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = ranks_dir(run_dir)
        self._pos: Dict[Path, int] = {}
        self._partial: Dict[Path, str] = {}

    def poll(self) -> List[tuple[int, Event]]:
        out: List[tuple[int, Event]] = []
        for path in sorted(self.dir.glob("rank*.jsonl")):
            rank = rank_of(path)
            with open(path) as f:
                f.seek(self._pos.get(path, 0))
                chunk = self._partial.get(path, "") + f.read()
                self._pos[path] = f.tell()
            lines = chunk.split("\n")
            self._partial[path] = lines.pop()  # an unfinished last line waits for the next poll
            for line in lines:
                if line.strip():
                    out.append((rank, json.loads(line)))
        return out


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the launcher and all its descendants (and its process group), then SIGKILL."""
    try:
        parent = psutil.Process(proc.pid)
        procs = [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 2.0)
        procs = alive
        if not procs:
            break
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass


# A rank's error that only says a peer went away: the consequence of another rank's death
PEER_LOST = re.compile(r"connection (reset|closed|refused)|broken pipe|by peer|DistNetworkError|remote process exited"
                       r"|communicator was aborted|HorovodInternalError|timed out|timeout", re.I)
# how a launcher reports a rank's exit: torchrun's failure summary, horovodrun's (gloo) first failure
LAUNCHER_EXIT = (re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"),
                 re.compile(r"Process name: (\d+)\s*\n\s*Exit code: (-?\d+)"),
                 re.compile(r"Process (\d+) exit with status code (-?\d+)"))
CLEANUP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # how launchers end the other ranks


def killed_ranks(output: str) -> List[tuple[int, signal.Signals]]:
    """(rank, signal) of each rank the launcher saw die by a signal it did not send itself (a
    SIGKILL, a segfault): such a rank left no traceback. torchrun gives -N, a shell 128+N."""
    out: List[tuple[int, signal.Signals]] = []
    for pattern in LAUNCHER_EXIT:
        for rank, code in pattern.findall(output):
            num = -int(code) if int(code) < 0 else int(code) - 128 if int(code) > 128 else 0
            try:
                sig = signal.Signals(num)
            except ValueError:
                continue
            if sig not in CLEANUP_SIGNALS and (int(rank), sig) not in out:
                out.append((int(rank), sig))
    return out


def _first_error(run_dir: Path, output: str = "") -> tuple[Optional[int], str]:
    """The rank that failed first, and what it said. A rank's traceback, the earliest one, unless
    it only says a peer went away and the launcher saw a rank killed by a signal (no traceback,
    so no file): that rank died first and the others lost their connection to it."""
    errs = sorted(ranks_dir(run_dir).glob("rank*.err"), key=lambda p: p.stat().st_mtime)
    first = errs[0].read_text() if errs else ""
    killed = killed_ranks(output)
    said_first = "\n".join(line for line in first.splitlines() if not line.lstrip().startswith("File "))
    if killed and (not errs or PEER_LOST.search(said_first)):
        rank, sig = killed[0]
        said = f"rank {rank} was killed by {sig.name} (signal {sig.value}) and left no traceback (kill -9? the OOM killer?)"
        lost = [ln.strip() for ln in said_first.splitlines() if PEER_LOST.search(ln)]
        if lost:  # the exception's own line: the last that says so
            said += f"\nthen rank {rank_of(errs[0])} lost its peer: {lost[-1][:300]}"
        return rank, said
    if not errs:
        return _unwritten(output)
    return rank_of(errs[0]), first


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
TRACEBACK_IN = "traceback in "  # how a job's one line points to the rank's file that holds its traceback


def _library(path: str) -> bool:
    """A frame of Python's own library, an installed package or the orchestrator: not the user's."""
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    here = str(Path(__file__).resolve().parent)
    return (path.startswith((*roots, here)) or "site-packages" in path or "dist-packages" in path
            or path.startswith("<"))


def traceback_line(text: str) -> Optional[str]:
    """A rank's traceback said in one line: `in <function> (<file>:<line>): <the error>`, the
    function the deepest frame of the user's code (else the deepest frame); None when `text` holds
    no traceback. Of chained exceptions, the last one raised."""
    if "Traceback (most recent call last):" not in text:
        return None
    block = text.rsplit("Traceback (most recent call last):", 1)[1]
    frames = [m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
    said = [line for line in block.splitlines() if line.strip() and not line[:1].isspace()]
    if not frames or not said:
        return None
    path, line, func = next((f for f in reversed(frames) if not _library(f[0])), frames[-1])
    return f"in {func} ({path}:{line}): {said[-1].strip()[:300]}"


RANK_PREFIX = re.compile(r"^\[rank(\d+)\] ")


def _unwritten(output: str) -> tuple[Optional[int], str]:
    """A rank that could not write its error file (a full disk) printed its one line instead:
    (its rank, that line), else (None, "")."""
    for line in output.splitlines():
        if CANNOT_WRITE in line:
            m = RANK_PREFIX.match(line)
            return (int(m.group(1)) if m else 0), line[m.end():] if m else line
    return None, ""


# A kept-alive pool's job is polled every 20 ms (its end is seen at once); what costs more than that
# poll is done less often, since the supervisor's CPU is taken from the job it measures: a memory
# check walks /proc for the job's processes (psutil, about 5 ms on 2 cores), and polled every 20 ms it
# would take 15-17% of a core; at these intervals a pool's polling takes 4-5%. The ranks' event files
# and tracebacks cost a glob and a read each.
MEMORY_POLL_S = 0.25
FILES_POLL_S = 0.1


def over_memory(proc: subprocess.Popen, cap_mb: float) -> str:
    """'' or a description of the first process of the job whose RSS is above `cap_mb`."""
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return ""
    for p in procs:
        try:
            rss = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
        if rss > cap_mb:
            return f"{_whose(p)} used {rss:.0f} MB > trainer.memory_cap_mb={cap_mb:g}"
    return ""


RANK_VARS = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _whose(p: psutil.Process) -> str:
    """A process of the job in words: `rank 1 (pid 123)`, `a loader worker of rank 1 (pid 124)`,
    or `the launcher (pid 120)`, the rank read from its (or its parent rank's) environment (a
    rank started alone, with none: rank 0)."""
    seen: Optional[psutil.Process] = p
    for depth in range(4):
        if seen is None:
            break
        try:
            env, alone = seen.environ(), "orchestrator.rank" in seen.cmdline()
        except (psutil.Error, OSError):
            break
        rank = next((env[v] for v in RANK_VARS if v in env), "0" if alone else None)
        if rank is not None:
            return f"{'rank' if depth == 0 else 'a loader worker of rank'} {rank} (pid {p.pid})"
        try:
            seen = seen.parent()
        except psutil.Error:
            break
    return f"the launcher (pid {p.pid})"


_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A preexec_fn that has the kernel send `sig` to the launcher when this process dies (Linux
    prctl(PR_SET_PDEATHSIG)): SIGTERM lets horovodrun and srun end their ranks, SIGKILL ends a
    torchrun agent (Launch.death_signal); the ranks watch this process themselves
    (rank.watch_owner). The signal follows the thread that forks: only the main thread's launches
    get it. None where it does not apply."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, never in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the signal was set
            os._exit(1)

    return preexec


class Launched:
    """A started launcher: its process (own session) and a thread keeping its output's tail. The
    launcher and its ranks end when this process does, even killed -9 (_die_with_parent, OWNER_ENV)."""

    def __init__(self, launch: Launch, echo: bool, log: Optional[Path] = None) -> None:
        env = {**os.environ, **launch.env, OWNER_ENV: owner_tag()}
        self.proc = subprocess.Popen(
            launch.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, text=True, bufsize=1, errors="replace", preexec_fn=_die_with_parent(launch.death_signal),
        )
        self.world_size = launch.world_size
        self.echo = echo
        self.tail: Deque[str] = collections.deque(maxlen=200)
        self._log = open(log, "a") if log else None
        self.reader = threading.Thread(target=self._pump, name="rank-output", daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if self.echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if self._log:
                self._log.write(line)
                self._log.flush()

    def kill(self, grace_s: float = 5.0) -> None:
        """End every process of the job. What they print while dying (torchrun's traceback of the
        signal, for one) is kept in the tail, not echoed: the caller says what happened."""
        self.echo = False
        kill_tree(self.proc, grace_s=grace_s)
        self.reader.join(timeout=5.0)


def watch(launched: Launched, run_dir: Path, *, done: Callable[[], bool], timeout_s: float = 0.0,
          on_events: Optional[Callable[[List[tuple[int, Event]]], None]] = None,
          should_stop: Optional[Callable[[], bool]] = None, memory_cap_mb: float = 0.0,
          poll_s: float = 0.5, fail_grace_s: float = 3.0) -> Outcome:
    """Follow one job running on `launched` until `done()`, the launcher exits, a rank fails, the
    timeout passes, `should_stop()` or the memory cap; every way but `done` ends the processes.
    KeyboardInterrupt ends them too and propagates."""
    proc = launched.proc
    events = EventTail(run_dir)
    start = time.monotonic()
    outcome = Outcome(returncode=None)
    fail_seen: Optional[float] = None
    memory_checked = files_read = -math.inf
    try:
        while True:
            rc = proc.poll()
            now = time.monotonic()
            read_files = now - files_read >= FILES_POLL_S
            files_read = now if read_files else files_read
            if read_files:
                _deliver(events, on_events)
            if done():
                rc = proc.poll()  # again: it may have exited since
                outcome.returncode = 0 if rc is None else rc
                break
            if rc is not None:  # a kept-alive launcher exited before finishing the job
                outcome.returncode = rc if rc != 0 else -1
                break
            check_memory = bool(memory_cap_mb) and now - memory_checked >= MEMORY_POLL_S
            memory_checked = now if check_memory else memory_checked
            if _past_a_limit(outcome, proc, time.monotonic() - start, timeout_s, should_stop, memory_cap_mb, check_memory):
                launched.kill()
                outcome.returncode = proc.returncode
                break
            # a rank wrote its traceback: give the launcher a moment to stop the rest, then do it
            if fail_seen is None and read_files and any(ranks_dir(run_dir).glob("rank*.err")):
                fail_seen = time.monotonic()
            if fail_seen is not None and time.monotonic() - fail_seen > fail_grace_s:
                launched.kill()
                outcome.returncode = proc.returncode if proc.returncode is not None else -9
                break
            try:
                proc.wait(timeout=poll_s)  # returns at once when the launcher exits
            except subprocess.TimeoutExpired:
                pass
    except BaseException:
        launched.kill(grace_s=2.0)
        raise
    return _how_it_ended(launched, run_dir, events, on_events, outcome)


def _deliver(events: EventTail, on_events: Optional[Callable[[List[tuple[int, Event]]], None]]) -> None:
    """The ranks' new events, to the caller (when it asked for them)."""
    if on_events is not None:
        batch = events.poll()
        if batch:
            on_events(batch)


def _past_a_limit(outcome: Outcome, proc: subprocess.Popen, elapsed_s: float, timeout_s: float,
                  should_stop: Optional[Callable[[], bool]], memory_cap_mb: float, check_memory: bool) -> bool:
    """Whether the job passed a limit: the timeout, the caller's stop, the memory cap (measured
    when `check_memory`); the one it passed is set on `outcome`."""
    if timeout_s and elapsed_s > timeout_s:
        outcome.timed_out = True
    elif should_stop is not None and should_stop():
        outcome.stopped = True
    elif check_memory:
        outcome.over_memory = over_memory(proc, memory_cap_mb)
    return bool(outcome.timed_out or outcome.stopped or outcome.over_memory)


def _how_it_ended(launched: Launched, run_dir: Path, events: EventTail,
                  on_events: Optional[Callable[[List[tuple[int, Event]]], None]], outcome: Outcome) -> Outcome:
    """Once the watch ends: the last events and output lines, and the error of the rank that
    failed first (else the output's tail, when the job did not end well)."""
    if launched.proc.poll() is not None:
        launched.reader.join(timeout=5.0)  # the last lines it printed
    _deliver(events, on_events)
    outcome.output_tail = list(launched.tail)
    outcome.failed_rank, outcome.error = _first_error(run_dir, "\n".join(launched.tail))
    if not outcome.ok and not outcome.error:
        outcome.error = "\n".join(outcome.output_tail[-30:])
    return outcome


def supervise(launch: Launch, run_dir: Path, *, timeout_s: float = 0.0,
              on_events: Optional[Callable[[List[tuple[int, Event]]], None]] = None,
              should_stop: Optional[Callable[[], bool]] = None, memory_cap_mb: float = 0.0,
              echo: bool = True, poll_s: float = 0.5, fail_grace_s: float = 3.0) -> Outcome:
    """Start `launch` for the job in `run_dir`, stream its output, and return how it ended."""
    launched = Launched(launch, echo)
    outcome = watch(launched, run_dir, done=lambda: launched.proc.poll() is not None, timeout_s=timeout_s,
                    on_events=on_events, should_stop=should_stop, memory_cap_mb=memory_cap_mb, poll_s=poll_s,
                    fail_grace_s=fail_grace_s)
    launched.kill(grace_s=2.0)  # stragglers (e.g. DataLoader workers of a killed rank)
    return outcome


class Ranks(Protocol):
    """How a job's ranks are obtained: started for it (FreshRanks) or kept alive across the
    trials of a study (tune/pool.py's RankPool). Either runs the job in a run dir whose
    config.yaml and job.json are written, and says how it ended."""

    def run(self, cfg: Any, run_dir: Path, **watch_kwargs: Any) -> Outcome: ...


class FreshRanks:
    """Ranks started by `launch` for one job and ended with it."""

    def __init__(self, launch: Launch, echo: bool = True) -> None:
        self.launch, self.echo = launch, echo

    def run(self, cfg: Any, run_dir: Path, **watch_kwargs: Any) -> Outcome:
        return supervise(self.launch, run_dir, echo=self.echo, **watch_kwargs)
