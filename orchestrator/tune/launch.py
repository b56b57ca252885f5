"""One trial, from the sampler's proposal to its told result: claimed under the study lock (never
two launches of one config), screened (known not to fit, shown by the job model unable to win, an
invalid combination: recorded without a launch), launched through `run_job_result` with the pruner's
window monitor (prune.py), and its figures, score and MLflow tags recorded. Mixed into
study.Tuner (TrialLaunching), which gives it `cfg`, `t`, `name`, `storage`, `space`, `multi`,
`offset`, `tracker`, `proposals`, `pool`, `run_dir`, `spent`, `mine`, `rejected`, `optuna`,
`_say`, `_show` and `_record`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from ..app import JobDiverged, JobFailed, JobStopped, check_launch, run_job_result
from ..measure.plan import steady_warmup_steps
from ..measure.results import Estimate, JobResult
from ..measure.stats import with_run_noise
from ..rundir import Status, said_disk_full
from ..schema import Config, ConfigError, Objective
from .evidence import POOLED_ATTR, pooled_with
from .goodput import global_batch, lr_for, record_trial, study_b, with_goodput
from .memory import memory_record
from .answer import knob_attrs
from .prune import Monitor, best_throughput, pruned_note, window_monitor
from .report import best_words
from .rules import counted, utilization_score
from .space import ACCUM_KEY, BATCH_KEY, WORKERS_KEY, apply, knob_words
from .steer import MAX_REJECTED
from .storage import study_lock

METRICS = ("utilization", "throughput", "data_wait_frac", "comm_frac", "peak_mem_mb", "step_time_s", "mfu", "busy_frac",
           "tokens_per_s", "padding_frac")
# what shapes a batch (its keys: an attention_mask or not); the loader knobs do not
BATCH_SHAPERS = ("data._target_", "data.args", "data.collate_fn", "data.batch_key")


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


class TrialLaunching:
    """A trial's claim, screen, launch and record (see the module's docstring)."""

    def _run_trial(self, study: Any, trial: Any, parent: Optional[str]) -> None:
        t0 = time.monotonic()
        self.mine.add(trial.number)
        self.held = []  # what the trial's end proposes is said after the trial's own line
        rec = self._claim(study, trial, t0)
        cfg = self._screen(study, trial, rec, t0) if rec is not None else None
        if cfg is None:  # recorded without a launch
            return
        trial.set_user_attr("global_batch", global_batch(cfg))
        trial.set_user_attr("lr", cfg.trainer.lr)
        pruned: Dict[str, Any] = {"flag": False}
        no_tokens: Optional[str] = None
        monitor = self._monitor(study, trial, pruned)
        self._show(lambda p: p.trial(counted(study.get_trials(deepcopy=False)), knob_words(rec.values), trial.number))
        tags = {"mlflow.parentRunId": parent, "trial": str(trial.number), "study_name": self.name,
                "run_kind": "trial"} if parent else {}
        try:
            result = self._launch(cfg, self.run_dir / "trials" / f"{trial.number:04d}", extra_tags=tags,
                                  monitor=monitor, run_name=f"trial {trial.number}", plots=self.t.trial_plots)
            self._completed(study, trial, rec, result, t0)
        except JobStopped as exc:
            rec.state, rec.mlflow_run_id = "PRUNED", exc.job.mlflow_run_id
            trial.set_user_attr("mlflow_run_id", rec.mlflow_run_id)
            rec.error = pruned_note(trial, pruned) or rec.error
            study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        except JobFailed as exc:
            no_tokens = self._failed(study, trial, rec, exc, rec.values, cfg)
        rec.duration_s = time.monotonic() - t0
        self._show(lambda p: p.ended(best_words(study, self.t)))
        self._tag_run(trial, rec)
        self._record(rec, t0)
        if no_tokens is not None:  # the space cannot change the batches: every trial would be refused alike
            raise StudyFailed(f"tune.objective=tokens: trial {trial.number} was refused at its first batch: {no_tokens}")

    def _claim(self, study: Any, trial: Any, t0: float) -> Optional[TrialRecord]:
        """The trial's values and record; None when another trial ran or runs the same config (then
        recorded as its duplicate). The check for a twin and the claim (this RUNNING trial's
        params) happen under the study lock: two tuner processes never launch one config at the
        same time."""
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
        return rec

    def _screen(self, study: Any, trial: Any, rec: TrialRecord, t0: float) -> Optional[Config]:
        """The trial's job, or None when it is answered without a launch: a batch known not to
        fit, a sampler's config the job model shows cannot be the pick, an invalid combination."""
        values = rec.values
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
            check_launch(cfg, self.run_dir / "trials" / f"{trial.number:04d}")  # e.g. a backend it cannot launch
        except ConfigError as exc:  # an invalid combination: recorded, never launched
            return self._unlaunched(study, trial, rec, t0, "invalid", str(exc), f"invalid: {exc}")
        return cfg

    def _unlaunched(self, study: Any, trial: Any, rec: TrialRecord, t0: float, attr: str, value: Any, error: str) -> None:
        """A proposal answered without a launch: recorded as pruned, with `attr` saying why."""
        rec.state, rec.error = "PRUNED", error
        trial.set_user_attr(attr, value)
        study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
        self._record(rec, t0)

    def _monitor(self, study: Any, trial: Any, pruned: Dict[str, Any]) -> Monitor:
        """The trial's window monitor (prune.window_monitor)."""
        return window_monitor(study, trial, self.t, self.offset, pruned)

    def _tag_run(self, trial: Any, rec: TrialRecord) -> None:
        """The trial's state on its MLflow run; a pruned run (stopped on purpose) ends FINISHED."""
        tags = {"trial_state": rec.state, "trial_duration_s": f"{rec.duration_s:.2f}",
                "proposed_by": rec.proposed_by, "verdict": trial.user_attrs.get("verdict", "-")}
        if rec.error:
            tags["prune_reason" if rec.state == "PRUNED" else "trial_error"] = rec.error[:500]
        self.tracker.log_to(rec.mlflow_run_id, tags=tags)
        if rec.state == "PRUNED":  # trial_state says it was stopped on purpose
            self.tracker.end_run(rec.mlflow_run_id, "FINISHED")

    def _completed(self, study: Any, trial: Any, rec: TrialRecord, result: JobResult, t0: float) -> None:
        """A measured trial: its figures on the trial and its MLflow run, its score told, and the
        guided search's next proposal (the job model's, else the diagnosis')."""
        values = rec.values
        rec.metrics = with_run_noise(trial_metrics(result), self.t.run_noise)
        rec.measured_s = rec.metrics.get("measured_s", 0.0)
        if self.t.objective is Objective.mfu and "mfu" not in rec.metrics:
            raise JobFailed(f"tune.objective=mfu: this trial has no mfu ({result.mfu_source})", result)
        if self.t.objective is Objective.tokens and "tokens_per_s" not in rec.metrics:  # the rank refuses it first
            raise JobFailed("tune.objective=tokens: this trial counted no real tokens (its batches have no "
                            "attention_mask); use tune.objective=throughput", result)
        rec.mlflow_run_id = result.mlflow_run_id
        self._log_estimate(rec.mlflow_run_id, rec.metrics)
        workers = values[WORKERS_KEY] if values.get(WORKERS_KEY) is not None else self.cfg.data.num_workers
        for k, v in {**rec.metrics, "stopped_by": result.stopped_by, "mlflow_run_id": rec.mlflow_run_id,
                     "duration_s": time.monotonic() - t0, "steps_per_epoch": result.steps_per_epoch,
                     "input_cost": result.input_cost, "item_bytes": result.item_bytes,
                     "memory": memory_record(result.per_rank, workers)}.items():
            trial.set_user_attr(k, v)
        if result.diagnosis:
            trial.set_user_attr("verdict", result.diagnosis["verdict"])
        self._goodput(study, trial, rec, result.noise_scale.as_dict() if result.noise_scale else None)
        self._tell(study, trial, rec)
        rec.state = "COMPLETE"
        if not self.proposals.model(study, trial, values) and result.diagnosis:
            self.proposals.diagnosis(study, trial, values, result.diagnosis)

    def _failed(self, study: Any, trial: Any, rec: TrialRecord, exc: JobFailed, values: Dict[str, Any],
                cfg: Config) -> Optional[str]:
        """A trial whose job failed (or diverged: failed, so never the pick): recorded FAIL; an out-of-
        memory one proposes half the batch at twice the accumulation. Returns why every trial would
        be refused alike under the tokens objective (its batches carry no mask), else None."""
        self._stop_if_disk_full(exc, f"trial {trial.number}", study, trial)
        err = exc.job.error if exc.job.error is not None else str(exc)
        rec.state, rec.mlflow_run_id = "DIVERGED" if isinstance(exc, JobDiverged) else "FAIL", exc.job.mlflow_run_id
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

    def _launch(self, cfg: Config, run_dir: Path, **kwargs: Any) -> JobResult:
        """run_job_result on the study's ranks and tracker (a trial or a confirmation run); its
        seconds, and its training loops' and warmups' (merge's `time_s`), go toward the study's
        time breakdown (_measured_share), whether it finished, was pruned or failed."""
        launched, result = time.monotonic(), None
        try:
            result = run_job_result(cfg, run_dir, echo=False, ranks=self.pool, tracker=self.tracker.sibling(), **kwargs)
            return result
        except (JobStopped, JobFailed) as exc:
            result = exc.job
            raise
        finally:
            loops = (result.time_s if result is not None else None) or {}
            self.spent["launch"] += time.monotonic() - launched
            self.spent["train"] += float(loops.get("train") or 0.0)
            self.spent["warmup"] += float(loops.get("warmup") or 0.0)
            self.spent["setup"] += float(loops.get("setup") or 0.0)

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

    def _tell(self, study: Any, trial: Any, rec: TrialRecord) -> None:
        """The measured trial's score told: on its figures pooled with a full match's earlier
        measurements of its config where there are (`_pooled`), else on its own."""
        study.tell(trial, self._score(study, {**rec.metrics, **self._pooled(study, trial, rec)}))

    def _pooled(self, study: Any, trial: Any, rec: TrialRecord) -> Dict[str, Any]:
        """In a warm study of the same job, layout and machine: the trial's figures pooled with the
        earlier study's measurements of its config (evidence.py), recorded on the trial (`pooled`)
        and said after its line; {} when nothing is pooled."""
        pooled = pooled_with(self.proposals.carried, rec.values, rec.metrics)
        if pooled is None:
            return {}
        f = pooled["figures"] = with_goodput(pooled["figures"], trial.user_attrs.get("global_batch"),
                                             global_batch(self.cfg), study_b(study))
        trial.set_user_attr(POOLED_ATTR, pooled)
        pm = f" +-{100 * f['rel_se']:.0f}%" if f.get("rel_se") else ""
        self._say(f"[tune] trial {trial.number} pooled, {pooled['words']}: utilization {100 * f['utilization']:.1f}%  "
                  f"throughput {f['throughput']:.1f}/s{pm}")
        return f

    def _score(self, study: Any, m: Dict[str, Any]) -> Any:
        """The value told to Optuna from the trial's figures `m` (pooled where they are)."""
        util, thr = m.get("utilization", 0.0), m.get("throughput", 0.0)
        if self.multi:
            return [util, thr]
        if self.t.objective is Objective.throughput:
            return thr
        if self.t.objective is Objective.mfu:
            return m["mfu"]
        if self.t.objective is Objective.tokens:
            return m["tokens_per_s"]
        if self.t.objective is Objective.goodput:
            return m["goodput"]
        return utilization_score(util, thr, best_throughput(study), self.t.throughput_floor) + self.offset

    def _goodput(self, study: Any, trial: Any, rec: TrialRecord, noise: Any) -> None:
        """The trial's noise scale pooled into the study's, its goodput on it and in `rec.metrics`."""
        rec.metrics = record_trial(study, trial, rec.metrics, noise, global_batch(self.cfg))

    def _log_estimate(self, run_id: Optional[str], m: Dict[str, float]) -> None:
        """The trial's estimate as MLflow metrics of its run."""
        names = {"throughput": "throughput_estimate", "throughput_lo": "throughput_lo", "throughput_hi": "throughput_hi",
                 "rel_se": "throughput_rel_se", "windows": "measured_windows", "measured_s": "measured_s",
                 "tokens_per_s_lo": "tokens_per_s_lo", "tokens_per_s_hi": "tokens_per_s_hi"}
        self.tracker.log_to(run_id, metrics={names[k]: m[k] for k in names if k in m})


def trial_config(cfg: Config, values: Dict[str, Any], longer: float = 1.0, b_noise: Optional[float] = None) -> Config:
    """The job a trial launches: `cfg` with the sampled `values`, measured as `cfg.measure` says
    (a study's nulls took the trials' defaults, schema.TRIAL_MEASURE): after a steady-state warmup
    until measure.rel_precision (or for measure.trial_steps steps when that is 0), at the
    learning rate tune.lr_scaling gives its global batch (goodput.lr_for; `b_noise`: the study's
    noise scale, for adascale). `longer` stretches the windows and the minimum measured time, not
    the cap (the confirmation runs)."""
    m = cfg.measure
    fixed = {
        "trainer.epochs": 10_000, "trainer.timeout_s": cfg.tune.trial_timeout_s, "trainer.save_model": False,
        "trainer.log_every": max(1, m.window_steps), "measure.window_s": m.window_s * longer,
        "measure.min_measure_s": m.min_measure_s * longer,
        "measure.max_measure_s": max(m.max_measure_s, m.min_measure_s * longer), "trainer.max_steps": 0,
    }
    job = apply(cfg, {**fixed, **values})
    scaled = lr_for(cfg, job, values, b_noise)
    if scaled:
        job = apply(job, scaled)
    if m.rel_precision == 0:  # a fixed count of measured steps after the steady-state warmup
        job = apply(job, {"trainer.max_steps": steady_warmup_steps(job) + m.trial_steps})
    return job


def _is_oom(err: str) -> bool:
    return any(s in err for s in ("OutOfMemoryError", "CUDA out of memory", "out of memory", "memory_cap_mb"))


def trial_metrics(result: Union[JobResult, Mapping[str, Any]]) -> Dict[str, float]:
    """A measured job's figures for the study (its JobResult, or result.json as a file holds it):
    METRICS, with `throughput` and `utilization` their estimates (means over the measured time,
    merge.merge, as the confirmation runs combine them), the 95% intervals of those means, the
    throughput's relative standard error, windows and measured seconds (the rest of a trial's wall
    time is overhead); for batches with an attention_mask, real tokens/s (`tokens_per_s`)
    likewise with its interval."""
    job = result if isinstance(result, JobResult) else JobResult.from_dict(result)
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
