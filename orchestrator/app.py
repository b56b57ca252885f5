"""A job from a validated config to `result.json` and an MLflow run.

`run_job` is what the CLI, the tests and the tuner call; `@hydra.main` in `__main__` is only glue
around it. It reads as the job's order: checks.preflight (everything that can refuse it, the
resume decision among them), the run dir taken (rundir.RunOwner), the attempt opened (attempts),
the MLflow run started, the ranks watched (supervise) while livelog.LiveLog logs their events,
and the result settled and recorded (finish, tracking).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from .attempts import clear_stale_request, close_dead_attempt, open_attempt
from .checks import Checked, check_launch, preflight
from .fingerprint import fingerprint
from .finish import add_load_report, mlflow_status, settle, write_result
from .launch import Launch, build_launch
from .livelog import LiveLog, Monitor
from .measure.results import JobResult
from .merge import measurement_warning, summary_rows
from .progress import JobProgress, console
from .rundir import (RecordError, RunOwner, Status, checkpoint_request_path, config_path, own_run_dir, owner_tag,
                     ranks_dir, result_path, write_atomic, write_job)
from .schema import Config, Launcher, flatten, to_yaml
from .supervise import FreshRanks, Outcome, Ranks
from .tracking import Tracker

# check_launch lives in checks.py; tune/study.py imports it from here
__all__ = ["JobCheckpointed", "JobDiverged", "JobFailed", "JobStopped", "Monitor", "RecordFailed", "check_launch",
           "print_summary", "run_job", "run_job_result"]


class JobFailed(RuntimeError):
    """A rank raised, the launcher failed or the job timed out; `job` holds what was recorded
    (`result`: as result.json has it)."""

    def __init__(self, message: str, result: Union[JobResult, Mapping[str, Any]]) -> None:
        super().__init__(message)
        self.job = result if isinstance(result, JobResult) else JobResult.from_dict(result)

    @property
    def result(self) -> Dict[str, Any]:
        return self.job.to_dict()


class RecordFailed(JobFailed):
    """A record of the job could not be written (a full disk): the MLflow run ends FAILED and the
    message is one line naming the file and the cause."""


class JobDiverged(JobFailed):
    """The loss went non-finite or exploded (runtime/step.py): result.json says DIVERGED, the
    message is the rank's one line (step, loss, the last good checkpoint); the MLflow run ends FAILED."""


class JobStopped(JobFailed):
    """The caller's monitor asked to stop the job (a pruned trial); the MLflow run ends KILLED."""


class JobCheckpointed(Exception):
    """The ranks stopped at a checkpoint on trainer.checkpoint_signal (a SLURM job's time limit
    near): result.json says CHECKPOINTED (`checkpointed_at_step`; `requeue`: the SLURM job to
    requeue, or None) and the MLflow run is SCHEDULED when the job will be requeued, else KILLED;
    a resume (or the requeued job) reopens it."""

    def __init__(self, result: JobResult) -> None:
        super().__init__(f"checkpointed at step {result.checkpointed_at_step}")
        self.job = result

    @property
    def result(self) -> Dict[str, Any]:
        return self.job.to_dict()


def run_job(cfg: Config, run_dir: Path, *, echo: bool = True, extra_tags: Optional[Dict[str, str]] = None,
            monitor: Optional[Monitor] = None, run_name: Optional[str] = None, ranks: Optional[Ranks] = None,
            tracker: Optional[Tracker] = None, plots: bool = True) -> Dict[str, Any]:
    """run_job_result's result as result.json has it (JobResult.to_dict): what the CLI, the
    benchmarks and the tests read."""
    return run_job_result(cfg, run_dir, echo=echo, extra_tags=extra_tags, monitor=monitor, run_name=run_name,
                          ranks=ranks, tracker=tracker, plots=plots).to_dict()


def run_job_result(cfg: Config, run_dir: Path, *, echo: bool = True, extra_tags: Optional[Dict[str, str]] = None,
                   monitor: Optional[Monitor] = None, run_name: Optional[str] = None, ranks: Optional[Ranks] = None,
                   tracker: Optional[Tracker] = None, plots: bool = True) -> JobResult:
    """Launch the job described by `cfg`, supervise it, merge and record its measured load.

    The tuner passes what a trial needs on top: a `monitor` of its windows (the pruner), kept-alive
    `ranks` (tune/pool.py; default: fresh ones for this job), a `tracker` already checked, and
    `plots=False`. Returns the result (also in `run_dir/result.json`). Raises ConfigError (or
    NothingToResume) before launching anything on bad input, JobFailed if the job failed (the
    MLflow run ends FAILED), and KeyboardInterrupt after ending every process on Ctrl-C/SIGTERM
    (the run ends KILLED). The run dir is this process's while the job runs (rundir.RunOwner):
    RunDirOwned, before anything changes, when another live process runs a job there.
    """
    # everything that can refuse the job is checked before the run dir is touched (a refused resume
    # prints nothing about resuming and archives nothing)
    checked = preflight(cfg, Path(run_dir).resolve(), tracker)
    with own_run_dir(checked.run_dir, checked.cfg.parallelism.node_rank) as owner:  # RunDirOwned while another runs there
        return _run_owned(checked, owner, echo=echo, extra_tags=extra_tags, monitor=monitor, run_name=run_name,
                          ranks=ranks, plots=plots)


def _run_owned(checked: Checked, owner: RunOwner, *, echo: bool, extra_tags: Optional[Dict[str, str]],
               monitor: Optional[Monitor], run_name: Optional[str], ranks: Optional[Ranks], plots: bool) -> JobResult:
    """run_job once its job is checked, in a run dir this process owns: what a dead owner left is
    closed first, the attempt opened, the ranks watched, and the result recorded whatever happens."""
    cfg, run_dir, tracker = checked.cfg, checked.run_dir, checked.tracker
    _close_what_the_dead_left(checked, owner)
    clear_stale_request(run_dir)
    launch = build_launch(cfg, run_dir)
    open_attempt(run_dir, checked.resumed)
    _say_notes(cfg, launch, echo)
    cfg_path = write_atomic(config_path(run_dir), to_yaml(cfg))
    run_id = _start_run(checked, launch.world_size, extra_tags, run_name)
    result = JobResult(status=Status.RUNNING, backend=cfg.backend.name.value)
    result.mlflow_run_id, result.run_dir, result.mlflow = run_id, str(run_dir), tracker.where()
    status = Status.FAILED
    report_files: List[Path] = []
    t0 = time.monotonic()
    try:
        write_job(run_dir, run_id)  # the job spec the ranks read (the MLflow run id goes into checkpoints)
        outcome = _watch(checked, launch, echo, monitor, ranks)
        # node 0's rank 0 gathers every rank's result; another node's parent sees its own ranks only
        expected = launch.world_size if cfg.parallelism.node_rank == 0 else launch.local_ranks
        status, why, rank_results = settle(result, outcome, run_dir, cfg, expected, t0)
        add_load_report(result, cfg, rank_results, run_dir, plots, report_files)
        _raise_unless_finished(status, why, outcome, result)
    except RecordError as exc:  # a full disk while writing the job's records
        status = Status.FAILED
        result.error = str(exc)
        raise RecordFailed(str(exc), result) from None
    except KeyboardInterrupt:
        status = Status.KILLED
        result.error = "interrupted"
        raise
    finally:
        checkpoint_request_path(run_dir).unlink(missing_ok=True)  # the parent's request was for this attempt
        out = result_path(run_dir)
        unwritten = write_result(out, result, status)
        tracker.record(result, [cfg_path, *report_files, out], ranks_dir(run_dir), result.status or status,
                       end_as=mlflow_status(result))
        if unwritten is not None and status == Status.FINISHED:  # else the job's own failure is on its way
            raise RecordFailed(str(unwritten), result)
    return result


def _watch(checked: Checked, launch: Launch, echo: bool, monitor: Optional[Monitor], ranks: Optional[Ranks]) -> Outcome:
    """Run the ranks (fresh ones for this job, unless the caller keeps some alive) until they end,
    logging their events live; a resume logs no loss point its earlier attempt logged."""
    cfg, tracker = checked.cfg, checked.tracker
    progress = JobProgress() if echo else None
    live = LiveLog(tracker, launch.world_size, progress, monitor)
    if checked.resumed is not None:
        live.logged_until = tracker.last_step("loss")
    try:
        return (ranks or FreshRanks(launch, echo)).run(
            cfg, checked.run_dir, timeout_s=cfg.trainer.timeout_s, on_events=live, should_stop=lambda: live.stop,
            memory_cap_mb=cfg.trainer.memory_cap_mb)
    finally:
        live.close()
        if progress is not None:
            progress.stop()


def _raise_unless_finished(status: str, why: str, outcome: Outcome, result: JobResult) -> None:
    """The exception for each way a job ends other than FINISHED, its reason in `result`."""
    if status == Status.CHECKPOINTED:
        raise JobCheckpointed(result)
    if status == Status.KILLED:
        result.error = why
        raise JobStopped("stopped", result)
    if status == Status.DIVERGED:
        result.error = why
        raise JobDiverged(why, result)
    if status == Status.FAILED:
        result.error = why if outcome.error.strip() in why else f"{why}\n{outcome.error}".strip()
        raise JobFailed(why, result)


def _say_notes(cfg: Config, launch: Launch, echo: bool) -> None:
    """What the config asks for that this launch does not do as asked, said once before it starts."""
    if cfg.single_process and cfg.parallelism.nproc_per_node > 1:
        print(f"[orchestrator] backend={cfg.backend.name.value} runs one process: "
              f"parallelism.nproc_per_node={cfg.parallelism.nproc_per_node} does not apply")
    if echo:
        _say_workers_over_cores(cfg, launch.local_ranks)


def _close_what_the_dead_left(checked: Checked, owner: RunOwner) -> None:
    """A dead owner's attempt is recorded FAILED (and, unless resumed, archived: attempts.py);
    MLflow runs left RUNNING in this run dir by a process that died are closed FAILED."""
    cfg, run_dir, tracker = checked.cfg, checked.run_dir, checked.tracker
    # else other nodes' parents share the dir: theirs to keep (under SLURM this process is the only parent)
    if owner.previous and (cfg.parallelism.nnodes == 1 or cfg.parallelism.launcher is Launcher.slurm):
        close_dead_attempt(run_dir, owner.previous, resuming=checked.resumed is not None)
    if tracker.enabled and "'" not in str(run_dir):
        tracker.close_dead_runs(f"tags.run_dir = '{run_dir}' and tags.host = '{socket.gethostname()}'",
                                f"a later start in {run_dir} found it RUNNING", unowned=True)


def _start_run(checked: Checked, world: int, extra_tags: Optional[Dict[str, str]],
               run_name: Optional[str]) -> Optional[str]:
    """The job's MLflow run: a resume's own, reopened, or a new one with the job's tags."""
    cfg, run_dir, tracker, resumed = checked.cfg, checked.run_dir, checked.tracker, checked.resumed
    if resumed is not None and resumed.checkpoint.get("mlflow_run_id"):
        return tracker.reopen(resumed.checkpoint["mlflow_run_id"], {"resumed_from_step": resumed.step})
    tags = {
        "backend": cfg.backend.name.value, "world_size": str(world), "nnodes": str(cfg.parallelism.nnodes),
        "run_dir": str(run_dir), "host": socket.gethostname(), "owner": owner_tag(), "run_kind": "job",
        **fingerprint(cfg).tags(), **cfg.tags,
        **(extra_tags or {}),
    }
    name = cfg.tracking.run_name or run_name or f"{cfg.backend.name.value} x{world} {cfg.model._target_.rsplit('.', 1)[-1]}"
    return tracker.start(name, flatten(cfg), tags)


def _say_workers_over_cores(cfg: Config, local_ranks: int) -> None:
    """More loader workers per rank than this machine's usable cores: said once here (each rank's
    DataLoader would warn twice, at its construction and at each new iterator: rank.py hushes
    that warning, this line says it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = cfg.data.num_workers
    if workers > cores:
        total = f" ({workers * local_ranks} loader processes on this machine)" if local_ranks > 1 else ""
        print(f"[orchestrator] note: data.num_workers={workers} per rank{total} is more than the {cores} CPU cores this "
              f"process may use: the workers share them (torch suggests at most {cores}); lower data.num_workers "
              "unless the loader waits on I/O, or let trainer.loader_autotune=true measure it")


def print_summary(result: Dict[str, Any], run_dir: Path) -> None:
    from rich.table import Table

    table = Table(show_header=False)
    for k, v in summary_rows(result):
        table.add_row(k, v)
    out = console()
    # the run dir on a line of its own, never wrapped (a table's title wraps at the table's width)
    out.print(f"[bold]run[/bold] {run_dir}", highlight=False, soft_wrap=True)
    out.print(table)
    diag = result.get("diagnosis")
    if diag:
        out.print(f"[bold]{diag['verdict']}[/bold]: {diag['reason']}", highlight=False, soft_wrap=True)
        for advice in diag["advice"]:
            out.print(f"  - {advice}", highlight=False, soft_wrap=True)
    if result.get("straggler"):
        out.print(f"imbalance: {result['straggler']}", highlight=False, soft_wrap=True)
    warning = measurement_warning(result)
    if warning:
        out.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    out.print(f"load report: {run_dir / 'load_report.md'}", highlight=False, soft_wrap=True)
    if result.get("mlflow"):
        out.print(result["mlflow"], highlight=False, soft_wrap=True, markup=False)
