"""The Optuna loop: every trial is a real, short launch through `run_job`, nested in MLflow.

Objective `goodput` (default): samples/s times what a sample is worth at the trial's global batch
(goodput.py). Objective `utilization`: the measured utilization decides among the trials whose
throughput is within `tune.throughput_floor` of the best seen; a trial below that floor ranks
under all of them (see `utilization_score`), and the reported best is the highest-utilization
trial within the floor of the study's best throughput. Utilization alone can be
raised by wasting work (smaller batches run less efficient kernels); this keeps such a setting
from winning when it costs samples per second.
"""

from __future__ import annotations

import secrets
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..app import check_launch
from ..fingerprint import describe, fingerprint
from ..progress import StudyProgress
from ..rundir import RecordError, Status, own_run_dir, owner_tag
from ..schema import Config, ConfigError, Mode, Objective, SamplerName
from ..slurm import resolve as resolve_allocation
from ..stores import PROJECT, redact, resolve_uri, store_error
from ..tracking import Tracker
from .confirm import Confirmation
from .edges import apply_extensions
from .launch import METRICS, StudyFailed, TrialLaunching, TrialRecord, trial_config, trial_metrics
from .outcome import StudyOutcome
from .ownership import StudyOwnership
from .pool import RankPool
from .proposals import Proposals
from .report import import_plotting
from .rules import counted, not_launched, stale_streak
from .space import SearchSpace, knob_words
from .steer import MAX_DUPLICATES
from .storage import check_shared, is_storage_error, study_lock

# what other modules (the CLI, workers.py, bench/, tests) import from here
__all__ = ["METRICS", "StudyFailed", "TrialRecord", "Tuner", "run_study", "trial_config", "trial_metrics"]


class Tuner(StudyOwnership, TrialLaunching, Confirmation, StudyOutcome):
    """One tuner process of a study: the ask-and-tell loop over its trials, then the confirmation.
    Its parts: the study's storage and what dead tuners left in it (ownership.py), a trial's
    launch (launch.py, its pruner in prune.py), the confirmation rounds (confirm.py), the study's
    outcome (outcome.py); the constants that steer them are in steer.py."""

    def __init__(self, cfg: Config, run_dir: Path, echo: bool = True, overrides: Optional[List[str]] = None) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its INFO lines ("A new study created") are not ours
        self.offset = 0.0  # added to the utilization score (answer.score_offset)
        self.held: Optional[List[str]] = None  # lines said during a trial, printed after its own line (_record)
        self.overrides = list(overrides or [])  # the study's own CLI overrides, for the rerun line
        self.optuna = optuna
        self.spent = {"launch": 0.0, "train": 0.0, "warmup": 0.0, "setup": 0.0}  # seconds, over this process's launches
        if cfg.mode is not Mode.tune:  # its measure.* nulls took a plain run's defaults: its trials would too
            raise ValueError(f"a study's config is composed with mode=tune (its trials measure by schema.TRIAL_MEASURE), "
                             f"got mode={cfg.mode.value}")
        cfg = resolve_allocation(cfg)  # inside a SLURM allocation: its nodes (orchestrator/slurm.py)
        self.cfg, self.t, self.echo = cfg, cfg.tune, echo
        self.run_dir = Path(run_dir).resolve()
        self.space = SearchSpace(cfg)  # raises ConfigError before any trial
        if self.t.sampler is SamplerName.grid and self.space.grid_size() > self.t.n_trials:
            raise ConfigError(f"tune.sampler: grid has {self.space.grid_size()} points, more than tune.n_trials="
                              f"{self.t.n_trials}; raise tune.n_trials or use guided, tpe, gp or random")
        self.stopped: Optional[Dict[str, Any]] = None  # why the study ended before tune.n_trials
        self.storage = resolve_uri(self.t.storage, PROJECT)  # a relative path is the project's, like tracking.uri's
        if check_shared(self.storage, machines=False) and echo:  # SQLite on a network file system: one line
            print(check_shared(self.storage, machines=False), flush=True)
        # a new study's name is its own: studies started in the same second (or microsecond) never merge
        self.name = self.t.study_name or f"{cfg.model._target_.rsplit('.', 1)[-1]}-{cfg.backend.name.value}-" \
                                         f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        self.multi = self.t.objective is Objective.both
        self.tracker = Tracker(cfg.tracking)
        self.proposals = Proposals(self.space, self.t, self.storage, self.name, self._say, cfg)
        self.pool = RankPool(self.run_dir / "pools") if self.t.reuse_ranks else None

    def _check(self) -> None:
        """What would refuse every trial: the base config's launch (devices, launcher, shard
        modules) and the tracking store. Checked before the study, its trials or its MLflow run
        exist, so a refused study changes nothing."""
        check_launch(trial_config(self.cfg, {}), self.run_dir / "trials" / "0000")
        self.tracker.check()

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        self.started, self.mine, self.confirmed_here, self.rejected = time.monotonic(), set(), False, 0
        finished = self._finished_study()
        if finished is not None:  # nothing to check, launch or record
            self._say_study()
            return self._nothing_to_run(finished, counted(finished.get_trials(deepcopy=False)))
        self._check()
        study = self._study()
        self._close_dead_runs()
        self._say_study()
        done = counted(study.get_trials(deepcopy=False))
        if done >= self.t.n_trials and not self._confirmation_due(study):
            return self._nothing_to_run(study, done)
        parent = self._parent(study)
        study.set_user_attr("run_dir", str(self.run_dir))  # its latest outputs (summary.json, tuned/best.yaml)
        self.progress = StudyProgress(self.name, self.t.n_trials) if self.echo else None
        if self.progress is not None:
            self.progress.start()
        status = Status.FAILED
        try:
            self._trials(study, parent, done)
            self._confirm(study, parent)
            status = Status.FINISHED
        except KeyboardInterrupt:
            status = Status.KILLED
            raise
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            raise StudyFailed(f"the study's database failed ({store_error(exc, self.storage, 'tune.storage')}); "
                              f"completed trials are kept: rerun with tune.study_name={self.name} to finish the count") from None
        finally:
            summary = self._end(study, parent, status)
        return summary

    def _trials(self, study: Any, parent: Optional[str], done: int) -> None:
        """Ask, launch and tell until the study counts tune.n_trials trials, or stops early: the
        space covered, tune.patience run out (a failure rate past tune.max_failure_rate raises)."""
        if self.pool is not None and done < self.t.n_trials:
            self.pool.prestart(self.cfg)  # its ranks import torch while the first trial is prepared
            import_plotting(self.t.n_trials)  # meanwhile: the report's imports, off its wall time
        duplicates_in_a_row = 0
        while True:
            with study_lock(self.storage, self.name):
                reclaimed = self._reclaim_orphans(study)
                apply_extensions(self.space, study.user_attrs.get("extended") or {})  # another process's
                if counted(study.get_trials(deepcopy=False)) >= self.t.n_trials:
                    return
                trial = study.ask()
            if reclaimed:  # another tuner process of this study died meanwhile
                self._close_dead_runs()
            try:
                self._run_trial(study, trial, parent)
            except KeyboardInterrupt:
                self._interrupted(study, trial)
                raise
            finally:  # a trial that raised before its own line: what it held is said still
                self._say_held()
            duplicates_in_a_row = duplicates_in_a_row + 1 if not_launched(trial) else 0
            if self._stops_after(study, trial, duplicates_in_a_row):
                return
            self._check_failure_rate(study)

    def _stops_after(self, study: Any, trial: Any, duplicates_in_a_row: int) -> bool:
        """After a trial: the study stops (`stopped` says why) when the space looks covered or
        tune.patience ran out; else the guided search's edge step, if any, is queued."""
        if duplicates_in_a_row >= MAX_DUPLICATES:  # a small space is covered
            self.stopped = {"by": "covered", "why": f"{MAX_DUPLICATES} proposals in a row were already "
                                                    "measured or predicted below the objective's floor: the "
                                                    "space looks covered"}
            return True
        if self.t.extend_edges and not self.multi:
            self.proposals.edges(study, trial)
        if getattr(study.sampler, "covered", False) and not study.get_trials(
                deepcopy=False, states=(self.optuna.trial.TrialState.WAITING,)):  # proposals still run
            self.stopped = {"by": "covered", "why": "every point of the grid was measured"}
            return True
        return self._out_of_patience(study)

    def _end(self, study: Any, parent: Optional[str], status: str) -> Optional[Dict[str, Any]]:
        """The study's outputs, however it ended (an unfinished study's pick says it is not final);
        the ranks end first. A study that raised keeps its own error: a failure here is one line."""
        if self.progress is not None:
            self.progress.stop()
        if self.pool is not None:
            self.pool.release()  # its ranks end while the report is written
        if status != Status.FINISHED:  # its pick is not final: said with it
            self.stopped = self._unfinished(study, status)
        try:
            return self._finish(study, parent, status)
        except RecordError as exc:  # a full disk: the study's MLflow run ends FAILED, the error is one line
            self.tracker.end(Status.FAILED)
            if status == Status.FINISHED:
                raise
            print(f"[tune] {exc}")
        except Exception as exc:
            if status == Status.FINISHED or not is_storage_error(exc):
                raise
            print(f"[tune] could not write the study's outputs: {store_error(exc, self.storage, 'tune.storage')}")
            self.tracker.end(status)
        finally:
            if self.pool is not None:
                self.pool.close()
        return None

    def _say_study(self) -> None:
        n = self.t.n_trials
        self._say(f"[tune] study '{self.name}' in {redact(self.storage)}: {n} trial{'s' if n != 1 else ''}, objective "
                  f"{self.t.objective.value}, sampler {self.t.sampler.value}, space: "
                  + ", ".join(f"{d.name} {d.describe()}" for d in self.space.dims)
                  + "".join(f"; {name} left out: {why}" for name, why in self.space.left_out.items()))
        self._say(f"[tune] {describe(self.cfg)}")

    def _parent(self, study: Any) -> Optional[str]:
        """The study's MLflow run, one across calls: the run an earlier call made (the study's
        user attribute `mlflow_run_id`) is reopened when this tracking store has it and no live
        tuner holds it (another process of a shared study running now gets its own); else a new one."""
        known = study.user_attrs.get("mlflow_run_id")
        run = self.tracker.run_info(known) if known else None  # None: another tracking store, or deleted there
        if run is not None and run.experiment_id == self.tracker.experiment_id and run.status != "RUNNING":
            self._say(f"[tune] continuing the study's MLflow run {known}")
            return self.tracker.reopen(known, {"owner": owner_tag(), "run_dir": str(self.run_dir),
                                               "resumed_at": f"{datetime.now():%Y-%m-%d %H:%M:%S}"})
        parent = self.tracker.start(
            self.cfg.tracking.run_name or f"tune {self.name}",
            {"tune.n_trials": self.t.n_trials, "tune.objective": self.t.objective.value, "tune.storage": redact(self.storage),
             "tune.study_name": self.name, "backend.name": self.cfg.backend.name.value,
             **{f"space.{d.name}": d.describe() for d in self.space.dims}},
            {"mode": "tune", "run_kind": "study", "study_name": self.name, "run_dir": str(self.run_dir),
             "backend": self.cfg.backend.name.value,
             "world_size": str(self.cfg.world_size), "owner": owner_tag(), **fingerprint(self.cfg).tags(),
             **self.cfg.tags},
        )
        if parent and (run is None or run.status != "RUNNING"):
            study.set_user_attr("mlflow_run_id", parent)
        return parent

    def _out_of_patience(self, study: Any) -> bool:
        """tune.patience: the last N counted trials did not beat the best by more than its noise."""
        if not self.t.patience:
            return False
        streak, best = stale_streak(study, self.t)
        if streak < self.t.patience:
            return False
        self.stopped = {"by": "patience", "streak": streak, "best": best,
                        "why": f"{streak} trials in a row did not beat trial {best} by more than its noise "
                               f"(tune.patience={self.t.patience}; tune.n_trials={self.t.n_trials} is the cap)"}
        return True

    def _interrupted(self, study: Any, trial: Any) -> None:
        """Record the running trial as failed and `interrupted`, so a resumed study neither counts
        nor loses it (its processes were already ended by run_job)."""
        TrialState = self.optuna.trial.TrialState
        try:
            if trial.number in {tr.number for tr in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}:
                trial.set_user_attr("interrupted", True)
                study.tell(trial, state=TrialState.FAIL)
        except Exception as exc:  # the interrupt matters more than this record
            print(f"[tune] could not record trial {trial.number} as interrupted: {exc}")
        self._say_held()
        self._say(f"[tune] trial {trial.number} interrupted; rerun with tune.study_name={self.name} to resume")

    def _check_failure_rate(self, study: Any) -> None:
        TrialState = self.optuna.trial.TrialState
        done = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                and not t.user_attrs.get("interrupted")]
        failed = sum(t.state == TrialState.FAIL for t in done)
        if len(done) >= 2 and failed / len(done) > self.t.max_failure_rate:
            raise StudyFailed(f"{failed} of {len(done)} trials failed (> tune.max_failure_rate={self.t.max_failure_rate:g})")

    # -- output ---------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if not self.echo:
            return
        if self.held is not None:
            self.held.append(text)
        else:
            print(text, flush=True)

    def _say_held(self) -> None:
        """The lines held while a trial ran (its proposals), after the trial's own line."""
        held, self.held = self.held or [], None
        for line in held:
            self._say(line)

    def _show(self, what: Callable[[StudyProgress], None]) -> None:
        """Tell the live progress (when the study echoes)."""
        if getattr(self, "progress", None) is not None:
            what(self.progress)

    def _record(self, rec: TrialRecord, t0: float) -> None:
        rec.duration_s = rec.duration_s or time.monotonic() - t0
        m = rec.metrics
        knobs = knob_words(rec.values)
        pm = f" +-{100 * m['rel_se']:.0f}%" if "rel_se" in m else ""
        tokens = f"  real tokens/s {m['tokens_per_s']:.0f}" if m.get("tokens_per_s") is not None else ""
        figures = (f"utilization {100 * m['utilization']:.1f}%  throughput {m['throughput']:.1f}/s{pm}{tokens}"
                   if "utilization" in m else rec.error.splitlines()[0] if rec.error else "")
        held, self.held = self.held, None
        self._say(f"[tune] trial {rec.number:3d} {rec.state:8s} {rec.proposed_by:9s} {knobs:45s} {figures}  "
                  f"({rec.duration_s:.1f}s)")
        self.held = held
        self._say_held()


def run_study(cfg: Config, run_dir: Path, echo: bool = True, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """`mode=tune`: run (or resume) the study; returns the summary written to the run dir."""
    with own_run_dir(Path(run_dir).resolve(), cfg.parallelism.node_rank):  # RunDirOwned: another live tuner's
        tuner = Tuner(cfg, run_dir, echo=echo, overrides=overrides)
        return tuner.run()
