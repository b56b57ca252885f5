"""The pruner's side of a trial: each measured window's score told to Optuna's median pruner, or
(tune.pruner=interval) the window estimates' interval compared with the bar a trial must reach to
be the pick; and what a pruned trial keeps of its last window."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional

from ..measure.stats import MIN_WINDOWS, estimate
from ..schema import Objective, PrunerName, TuneConfig
from .goodput import efficiency, scale_of
from .rules import deciding, refused, utilization_score

Monitor = Callable[[int, Dict[str, float]], bool]


def window_monitor(study: Any, trial: Any, t: TuneConfig, offset: float, pruned: Dict[str, Any]) -> Monitor:
    """The trial's window monitor: the pruner's decision on each measured window (`pruned` gets
    why when it stops the trial). `offset`: added to the utilization score (answer.score_offset)."""
    best_thr = best_throughput(study)
    bar = interval_bar(study, t)
    window_thr: List[float] = []
    m0, b = scale_of(study)
    worth = efficiency(trial.user_attrs.get("global_batch") or m0 or 1, m0 or 1, b)  # a sample's, for goodput

    def monitor(window: int, job: Dict[str, float]) -> bool:
        """Report each measured window's score (the objective's, not raw utilization) to the pruner."""
        if t.objective is Objective.both:
            return False
        name = deciding(t)  # samples/s, or real tokens/s for the tokens objective
        if name == "goodput":
            job = {**job, "goodput": job["throughput"] * worth}
        if job.get(name) is None:  # no tokens counted (a batch without a mask: refused at its first batch)
            return False
        if t.pruner is PrunerName.interval:
            window_thr.append(job[name])
            return _below_bar(window_thr, bar, name, window, job, pruned)
        # for a fixed model mfu is proportional to samples/s: the pruner compares throughput
        value = (job[name] if t.objective is not Objective.utilization else
                 utilization_score(job["utilization"], job["throughput"], best_thr, t.throughput_floor) + offset)
        trial.report(value, window)
        if trial.should_prune():
            bar_ = median_at(study, trial.number, window)
            pruned.update(flag=True, window=window, score=value, job=job, reason=(
                f"score {value:.3f} below the median " + (f"{bar_:.3f} " if bar_ is not None else "")
                + "of earlier trials at that window"))
        return pruned["flag"]

    return monitor


def _below_bar(window_thr: List[float], bar: Optional[tuple], name: str, window: int, job: Dict[str, float],
               pruned: Dict[str, Any]) -> bool:
    """tune.pruner=interval: the windows so far lie wholly below `bar` (interval_bar): pruned."""
    est = estimate(window_thr) if len(window_thr) >= MIN_WINDOWS and bar is not None else None
    if est is not None and est.interval and est.interval[1] < bar[0]:  # type: ignore[index]
        what = {"tokens_per_s": "real tokens/s", "goodput": "goodput"}.get(name, "throughput")
        pruned.update(flag=True, window=window, job=job, reason=(
            f"{what} {est.mean:.1f}/s over {len(window_thr)} windows, at most "
            f"{est.interval[1]:.1f}/s (95%): below {bar[1]}"))
    return pruned["flag"]


def best_throughput(study: Any) -> float:
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max([tr.user_attrs.get("throughput", 0.0) for tr in done] + [0.0])


def interval_bar(study: Any, t: TuneConfig) -> Optional[tuple]:
    """tune.pruner=interval: (throughput, why) below which a trial cannot be the pick: the
    objective's floor (1 for throughput and mfu) of the lower end of the fastest measured trial's
    95% interval (for the tokens objective: in real tokens/s, of the trial with the most). A trial
    whose own interval lies wholly below it ranks under that trial, whatever its remaining windows
    read."""
    from optuna.trial import TrialState

    name = deciding(t)  # real tokens/s for the tokens objective
    done = [tr for tr in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if tr.user_attrs.get(name) is not None and not refused(tr, t)]
    if not done:
        return None
    fastest = max(done, key=lambda tr: tr.user_attrs[name])
    lo = fastest.user_attrs.get(f"{name}_lo") or fastest.user_attrs[name]
    floor = t.throughput_floor if t.objective is Objective.utilization else 1.0
    return floor * lo, f"{floor:g} x trial {fastest.number}'s {lo:.1f}/s, the low end of its interval"


def median_at(study: Any, number: int, window: int) -> Optional[float]:
    """The median pruner's bar at `window`: the median of the earlier trials' scores there."""
    from optuna.trial import TrialState

    scores = [tr.intermediate_values[window] for tr in study.get_trials(
              deepcopy=False, states=(TrialState.COMPLETE,)) if window in tr.intermediate_values]
    return statistics.median(scores) if scores else None


def pruned_note(trial: Any, pruned: Dict[str, Any]) -> Optional[str]:
    """A pruned trial keeps its last window's figures and the pruner's reason (trials.csv, the
    console line, the MLflow tag prune_reason); returns that reason (None: no window measured)."""
    if not pruned.get("job"):
        return None
    job = pruned["job"]
    trial.set_user_attr("last_window_throughput", float(job["throughput"]))
    trial.set_user_attr("last_window_utilization", float(job["utilization"]))
    tokens = ""
    if job.get("tokens_per_s") is not None:
        trial.set_user_attr("last_window_tokens_per_s", float(job["tokens_per_s"]))
        tokens = f", real tokens/s {job['tokens_per_s']:.0f}"
    note = (f"last window {pruned['window']}: utilization {100 * job['utilization']:.1f}%, throughput "
            f"{job['throughput']:.1f}/s{tokens}; {pruned['reason']}")
    trial.set_user_attr("prune_reason", note)
    return note
