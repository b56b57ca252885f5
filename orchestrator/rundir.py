"""The run directory's layout: the contract between the parent (supervise, merge, pool, job) and
the ranks (rank.py, the loop). Every path, file name and record format the two sides exchange is
defined here and nowhere else.

    <run dir>/config.yaml          the resolved config the ranks load (written by the parent)
    <run dir>/job.json             the job spec: what a rank needs besides the config (MLflow run id)
    <run dir>/ranks/rank<R>.jsonl  rank R's events, tailed live by the parent (Event)
    <run dir>/ranks/rank<R>.json   rank R's result (rank 0 also writes every other rank's)
    <run dir>/ranks/rank<R>.err    rank R's traceback, when it failed
    <pool dir>/jobs/<seq>.json     a kept-alive pool's next job: {"run_dir", **job spec}
    <pool dir>/stop                asks a pool's ranks to exit
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypedDict, Union

RANKS_DIR = "ranks"
JOB_FILE = "job.json"


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


Event = Union[StartEvent, ResumeEvent, LogEvent, WindowEvent, CheckpointEvent, LoaderEvent, BalanceEvent]
# the per-window figures the parent turns into MLflow metrics
WINDOW_KEYS = tuple(k for k in WindowEvent.__annotations__ if k not in ("type", "step"))


class RankResult(TypedDict, total=False):
    """What every rank reports in rank<R>.json (rank.run_one) and result.json repeats per rank
    (merge.RANK_FIELDS); ranks add their warmup, estimate and window details beside these."""

    rank: int
    host: str
    device: str
    param_digest: str
    steps: int
    first_loss: float
    final_loss: float
    utilization: float
    utilization_source: str
    throughput: float
    step_time_s: float
    data_wait_frac: float
    h2d_frac: float
    compute_frac: float
    comm_frac: float
    optimizer_frac: float
    other_frac: float
    phase_s: Dict[str, float]
    peak_mem_mb: float
    reserved_mem_mb: float
    model_state_mb: float  # parameters + gradients + optimizer state this rank holds (fsdp: its shards)
    mem_source: str
    measured_steps: int
    warmup_excluded: bool
    utilization_spread: List[float]
    throughput_spread: List[float]
    mfu: Optional[float]
    mfu_source: str
    mfu_dtype: str
    flops_per_sample: Optional[float]
    peak_flops: Optional[float]
    nvml_util: Optional[float]
    nvml_util_source: str
    sm_active: Optional[float]
    sm_active_source: str
    busy_frac: float  # (compute + optimizer) / wall: the busy share by wall time
    input_cost: Dict[str, Any]  # per item: loader CPU, data wait, process CPU (StepMeter._input_cost)

_RANK_FILE = re.compile(r"^rank(\d+)$")


def ranks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS_DIR


def rank_paths(run_dir: Path, rank: int) -> Dict[str, Path]:
    d = ranks_dir(run_dir)
    return {"events": d / f"rank{rank}.jsonl", "result": d / f"rank{rank}.json", "error": d / f"rank{rank}.err",
            "trace": d / f"trace_rank{rank}.json"}


def rank_of(path: Path) -> int:
    """The rank a rank file belongs to (`rank3.jsonl` -> 3)."""
    m = _RANK_FILE.match(Path(path).stem)
    if m is None:
        raise ValueError(f"not a rank file: {path}")
    return int(m.group(1))


class RecordError(OSError):
    """A record could not be written (a full disk, no permission): one line naming the file and
    the cause. The file is as it was before the write (absent, or its previous content)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        super().__init__(exc.errno, f"{path}: cannot write ({exc.strerror or exc})")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


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
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise RecordError(path, exc) from None
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
    write_json(Path(run_dir) / JOB_FILE, {"mlflow_run_id": mlflow_run_id})


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
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


def process_gone(tag: str) -> bool:
    """The `host:pid` process is known to be gone: it ran on this host and no longer exists.
    (A process on another host cannot be checked from here: False.)"""
    import socket

    import psutil

    host, _, pid = tag.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid))
