"""A job from a validated config to `result.json` and an MLflow run.

`run_job` is what the CLI, the tests and (later) the tuner call; `@hydra.main` in `__main__` is
only glue around it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from . import checkpoint, load_report, slurm
from .launch import build_launch
from .measure.results import JobResult, WindowFigures, job_window
from .progress import JobProgress, console
from .merge import load_rank_results, measurement_warning, merge, summary_rows
from .rundir import (DIVERGED_AT, WINDOW_KEYS, Event, RecordError, RunOwner, Status, attempt_dir, checkpoint_request_path,
                     config_path, note_unreadable, own_run_dir, owner_tag, process_start, ranks_dir, read_job, read_json,
                     report_paths, result_path, write_atomic, write_job, write_json)
from .runtime.dist import check_devices, check_shard_modules
from .runtime.loop import check_model
from .schema import Config, ConfigError, Launcher, flatten, load_config, to_yaml
from .stores import store_error
from .supervise import TRACEBACK_IN, FreshRanks, Outcome, Ranks, traceback_line
from .tracking import Tracker, eval_points


class JobFailed(RuntimeError):
    """A rank raised, the launcher failed or the job timed out; `result` holds what was recorded."""

    def __init__(self, message: str, result: Dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


class NothingToResume(Exception):
    """trainer.resume names a run that finished, and the new config trains no further."""


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

    def __init__(self, result: Dict[str, Any]) -> None:
        super().__init__(f"checkpointed at step {result.get('checkpointed_at_step')}")
        self.result = result


# monitor(window ordinal, job-level window metrics) -> True to stop the job
Monitor = Callable[[int, Dict[str, float]], bool]


class LiveLog:
    """Turns the ranks' events into MLflow metrics and the live progress (progress.JobProgress:
    step/total, loss, samples/s, ETA) while the job runs. The metrics go to MLflow in one batch
    every FLUSH_S seconds and at the job's end (`flush`), not at every event: one write to a
    SQLite store takes ~29 ms of the parent's CPU on 2 cores, and a write per event would take
    about a quarter of a study's wall time from the ranks it measures."""

    FLUSH_S = 5.0

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
                    points += [(f"rank{rank}/{k}", ev[k], step) for k in WINDOW_KEYS  # type: ignore[misc]
                               if ev.get(k) is not None]
                n = self.seen.get(rank, 0)
                self.seen[rank] = n + 1
                group = self.windows.setdefault(n, {})
                group[rank] = ev
                if len(group) == self.world:  # every rank closed this window: job-level point
                    del self.windows[n]
                    fig = job_window([WindowFigures.from_event(e) for e in group.values()])
                    job = fig.metrics()
                    points += [(k, v, fig.step) for k, v in {**job, **self.loader}.items()]
                    if self.progress is not None:
                        self.progress.update(throughput=self._measured_rate(fig))
                    if self.monitor is not None and self.monitor(n, job):
                        self.stop = True
        self.pending += points
        if self.pending and time.monotonic() - self.flushed >= self.FLUSH_S:
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



def run_job(cfg: Config, run_dir: Path, *, echo: bool = True, extra_tags: Optional[Dict[str, str]] = None,
            monitor: Optional[Monitor] = None, run_name: Optional[str] = None, ranks: Optional[Ranks] = None,
            tracker: Optional[Tracker] = None, plots: bool = True) -> Dict[str, Any]:
    """Launch the job described by `cfg`, supervise it, merge and record its measured load.

    The tuner passes what a trial needs on top: a `monitor` of its windows (the pruner), kept-alive
    `ranks` (tune/pool.py; default: fresh ones for this job), a `tracker` already checked, and
    `plots=False`. Returns the result (also in `run_dir/result.json`). Raises ConfigError before
    launching anything on bad input, JobFailed if the job failed (the MLflow run ends FAILED), and
    KeyboardInterrupt after ending every process on Ctrl-C/SIGTERM (the run ends KILLED). The run
    dir is this process's while the job runs (rundir.RunOwner): RunDirOwned, before anything
    changes, when another live process runs a job there.
    """
    cfg = slurm.resolve(cfg)  # inside a SLURM allocation: its nodes and ranks per node (ConfigError if it cannot)
    cfg, run_dir, resumed = resume_target(cfg, Path(run_dir).resolve())
    # everything that can refuse the job is checked before the run dir is touched (a refused resume
    # prints nothing about resuming and archives nothing)
    check_launch(cfg, run_dir)
    check_run_dir(cfg, run_dir)
    if tracker is None:
        tracker = Tracker(cfg.tracking, enabled=cfg.parallelism.node_rank == 0)  # one MLflow run per job: node 0
        tracker.check()
    owner = own_run_dir(run_dir, cfg.parallelism.node_rank)  # RunDirOwned, changing nothing, while another runs there
    with owner:
        return _run_owned(cfg, run_dir, resumed, owner, tracker, echo=echo, extra_tags=extra_tags, monitor=monitor,
                          run_name=run_name, ranks=ranks, plots=plots)


def _run_owned(cfg: Config, run_dir: Path, resumed: Optional[Dict[str, Any]], owner: RunOwner, tracker: Tracker, *,
               echo: bool, extra_tags: Optional[Dict[str, str]], monitor: Optional[Monitor], run_name: Optional[str],
               ranks: Optional[Ranks], plots: bool) -> Dict[str, Any]:
    """run_job once its job is checked, in a run dir this process owns: what a dead owner left is
    closed first (its attempt recorded FAILED and archived, its MLflow runs closed)."""
    _close_what_the_dead_left(cfg, run_dir, resumed, owner, tracker)
    _clear_stale_request(run_dir)
    launch = build_launch(cfg, run_dir)
    open_run_dir(run_dir, resumed)
    if cfg.single_process and cfg.parallelism.nproc_per_node > 1:
        print(f"[orchestrator] backend={cfg.backend.name.value} runs one process: "
              f"parallelism.nproc_per_node={cfg.parallelism.nproc_per_node} does not apply")
    if echo:
        _say_workers_over_cores(cfg, launch.local_ranks)
    cfg_path = write_atomic(config_path(run_dir), to_yaml(cfg))

    world = launch.world_size
    # node 0's rank 0 gathers every rank's result; another node's parent sees its own ranks only
    expected = world if cfg.parallelism.node_rank == 0 else launch.local_ranks
    run_id = _start_run(cfg, run_dir, resumed, tracker, world, extra_tags, run_name)
    result = JobResult(status=Status.RUNNING, backend=cfg.backend.name.value,
                       extra={"mlflow_run_id": run_id, "run_dir": str(run_dir), "mlflow": tracker.where()}).to_dict()
    status = Status.FAILED
    report_files: List[Path] = []
    t0 = time.monotonic()
    progress = JobProgress() if echo else None
    try:
        write_job(run_dir, run_id)  # the job spec the ranks read (the MLflow run id goes into checkpoints)
        live = LiveLog(tracker, world, progress, monitor)
        if resumed is not None:
            live.logged_until = tracker.last_step("loss")
        try:
            watch_kwargs = dict(timeout_s=cfg.trainer.timeout_s, on_events=live, should_stop=lambda: live.stop,
                                memory_cap_mb=cfg.trainer.memory_cap_mb)
            outcome = (ranks or FreshRanks(launch, echo)).run(cfg, run_dir, **watch_kwargs)
        finally:
            live.flush()
            if progress is not None:
                progress.stop()
        rank_results = load_rank_results(run_dir)
        result.update(merge(rank_results).to_dict())
        result["wall_s"] = time.monotonic() - t0
        status, why = classify(outcome, len(rank_results), expected, cfg.trainer.timeout_s)
        if status == Status.FINISHED and result.get("stopped_by") == "checkpoint_signal":
            status = Status.CHECKPOINTED  # every rank stopped at the checkpoint the signal asked for
            result["checkpointed_at_step"] = result.get("steps")
            result["requeue"] = slurm.requeue_target()  # the SLURM job, when SLURM can run it again
        result["status"] = status  # before the load report, which records it
        if result.get("measured_steps"):
            report, report_files = load_report.write(result, cfg, [r.to_dict() for r in rank_results], run_dir,
                                                     plots=plots)
            if result.get("loader_autotune"):
                report_files.append(load_report.write_loader_override(result["loader_autotune"], run_dir))
            result["diagnosis"] = report["diagnosis"]
            result["bottleneck"] = report["diagnosis"]["verdict"]
            result["straggler"] = report["straggler"]
        if status == Status.CHECKPOINTED:
            raise JobCheckpointed(result)
        if status == Status.KILLED:
            result["error"] = why
            raise JobStopped("stopped", result)
        if status == Status.DIVERGED:
            result["error"] = why
            raise JobDiverged(why, result)
        if status == Status.FAILED:
            result["error"] = why if outcome.error.strip() in why else f"{why}\n{outcome.error}".strip()
            raise JobFailed(why, result)
    except RecordError as exc:  # a full disk while writing the job's records
        status = Status.FAILED
        result["error"] = str(exc)
        raise RecordFailed(str(exc), result) from None
    except KeyboardInterrupt:
        status = Status.KILLED
        result["error"] = "interrupted"
        raise
    finally:
        checkpoint_request_path(run_dir).unlink(missing_ok=True)  # the parent's request was for this attempt
        out = result_path(run_dir)
        unwritten = _write_result(out, result, status)
        tracker.record(result, [cfg_path, *report_files, out], ranks_dir(run_dir), result["status"],
                       end_as=_mlflow_status(result))
        if unwritten is not None and status == Status.FINISHED:  # else the job's own failure is on its way
            raise RecordFailed(str(unwritten), result)
    return result


def _mlflow_status(result: Dict[str, Any]) -> str:
    """The MLflow word for the job's status: a checkpointed job is SCHEDULED when SLURM runs it
    again (requeued), else KILLED (stopped; a resume reopens it either way)."""
    if result["status"] == Status.CHECKPOINTED:
        return "SCHEDULED" if result.get("requeue") else Status.KILLED.value
    if result["status"] == Status.DIVERGED:
        return Status.FAILED.value
    return str(result["status"])


def _clear_stale_request(run_dir: Path) -> None:
    """A checkpoint request an earlier process left (killed before it could remove it) would stop
    this attempt at once; one written since this process started (the signal came early) stays."""
    path = checkpoint_request_path(run_dir)
    try:
        if path.stat().st_mtime < process_start():
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


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


def _close_what_the_dead_left(cfg: Config, run_dir: Path, resumed: Optional[Dict[str, Any]], owner: RunOwner,
                              tracker: Tracker) -> None:
    """A dead owner's attempt is recorded FAILED (and, unless resumed, archived); MLflow runs left
    RUNNING in this run dir by a process that died are closed FAILED."""
    # else other nodes' parents share the dir: theirs to keep (under SLURM this process is the only parent)
    if owner.previous and (cfg.parallelism.nnodes == 1 or cfg.parallelism.launcher is Launcher.slurm):
        _close_dead_attempt(run_dir, owner.previous)
        if resumed is None and ranks_dir(run_dir).exists():  # a dead job's files: kept, not mixed in
            _archive_attempt(run_dir)
    if tracker.enabled and "'" not in str(run_dir):
        tracker.close_dead_runs(f"tags.run_dir = '{run_dir}' and tags.host = '{socket.gethostname()}'",
                                f"a later start in {run_dir} found it RUNNING", unowned=True)


def _start_run(cfg: Config, run_dir: Path, resumed: Optional[Dict[str, Any]], tracker: Tracker, world: int,
               extra_tags: Optional[Dict[str, str]], run_name: Optional[str]) -> Optional[str]:
    """The job's MLflow run: a resume's own, reopened, or a new one with the job's tags."""
    if resumed is not None and resumed.get("mlflow_run_id"):
        return tracker.reopen(resumed["mlflow_run_id"], {"resumed_from_step": resumed["step"]})
    tags = {
        "backend": cfg.backend.name.value, "world_size": str(world), "nnodes": str(cfg.parallelism.nnodes),
        "run_dir": str(run_dir), "host": socket.gethostname(), "owner": owner_tag(), "run_kind": "job", **cfg.tags,
        **(extra_tags or {}),
    }
    name = cfg.tracking.run_name or run_name or f"{cfg.backend.name.value} x{world} {cfg.model._target_.rsplit('.', 1)[-1]}"
    return tracker.start(name, flatten(cfg), tags)


def _write_result(out: Path, result: Dict[str, Any], status: str) -> Optional[RecordError]:
    """result.json, written atomically; when it cannot be (a full disk), the job ends FAILED (an
    interrupted one stays KILLED) with the write error added to its own, which is returned."""
    result["status"] = status
    try:
        write_json(out, result, indent=2)
        return None
    except RecordError as exc:
        result["status"] = Status.KILLED if status == Status.KILLED else Status.FAILED
        result["error"] = "\n".join(filter(None, [result.get("error"), str(exc)]))
        return exc


def check_launch(cfg: Config, run_dir: Path) -> None:
    """What the launch of `cfg` refuses, checked without starting or writing anything: the model
    (built on the meta device), its shard modules, the devices, the launcher. Raises ConfigError
    (the tuner calls it on its base config before it creates a study)."""
    check_model(cfg)
    check_shard_modules(cfg)
    check_devices(cfg)
    build_launch(cfg, run_dir)


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """The run dir can be made (it is, when it did not exist) and written. Raises ConfigError."""
    key = "trainer.resume" if cfg.trainer.resume else "hydra.run.dir"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot make {run_dir} ({exc.strerror or exc}); allowed: a directory "
                          "this user can create or write") from None
    _check_writable(run_dir, key)


def _check_writable(run_dir: Path, key: str) -> None:
    """Before launch: the job's records go into `run_dir` (a read-only one ends with a traceback)."""
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: the run dir {run_dir} is not writable; allowed: a directory this user can write")


def resume_target(cfg: Config, run_dir: Path) -> tuple:
    """(cfg, run dir, checkpoint metadata or None), touching nothing. A resume continues in the
    run dir it names (cfg.trainer.resume resolved to it); otherwise `run_dir`."""
    resumed = resume_point(cfg) if cfg.trainer.resume else None
    if resumed is None:
        return cfg, run_dir, None
    run_dir, meta = resumed
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume=str(run_dir))), run_dir, meta


def open_run_dir(run_dir: Path, resumed: Optional[Dict[str, Any]]) -> None:
    """Once the job is checked: make the run dir, or for a resume archive the earlier attempt. A
    new start in a run dir an earlier job used archives that job's rank files too: its error file
    would be read as this job's (and end it)."""
    if resumed is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if ranks_dir(run_dir).exists():
            _archive_attempt(run_dir)
        return
    print(f"[orchestrator] resuming {run_dir} from step {resumed['step']}")
    _archive_attempt(run_dir)


def _close_dead_attempt(run_dir: Path, previous: Dict[str, Any]) -> None:
    """The attempt of an owner that died mid-job (killed -9) never wrote its result: it is recorded
    FAILED, saying so (its MLflow run is closed once the tracker is up: _run_owned)."""
    out = result_path(run_dir)
    if read_json(out, {}).get("status") == Status.FINISHED:
        return
    write_json(out, JobResult(status=Status.FAILED, extra={
        "run_dir": str(run_dir), "mlflow_run_id": read_job(run_dir).get("mlflow_run_id"),
        "error": f"its process died while it ran (host {previous.get('host')}, pid {previous.get('pid')})"}).to_dict(),
               indent=2)


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
        said = outcome.error.strip()
        if said.startswith(DIVERGED_AT) and "\n" not in said:  # its loss or weights (runtime/step.py)
            return Status.DIVERGED, f"rank {outcome.failed_rank} {said}"
        if said and "\n" not in said:  # the rank's own one line (a config it found wrong): the reason
            return Status.FAILED, f"rank {outcome.failed_rank} failed: {said}"
        where = traceback_line(said)
        if where is not None:  # the user's code raised: the traceback stays in the rank's file
            return Status.FAILED, (f"rank {outcome.failed_rank} failed {where} ({TRACEBACK_IN}"
                                   f"ranks/rank{outcome.failed_rank}.err)")
        return Status.FAILED, f"rank {outcome.failed_rank} failed"
    if outcome.ok:
        return Status.FAILED, f"only {reported} of {expected} ranks reported a result"
    return Status.FAILED, f"launcher exited with code {outcome.returncode}"


def resume_point(cfg: Config) -> tuple:
    """(run dir, checkpoint metadata) for trainer.resume. ConfigError when it cannot resume (no
    checkpoint, another world size, a key the checkpoint fixed changed); NothingToResume when the
    run finished and the new config trains no further. Neither touches the run."""
    try:
        run_dir = checkpoint.resolve_resume(str(cfg.trainer.resume))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    meta = checkpoint.meta_of(checkpoint.find_latest(run_dir))  # type: ignore[arg-type]
    if meta["world_size"] != cfg.world_size:
        raise ConfigError(f"trainer.resume: the checkpoint was written by {meta['world_size']} ranks and this job has "
                          f"{cfg.world_size}; resume with the same world size (parallelism.nproc_per_node / nnodes)")
    saved = _saved_config(config_path(run_dir))
    if saved is None:
        return run_dir, meta
    changed = checkpoint.changed_keys(flatten(saved), flatten(cfg))
    if changed:
        listed = ", ".join(f"{k} ({old} -> {new})" for k, old, new in changed)
        raise ConfigError(f"trainer.resume: a resume continues the same run, but these keys differ from its config.yaml: "
                          f"{listed}; pass the run's own values (docs/long-runs.md lists what may change)")
    # one left empty by a full disk: skipped, with a note; one written before typed results reads alike
    previous = JobResult.from_dict(read_json(result_path(run_dir), {}))
    if previous.status == Status.FINISHED and not checkpoint.trains_further(
            saved.trainer, cfg.trainer, int(previous.steps or 0), previous.steps_per_epoch):
        raise NothingToResume(
            f"nothing to resume: {run_dir} finished at step {previous.get('steps', meta['step'])} "
            f"(trainer.max_steps={saved.trainer.max_steps}, trainer.epochs={saved.trainer.epochs}); raise "
            "trainer.max_steps or trainer.epochs to train further. Its records are unchanged.")
    return run_dir, meta


def _saved_config(path: Path) -> Optional[Config]:
    """The run's own config.yaml; None when it is missing, or empty or cut short (written before
    records were atomic): then with a one-line note, and the resume goes on without comparing."""
    import yaml

    if not path.exists():
        return None
    try:
        if path.read_text().strip():
            return load_config(str(path))
        raise ValueError("empty")
    except (ValueError, yaml.YAMLError) as exc:
        if isinstance(exc, ConfigError):  # it reads, and says something the schema refuses
            raise
        note_unreadable(path, exc)
        return None


def _archive_attempt(run_dir: Path) -> None:
    """Keep what the earlier attempt recorded under attempts/<n>/ (its rank files, config, result
    and load report), so the new attempt overwrites nothing and the supervisor starts clean."""
    n = 1
    while attempt_dir(run_dir, n).exists():
        n += 1
    dest = attempt_dir(run_dir, n)
    dest.mkdir(parents=True)
    if ranks_dir(run_dir).exists():
        ranks_dir(run_dir).rename(ranks_dir(dest))
    for path in (config_path(run_dir), result_path(run_dir), *report_paths(run_dir)):
        if path.exists():
            shutil.copy2(path, dest / path.name)


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
