"""`python -m orchestrator [overrides]`: Hydra glue around `app.run_job`.

Errors are ours to print: a bad config is one line naming the field and the allowed values
(exit 2); a failed job shows the failing rank's traceback (exit 1); Ctrl-C/SIGTERM end the whole
job (exit 130/143); a job stopped at a checkpoint by trainer.checkpoint_signal exits 3, after
requeueing its SLURM job where SLURM allows it (a requeued job resumes its own run: resume_requeued);
a job whose loss diverged exits 4 (one line: the step, the loss, the last good checkpoint).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from .errors import config_library_error, format_error
from .moved import moved_override
from .schema import Config, ConfigError, Mode, register_configs, to_config
from .slurm import secondary_task
from .stores import redact, redact_files

if TYPE_CHECKING:
    from .app import JobFailed

register_configs()

EXIT_CONFIG, EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 2, 1, 130, 143
EXIT_CHECKPOINTED = 3  # stopped at a checkpoint on trainer.checkpoint_signal: not finished; requeued, or resume it
EXIT_DIVERGED = 4  # the loss went non-finite or exploded: result.json DIVERGED


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every rank ends, the MLflow run ends KILLED."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


_started = False  # the job function was entered: Hydra made the run dir and wrote .hydra/


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    global _started
    _started = True
    if secondary_task():  # a submitit job's other tasks: its first one starts the ranks on every node
        return
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    # Hydra wrote the overrides and the composed config before this: a password in a store URL
    # given on the command line is masked there too (docs/distributed.md, "Passwords")
    redact_files([*(run_dir / hc.output_subdir).glob("*.yaml")] if hc.output_subdir else [])
    if multirun:
        redact_files([Path(hc.sweep.dir) / "multirun.yaml"])
    tags = {"sweep_id": hc.sweep.dir, "sweep_job": str(hc.job.num)} if multirun else {}
    # the user's own overrides, for the tuner's "rerun the best" line
    overrides = [o for o in hc.overrides.task if not o.lstrip("+~").startswith(("mode=", "tune.", "hydra."))]
    code = run_from_cli(dcfg, run_dir, tags, overrides)
    if code and not multirun:
        sys.exit(code)
    # in a sweep, a failed job is recorded and the next one runs; SweepSummary sets the exit code


def run_from_cli(dcfg: DictConfig, run_dir: Path, tags: dict, overrides: list) -> int:
    """Run one job (or a study) and print its outcome; returns the exit code."""
    from .app import JobCheckpointed, JobFailed, print_summary, run_job
    from .resume import NothingToResume
    from .rundir import RecordError, RunDirOwned
    from .tune.study import StudyFailed
    from .tune.warm import apply_tuned

    try:
        cfg = to_config(dcfg)
        print(f"[orchestrator] run dir: {run_dir}")
        if cfg.mode is Mode.tune:
            return _run_study(cfg, run_dir, overrides)
        cfg = apply_tuned(cfg, print)  # trainer.tuned: a study's pick, or cfg as it is
        _arm_checkpoint_signal(cfg, run_dir, note="sweep_id" not in tags)
        result = run_job(cfg, run_dir, extra_tags=tags)
    except JobCheckpointed as exc:
        return _checkpointed(exc.result, cfg, run_dir, overrides)
    except NothingToResume as exc:
        print(f"[orchestrator] {exc}")
        return 0
    except RunDirOwned as exc:  # another live job's dir: nothing of it is touched, no result.json either
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as exc:
        return _refused(exc, run_dir)
    except StudyFailed as exc:
        print(f"error: tune: study stopped: {redact(str(exc))} (run dir: {run_dir})", file=sys.stderr)
        return EXIT_FAILED
    except JobFailed as exc:  # a failed, diverged or unrecorded job (RecordFailed)
        return _job_failed(exc)
    except RecordError as exc:  # before launch (config.yaml), or a study's outputs
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Terminated:
        print("error: terminated (SIGTERM); every rank was stopped", file=sys.stderr)
        _resume_hint(run_dir, overrides)
        sys.exit(EXIT_SIGTERM)
    except KeyboardInterrupt:
        print("error: interrupted; every rank was stopped", file=sys.stderr)
        _resume_hint(run_dir, overrides)
        sys.exit(EXIT_SIGINT)
    print_summary(_with_rerun_advice(result, cfg, run_dir, overrides), run_dir)
    return 0


def _run_study(cfg: Config, run_dir: Path, overrides: list) -> int:
    """mode=tune: the study here, or its workers as a SLURM job array (tune.workers > 1); a study
    that found nothing to run leaves no empty run dir behind."""
    if cfg.tune.workers > 1:
        return _run_workers(cfg, run_dir, overrides)
    from .rundir import Status, remove_if_unused
    from .tune.study import run_study

    summary = run_study(cfg, run_dir, overrides=overrides)
    if summary["status"] == Status.NOTHING_TO_RUN and remove_if_unused(run_dir):
        print(f"[orchestrator] nothing ran: {run_dir} removed")
    return 0


def _refused(exc: ConfigError, run_dir: Path) -> int:
    """A config refused before launch: its one line, and result.json INVALID saying it (unless the
    run dir holds a result already: a refused resume leaves the run's records alone). Exit 2."""
    from .measure.results import JobResult
    from .rundir import RecordError, Status, result_path, write_json

    print(f"error: {redact(str(exc))}", file=sys.stderr)
    out = result_path(run_dir)
    if not out.exists():
        try:
            write_json(out, JobResult(status=Status.INVALID, extra={"error": redact(str(exc))}).to_dict())
        except RecordError:
            pass  # the config error is the one to read
    return EXIT_CONFIG


def _job_failed(exc: "JobFailed") -> int:
    """A job that ran and did not finish: one line with its run dir (and what the launcher said,
    when no rank said why). Exit 4 when it diverged, else 1."""
    from .app import JobDiverged, RecordFailed
    from .supervise import TRACEBACK_IN

    if isinstance(exc, RecordFailed):  # the job's record could not be written (a full disk): one line
        print(f"error: {exc}; the run ended FAILED (run dir: {exc.result.get('run_dir')})", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(exc, JobDiverged):
        print(f"error: {exc} (run dir: {exc.result.get('run_dir')})", file=sys.stderr)
        return EXIT_DIVERGED
    error = exc.result.get("error", str(exc))
    if error != str(exc) and TRACEBACK_IN not in str(exc):  # what the launcher said, when no rank said why
        print(redact(error), file=sys.stderr)
    print(f"error: job failed: {redact(str(exc))} (run dir: {exc.result.get('run_dir')})", file=sys.stderr)
    return EXIT_FAILED


def _with_rerun_advice(result: dict, cfg: Config, run_dir: Path, overrides: list) -> dict:
    """The rerun of a study's pick: its advice checked against the study that picked this config,
    in place of the job's own diagnosis when they agree; a line when its samples/s left the
    interval the study confirmed the pick at, with the command that re-tunes from that study."""
    if cfg.tags.get("tuned_study") and cfg.tags.get("tuned_storage"):
        from .commands import orchestrator_command
        from .tune.advise import rerun_advice, study_drift

        study, storage = cfg.tags["tuned_study"], cfg.tags["tuned_storage"]
        retune = orchestrator_command([*(o for o in overrides if not o.startswith(("trainer.tuned=", "+tuned="))),
                                       "mode=tune", f"tune.warm_start={study}", f"tune.storage={storage}"])
        note = study_drift(run_dir, result, study, storage, retune)
        if note:
            print(f"[tuned] {note}")
            result = {**result, "drift": note}
        checked = rerun_advice(run_dir, study, storage)
        if checked is not None:  # advice that agrees with the study that picked this config
            return {**result, "diagnosis": checked}
    return result


def _run_workers(cfg: Config, run_dir: Path, overrides: list) -> int:
    """tune.workers > 1: the study's workers as a SLURM job array (tune/workers.py), with the
    Hydra launcher's resources; the collect line keeps the study's own tune.* overrides."""
    from omegaconf import OmegaConf

    from .tune.workers import run_workers

    hc = HydraConfig.get()
    launcher = OmegaConf.to_container(hc.launcher, resolve=True)
    study_overrides = [o for o in hc.overrides.task if not o.lstrip("+~").startswith(
        ("hydra.", "hydra/", "mode=", "tune.workers=", "tune.wait=", "tune.study_name=", "tune.storage=", "tune.n_trials="))]
    summary = run_workers(cfg, run_dir, launcher, overrides, [redact(o) for o in study_overrides])  # type: ignore[arg-type]
    if summary["status"] == "FAILED":
        failed = summary.get("workers", {}).get("failed") or []
        print(f"error: tune: the workers ended with {summary['n_trials']} of tune.n_trials={cfg.tune.n_trials} trials "
              f"counted ({len(failed)} did not finish); to finish the count: {summary['workers']['collect']}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _arm_checkpoint_signal(cfg: Config, run_dir: Path, note: bool) -> None:
    """trainer.checkpoint_signal at this process (`sbatch --signal=B:USR1@<s>`, `kill -USR1`): the
    request file in the run dir, which rank 0 reads at a step boundary (runtime/hooks.py); the
    ranks then agree on the step, checkpoint and stop. In a SLURM job (`note`: not a sweep's), the
    run dir is noted for the requeued job (outputs/slurm/<job id>.json) unless the command names
    it (hydra.run.dir)."""
    from . import slurm
    from .rundir import RecordError, checkpoint_request_path, write_atomic

    signum = cfg.trainer.checkpoint_signal.signum
    if signum is None:
        return
    request = checkpoint_request_path(run_dir.resolve())

    def on_signal(got: int, frame: object) -> None:
        try:
            write_atomic(request, f"{signal.Signals(got).name}\n")
        except RecordError:  # no room: the ranks' own signal, else SLURM's time limit, ends it
            pass

    signal.signal(signum, on_signal)
    if note and os.environ.get("SLURM_JOB_ID") and not any(RUN_DIR_ARG.match(a) for a in sys.argv[1:]):
        slurm.note_run_dir(str(run_dir.resolve()))


def _checkpointed(result: dict, cfg: Config, run_dir: Path, overrides: list) -> int:
    """The ranks checkpointed on trainer.checkpoint_signal and stopped: requeue the SLURM job
    (it resumes from there when it runs again), else say how to resume. Exit 3."""
    from .slurm import requeue

    step, job = result.get("checkpointed_at_step"), result.get("requeue")
    said = f"[orchestrator] SIG{cfg.trainer.checkpoint_signal.value}: checkpointed at step {step} and stopped"
    if job:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue ends this job's processes: this one is done
        refused = requeue(job)
        if not refused:
            print(f"{said}; SLURM job {job} requeued: run again, it resumes this run from step {step} "
                  f"(run dir {run_dir}, the same MLflow run)", flush=True)
            return EXIT_CHECKPOINTED
        print(f"error: scontrol requeue {job}: {refused}", file=sys.stderr)
    print(f"{said} (run dir {run_dir})", flush=True)
    _resume_hint(run_dir, overrides)
    return EXIT_CHECKPOINTED


def _resume_hint(run_dir: Path, overrides: list) -> None:
    """After an interrupt: the command that continues the run, when it has a checkpoint."""
    from . import checkpoint
    from .commands import orchestrator_command

    if (run_dir / checkpoint.DIR).exists() and checkpoint.find_latest(run_dir) is not None:
        args = [o for o in overrides if not o.lstrip("+~").startswith("trainer.resume=")]
        print(f"resume it: {orchestrator_command([*args, f'trainer.resume={run_dir}'])}", file=sys.stderr)


RESUME_ARG = re.compile(r"^\+{0,2}trainer\.resume=(.*)$")


def resume_in_place(argv: List[str]) -> List[str]:
    """A resume runs in the run dir it continues: point Hydra there (no new, empty run dir) and
    keep Hydra from rewriting the run's own .hydra/ record. A value that does not resolve raises
    ValueError naming the field, before Hydra makes any run dir."""
    values = [m.group(1) for m in map(RESUME_ARG.match, argv) if m]
    if not values or values[-1] in ("", "null", "None") or {"-m", "--multirun"} & set(argv):
        return argv
    from .resume import resolve_resume

    run_dir = resolve_resume(values[-1])
    kept = [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.output_subdir="))]
    return [*kept, f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


RUN_DIR_ARG = re.compile(r"^hydra\.run\.dir=(.*)$")
MODE_TUNE_ARG = re.compile(r"^\+{0,2}mode=tune$")


def resume_requeued(argv: List[str], environ: Optional[dict] = None) -> List[str]:
    """A SLURM job requeued after it checkpointed (or preempted) runs the same command again, with
    SLURM_RESTART_COUNT >= 1: it resumes its own run (trainer.resume=<that run dir>) when the
    earlier start of this job left one with a checkpoint (slurm.restarted_run_dir), rather than
    starting from step 0 in a new run dir. A command that names trainer.resume is left as it is."""
    from .slurm import restarted_run_dir

    environ = dict(os.environ) if environ is None else environ
    if (not environ.get("SLURM_JOB_ID") or environ.get("SLURM_RESTART_COUNT", "0") in ("", "0")
            or {"-m", "--multirun"} & set(argv) or any(RESUME_ARG.match(a) or MODE_TUNE_ARG.match(a) for a in argv)):
        return argv
    explicit = [m.group(1) for m in map(RUN_DIR_ARG.match, argv) if m]
    run_dir = restarted_run_dir(explicit[-1] if explicit else None, environ)
    if run_dir is None:
        return argv
    print(f"[orchestrator] SLURM job {environ['SLURM_JOB_ID']} runs again (SLURM_RESTART_COUNT="
          f"{environ['SLURM_RESTART_COUNT']}): resuming its run {run_dir}", flush=True)
    return [*argv, f"trainer.resume={run_dir}"]


def odd_override(argv: List[str]) -> Optional[str]:
    """The one line for an override Hydra would take wrongly: no key (`=5`: a 39-line traceback
    of Hydra's), or no value (`key=`: an empty string, which a field then reads as if unset);
    None when every override has both."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg or arg.startswith("~"):
            continue  # a flag (-m, --cfg job), a group default (`backend`), a deletion
        key, _, value = arg.partition("=")
        if not key.lstrip("+"):
            return f"malformed override '{arg}': no key before '='; expected <key>=<value>, e.g. data.batch_size=64"
        if value == "":
            return (f"{key.lstrip('+')}: empty value in '{arg}'; allowed: a value, null (`{key}=null`: unset), "
                    f"'' quoted for an empty string (\"{key}=''\"), or leave the override out")
    return None


NODE_RANK_ARG = re.compile(r"^\+{0,2}parallelism\.node_rank=(\d+)$")


def refuse_if_owned(argv: List[str]) -> None:
    """A start or resume in a run dir another live job owns ends here, in one line (exit 2), before
    Hydra writes its .hydra/ record or log there (run_job checks again as it takes the dir)."""
    from .rundir import owned_by, owned_message

    values = [m.group(1) for m in map(RUN_DIR_ARG.match, argv) if m]
    if not values or {"-m", "--multirun"} & set(argv):
        return
    run_dir = Path(values[-1]).resolve()
    node = [int(m.group(1)) for m in map(NODE_RANK_ARG.match, argv) if m]
    owner = owned_by(run_dir, node[-1] if node else 0)
    if owner is not None:
        print(f"error: {owned_message(run_dir, owner)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def check_command_line(argv: List[str]) -> List[str]:
    """What the command line refuses before Hydra makes a run dir, each in one line (exit 2): an
    override without key or value, an old key (moved.py), a resume of nothing, a run dir another live job owns. Returns
    the command pointed at the run it resumes (a requeued SLURM job's own, trainer.resume's dir).
    The job's own checks follow once its config is composed (checks.preflight, in run_job)."""
    odd = odd_override(argv) or moved_override(argv)
    if odd is not None:
        print(f"error: {redact(odd)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    try:
        argv = resume_in_place(resume_requeued(argv))
    except ValueError as exc:  # a resume of nothing: refused before any run dir is made
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    refuse_if_owned(argv)
    return argv


def cli() -> None:
    # We print Hydra's compose errors ourselves (one line); HYDRA_FULL_ERROR makes Hydra raise them.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    signal.signal(signal.SIGTERM, _on_sigterm)
    sys.argv = [sys.argv[0], *check_command_line(sys.argv[1:])]
    try:
        main()
    except (HydraException, OmegaConfBaseException, ConfigError) as exc:  # compose-time errors
        print(f"error: {redact(format_error(exc, Config))}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except Exception as exc:  # noqa: BLE001 - Hydra's own writes before the job: the run dir
        os_error = _os_error(exc)
        composing = None if _started or os_error is not None else config_library_error(exc)
        if composing is not None:  # OmegaConf or Hydra failed with a plain exception: one line
            print(f"error: {redact(composing)}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
        if _started or os_error is None:
            raise
        multirun = bool({"-m", "--multirun"} & set(sys.argv))
        print(f"error: {run_dir_error(os_error, multirun=multirun, where=_hydra_dir(multirun))}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _hydra_dir(multirun: bool) -> str:
    """The run (or sweep) dir Hydra was writing: the command's, else under conf/config.yaml's default."""
    arg = re.compile(r"^hydra\.sweep\.dir=(.*)$") if multirun else RUN_DIR_ARG
    given = [m.group(1) for m in map(arg.match, sys.argv[1:]) if m]
    return given[-1] if given else ("outputs/multirun/" if multirun else "outputs/runs/")


def _os_error(exc: BaseException) -> Optional[OSError]:
    """The OSError behind `exc` (Hydra wraps the one of its log file in a ValueError)."""
    seen: Optional[BaseException] = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def run_dir_error(exc: OSError, multirun: bool = False, where: Optional[str] = None) -> str:
    """Hydra could not make the run dir, or write its .hydra/ record there (a read-only folder, a
    file in the way, a full disk): one line naming the option, before anything is launched. A
    write that fails on a full disk names no file: `where` (the dir) then stands for it."""
    from .rundir import DISK_FULL, FREE_THERE, free_space

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    where = exc.filename or where or "?"
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        problem = f"{where} is a file, not a directory"
    elif exc.errno in DISK_FULL:  # the host's disk, not the option's value
        return (f"{key}: cannot write {where} ({exc.strerror}; {free_space(Path(where))}{FREE_THERE}): the disk is full "
                "or over a size limit; free some space, or give a directory on another disk")
    else:
        problem = f"cannot write {where} ({exc.strerror or exc})"
    return f"{key}: {problem}; allowed: a directory this user can create or write (or a new path)"


if __name__ == "__main__":
    cli()
