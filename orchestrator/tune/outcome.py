"""What a study ends with: the notes the user needs to act on its pick (edges, global batch,
pruning's savings, the time to the user's target, where the study's time went), its files
(report.write_outputs) and its MLflow record; or, for a call with nothing to run, what the study
already holds. Mixed into study.Tuner (StudyOutcome), which gives it `cfg`, `t`, `name`,
`storage`, `space`, `multi`, `tracker`, `proposals`, `run_dir`, `overrides`, `echo`, `stopped`,
`started`, `mine`, `spent`, `confirmed_here`, `optuna` and `_say`."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..fingerprint import describe
from ..rundir import Status, read_json
from ..stores import redact
from ..tracking import with_percent
from . import report
from .answer import tell_mlflow
from .edges import summary_of
from .goodput import global_batch, judged, scale_of, time_to_target
from .launch import METRICS
from .rules import baseline_trial, best_trials, confirmed, counted, figures, guarded_pick
from .warm import WARM_ATTR


class StudyOutcome:
    """The study's outcome: its notes, files and MLflow record (see the module's docstring)."""

    def _unfinished(self, study: Any, status: str) -> Dict[str, Any]:
        """A study that ended before its count and confirmation (interrupted, or stopped by a
        failure): how many trials its pick stands on, and how to finish it."""
        done, by = counted(study.get_trials(deepcopy=False)), "interrupted" if status == Status.KILLED else "failed"
        left = (f"{done} of tune.n_trials={self.t.n_trials} trials counted" if done < self.t.n_trials
                else "its confirmation not done")
        return {"by": by, "counted": done, "n_trials": self.t.n_trials,
                "why": f"{by} with {left}: the pick below stands on those alone; rerun the same command with "
                       f"tune.study_name={self.name} to finish"}

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

    def _notes(self, study: Any, best: List[Any]) -> Dict[str, Any]:
        """What the user must know to act on the pick: the edges it sits on, how its global batch
        compares with the base config's, and the trial time pruning saved."""
        trials = study.get_trials(deepcopy=False)
        notes: Dict[str, Any] = {"edges": [], "pruning": self._pruning(study, best), "global_batch": None}
        notes["not_launched"] = [{"trial": tr.number, "why": tr.user_attrs["predicted_below"]} for tr in trials
                                 if "predicted_below" in tr.user_attrs]
        notes["measured_share"] = self._measured_share(study)
        notes["fingerprint"] = describe(self.cfg)
        notes["warm_start"] = study.user_attrs.get(WARM_ATTR)
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

    def _pruning(self, study: Any, best: List[Any]) -> Dict[str, Any]:
        """The trial time pruning saved (each pruned trial would have run about as long as a
        completed one), and the pruned trials whose last window reached the best's interval."""
        TrialState = self.optuna.trial.TrialState
        trials = study.get_trials(deepcopy=False)
        done = [tr.user_attrs["duration_s"] for tr in trials if tr.state == TrialState.COMPLETE
                and tr.user_attrs.get("duration_s")]
        pruned = [tr for tr in trials if tr.state == TrialState.PRUNED and "prune_reason" in tr.user_attrs]
        if not (pruned and done):
            return {}
        spent = sum(tr.duration.total_seconds() for tr in pruned if tr.duration)
        out = {"pruner": self.t.pruner.value, "pruned": len(pruned), "spent_s": spent, "median_s": statistics.median(done),
               "saved_s": max(0.0, len(pruned) * statistics.median(done) - spent)}
        if best and not self.multi:
            lo = figures(best[0], confirmed(study)).get("throughput_lo") or best[0].user_attrs["throughput"]
            out["within_noise_of_best"] = [tr.number for tr in pruned
                                           if tr.user_attrs.get("last_window_throughput", 0.0) >= lo]
        return out

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
        """The study's files and its MLflow record: the pick, its confirmed figures, the files as
        artifacts; the study's run ended with `status`. Returns the summary."""
        best = best_trials(study, self.t)
        summary = report.write_outputs(study, best, t=self.t, out_dir=self.run_dir, name=self.name,
                                       storage=self.storage, overrides=self.overrides, echo=self.echo,
                                       notes={"stopped": self.stopped, **self._notes(study, best)})
        tell_mlflow(self.tracker, study, best, self.t, parent)  # the pick and the confirmed figures
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
