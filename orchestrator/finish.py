"""A watched job's end, written into its result: the ranks' results merged, the status and the
reason a user reads first (classify), the fields that follow (a checkpointed job's step and
requeue, the load report's diagnosis), result.json itself, and the MLflow run's end status."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional, Tuple

from . import load_report, slurm
from .measure.results import JobResult, RankResult
from .merge import load_rank_results, merge
from .rundir import DIVERGED_AT, RecordError, Status, write_json
from .schema import Config
from .supervise import TRACEBACK_IN, Outcome, traceback_line


def settle(result: JobResult, outcome: Outcome, run_dir: Path, cfg: Config, expected: int,
           t0: float) -> Tuple[str, str, List[RankResult]]:
    """Merge the ranks' results into `result` and set its status: (status, why, the rank results).
    `expected`: the ranks that should have reported; `t0`: the job's start (time.monotonic)."""
    rank_results = load_rank_results(run_dir)
    result.absorb(merge(rank_results))
    result.wall_s = time.monotonic() - t0
    status, why = classify(outcome, len(rank_results), expected, cfg.trainer.timeout_s)
    if status == Status.FINISHED and result.stopped_by == "checkpoint_signal":
        status = Status.CHECKPOINTED  # every rank stopped at the checkpoint the signal asked for
        result.checkpointed_at_step = result.steps
        result.requeue = slurm.requeue_target()  # the SLURM job, when SLURM can run it again
    result.status = status  # before the load report, which records it
    return status, why, rank_results


def add_load_report(result: JobResult, cfg: Config, rank_results: List[RankResult], run_dir: Path, plots: bool,
                    files: List[Path]) -> None:
    """A job that measured steps gets its load report (its files are added to `files`) and the
    report's diagnosis, bottleneck and straggler in `result`."""
    if not result.measured_steps:
        return
    report, written = load_report.write(result, cfg, rank_results, run_dir, plots=plots)
    files.extend(written)
    if result.loader_autotune:
        files.append(load_report.write_loader_override(result.loader_autotune, run_dir))
    result.diagnosis = report["diagnosis"]
    result.bottleneck = report["diagnosis"]["verdict"]
    result.straggler = report["straggler"]


def classify(outcome: Outcome, reported: int, expected: int, timeout_s: float) -> tuple[str, str]:
    """(status, why) of a watched job: FINISHED, KILLED (the monitor stopped it: a pruned trial),
    DIVERGED or FAILED, with the reason a user reads first."""
    if outcome.ok and reported == expected:
        return Status.FINISHED, ""
    if outcome.stopped:
        return Status.KILLED, "stopped by the monitor (pruned)"
    if outcome.timed_out:
        return Status.FAILED, f"timed out after trainer.timeout_s={timeout_s:g}s"
    if outcome.over_memory:
        return Status.FAILED, f"out of memory: {outcome.over_memory}"
    if outcome.failed_rank is not None:
        return _rank_failure(outcome.failed_rank, outcome.error.strip())
    if outcome.ok:
        return Status.FAILED, f"only {reported} of {expected} ranks reported a result"
    return Status.FAILED, f"launcher exited with code {outcome.returncode}"


def _rank_failure(rank: int, said: str) -> tuple[str, str]:
    """(status, why) when rank `rank` failed, having written `said` to its error file."""
    if said.startswith(DIVERGED_AT) and "\n" not in said:  # its loss or weights (runtime/step.py)
        return Status.DIVERGED, f"rank {rank} {said}"
    if said and "\n" not in said:  # the rank's own one line (a config it found wrong): the reason
        return Status.FAILED, f"rank {rank} failed: {said}"
    where = traceback_line(said)
    if where is not None:  # the user's code raised: the traceback stays in the rank's file
        return Status.FAILED, f"rank {rank} failed {where} ({TRACEBACK_IN}ranks/rank{rank}.err)"
    return Status.FAILED, f"rank {rank} failed"


def mlflow_status(result: JobResult) -> str:
    """The MLflow word for the job's status: a checkpointed job is SCHEDULED when SLURM runs it
    again (requeued), else KILLED (stopped; a resume reopens it either way)."""
    if result.status == Status.CHECKPOINTED:
        return "SCHEDULED" if result.requeue else Status.KILLED.value
    if result.status == Status.DIVERGED:
        return Status.FAILED.value
    return str(result.status)


def write_result(out: Path, result: JobResult, status: str) -> Optional[RecordError]:
    """result.json (the record's one JSON form, JobResult.to_dict), written atomically; when it
    cannot be (a full disk), the job ends FAILED (an interrupted one stays KILLED) with the write
    error added to its own, which is returned."""
    result.status = status
    try:
        write_json(out, result.to_dict(), indent=2)
        return None
    except RecordError as exc:
        result.status = Status.KILLED if status == Status.KILLED else Status.FAILED
        result.error = "\n".join(filter(None, [result.error, str(exc)]))
        return exc
