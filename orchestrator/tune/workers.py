"""A study on a SLURM cluster: `mode=tune tune.workers=N hydra/launcher=submitit_slurm` submits N
tuner workers as one SLURM job array (submitit, with the launcher's resources), each a `run_study`
in its own allocation (its ranks kept alive across trials, tune.reuse_ranks), all pulling trials
from one shared study under its count lock, `tune.n_trials` in all. This process follows them
(done / running / failed, best so far, workers alive) and ends with the study's table, best.yaml
and rerun line; `tune.wait=false` returns once they are queued, saying how to follow and collect.
"""

from __future__ import annotations

import dataclasses
import signal
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..commands import orchestrator_command
from ..rundir import write_json
from ..schema import Config, ConfigError
from ..slurm import secondary_task
from ..stores import PROJECT, redact, resolve_uri
from .report import write_outputs
from .rules import best_trials, counted
from .storage import check_shared, study_storage

SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# hydra-submitit-launcher's keys that submitit takes as they are; the others are slurm_<key> (its launch())
GENERIC = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
           "stderr_to_stdout"}
FOLLOW_EVERY_S = 2.0
WORKERS_FILE = "workers.json"


def check_launcher(launcher: Dict[str, Any], workers: int) -> None:
    """tune.workers > 1 runs on SLURM through Hydra's submitit launcher: one line otherwise."""
    if launcher.get("_target_") != SUBMITIT_SLURM:
        raise ConfigError(f"tune.workers: {workers} workers run as a SLURM job array; add hydra/launcher=submitit_slurm "
                          "(or your own launcher built on it; pip install -e .[slurm]); allowed without it: 1")


def executor(folder: Path, launcher: Dict[str, Any]) -> Any:
    """A submitit SLURM executor with the Hydra launcher's parameters, as hydra-submitit-launcher builds it."""
    import submitit

    ex = submitit.AutoExecutor(folder=str(folder / "%j"), cluster="slurm",
                               slurm_max_num_timeout=int(launcher.get("max_num_timeout") or 0))
    params = {k: v for k, v in launcher.items() if k not in ("_target_", "submitit_folder", "max_num_timeout")}
    ex.update_parameters(**{k if k in GENERIC else f"slurm_{k}": v for k, v in params.items()})
    return ex


class Worker:
    """What each array job runs: `work`. Requeued (preempted, `scontrol requeue`, or its time
    limit near with hydra.launcher.max_num_timeout > 0: submitit's checkpoint hook), it runs again
    with the same arguments and rejoins the study; its interrupted trial was not counted."""

    def __call__(self, cfg: Config, run_dir: str, overrides: List[str]) -> Optional[Dict[str, Any]]:
        return work(cfg, run_dir, overrides)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def work(cfg: Config, run_dir: str, overrides: List[str]) -> Optional[Dict[str, Any]]:
    """One worker, in its SLURM job: a tuner of the shared study (its first task only; with
    hydra.launcher.nodes > 1 the others return, the first starts the ranks on every node)."""
    if secondary_task():
        return None
    from .study import run_study

    # scancel, preemption: SLURM sends SIGTERM (submitit only logs it), then SIGKILL after KillWait;
    # as Ctrl-C, the running trial is recorded interrupted (not counted, rerun by another worker)
    signal.signal(signal.SIGTERM, _terminated)
    summary = run_study(cfg, Path(run_dir), overrides=overrides)
    return {"status": summary.get("status"), "n_trials": summary.get("n_trials")}


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_workers(cfg: Config, run_dir: Path, launcher: Dict[str, Any], overrides: List[str], study_overrides: List[str],
                say: Callable[[str], None] = print) -> Dict[str, Any]:
    """Check, submit the job array, then follow it (tune.wait) and collect; returns the summary.
    `overrides`: the user's own, for the rerun line; `study_overrides`: with tune.*, for collecting."""
    from .study import StudyFailed, Tuner

    t = cfg.tune
    check_launcher(launcher, t.workers)
    storage = resolve_uri(t.storage, PROJECT)
    check_shared(storage, machines=True)
    tuner = Tuner(cfg, run_dir, echo=False, overrides=overrides)  # the space, the grid: ConfigError before submitting
    tuner._check()  # the base config's launch and the tracking store
    worker_cfg = dataclasses.replace(cfg, tune=dataclasses.replace(t, workers=1, study_name=tuner.name, storage=storage))
    folder = Path(run_dir).resolve() / "workers"
    jobs = executor(folder, launcher).map_array(
        Worker(), [worker_cfg] * t.workers, [str(folder / f"{i}") for i in range(t.workers)], [overrides] * t.workers)
    array = jobs[0].job_id.split("_")[0]
    collect = orchestrator_command([*study_overrides, "mode=tune", f"tune.study_name={tuner.name}", f"tune.storage={redact(storage)}",
                                    f"tune.n_trials={t.n_trials}"])
    record = {"array_job_id": array, "jobs": [j.job_id for j in jobs], "study_name": tuner.name,
              "storage": redact(storage), "logs": str(folder), "collect": collect}
    write_json(Path(run_dir) / WORKERS_FILE, record, indent=2)
    say(f"[tune] study '{tuner.name}' in {redact(storage)}: {t.workers} workers submitted as SLURM job array {array} "
        f"({t.n_trials} trials in all); their logs: {folder}/<job id>/")
    if not t.wait:
        say(f"[tune] follow: squeue -j {array}   (and tail -f {folder}/{array}_*/*_0_log.out)")
        say(f"[tune] collect once they ended (the table, best.yaml, the rerun line): {collect}")
        return {"status": "SUBMITTED", **record}
    try:
        failed = follow(tuner.name, storage, jobs, t.n_trials, say)
    except KeyboardInterrupt:  # the workers are SLURM's: they go on
        say(f"[tune] stopped following; the workers keep running (scancel {array} ends them); follow: squeue -j "
            f"{array}; collect once they ended: {collect}")
        raise
    study = _load(tuner.name, storage)
    if study is None:
        raise StudyFailed(f"no worker of SLURM job array {array} created study '{tuner.name}'; their logs: {folder}")
    summary = write_outputs(study, best_trials(study, t), t=t, out_dir=Path(run_dir), name=tuner.name, storage=storage,
                            overrides=overrides, echo=True, notes={"workers": {**record, "failed": failed}})
    for line in failed:  # a cancelled or preempted worker: its trial was recorded interrupted, the others went on
        say(f"[tune] worker {line}")
    summary["status"] = "FINISHED" if counted(study.trials) >= t.n_trials else "FAILED"
    return summary


def _load(name: str, storage: str) -> Any:
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=study_storage(storage))
    except KeyError:  # no worker created it yet
        return None


def alive(array: str) -> Dict[str, str]:
    """The array's jobs SLURM still holds: job id -> state (PENDING, RUNNING, ...)."""
    squeue = shutil.which("squeue") or "squeue"
    out = subprocess.run([squeue, "-h", "-r", "-j", array, "-o", "%i %T"], capture_output=True, text=True, timeout=60)
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2)


def progress_line(study: Any, jobs: Dict[str, str], n_trials: int) -> str:
    """done / running / failed, the best so far, the workers alive: one line."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False) if study is not None else []
    running = sum(tr.state == TrialState.RUNNING for tr in trials)
    failed = sum(tr.state == TrialState.FAIL for tr in trials)
    done = [tr for tr in trials if tr.state == TrialState.COMPLETE and tr.values]
    best = max(done, key=lambda tr: tr.values[0], default=None)
    best_s = (f"best trial {best.number}: utilization {100 * best.user_attrs.get('utilization', 0):.1f}%  throughput "
              f"{best.user_attrs.get('throughput', 0):.1f}/s" + (f"  real tokens/s {best.user_attrs['tokens_per_s']:.0f}"
                                                                 if best.user_attrs.get("tokens_per_s") is not None else "")
              ) if best is not None else "no best yet"
    up = sum(state == "RUNNING" for state in jobs.values())
    return (f"[tune] {counted([tr for tr in trials if tr.state.is_finished()])}/{n_trials} done, {running} running, {failed} failed; {best_s}; "
            f"workers alive {up} ({len(jobs) - up} queued)")


def follow(name: str, storage: str, jobs: List[Any], n_trials: int, say: Callable[[str], None]) -> List[str]:
    """Until no job of the array is left: a progress line whenever it changes. Returns the
    workers that ended without finishing, as 'job id: why'."""
    array = jobs[0].job_id.split("_")[0]
    last = ""
    while True:
        held = alive(array)
        line = progress_line(_load(name, storage), held, n_trials)
        if line != last:
            say(line)
            last = line
        if not held:
            break
        time.sleep(FOLLOW_EVERY_S)
    return failed_workers(jobs)


def failed_workers(jobs: List[Any]) -> List[str]:
    """Workers that raised (their submitit result) or left no result (cancelled, killed by SLURM,
    past their time limit): 'job id: first line'. Read from the result files, never waited for."""
    from submitit.core.utils import pickle_load

    out = []
    for job in jobs:
        if not job.paths.result_pickle.exists():
            out.append(f"{job.job_id}: left no result (cancelled, or ended by SLURM; its log: {job.paths.stdout})")
            continue
        outcome, value = pickle_load(job.paths.result_pickle)
        if outcome != "success":
            lines = str(value).strip().splitlines()
            out.append(f"{job.job_id}: {lines[-1] if lines else 'failed'}")
    return out


__all__ = ["Worker", "check_launcher", "failed_workers", "follow", "progress_line", "run_workers", "work"]
