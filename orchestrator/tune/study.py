"""The Optuna loop: every trial is a real, short launch through `run_job`, nested in MLflow.

Objective `utilization` (default): the measured utilization decides among the trials whose
throughput is within `tune.throughput_floor` of the best seen; a trial below that floor ranks
under all of them (see `utilization_score`), and the reported best is the highest-utilization
trial within the floor of the study's best throughput. Utilization alone can be
raised by wasting work (smaller batches run less efficient kernels); this keeps such a setting
from winning when it costs samples per second.
"""

from __future__ import annotations

import secrets
import statistics
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..app import JobDiverged, JobFailed, JobStopped, check_launch, run_job
from ..measure.plan import steady_warmup_steps
from ..measure.results import Estimate, JobResult
from ..measure.stats import MIN_WINDOWS, estimate, with_run_noise
from ..rundir import RecordError, Status, own_run_dir, owner_tag, process_tag, read_json, said_disk_full
from ..schema import Config, ConfigError, Objective, PrunerName, SamplerName
from ..slurm import resolve as resolve_allocation
from ..stores import PROJECT, redact, resolve_uri, sqlite_path, store_error, store_lock
from ..tracking import Tracker, with_percent
from .pool import RankPool
from ..progress import StudyProgress
from .report import best_words, import_plotting, write_outputs
from .rules import (baseline_trial, best_trials, confirm_candidates, confirmed, counted, deciding, failed_confirmation,
                    figures, guarded_pick, not_launched, open_contest, reference_only, refused, stale_streak,
                    utilization_score)
from .space import ACCUM_KEY, BATCH_KEY, NEEDS_WORKERS, WORKERS_KEY, SearchSpace, apply, knob_words
from .confirm import CONFIRM_ROUND, combined, left_out
from .edges import apply_extensions, summary_of
from .goodput import (efficiency, global_batch, judged, lr_for, record_trial, rule_of, scale_of, study_b,
                      time_to_target)
from .memory import memory_record
from .answer import knob_attrs, name_objectives, score_offset, tell_mlflow
from .proposals import Proposals
from .storage import check_shared, is_storage_error, orphaned, study_lock, study_storage

MAX_DUPLICATES = 20  # re-proposed configs in a row before the study calls the space covered
MAX_REJECTED = 10  # sampler configs in a row the job model may keep from a launch; the next one tests the model
CONFIRM_ROUNDS = 2  # interleaved re-measurements of each candidate before the pick (tune.confirm_top)
CONFIRM_LONGER = 2.0  # their windows and minimum measured time, relative to a trial's (same cap)
# more rounds, of the candidates still within the noise of the leader (rules.open_contest) only
CONFIRM_MAX_ROUNDS = 4
METRICS = ("utilization", "throughput", "data_wait_frac", "comm_frac", "peak_mem_mb", "step_time_s", "mfu", "busy_frac",
           "tokens_per_s", "padding_frac")
# what shapes a batch (its keys: an attention_mask or not); the loader knobs do not
BATCH_SHAPERS = ("data._target_", "data.args", "data.collate_fn", "data.batch_key")


WAIT_FOR_TRIALS_S = 1.0  # how often a tuner about to confirm looks whether the other tuners' trials ended


def _trials_words(numbers: List[int]) -> str:
    return f"trial{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"


class StudyFailed(RuntimeError):
    """The failure rate passed tune.max_failure_rate; what was recorded is kept."""


@dataclass
class TrialRecord:
    number: int
    state: str
    values: Dict[str, Any]
    metrics: Dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    measured_s: float = 0.0
    mlflow_run_id: Optional[str] = None
    error: str = ""
    proposed_by: str = "sampler"


class Tuner:
    def __init__(self, cfg: Config, run_dir: Path, echo: bool = True, overrides: Optional[List[str]] = None) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its INFO lines ("A new study created") are not ours
        self.offset = 0.0  # added to the utilization score (answer.score_offset)
        self.held: Optional[List[str]] = None  # lines said during a trial, printed after its own line (_record)
        self.overrides = list(overrides or [])  # the study's own CLI overrides, for the rerun line
        self.optuna = optuna
        self.spent = {"launch": 0.0, "train": 0.0, "warmup": 0.0, "setup": 0.0}  # seconds, over this process's launches
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

    # -- setup -----------------------------------------------------------------------------------
    def _study(self) -> Any:
        optuna = self.optuna
        if self.storage.startswith("sqlite:///"):
            Path(self.storage[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)  # interval: decided in _run_trial
                  if self.t.pruner is PrunerName.median and not self.multi else optuna.pruners.NopPruner())
        # the store lock covers the first use of a fresh store (Optuna creates its tables)
        try:
            with store_lock(self.storage), study_lock(self.storage, self.name):
                study = self._create_or_load(pruner)
                name_objectives(study, self.t)
                self.offset = score_offset(study, self.t)  # 1 in a study made when the score was 1 + utilization
                self._check_space(study)
                worker = int(study.user_attrs.get("workers", 0))
                study.set_user_attr("workers", worker + 1)
                if "base_global_batch" not in study.user_attrs:  # M0: what goodput and the lr rule are relative to
                    study.set_user_attr("base_global_batch", global_batch(self.cfg))
                    study.set_user_attr("lr_scaling", rule_of(self.cfg).value)  # "none": goodput's worst case
                self._reclaim_orphans(study)
                apply_extensions(self.space, study.user_attrs.get("extended") or {})
                if self.t.baseline and (worker == 0 and not study.trials or self._baseline_interrupted(study)):
                    self._enqueue_baseline(study)
        except ConfigError:
            raise
        except Exception as exc:  # unreachable host, wrong password, ...: before any trial
            raise ConfigError(f"tune.storage: cannot use {redact(self.storage)}: {_first_line(exc)}") from None
        study.sampler = self._sampler(worker)
        return study

    def _check_space(self, study: Any) -> None:
        """A study keeps the tune.space it was made with (user attribute `space`, as given: caps
        that follow each machine's cores are not part of it): resuming it with another space is
        refused, in one line naming the dimensions that differ."""
        given = self._given_space()
        held = "free" if self.space.global_batch is None else self.space.global_batch
        if study.user_attrs.get("global_batch", held) != held:  # a study made before it was recorded: any
            raise ConfigError(f"tune.global_batch: study '{self.name}' was made with the global batch "
                              f"{study.user_attrs['global_batch']}, this call gives {held}; resume it with its own "
                              "tune.global_batch, or start another study (a new tune.study_name)")
        study.set_user_attr("global_batch", held)
        made = study.user_attrs.get("space")
        if made is None:  # a new study (or one made before the space was recorded)
            study.set_user_attr("space", given)
        elif made != given:
            differ = "; ".join(f"{n}: {made.get(n, 'absent')} -> {given.get(n, 'absent')}"
                               for n in sorted(set(made) | set(given)) if made.get(n) != given.get(n))
            raise ConfigError(f"tune.space: study '{self.name}' was made with another space ({differ}); resume it "
                              "with its own tune.space, or start another study (a new tune.study_name)")

    def _given_space(self) -> Dict[str, str]:
        return {name: " ".join(f"{k}={v.value if isinstance(v, Enum) else v}" for k, v in vars(spec).items())
                for name, spec in sorted(self.t.space.items())}

    def _baseline_interrupted(self, study: Any) -> bool:
        """The study's baseline trials were all interrupted (Ctrl-C, a killed tuner): a resumed
        study runs it again, so its summary has one."""
        base = [tr for tr in study.get_trials(deepcopy=False) if tr.user_attrs.get("baseline")]
        return bool(base) and all(tr.user_attrs.get("interrupted") for tr in base)

    def _enqueue_baseline(self, study: Any) -> None:
        """Trial 0: the config as given (its values outside the space are left to the sampler).
        A grid takes only whole points: knobs the baseline does not use (prefetch without workers)
        get the grid's first value; a baseline off the grid is not run, and the study says so."""
        params = self.space.params_of(self.space.baseline())
        if self.t.sampler is SamplerName.grid:
            grid = self.space.grid()
            missing = [d for d in self.space.dims if d.param not in params]
            if any(d.key not in NEEDS_WORKERS for d in missing):
                self._say("[tune] the config as given is not a point of the grid: no baseline trial ("
                          + ", ".join(f"{d.name}={self.space.baseline().get(d.key)}" for d in missing) + ")")
                return
            params.update({d.param: grid[d.param][0] for d in missing})
        study.enqueue_trial(params, user_attrs={"baseline": True})

    def _sampler(self, worker: int) -> Any:
        """tune.sampler, seeded: each tuner process of a shared study samples its own stream, the
        first one reproducible from tune.seed. guided is TPE; the diagnosis moves come on top
        (proposals.py)."""
        samplers, seed = self.optuna.samplers, self.t.seed + worker
        name = self.t.sampler
        if name is SamplerName.random:
            return samplers.RandomSampler(seed=seed)
        if name is SamplerName.grid:
            return _Grid(self.space.grid(), seed=seed)
        if name is SamplerName.gp:
            return samplers.GPSampler(seed=seed, n_startup_trials=self._startup_trials())
        with warnings.catch_warnings():  # group (conditional knobs such as prefetch_factor) is experimental
            warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
            return samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=self._startup_trials())

    def _startup_trials(self) -> int:
        return min(5, max(2, self.t.n_trials // 4))

    def _create_or_load(self, pruner: Any, attempts: int = 3) -> Any:
        """create_study(load_if_exists=True); on a server database another machine's tuner may be
        creating the schema or the study at the same moment: try again before giving up."""
        for attempt in range(attempts):
            try:
                return self.optuna.create_study(
                    study_name=self.name, storage=study_storage(self.storage), load_if_exists=True, pruner=pruner,
                    directions=["maximize", "maximize"] if self.multi else ["maximize"],
                )
            except ValueError as exc:  # e.g. resuming a single-objective study as multi-objective
                raise ConfigError(f"tune.study_name: cannot resume '{self.name}': {exc}") from None
            except Exception as exc:
                if attempt == attempts - 1:
                    raise ConfigError(f"tune.storage: cannot use {redact(self.storage)}: {_first_line(exc)}") from None
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def _reclaim_orphans(self, study: Any) -> int:
        """Trials left RUNNING by a tuner process that died (killed, or its database went away
        mid-trial; see `storage.orphaned`) are recorded as interrupted: they neither count toward
        tune.n_trials nor hold a slot. Called under the study lock, before each count. Their MLflow
        runs are closed by _close_dead_runs. Returns how many. (Another process's trial: Optuna's
        public API marks only this process's own, so this goes through the study's storage.)"""
        n = 0
        for tr in study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,)):
            if orphaned(tr):
                study._storage.set_trial_user_attr(tr._trial_id, "interrupted", True)
                study._storage.set_trial_state_values(tr._trial_id, self.optuna.trial.TrialState.FAIL)
                n += 1
        return n

    def _close_dead_runs(self) -> None:
        """The MLflow runs of this study (a tuner's own run, its trials' and confirmations') left
        RUNNING by a tuner process that died: closed FAILED, with a note."""
        if "'" not in self.name:
            self.tracker.close_dead_runs(f"tags.study_name = '{self.name}'", f"study '{self.name}' was run again")

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
            if self.pool is not None and done < self.t.n_trials:
                self.pool.prestart(self.cfg)  # its ranks import torch while the first trial is prepared
                import_plotting(self.t.n_trials)  # meanwhile: the report's imports, off its wall time
            duplicates_in_a_row = 0
            while True:
                with study_lock(self.storage, self.name):
                    reclaimed = self._reclaim_orphans(study)
                    apply_extensions(self.space, study.user_attrs.get("extended") or {})  # another process's
                    if counted(study.get_trials(deepcopy=False)) >= self.t.n_trials:
                        break
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
                if duplicates_in_a_row >= MAX_DUPLICATES:  # a small space is covered
                    self.stopped = {"by": "covered", "why": f"{MAX_DUPLICATES} proposals in a row were already "
                                                            "measured or predicted below the objective's floor: the "
                                                            "space looks covered"}
                    break
                if self.t.extend_edges and not self.multi:
                    self.proposals.edges(study, trial)
                if getattr(study.sampler, "covered", False) and not study.get_trials(
                        deepcopy=False, states=(self.optuna.trial.TrialState.WAITING,)):  # proposals still run
                    self.stopped = {"by": "covered", "why": "every point of the grid was measured"}
                    break
                if self._out_of_patience(study):
                    break
                self._check_failure_rate(study)
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
            if self.progress is not None:
                self.progress.stop()
            if self.pool is not None:
                self.pool.release()  # its ranks end while the report is written
            if status != Status.FINISHED:  # its pick is not final: said with it
                self.stopped = self._unfinished(study, status)
            try:
                summary = self._finish(study, parent, status)
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
        return summary

    def _unfinished(self, study: Any, status: str) -> Dict[str, Any]:
        """A study that ended before its count and confirmation (interrupted, or stopped by a
        failure): how many trials its pick stands on, and how to finish it."""
        done, by = counted(study.get_trials(deepcopy=False)), "interrupted" if status == Status.KILLED else "failed"
        left = (f"{done} of tune.n_trials={self.t.n_trials} trials counted" if done < self.t.n_trials
                else "its confirmation not done")
        return {"by": by, "counted": done, "n_trials": self.t.n_trials,
                "why": f"{by} with {left}: the pick below stands on those alone; rerun the same command with "
                       f"tune.study_name={self.name} to finish"}

    def _say_study(self) -> None:
        n = self.t.n_trials
        self._say(f"[tune] study '{self.name}' in {redact(self.storage)}: {n} trial{'s' if n != 1 else ''}, objective "
                  f"{self.t.objective.value}, sampler {self.t.sampler.value}, space: "
                  + ", ".join(f"{d.name} {d.describe()}" for d in self.space.dims)
                  + "".join(f"; {name} left out: {why}" for name, why in self.space.left_out.items()))

    def _finished_study(self) -> Any:
        """The named study, read without changing it, when it already has its trials and its
        confirmation under this space (a call with nothing to run returns at once); else None
        (the full path creates, checks or refuses it)."""
        db = sqlite_path(self.storage)
        if not self.t.study_name or (db is not None and not db.exists()):
            return None
        try:
            study = self.optuna.load_study(study_name=self.name, storage=study_storage(self.storage))
        except Exception:  # not there yet, or a store the full path reports on
            return None
        if study.user_attrs.get("space") != self._given_space() or self._confirmation_due(study):
            return None
        return study if counted(study.get_trials(deepcopy=False)) >= self.t.n_trials else None

    def _nothing_to_run(self, study: Any, done: int) -> Dict[str, Any]:
        """A call on a study that has its trials (and its confirmation): said, and nothing is
        made (no trial, no MLflow run, no files)."""
        self._say(f"[tune] study '{self.name}' already has {done} counted trial{'s' if done != 1 else ''} "
                  f"(tune.n_trials={self.t.n_trials}): "
                  f"nothing to run. To add more, raise it: tune.study_name={self.name} "
                  f"tune.n_trials={done + self.t.n_trials}")
        best = best_trials(study, self.t)
        rerun = read_json(Path(study.user_attrs.get("run_dir", "")) / "summary.json", {}).get("rerun")
        if best:
            self._say(f"[tune] its best: trial {best[0].number}" + (f"; rerun it: {rerun}" if rerun else ""))
        return {"status": Status.NOTHING_TO_RUN, "study_name": self.name, "storage": redact(self.storage), "n_trials": done,
                "best": {"number": best[0].number, "values": best[0].user_attrs["values"]} if best else None,
                "mlflow_run_id": study.user_attrs.get("mlflow_run_id")}

    def _parent(self, study: Any) -> Optional[str]:
        """The study's MLflow run, one across calls: the run an earlier call made (the study's
        user attribute `mlflow_run_id`) is reopened when this tracking store has it and no live
        tuner holds it (another process of a shared study running now gets its own); else a new one."""
        known, run = study.user_attrs.get("mlflow_run_id"), None
        if known and self.tracker.enabled and self.tracker.client is not None:
            try:
                run = self.tracker.client.get_run(known)
            except Exception:  # another tracking store, or deleted there
                run = None
            if run is not None and run.info.experiment_id == self.tracker.experiment_id and run.info.status != "RUNNING":
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
             "world_size": str(self.cfg.world_size), "owner": owner_tag(), **self.cfg.tags},
        )
        if parent and (run is None or run.info.status != "RUNNING"):
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

    def _unlaunched(self, study: Any, trial: Any, rec: TrialRecord, t0: float, attr: str, value: Any, error: str) -> None:
        """A proposal answered without a launch: recorded as pruned, with `attr` saying why."""
        rec.state, rec.error = "PRUNED", error
        trial.set_user_attr(attr, value)
        study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        self._record(rec, t0)

    def _run_trial(self, study: Any, trial: Any, parent: Optional[str]) -> None:
        TrialState = self.optuna.trial.TrialState
        t0 = time.monotonic()
        self.mine.add(trial.number)
        self.held = []  # what the trial's end proposes is said after the trial's own line
        run_dir = self.run_dir / "trials" / f"{trial.number:04d}"
        # the check for a twin and the claim (this RUNNING trial's params) happen under the study
        # lock: two tuner processes never launch one config at the same time
        with study_lock(self.storage, self.name):
            values = self.space.sample(trial)
            rec = TrialRecord(trial.number, Status.RUNNING, values)
            trial.set_user_attr("values", values)
            for key, value in knob_attrs(values).items():  # user units beside Optuna's internal parameters
                trial.set_user_attr(key, value)
            if "proposed_by" not in trial.user_attrs:  # a diagnosis proposal carries its own
                trial.set_user_attr("proposed_by", "baseline" if trial.user_attrs.get("baseline") else "sampler")
            rec.proposed_by = trial.user_attrs["proposed_by"]
            twin = self._twin(study, trial, values)
            if twin is not None:  # measured already, or running in another tuner: no second launch
                running = " (running)" if twin.state == self.optuna.trial.TrialState.RUNNING else ""
                return self._unlaunched(study, trial, rec, t0, "duplicate_of", twin.number,
                                        f"duplicate of trial {twin.number}{running}")
        ceiling = self.proposals.memory_ceiling(study, values)
        if ceiling is not None and values.get(BATCH_KEY, 0) >= ceiling[0]:  # known not to fit: no launch
            return self._unlaunched(study, trial, rec, t0, "over_memory_of", ceiling[1],
                                    f"batch {values[BATCH_KEY]} does not fit: {ceiling[2]}")
        below = (self.proposals.cannot_win(study, values)
                 if rec.proposed_by == "sampler" and self.rejected < MAX_REJECTED else None)
        self.rejected = self.rejected + 1 if below is not None else 0
        if below is not None:  # the job model shows it cannot be the pick: no launch
            return self._unlaunched(study, trial, rec, t0, "predicted_below", below[:480], f"not launched: {below}")
        try:
            cfg = trial_config(self.cfg, values, b_noise=study_b(study))
            check_launch(cfg, run_dir)  # e.g. a backend of the space this machine cannot launch
        except ConfigError as exc:  # an invalid combination: recorded, never launched
            return self._unlaunched(study, trial, rec, t0, "invalid", str(exc), f"invalid: {exc}")
        trial.set_user_attr("global_batch", global_batch(cfg))
        trial.set_user_attr("lr", cfg.trainer.lr)
        pruned: Dict[str, Any] = {"flag": False}
        no_tokens: Optional[str] = None
        monitor = self._monitor(study, trial, pruned)
        self._show(lambda p: p.trial(counted(study.get_trials(deepcopy=False)), knob_words(values), trial.number))
        tags = {"mlflow.parentRunId": parent, "trial": str(trial.number), "study_name": self.name,
                "run_kind": "trial"} if parent else {}
        try:
            result = self._launch(cfg, run_dir, extra_tags=tags, monitor=monitor, run_name=f"trial {trial.number}",
                                  plots=self.t.trial_plots)
            self._completed(study, trial, rec, result, t0)
        except JobStopped as exc:
            rec.state, rec.mlflow_run_id = "PRUNED", exc.result.get("mlflow_run_id")
            trial.set_user_attr("mlflow_run_id", rec.mlflow_run_id)
            self._pruned(trial, rec, pruned)
            study.tell(trial, state=TrialState.PRUNED)
        except JobFailed as exc:
            no_tokens = self._failed(study, trial, rec, exc, values, cfg)
        rec.duration_s = time.monotonic() - t0
        self._show(lambda p: p.ended(best_words(study, self.t)))
        trial_state_tags = {"trial_state": rec.state, "trial_duration_s": f"{rec.duration_s:.2f}",
                            "proposed_by": rec.proposed_by, "verdict": trial.user_attrs.get("verdict", "-")}
        if rec.error:
            trial_state_tags["prune_reason" if rec.state == "PRUNED" else "trial_error"] = rec.error[:500]
        self._tag(rec.mlflow_run_id, trial_state_tags)
        if rec.state == "PRUNED" and rec.mlflow_run_id and self.tracker.client is not None:
            self.tracker.client.set_terminated(rec.mlflow_run_id, "FINISHED")  # stopped on purpose: trial_state says so
        self._record(rec, t0)
        if no_tokens is not None:  # the space cannot change the batches: every trial would be refused alike
            raise StudyFailed(f"tune.objective=tokens: trial {trial.number} was refused at its first batch: {no_tokens}")

    def _monitor(self, study: Any, trial: Any, pruned: Dict[str, Any]) -> Callable[[int, Dict[str, float]], bool]:
        """The trial's window monitor: the pruner's decision on each measured window (`pruned`
        gets why when it stops the trial)."""
        best_thr = self._best_throughput(study)
        bar = self._interval_bar(study)
        window_thr: List[float] = []
        m0, b = scale_of(study)
        worth = efficiency(trial.user_attrs.get("global_batch") or m0 or 1, m0 or 1, b)  # a sample's, for goodput

        def monitor(window: int, job: Dict[str, float]) -> bool:
            """Report each measured window's score (the objective's, not raw utilization) to the pruner."""
            if self.multi or self.t.objective is Objective.both:
                return False
            name = deciding(self.t)  # samples/s, or real tokens/s for the tokens objective
            if name == "goodput":
                job = {**job, "goodput": job["throughput"] * worth}
            if job.get(name) is None:  # no tokens counted (a batch without a mask: refused at its first batch)
                return False
            if self.t.pruner is PrunerName.interval:
                window_thr.append(job[name])
                est = estimate(window_thr) if len(window_thr) >= MIN_WINDOWS and bar is not None else {}
                if est.get("interval") and est["interval"][1] < bar[0]:
                    what = {"tokens_per_s": "real tokens/s", "goodput": "goodput"}.get(name, "throughput")
                    pruned.update(flag=True, window=window, job=job, reason=(
                        f"{what} {est['mean']:.1f}/s over {len(window_thr)} windows, at most "
                        f"{est['interval'][1]:.1f}/s (95%): below {bar[1]}"))
                return pruned["flag"]
            # for a fixed model mfu is proportional to samples/s: the pruner compares throughput
            value = (job[name] if self.t.objective is not Objective.utilization else
                     utilization_score(job["utilization"], job["throughput"], best_thr, self.t.throughput_floor)
                     + self.offset)
            trial.report(value, window)
            if trial.should_prune():
                bar_ = self._median_at(study, trial.number, window)
                pruned.update(flag=True, window=window, score=value, job=job, reason=(
                    f"score {value:.3f} below the median " + (f"{bar_:.3f} " if bar_ is not None else "")
                    + "of earlier trials at that window"))
            return pruned["flag"]

        return monitor

    def _completed(self, study: Any, trial: Any, rec: TrialRecord, result: Dict[str, Any], t0: float) -> None:
        """A measured trial: its figures on the trial and its MLflow run, its score told, and the
        guided search's next proposal (the job model's, else the diagnosis')."""
        values = rec.values
        rec.metrics = with_run_noise(trial_metrics(result), self.t.run_noise)
        rec.measured_s = rec.metrics.get("measured_s", 0.0)
        if self.t.objective is Objective.mfu and "mfu" not in rec.metrics:
            raise JobFailed(f"tune.objective=mfu: this trial has no mfu ({result.get('mfu_source')})", result)
        if self.t.objective is Objective.tokens and "tokens_per_s" not in rec.metrics:  # the rank refuses it first
            raise JobFailed("tune.objective=tokens: this trial counted no real tokens (its batches have no "
                            "attention_mask); use tune.objective=throughput", result)
        rec.mlflow_run_id = result.get("mlflow_run_id")
        self._log_estimate(rec.mlflow_run_id, rec.metrics)
        workers = values[WORKERS_KEY] if values.get(WORKERS_KEY) is not None else self.cfg.data.num_workers
        for k, v in {**rec.metrics, "stopped_by": result.get("stopped_by"), "mlflow_run_id": rec.mlflow_run_id,
                     "duration_s": time.monotonic() - t0, "steps_per_epoch": result.get("steps_per_epoch"),
                     "input_cost": result.get("input_cost"), "item_bytes": result.get("item_bytes"),
                     "memory": memory_record(result, workers)}.items():
            trial.set_user_attr(k, v)
        if result.get("diagnosis"):
            trial.set_user_attr("verdict", result["diagnosis"]["verdict"])
        self._goodput(study, trial, rec, result.get("noise_scale"))
        study.tell(trial, self._score(study, rec))
        rec.state = "COMPLETE"
        if not self.proposals.model(study, trial, values) and result.get("diagnosis"):
            self.proposals.diagnosis(study, trial, values, result["diagnosis"])

    def _failed(self, study: Any, trial: Any, rec: TrialRecord, exc: JobFailed, values: Dict[str, Any],
                cfg: Config) -> Optional[str]:
        """A trial whose job failed (or diverged: failed, so never the pick): recorded FAIL; an out-of-
        memory one proposes half the batch at twice the accumulation. Returns why every trial would
        be refused alike under the tokens objective (its batches carry no mask), else None."""
        self._stop_if_disk_full(exc, f"trial {trial.number}", study, trial)
        err = exc.result.get("error", str(exc))
        rec.state, rec.mlflow_run_id = "DIVERGED" if isinstance(exc, JobDiverged) else "FAIL", exc.result.get("mlflow_run_id")
        if isinstance(exc, JobDiverged):  # said as such in trials.csv and summary.json
            trial.set_user_attr("diverged", True)
        rec.error = ("out of memory: " if _is_oom(err) else "") + str(exc)
        trial.set_user_attr("error", rec.error[:500])
        trial.set_user_attr("mlflow_run_id", rec.mlflow_run_id)
        study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        if _is_oom(err) and values.get(BATCH_KEY):
            self.proposals.diagnosis(study, trial, values, {"verdict": "out of memory", "moves": [{
                "set": {BATCH_KEY: max(1, values[BATCH_KEY] // 2),
                        ACCUM_KEY: int(values.get(ACCUM_KEY) or cfg.trainer.accumulation_steps) * 2},
                "why": "half the batch, twice the accumulation: the same samples per step in less memory"}]})
        if "tune.objective=tokens:" in str(exc) and not any(d.key.startswith(BATCH_SHAPERS) for d in self.space.dims):
            return str(exc).split("tune.objective=tokens:", 1)[1].strip()  # every trial's batches are alike
        return None

    def _interval_bar(self, study: Any) -> Optional[tuple]:
        """tune.pruner=interval: (throughput, why) below which a trial cannot be the pick: the
        objective's floor (1 for throughput and mfu) of the lower end of the fastest measured trial's
        95% interval (for the tokens objective: in real tokens/s, of the trial with the most). A trial
        whose own interval lies wholly below it ranks under that trial, whatever its remaining windows
        read."""
        name = deciding(self.t)  # real tokens/s for the tokens objective
        done = [tr for tr in study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
                if tr.user_attrs.get(name) is not None and not refused(tr, self.t)]
        if not done:
            return None
        fastest = max(done, key=lambda tr: tr.user_attrs[name])
        lo = fastest.user_attrs.get(f"{name}_lo") or fastest.user_attrs[name]
        floor = self.t.throughput_floor if self.t.objective is Objective.utilization else 1.0
        return floor * lo, f"{floor:g} x trial {fastest.number}'s {lo:.1f}/s, the low end of its interval"

    def _median_at(self, study: Any, number: int, window: int) -> Optional[float]:
        """The median pruner's bar at `window`: the median of the earlier trials' scores there."""
        scores = [tr.intermediate_values[window] for tr in study.get_trials(
                  deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,)) if window in tr.intermediate_values]
        return statistics.median(scores) if scores else None

    def _pruned(self, trial: Any, rec: TrialRecord, pruned: Dict[str, Any]) -> None:
        """A pruned trial keeps its last window's figures and the pruner's reason (trials.csv,
        the console line, the MLflow tag prune_reason)."""
        if not pruned.get("job"):
            return
        job = pruned["job"]
        trial.set_user_attr("last_window_throughput", float(job["throughput"]))
        trial.set_user_attr("last_window_utilization", float(job["utilization"]))
        tokens = ""
        if job.get("tokens_per_s") is not None:
            trial.set_user_attr("last_window_tokens_per_s", float(job["tokens_per_s"]))
            tokens = f", real tokens/s {job['tokens_per_s']:.0f}"
        rec.error = (f"last window {pruned['window']}: utilization {100 * job['utilization']:.1f}%, throughput "
                     f"{job['throughput']:.1f}/s{tokens}; {pruned['reason']}")
        trial.set_user_attr("prune_reason", rec.error)

    def _confirm(self, study: Any, parent: Optional[str]) -> None:
        """The confirmation, by one tuner process of the study: under the study's confirm lock,
        once no other tuner runs a trial (their trials are candidates too); a tuner that gets the
        lock after another confirmed finds nothing due and reports the same pick."""
        with study_lock(self.storage, f"{self.name}.confirm"):
            self._wait_for_trials(study)
            self._confirm_candidates(study, parent)

    def _wait_for_trials(self, study: Any) -> None:
        """Until no other tuner runs a trial of the study (a dead tuner's are reclaimed; this
        process runs none now), or for at most tune.trial_timeout_s (a tuner on another host that
        died cannot be seen to)."""
        said, until, me = False, time.monotonic() + self.t.trial_timeout_s, process_tag()
        while True:
            with study_lock(self.storage, self.name):
                self._reclaim_orphans(study)
                running = [tr for tr in study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,))
                           if tr.user_attrs.get("owner") != me]
            if not running:
                return
            if time.monotonic() > until:
                self._say(f"[tune] {_trials_words([tr.number for tr in running])} still running after "
                          f"tune.trial_timeout_s={self.t.trial_timeout_s:g}: confirming without them")
                return
            if not said:
                self._say(f"[tune] waiting for {_trials_words([tr.number for tr in running])} of another tuner "
                          "before the confirmation")
                said = True
            time.sleep(WAIT_FOR_TRIALS_S)

    def _confirm_candidates(self, study: Any, parent: Optional[str]) -> None:
        """Re-measure the best candidates (report.confirm_candidates) in CONFIRM_ROUNDS interleaved
        rounds with CONFIRM_LONGER x longer windows and minimum time, and store their combined
        figures in the study (`confirmed`): the pick is made from those, not from the single short
        measurement that made a trial look best (its luck included). Past those rounds, up to
        CONFIRM_MAX_ROUNDS, the leader and the candidates still within its noise
        (rules.open_contest) are measured again, each round: the pick at the floor's edge is a
        coin toss on two short runs."""
        top = confirm_candidates(study, self.t)
        numbers = sorted(tr.number for tr in top)
        if len(top) == 1:
            self._say(f"[tune] trial {numbers[0]} needs no confirmation: the other candidates' throughput and "
                      "utilization intervals lie below its own")
        if not self._confirmation_due(study):
            return  # nothing to choose between, or already confirmed (a resumed, finished study)
        self._say(f"[tune] confirming trials {', '.join(map(str, numbers))}: {CONFIRM_ROUNDS} interleaved rounds "
                  f"(up to {CONFIRM_MAX_ROUNDS} while the pick is within the noise), windows x{CONFIRM_LONGER:g}")
        runs: Dict[int, List[Dict[str, Any]]] = {tr.number: [] for tr in top}
        failed: Dict[str, str] = {}  # a candidate whose run failed is out: no more rounds, never the pick
        active, done, total = top, 0, CONFIRM_ROUNDS * len(top)
        for r in range(CONFIRM_MAX_ROUNDS):
            if r >= CONFIRM_ROUNDS:  # past the planned rounds: only while the pick is still open
                ref = reference_only(study, self.t)  # measured beside them, not in the contest
                still = set(open_contest(self._judged(study, combined({n: rs for n, rs in runs.items() if n != ref},
                                                                       self.t.run_noise)), self.t))
                active = [tr for tr in top if tr.number in still]
            active = [tr for tr in active if str(tr.number) not in failed]
            if not active:
                break
            if r >= CONFIRM_ROUNDS:
                grown, total = total, done + len(active) * (CONFIRM_MAX_ROUNDS - r)
                self._say(f"[tune] round {r + 1}: trials {', '.join(str(tr.number) for tr in active)} "
                          f"still within each other's noise, measured again"
                          + (f": confirmation runs up to {total}, from {grown}" if total != grown else ""))
            for tr in active[r % len(active):] + active[:r % len(active)]:
                done += 1
                self._confirm_run(study, tr, r, parent, done, total, runs, failed)
        out = combined(runs, self.t.run_noise)  # a failed candidate's runs were dropped with it
        said = left_out(runs)
        for (n, r), why in said.items():
            self._say(f"[tune] confirmation run of trial {n} in round {r + 1} {why}")
        if said:
            study.set_user_attr("confirm_left_out", {f"{n}-{r}": why for (n, r), why in said.items()})
        for number, m in out.items():
            tokens = f"  real tokens/s {m['tokens_per_s']:.0f}" if m.get("tokens_per_s") is not None else ""
            self._say(f"[tune] confirmed trial {int(number):3d}: utilization {100 * m['utilization']:.1f}%  "
                      f"throughput {m['throughput']:.1f}/s" + (f" +-{100 * m['rel_se']:.0f}%" if m["rel_se"] else "")
                      + tokens)
        if failed:
            study.set_user_attr("confirm_failed", failed)
        study.set_user_attr("confirmed", out)
        self.confirmed_here = True

    def _confirm_run(self, study: Any, tr: Any, r: int, parent: Optional[str], done: int, total: int,
                     runs: Dict[int, List[Dict[str, Any]]], failed: Dict[str, str]) -> None:
        """One confirmation run of trial `tr` (round `r`), its result added to `runs`, or why it
        failed to `failed`."""
        tags = {"study_name": self.name, "run_kind": "confirm"} if parent else {}
        cfg = trial_config(self.cfg, tr.user_attrs["values"], longer=CONFIRM_LONGER, b_noise=study_b(study))
        self._show(lambda p: p.confirm(done, total, f"trial {tr.number}: {knob_words(tr.user_attrs['values'])}"))
        try:
            runs[tr.number].append({**self._launch(
                cfg, self.run_dir / "confirm" / f"{tr.number:04d}-{r}",
                extra_tags={**tags, "confirm_of": str(tr.number), "mlflow.parentRunId":  # under the trial
                            tr.user_attrs.get("mlflow_run_id") or parent} if tags else None, plots=False,
                run_name=f"confirm trial {tr.number}"), CONFIRM_ROUND: r})
        except JobFailed as exc:
            self._stop_if_disk_full(exc, f"the confirmation of trial {tr.number}")
            failed[str(tr.number)] = why = str(exc).splitlines()[0][:300]
            runs.pop(tr.number, None)  # its earlier runs do not make it a contender again
            self._say(f"[tune] confirmation of trial {tr.number} failed: {why}; a config that fails when run again "
                      "is not the pick")
        self._show(lambda p: p.ended(best_words(study, self.t)))

    def _stop_if_disk_full(self, exc: JobFailed, what: str, study: Any = None, trial: Any = None) -> None:
        """A run that could not write for the host's disk (full, a quota, a size limit) says nothing
        of its config: the study stops in one line (StudyFailed), the trial is not counted and a
        candidate stays one (a rerun measures or confirms it again), and the outputs are written
        as far as the disk allows."""
        if not said_disk_full(str(exc)):
            return
        if trial is not None:
            trial.set_user_attr("interrupted", True)  # not counted, and run again by the rerun
            study.tell(trial, state=self.optuna.trial.TrialState.FAIL)
        raise StudyFailed(f"{what} could not write: {str(exc).splitlines()[0][:300]}; the disk is the host's, not the "
                          f"config's: free some space and rerun with tune.study_name={self.name} to finish") from None

    def _launch(self, cfg: Config, run_dir: Path, **kwargs: Any) -> Dict[str, Any]:
        """run_job on the study's ranks and tracker (a trial or a confirmation run); its seconds,
        and its training loops' and warmups' (merge's `time_s`), go toward the study's time
        breakdown (_measured_share), whether it finished, was pruned or failed."""
        launched, result = time.monotonic(), None
        try:
            result = run_job(cfg, run_dir, echo=False, ranks=self.pool, tracker=self.tracker.sibling(), **kwargs)
            return result
        except (JobStopped, JobFailed) as exc:
            result = exc.result
            raise
        finally:
            loops = (result or {}).get("time_s") or {}
            self.spent["launch"] += time.monotonic() - launched
            self.spent["train"] += float(loops.get("train") or 0.0)
            self.spent["warmup"] += float(loops.get("warmup") or 0.0)
            self.spent["setup"] += float(loops.get("setup") or 0.0)

    def _confirmation_due(self, study: Any) -> bool:
        """Two or more candidates to confirm, not yet confirmed (a study interrupted there)."""
        numbers = sorted(tr.number for tr in confirm_candidates(study, self.t))
        return len(numbers) >= 2 and sorted(map(int, [*confirmed(study), *failed_confirmation(study)])) != numbers

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

    def _twin(self, study: Any, trial: Any, values: Dict[str, Any]) -> Any:
        """Another trial of any tuner process that ran this config (COMPLETE, or FAIL and not
        interrupted) or is running it now (RUNNING, by params), if any; called under the study lock."""
        TrialState = self.optuna.trial.TrialState
        for tr in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING)):
            if tr.number == trial.number:
                continue
            if tr.state == TrialState.RUNNING:
                if tr.params == trial.params:
                    return tr
            elif tr.user_attrs.get("values") == values and not tr.user_attrs.get("interrupted"):
                return tr
        return None

    def _best_throughput(self, study: Any) -> float:
        done = study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))
        return max([tr.user_attrs.get("throughput", 0.0) for tr in done] + [0.0])

    def _score(self, study: Any, rec: TrialRecord) -> Any:
        util, thr = rec.metrics.get("utilization", 0.0), rec.metrics.get("throughput", 0.0)
        if self.multi:
            return [util, thr]
        if self.t.objective is Objective.throughput:
            return thr
        if self.t.objective is Objective.mfu:
            return rec.metrics["mfu"]
        if self.t.objective is Objective.tokens:
            return rec.metrics["tokens_per_s"]
        if self.t.objective is Objective.goodput:
            return rec.metrics["goodput"]
        return utilization_score(util, thr, self._best_throughput(study), self.t.throughput_floor) + self.offset

    def _goodput(self, study: Any, trial: Any, rec: TrialRecord, noise: Any) -> None:
        """The trial's noise scale pooled into the study's, its goodput on it and in `rec.metrics`."""
        rec.metrics = record_trial(study, trial, rec.metrics, noise, global_batch(self.cfg))

    def _judged(self, study: Any, conf: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """Confirmed figures with their goodput at the study's noise scale."""
        trials, scale = {str(tr.number): tr for tr in study.get_trials(deepcopy=False)}, scale_of(study)
        return {n: judged(trials[n], f, scale) if n in trials else f for n, f in conf.items()}

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

    def _tag(self, run_id: Optional[str], tags: Dict[str, Any]) -> None:
        if run_id and self.tracker.client is not None:
            from mlflow.entities import RunTag

            self.tracker.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def _log_estimate(self, run_id: Optional[str], m: Dict[str, float]) -> None:
        """The trial's estimate as MLflow metrics of its run."""
        names = {"throughput": "throughput_estimate", "throughput_lo": "throughput_lo", "throughput_hi": "throughput_hi",
                 "rel_se": "throughput_rel_se", "windows": "measured_windows", "measured_s": "measured_s",
                 "tokens_per_s_lo": "tokens_per_s_lo", "tokens_per_s_hi": "tokens_per_s_hi"}
        if run_id and self.tracker.client is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.tracker.client.log_batch(run_id, metrics=[Metric(names[k], m[k], now, 0) for k in names if k in m])

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

    def _notes(self, study: Any, best: List[Any]) -> Dict[str, Any]:
        """What the user must know to act on the pick: the edges it sits on, how its global batch
        compares with the base config's, and the trial time pruning saved."""
        TrialState = self.optuna.trial.TrialState
        trials = study.get_trials(deepcopy=False)
        notes: Dict[str, Any] = {"edges": [], "pruning": {}, "global_batch": None}
        done = [tr.user_attrs["duration_s"] for tr in trials if tr.state == TrialState.COMPLETE
                and tr.user_attrs.get("duration_s")]
        pruned = [tr for tr in trials if tr.state == TrialState.PRUNED and "prune_reason" in tr.user_attrs]
        if pruned and done:  # each pruned trial would have run about as long as a completed one
            spent = sum(tr.duration.total_seconds() for tr in pruned if tr.duration)
            notes["pruning"] = {"pruner": self.t.pruner.value, "pruned": len(pruned), "spent_s": spent,
                                "median_s": statistics.median(done),
                                "saved_s": max(0.0, len(pruned) * statistics.median(done) - spent)}
            if best and not self.multi:  # a pruned trial whose last window reached the best's interval
                lo = figures(best[0], confirmed(study)).get("throughput_lo") or best[0].user_attrs["throughput"]
                notes["pruning"]["within_noise_of_best"] = [
                    tr.number for tr in pruned if tr.user_attrs.get("last_window_throughput", 0.0) >= lo]
        notes["not_launched"] = [{"trial": tr.number, "why": tr.user_attrs["predicted_below"]} for tr in trials
                                 if "predicted_below" in tr.user_attrs]
        notes["measured_share"] = self._measured_share(study)
        if not best or self.multi:
            return notes
        b = best[0]
        notes["edges"] = summary_of(b, self.space, study.user_attrs.get("extended") or {}, self.proposals.capped)
        base = global_batch(self.cfg)
        mine = b.user_attrs.get("global_batch")
        if mine is not None and mine != base and mine != self.space.global_batch:  # not the one asked for
            ranks = f"{self.cfg.world_size} rank{'s' if self.cfg.world_size != 1 else ''}"
            notes["global_batch"] = {
                "base": base, "best": mine, "ratio": mine / base,
                "note": f"the best trains a global batch of {mine} (batch x accumulation x {ranks}) where the base "
                        f"config trains {base} ({mine / base:.3g}x): different optimization math (learning rate, "
                        f"steps per epoch); hold it with tune.global_batch={base}"}
        notes["time_to_target"] = self._time_to_target(study, b)
        return notes

    def _time_to_target(self, study: Any, pick: Any) -> Dict[str, Any]:
        """The pick in the user's units: its learning rate, the noise scale, its goodput against the
        user's config, and why a pick predicted slower to the user's target was set aside."""
        conf = confirmed(study)
        _, why = guarded_pick(study, self.t)
        base = baseline_trial(study, self.t)
        scale = scale_of(study)
        user = judged(base, figures(base, conf), scale) if base is not None else None
        return time_to_target(study, self.cfg, pick, judged(pick, figures(pick, conf), scale), user, why)

    def _measured_share(self, study: Any) -> Dict[str, Any]:
        """This process's study time spent measuring: the measured seconds of its trials and
        confirmation runs over its wall time, and where the rest went (`spent`, seconds):
        measured, the warmups, the rest of the training loops (partial windows: the rest of the
        warmup's epoch when windows are whole epochs, the steps that end a run), each job's setup
        in its ranks before its loop (data loader, model, optimizer), the rest of each launch
        (starting or handing the job to the ranks, the records), and the tuner between launches
        (sampling, the job model, the database, MLflow, the report)."""
        wall = time.monotonic() - self.started
        mine = [tr for tr in study.get_trials(deepcopy=False) if tr.number in self.mine]
        measured = sum(tr.user_attrs.get("measured_s") or 0.0 for tr in mine)
        measured += sum(m.get("measured_s") or 0.0 for m in confirmed(study).values()) if self.confirmed_here else 0.0
        launch, train, warmup, setup = (self.spent[k] for k in ("launch", "train", "warmup", "setup"))
        spent = {"measuring": measured, "warmup": warmup, "rest_of_loops": max(0.0, train - warmup - measured),
                 "setup": setup, "launch": max(0.0, launch - train - setup), "tuner": max(0.0, wall - launch)}
        return {"measured_s": measured, "wall_s": wall, "share": measured / wall if wall > 0 else 0.0,
                "spent": {k: round(v, 2) for k, v in spent.items()}}

    def _finish(self, study: Any, parent: Optional[str], status: str) -> Dict[str, Any]:

        best = best_trials(study, self.t)
        summary = write_outputs(study, best, t=self.t, out_dir=self.run_dir, name=self.name, storage=self.storage,
                                overrides=self.overrides, echo=self.echo,
                                notes={"stopped": self.stopped, **self._notes(study, best)})
        tell_mlflow(self.tracker.client, study, best, self.t, parent)  # the pick and the confirmed figures
        for path in summary["artifacts"]:
            self.tracker.log_artifact(Path(path))
        if best:
            fig = {**best[0].user_attrs, **figures(best[0], confirmed(study))}  # the confirmed figures when re-measured
            fig = judged(best[0], fig, scale_of(study))
            self.tracker.log_metrics([(f"best_{k}", fig[k], 0) for k in (*METRICS, "throughput_lo", "throughput_hi",
                                                                        "tokens_per_s_lo", "tokens_per_s_hi", "goodput",
                                                                        "efficiency", "lr")
                                      if isinstance(fig.get(k), (int, float))]
                                     + with_percent([(k, fig[k], 0) for k in ("throughput", "utilization", "mfu",
                                                                             "tokens_per_s")  # its row's columns
                                                     if isinstance(fig.get(k), (int, float))]))
        self.tracker.end(status)
        self._say(f"[tune] {self.tracker.where()}")
        summary["status"] = status
        summary["mlflow_run_id"] = parent
        return summary


def _Grid(search_space: Dict[str, List[Any]], seed: int) -> Any:
    """Optuna's GridSampler for an ask-and-tell loop: it says when the grid is covered (the loop
    ends) instead of calling study.stop(), which only works inside study.optimize."""
    import optuna

    class Grid(optuna.samplers.GridSampler):
        covered = False

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            self.covered = self.is_exhausted(study)

    return Grid(search_space, seed=seed)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def trial_config(cfg: Config, values: Dict[str, Any], longer: float = 1.0, b_noise: Optional[float] = None) -> Config:
    """The job a trial launches: `cfg` with the sampled `values`, measured after a steady-state
    warmup until tune.rel_precision (or for tune.measure_steps steps when that is 0), at the
    learning rate tune.lr_scaling gives its global batch (goodput.lr_for; `b_noise`: the study's
    noise scale, for adascale). `longer` stretches the windows and the minimum measured time, not
    the cap (the confirmation runs)."""
    t = cfg.tune
    fixed = {
        "trainer.warmup_steps": t.warmup_steps, "trainer.window_steps": t.window_steps, "trainer.epochs": 10_000,
        "trainer.timeout_s": t.trial_timeout_s, "trainer.save_model": False,
        "trainer.log_every": max(1, t.window_steps), "trainer.window_s": t.window_s * longer,
        "trainer.rel_precision": t.rel_precision, "trainer.min_measure_s": t.min_measure_s * longer,
        "trainer.max_measure_s": max(t.max_measure_s, t.min_measure_s * longer), "trainer.max_steps": 0,
    }
    job = apply(cfg, {**fixed, **values})
    scaled = lr_for(cfg, job, values, b_noise)
    if scaled:
        job = apply(job, scaled)
    if t.rel_precision == 0:  # a fixed count of measured steps after the steady-state warmup
        job = apply(job, {"trainer.max_steps": steady_warmup_steps(job) + t.measure_steps})
    return job


def _is_oom(err: str) -> bool:
    return any(s in err for s in ("OutOfMemoryError", "CUDA out of memory", "out of memory", "memory_cap_mb"))


def trial_metrics(result: Dict[str, Any]) -> Dict[str, float]:
    """A measured job's figures for the study (its result, as result.json holds it: JobResult):
    METRICS, with `throughput` and `utilization` their estimates (means over the measured time,
    merge.merge, as the confirmation runs combine them), the 95% intervals of those means, the
    throughput's relative standard error, windows and measured seconds (the rest of a trial's wall
    time is overhead); for batches with an attention_mask, real tokens/s (`tokens_per_s`)
    likewise with its interval."""
    job = JobResult.from_dict(result)
    out = {k: float(v) for k in METRICS if isinstance(v := job.get(k), (int, float))}
    for name, key in JobResult.ESTIMATES:
        est: Optional[Estimate] = getattr(job, key)
        if est is None or est.mean is None:
            continue
        out[name] = float(est.mean)  # over the measured time (windows weighted by their length)
        if est.interval:
            out[f"{name}_lo"], out[f"{name}_hi"] = map(float, est.interval)
        if name == "throughput":
            out["windows"], out["measured_s"] = float(est.windows), float(est.measured_s)
            if est.rel_se is not None:
                out["rel_se"] = float(est.rel_se)
    return out


def run_study(cfg: Config, run_dir: Path, echo: bool = True, overrides: Optional[List[str]] = None) -> Dict[str, Any]:
    """`mode=tune`: run (or resume) the study; returns the summary written to the run dir."""
    with own_run_dir(Path(run_dir).resolve(), cfg.parallelism.node_rank):  # RunDirOwned: another live tuner's
        tuner = Tuner(cfg, run_dir, echo=echo, overrides=overrides)
        return tuner.run()

