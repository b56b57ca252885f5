"""The run directory's layout: the contract between the parent (supervise, merge, pool, job) and
the ranks (rank.py, the loop). Every path, file name and record format the two sides exchange is
defined here and nowhere else, but for the results' (rank<R>.json, result.json: typed in
measure/results.py, which every floor reads).

    <run dir>/config.yaml          the resolved config the ranks load (written by the parent)
    <run dir>/result.json          the job's merged result (the parent, once the ranks reported): measure.results.JobResult
    <run dir>/load_report.json|md  the diagnosis (load_report.py)
    <run dir>/attempts/<N>/        what an earlier attempt recorded (a resume, a dead owner's job)
    <run dir>/job.json             the job spec: what a rank needs besides the config (MLflow run id)
    <run dir>/owner.json           the process running a job there: flock-ed while it lives (RunOwner)
    <run dir>/checkpoint.request   the parent got trainer.checkpoint_signal: the ranks checkpoint and stop
    <run dir>/ranks/rank<R>.jsonl  rank R's events, tailed live by the parent (Event)
    <run dir>/ranks/rank<R>.json   rank R's result (rank 0 also writes every other rank's): measure.results.RankResult
    <run dir>/ranks/rank<R>.err    rank R's traceback, when it failed
    <pool dir>/jobs/<seq>.json     a kept-alive pool's next job: {"run_dir", **job spec}
    <pool dir>/stop                asks a pool's ranks to exit
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypedDict, Union

class Status(str, Enum):
    """A job's (and a study's) status in result.json, summary.json and MLflow (the same words)."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"  # interrupted (Ctrl-C, SIGTERM) or stopped by its monitor (a pruned trial)
    CHECKPOINTED = "CHECKPOINTED"  # stopped at a checkpoint on trainer.checkpoint_signal: requeued, or to resume
    DIVERGED = "DIVERGED"  # the loss went non-finite or exploded (runtime/step.py: check_loss)
    INVALID = "INVALID"  # refused before launch
    NOT_RUN = "NOT RUN"  # a sweep job that wrote no result
    NOTHING_TO_RUN = "NOTHING TO RUN"  # a study call whose study already has its trials

    __str__ = str.__str__  # the word itself in messages and f-strings
    __format__ = str.__format__


# how a rank's one-line error of a diverged loss begins (runtime/step.py), which the parent reads
DIVERGED_AT = "diverged at step"

RANKS_DIR = "ranks"
CONFIG_FILE = "config.yaml"
RESULT_FILE = "result.json"
REPORT_FILES = ("load_report.json", "load_report.md")
ATTEMPTS_DIR = "attempts"
JOB_FILE = "job.json"
OWNER_FILE = "owner.json"
CHECKPOINT_REQUEST_FILE = "checkpoint.request"
# the supervising process (`host:pid:start`, owner_tag) whose end ends the ranks (rank.watch_owner)
OWNER_ENV = "ORCHESTRATOR_OWNER"


# -- the records of rank<R>.jsonl (one JSON object a line, `type` first) -------------------------
class StartEvent(TypedDict):
    type: str  # "start"
    total_steps: int
    steps_per_epoch: int
    device: str
    utilization_source: str


class ResumeEvent(TypedDict):
    type: str  # "resume"
    step: int
    epoch: int


class LogEvent(TypedDict):
    type: str  # "log"
    step: int
    epoch: int
    loss: float


class WindowEvent(TypedDict):
    type: str  # "window": a measured window closed
    step: int
    throughput: float
    utilization: float
    data_wait_frac: float
    comm_frac: float
    step_time_s: float
    tokens_per_s: Optional[float]  # real tokens/s (dict batches with an attention_mask), else None
    wall_s: float  # the window's seconds (the live progress weighs the windows by them)


class CheckpointEvent(TypedDict):
    type: str  # "checkpoint"
    step: int


class LoaderEvent(TypedDict):
    type: str  # "loader": the loader autotune (runtime/autotune.py) decided; rank 0 only
    step: int
    action: str  # start (the settings a run starts with) | try | keep | revert
    num_workers: int  # the settings in place after this event
    prefetch_factor: Optional[int]
    effective_prefetch: int  # batches queued per worker (torch's 2 for null; 0 without workers)
    from_workers: int  # the settings before it
    from_prefetch: Optional[int]
    reason: str
    throughput_before: Optional[float]  # samples/s, job-level, steady state
    throughput_after: Optional[float]
    noise: Optional[float]  # the 95% half-width of the difference
    t_s: float  # seconds since training started


class BalanceEvent(TypedDict):
    type: str  # "balance": the ranks' shares of the global batch from `step` on (parallelism.balance=speed)
    step: int
    shares: List[float]


class EvalEvent(TypedDict):
    type: str  # "eval": an evaluation over the validation set (runtime/evaluate.py); rank 0 only
    step: int
    samples: float  # global samples trained on before it
    wall_s: float  # seconds since the loop began, evaluations included
    val_loss: float
    metrics: Dict[str, float]  # trainer.val_metric's mean, by its name


Event = Union[StartEvent, ResumeEvent, LogEvent, WindowEvent, CheckpointEvent, LoaderEvent, BalanceEvent, EvalEvent]


_RANK_FILE = re.compile(r"^rank(\d+)$")


def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS_DIR


def config_path(run_dir: Path) -> Path:
    return Path(run_dir) / CONFIG_FILE


def result_path(run_dir: Path) -> Path:
    return Path(run_dir) / RESULT_FILE


def report_paths(run_dir: Path) -> tuple:
    """(load_report.json, load_report.md)."""
    return tuple(Path(run_dir) / name for name in REPORT_FILES)


def checkpoint_request_path(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_REQUEST_FILE


def attempt_dir(run_dir: Path, n: int) -> Path:
    return Path(run_dir) / ATTEMPTS_DIR / str(n)


def rank_paths(run_dir: Path, rank: int) -> Dict[str, Path]:
    d = ranks_dir(run_dir)
    return {"events": d / f"rank{rank}.jsonl", "result": d / f"rank{rank}.json", "error": d / f"rank{rank}.err",
            "trace": d / f"trace_rank{rank}.json", "survived": d / f"rank{rank}.survived"}


def rank_of(path: Path) -> int:
    """The rank a rank file belongs to (`rank3.jsonl` -> 3)."""
    m = _RANK_FILE.match(Path(path).stem)
    if m is None:
        raise ValueError(f"not a rank file: {path}")
    return int(m.group(1))


# how a record that could not be written is said (RecordError), which the parent finds in a rank's output
CANNOT_WRITE = ": cannot write ("
# the host's disk, not the job: full, over the user's quota, or over a file-size limit (ulimit -f)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


FREE_THERE = " free there"  # how RecordError says the free space when the disk is full


def said_disk_full(text: str) -> bool:
    """`text` (an error, a rank's line) says a record could not be written for the host's disk."""
    return CANNOT_WRITE in text and FREE_THERE in text


def free_space(path: Path) -> str:
    """The free space of the filesystem that holds `path` (or its nearest existing parent), in
    words ("0 B", "12.5 MB")."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = float(shutil.disk_usage(path).free)
    except OSError:
        return "?"
    if free < 1024:
        return f"{free:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        free /= 1024
        if free < 1024 or unit == "TB":
            break
    return f"{free:.1f} {unit}"


class RecordError(OSError):
    """A record could not be written (a full disk, no permission): one line naming the file and
    the cause, with the free space where the disk is full (the host's fault, not the job's). The
    file is as it was before the write (absent, or its previous content)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        why = exc.strerror or str(exc)
        if exc.errno in DISK_FULL:
            why += f"; {free_space(path)}{FREE_THERE}"
        super().__init__(exc.errno, f"{path}{CANNOT_WRITE}{why})")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def _os_error(exc: BaseException) -> OSError:
    """The OSError behind a failed write: `exc`, or one in its chain (torch.save into a file
    raises a RuntimeError in the OSError's handling), else one made of its first line."""
    seen: Optional[BaseException] = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    if seen is not None:
        return seen
    return OSError(errno.EIO, (str(exc).strip().splitlines() or [type(exc).__name__])[0])


def write_atomic(path: Path, data: Union[str, bytes, Callable[[Path], Any]]) -> Path:
    """Every record the product writes goes through here: `data` (text, bytes, or a function that
    writes the path it is given, e.g. torch.save) goes to a temporary name beside `path`, reaches
    the disk (fsync), and is renamed over `path`. A reader sees the old file or the new one, whole,
    never an empty or half-written one. On failure the temporary file is removed, `path` is left
    as it was, and RecordError names it and the cause. The temporary name is this process's own,
    so concurrent writers of one path each rename a whole file (the last one wins)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        if callable(data):
            data(tmp)
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 - a writer function may say an I/O error its own way
        tmp.unlink(missing_ok=True)
        raise RecordError(path, _os_error(exc)) from None
    return path


def write_json(path: Path, obj: Any, indent: int = 1) -> Path:
    return write_atomic(path, json.dumps(obj, indent=indent, default=str))


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON record at `path`; `default` when it is missing, or unreadable (empty, cut short:
    written before records were atomic, or a damaged disk), then with a one-line note that says
    so and that it is skipped."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as exc:
        note_unreadable(path, exc)
        return default


def note_unreadable(path: Path, exc: Exception) -> None:
    """The one-line note for a record that is skipped because it does not read."""
    why = "empty" if path.exists() and not path.read_bytes().strip() else (str(exc).splitlines() or [repr(exc)])[0]
    print(f"[orchestrator] note: {path} is unreadable ({why}); skipped")


def write_job(run_dir: Path, mlflow_run_id: Optional[str]) -> None:
    """The job spec; also the SLURM job that runs it (a requeued job finds its own run dir by it)."""
    spec: Dict[str, Any] = {"mlflow_run_id": mlflow_run_id}
    if os.environ.get("SLURM_JOB_ID"):
        spec["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    write_json(Path(run_dir) / JOB_FILE, spec)


def read_job(run_dir: Path) -> Dict[str, Any]:
    path = Path(run_dir) / JOB_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def pool_job_path(pool_dir: Path, seq: int) -> Path:
    return Path(pool_dir) / "jobs" / f"{seq:06d}.json"


def pool_stop_path(pool_dir: Path) -> Path:
    return Path(pool_dir) / "stop"


def pool_owner_path(pool_dir: Path) -> Path:
    """`host:pid` of the process that started the pool: its ranks end when it is gone."""
    return Path(pool_dir) / "owner"


def process_tag() -> str:
    """This process as `host:pid` (a trial's or a pool's owner)."""
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


def process_start(pid: Optional[int] = None) -> float:
    """When the process started (seconds since the epoch), for comparing with file times: on Linux
    now minus its age (the time since boot less its start in ticks since boot), as the clock reads
    now; psutil's figure is the boot time plus those ticks, and the boot time moves when the clock
    is slewed (start_stamp). Not who it is: start_stamp says that."""
    ticks = _ticks_since_boot(pid)
    if ticks is not None:
        try:
            up = float(Path("/proc/uptime").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            up = None
        if up is not None:
            return time.time() - max(0.0, up - ticks / os.sysconf("SC_CLK_TCK"))
    import psutil

    return psutil.Process(pid).create_time()


def _ticks_since_boot(pid: Optional[int] = None) -> Optional[int]:
    """The process's start in clock ticks since boot (Linux /proc/<pid>/stat, field 22); None
    elsewhere or when it is gone."""
    try:
        text = Path(f"/proc/{pid if pid is not None else os.getpid()}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])  # after "pid (comm) ": state is field 3


def start_stamp(pid: Optional[int] = None) -> str:
    """Who the process is besides its pid (pids are reused): on Linux `b<ticks>`, its start in clock
    ticks since boot, which never changes; elsewhere its start since the epoch. psutil's epoch
    start is the boot time plus those ticks, and the boot time moves when the clock is slewed (by
    seconds within minutes on a VM), so a tag from it would stop matching a live owner and its
    ranks would end themselves."""
    ticks = _ticks_since_boot(pid)
    return f"b{ticks}" if ticks is not None else f"{process_start(pid):.2f}"


def owner_tag() -> str:
    """This process as `host:pid:start`: a recycled pid is not mistaken for it (process_gone)."""
    return f"{process_tag()}:{start_stamp()}"


_TAG = re.compile(r"^(.*):(\d+)(?::(b\d+|\d+(?:\.\d*)?))?$")


def process_gone(tag: str) -> bool:
    """The `host:pid` (or `host:pid:start`) process is known to be gone: it ran on this host and no
    longer exists, is a zombie, or its pid now names a process started at another time (a start
    stamp in ticks since boot must match exactly; one since the epoch, written by earlier
    versions, within 1 s). A process on another host cannot be checked from here: False."""
    import socket

    import psutil

    m = _TAG.match(tag)
    if m is None or m.group(1) != socket.gethostname():
        return False
    pid, start = int(m.group(2)), m.group(3)
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        if start is None:
            return False
        if start.startswith("b"):
            return _ticks_since_boot(pid) != int(start[1:])  # None: it ended since
        return abs(proc.create_time() - float(start)) > 1.0
    except psutil.NoSuchProcess:  # ZombieProcess included
        return True
    except psutil.Error:
        return False


def describe_process(tag: str) -> str:
    """`host H, pid P` for a `host:pid[:start]` tag (the tag itself when it is not one)."""
    m = _TAG.match(tag)
    return f"host {m.group(1)}, pid {m.group(2)}" if m else tag


# -- the run dir's owner -------------------------------------------------------------------------
class RunDirOwned(RuntimeError):
    """Another live process runs a job in this run dir: one line naming it (host, pid)."""


def owner_path(run_dir: Path, node_rank: int = 0) -> Path:
    """owner.json; on the other nodes of a job sharing its run dir, owner.node<R>.json (each node's
    parent owns its own part)."""
    return Path(run_dir) / (OWNER_FILE if not node_rank else f"owner.node{node_rank}.json")


def remove_if_unused(run_dir: Path) -> bool:
    """Remove `run_dir` when it holds nothing but what Hydra and the owner lock put there before a
    call found nothing to do (.hydra/, Hydra's job log, owner.json): no empty run dirs pile up."""
    import shutil

    run_dir = Path(run_dir)
    if not run_dir.is_dir() or any(p.name not in (".hydra", OWNER_FILE) and p.suffix != ".log" for p in run_dir.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def _owner_record(fd: int) -> Dict[str, Any]:
    """What owner.json says ({} when empty: released, or still being written)."""
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def _owner_of(rec: Dict[str, Any]) -> str:
    return f"{rec.get('host', '?')}:{rec.get('pid', '?')}:{rec.get('start', '')}".rstrip(":")


def owned_message(run_dir: Path, rec: Dict[str, Any]) -> str:
    who = f"host {rec['host']}, pid {rec['pid']}, since {rec.get('since', '?')}" if rec else "its owner not recorded yet"
    return (f"{run_dir} is in use by a running job ({who}); a start or a resume there waits for it to end "
            f"(or stop it first)")


def _lock(fd: int, run_dir: Path) -> bool:
    """Take the exclusive flock on owner.json: True; False when the filesystem has none (the record
    alone then tells). RunDirOwned when another process holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        rec = _owner_record(fd)
        os.close(fd)
        raise RunDirOwned(owned_message(run_dir, rec)) from None
    except OSError:
        return False


class RunOwner:
    """This process's hold on a run dir: an exclusive flock on `owner.json`, kept while the job runs
    (the kernel lets go when the process dies, however it dies), and in it the owner's host, pid and
    start time for the message a second start reads. `previous`: the record of an owner that died
    holding the dir (it never released it), or None. `release()` empties the record and lets go."""

    def __init__(self, run_dir: Path, fd: int, previous: Optional[Dict[str, Any]]) -> None:
        self.run_dir, self.fd, self.previous = Path(run_dir), fd, previous

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # lets go of the flock
        self.fd = -1

    def __enter__(self) -> "RunOwner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _still_runs(rec: Dict[str, Any], locked: bool) -> bool:
    """Whether the owner a record names runs, though its lock was taken (`locked`: a filesystem that
    does not share flocks between hosts, or a process that let go without releasing), or could
    not be tried (a filesystem without flock: then an owner on another host counts as running)."""
    if rec.get("host") != _host():
        return not locked
    return not process_gone(_owner_of(rec)) and (not locked or rec.get("pid") != os.getpid())


def own_run_dir(run_dir: Path, node_rank: int = 0) -> RunOwner:
    """Become the owner of `run_dir` (this node's part: owner_path) before anything in it changes.
    RunDirOwned (one line naming the owner's host and pid) when a live process owns it; a dead
    owner's hold is taken over with a one-line note."""
    from datetime import datetime

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(owner_path(run_dir, node_rank), os.O_RDWR | os.O_CREAT, 0o644)
    locked = _lock(fd, run_dir)
    previous = _owner_record(fd) or None
    if previous and _still_runs(previous, locked):
        os.close(fd)
        raise RunDirOwned(owned_message(run_dir, previous))
    if previous:
        print(f"[orchestrator] note: {run_dir} was left by a job whose process is gone (host {previous.get('host')}, "
              f"pid {previous.get('pid')}, since {previous.get('since', '?')}); taking it over")
    rec = {"host": _host(), "pid": os.getpid(), "start": start_stamp(),
           "since": datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(rec).encode(), 0)
    os.fsync(fd)
    return RunOwner(run_dir, fd, previous)


def owned_by(run_dir: Path, node_rank: int = 0) -> Optional[Dict[str, Any]]:
    """The record of the live process that owns `run_dir` (this node's part; {} if not written yet),
    or None. Changes nothing."""
    import fcntl

    try:
        fd = os.open(owner_path(run_dir, node_rank), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        locked = True
    except BlockingIOError:
        return _owner_record(fd)
    except OSError:
        locked = False
    try:
        rec = _owner_record(fd)
        return rec if rec and _still_runs(rec, locked) else None
    finally:
        os.close(fd)  # also lets go of a shared lock taken


def _host() -> str:
    import socket

    return socket.gethostname()
