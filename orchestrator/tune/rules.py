"""The tuner's rules, in one place: what counts toward tune.n_trials, the objective's score,
which trials are compared and how the best is picked (on confirmed figures when there are).
study.py (the loop) and report.py (the files and the table) both follow them."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..measure.stats import Z95
from ..schema import Objective, TuneConfig
from .evidence import POOLED_ATTR
from .goodput import guard, judged, scale_of

# The figure a single-figure objective ranks by: samples/s, real tokens/s (padding excluded), or mfu
# (whose confirmation runs re-measure samples/s: for one model mfu moves with it)
FIGURE = {Objective.throughput: "throughput", Objective.mfu: "mfu", Objective.tokens: "tokens_per_s",
          Objective.goodput: "goodput"}


def deciding(t: TuneConfig) -> str:
    """The figure whose interval the objective's pruning, floor and noise are judged on:
    real tokens/s for tokens, goodput (samples/s x the efficiency of the global batch) for goodput,
    else samples/s (utilization's floor and mfu are in samples/s)."""
    return {Objective.tokens: "tokens_per_s", Objective.goodput: "goodput"}.get(t.objective, "throughput")


def counted(trials: List[Any]) -> int:
    """Trials that count toward tune.n_trials: all but those an interrupt cut short, the
    re-proposals of an already measured config (never launched) and the ones still waiting in the
    queue (a diagnosis proposal counts once a tuner takes it)."""
    return sum(not (t.user_attrs.get("interrupted") or not_launched(t) or t.state.name == "WAITING") for t in trials)


def not_launched(trial: Any) -> bool:
    """A proposal answered without a launch: a config already measured (`duplicate_of`), a
    batch larger than one that ran out of memory (`over_memory_of`), or one the job model shows
    cannot reach the objective's floor (`predicted_below`)."""
    return any(k in trial.user_attrs for k in ("duplicate_of", "over_memory_of", "predicted_below"))


def utilization_score(util: float, thr: float, best_thr: float, floor: float) -> float:
    """The utilization objective's score, in utilization's own unit for the trials that keep up: their
    utilization (0-1) for a trial within `floor` of the best throughput seen (so among those,
    utilization decides); below it minus the share of samples/s it loses against the best
    (throughput / best - 1, under -(1 - floor)), so it ranks under every trial that keeps up,
    ordered by how much data rate it loses."""
    best = max(best_thr, thr)
    if best <= 0:
        return -1.0
    return util if thr >= floor * best else thr / best - 1.0


def refused(trial: Any, t: TuneConfig) -> bool:
    """A trial that cannot be the pick: its global batch leaves one optimizer step per epoch (or
    none) of the dataset, a different training altogether (unless tune.allow_large_global_batch)."""
    per_epoch = trial.user_attrs.get("steps_per_epoch")
    return not t.allow_large_global_batch and per_epoch is not None and per_epoch <= 1


def out_of_memory(trial: Any) -> bool:
    """The trial ran out of memory (its error), or was memory-bound (its verdict)."""
    return (str(trial.user_attrs.get("error", "")).startswith("out of memory")
            or trial.user_attrs.get("verdict") == "memory-bound")


def completed(study: Any) -> List[Any]:
    import optuna

    return [t for t in study.get_trials(deepcopy=False)
            if t.state == optuna.trial.TrialState.COMPLETE and "utilization" in t.user_attrs]


def confirmed(study: Any) -> Dict[str, Dict[str, Any]]:
    """Trial number (str) -> the figures its confirmation runs measured (Tuner._confirm)."""
    return study.user_attrs.get("confirmed") or {}


def failed_confirmation(study: Any) -> Dict[str, str]:
    """Trial number (str) -> why one of its confirmation runs failed (Tuner._confirm). Such a config
    is not a pick: run again it fails (a batch that completes its trial just under the memory cap
    can run out of memory in a confirmation run)."""
    return study.user_attrs.get("confirm_failed") or {}


def pickable(study: Any, t: TuneConfig) -> List[Any]:
    """The completed trials that may be the pick: not refused, and none whose confirmation failed
    (all of them when that leaves none: the best of what ran is still reported)."""
    done = [tr for tr in completed(study) if not refused(tr, t)] or completed(study)
    failed = failed_confirmation(study)
    return [tr for tr in done if str(tr.number) not in failed] or done


def figures(trial: Any, confirmed_: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """What a trial is judged by: its confirmed figures when it was re-measured, else `measured`."""
    return confirmed_.get(str(trial.number)) or measured(trial)


def measured(trial: Any) -> Dict[str, Any]:
    """A trial's figures before any confirmation: its own, or in a warm study of the same job,
    layout and machine its own pooled with the earlier study's measurements of its config
    (evidence.py: the user attribute `pooled`)."""
    pooled = trial.user_attrs.get(POOLED_ATTR)
    return {**trial.user_attrs, **pooled["figures"]} if pooled else trial.user_attrs


def ranked(study: Any, t: TuneConfig) -> List[Any]:
    """Completed trials best first by the objective's rule on their figures; the confirmed ones
    (when there are) come first and decide. utilization: by `expected_scores` (utilization within
    throughput_floor of the best throughput, throughput below it, expected over the figures'
    noise: the chance that a trial in truth keeps up, or does not); throughput, mfu and tokens: by that figure
    (tokens: real tokens/s, padding excluded)."""
    done = completed(study)
    if not done:
        return []
    conf = confirmed(study)
    scale = scale_of(study)
    fig = {tr.number: judged(tr, figures(tr, conf), scale) for tr in done}  # goodput at the study's noise scale
    # the floor is measured from a possible pick; of the trials read above: another tuner process of
    # a shared study may complete one meanwhile (4 tuners started together: one ended with KeyError)
    eligible = [tr for tr in pickable(study, t) if tr.number in fig]
    ref = reference_only(study, t) if conf else None
    pool = [tr for tr in eligible if str(tr.number) in conf and tr.number != ref] or eligible
    order = _ranked(done, pool, fig, t)
    if ref is not None and ref in fig and str(ref) in conf and improves(fig[ref], fig[order[0].number], t):
        base = next((tr for tr in eligible if tr.number == ref), None)  # the user's config beat the pick beyond the noise
        order = _ranked(done, [*pool, base], fig, t) if base is not None else order
    return order


def reference_only(study: Any, t: TuneConfig) -> Optional[int]:
    """The baseline trial's number when it is confirmed only as the reference the pick is compared with
    (not a candidate by its own figures): it becomes a contender only by beating the pick beyond
    the noise. As one more arm of a contest of configs within each other's noise it would win
    ties by luck, and a lucky run of the user's config would set the floor the busier configs fall
    under."""
    base = baseline_trial(study, t)
    if base is None or base.number in {tr.number for tr in _candidates(study, t)}:
        return None
    return base.number


def _ranked(done: List[Any], pool: List[Any], fig: Dict[int, Dict[str, Any]], t: TuneConfig) -> List[Any]:
    # the pool's own scores decide; the rest (unconfirmed when some were confirmed) follow by theirs
    expected = {tr.number: e for tr, e in zip(done, expected_scores([fig[tr.number] for tr in done], t.throughput_floor))}
    expected.update(zip((tr.number for tr in pool), expected_scores([fig[tr.number] for tr in pool], t.throughput_floor)))

    def key(tr: Any) -> tuple:
        f, outside = fig[tr.number], tr not in pool
        if t.objective is Objective.mfu and f.get("mfu") is not None:
            return (outside, -f["mfu"])
        if t.objective in (Objective.tokens, Objective.goodput):
            return (outside, -(f.get(FIGURE[t.objective]) or 0.0))
        if t.objective in (Objective.throughput, Objective.mfu):  # confirmed figures: mfu moves with samples/s
            return (outside, -f["throughput"])
        return (outside, -expected[tr.number])

    return sorted(done, key=key)


def expected_scores(figs: List[Dict[str, Any]], floor: float) -> List[float]:
    """The utilization objective's score of each trial as a share of the best one's, expected over
    the figures' noise: in each of DRAWS joint draws of every trial's true throughput and
    utilization (normal, with the standard errors their 95% intervals imply), the trials within
    `floor` of the fastest draw keep up and score their utilization / the busiest of them; the rest
    score their throughput / the fastest's. Each trial's score is its mean over the draws.
    A busy trial measured just inside the floor is often below it in a longer run, and on its
    point figures alone it would be picked over one that keeps up for certain; and a trial much
    busier than the fastest that may keep up is worth its chance: a much busier config can keep up
    within a fraction of a percent side by side while confirmations a few percent apart read it
    under the floor. The draws are seeded: the same figures always score alike. Figures without intervals
    are taken as exact (the point rule)."""
    if not figs:
        return []
    if max(f["throughput"] for f in figs) <= 0:
        return [0.0] * len(figs)
    rng = np.random.default_rng(0)
    se = {name: np.array([_se(f, name) for f in figs]) for name in ("throughput", "utilization")}
    n = DRAWS if any(s.any() for s in se.values()) else 1

    def draws(name: str) -> np.ndarray:
        mean = np.array([f[name] for f in figs], dtype=float)
        return np.maximum(mean + se[name] * rng.standard_normal((n, len(figs))), 0.0)

    thr, util = draws("throughput"), draws("utilization")
    top = thr.max(axis=1, keepdims=True)
    keep = thr >= floor * top
    busiest = np.where(keep, util, 0.0).max(axis=1, keepdims=True)  # the fastest always keeps up
    kept = np.divide(util, busiest, out=np.ones_like(util), where=busiest > 0)
    score = np.where(keep, np.minimum(kept, 1.0), thr / np.where(top > 0, top, 1.0))
    return [float(x) for x in score.mean(axis=0)]


# joint draws of the figures in expected_scores: its scores move by about 0.002 between seeds
DRAWS = 4000


def _se(f: Dict[str, Any], name: str) -> float:
    """The standard error `f`'s 95% interval of `name` implies (0: no interval, an exact figure)."""
    lo, hi = f.get(f"{name}_lo"), f.get(f"{name}_hi")
    return 0.0 if lo is None or hi is None else max(hi - lo, 0.0) / (2 * Z95)


def keeps_up(f: Dict[str, Any], top: Dict[str, Any], floor: float) -> Tuple[float, float]:
    """The chance that `f`'s true throughput is at least `floor` x `top`'s, and how far below its
    measured figure it lies on average when it is not (both normal, with the standard errors
    their 95% intervals imply; an interval missing: that figure is exact)."""
    gap = f["throughput"] - floor * top["throughput"]
    spread = math.hypot(_se(f, "throughput"), floor * _se(top, "throughput"))
    if spread == 0:
        return (1.0, 0.0) if gap >= 0 else (0.0, 0.0)
    z = gap / spread
    below = 0.5 * math.erfc(z / math.sqrt(2))  # P(true gap < 0)
    density = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    # E[gap | gap < 0] = gap - spread * density / below: how far under its measurement it sits then
    return 1.0 - below, (-spread * density / below if below > 1e-12 else 0.0)


def best_trials(study: Any, t: TuneConfig) -> List[Any]:
    """Best first: the Pareto front for objective both, else the top of `ranked`."""
    if t.objective is Objective.both:
        return sorted(study.best_trials, key=lambda tr: -tr.user_attrs["utilization"]) if completed(study) else []
    pick, _ = guarded_pick(study, t)
    return [pick] if pick is not None else []


def guarded_pick(study: Any, t: TuneConfig) -> Tuple[Optional[Any], Optional[str]]:
    """The top of `ranked` among the pickable trials, unless its own figures predict it reaches
    the user's target slower than the user's config (goodput.guard): then the best trial with
    the user's global batch, and why."""
    eligible = {tr.number for tr in pickable(study, t)}
    order = [tr for tr in ranked(study, t) if tr.number in eligible and not refused(tr, t)]
    base = baseline_trial(study, t)
    conf = confirmed(study)
    scale = scale_of(study)
    fig = {tr.number: judged(tr, figures(tr, conf), scale) for tr in [*order, *([base] if base else [])]}
    return guard(order, fig, base, scale[0], t, measured=scale[1] is not None)


def confirm_candidates(study: Any, t: TuneConfig) -> List[Any]:
    """The tune.confirm_top best trials by their own figures, and the fastest (the utilization
    objective's floor is measured from it), less those the noise cannot make win: a runner-up
    whose intervals lie below the leader's on both throughput and utilization, and the fastest
    when the leader is within the floor of it for certain; and the user's config (the baseline
    trial), so that the pick is compared with it side by side (`versus_baseline`): a trial's
    single short run is no fair comparison (a first trial in fresh processes reads about 0.8-0.9
    of its steady figure, later trials about 0.9-1.0). A lone leader that is the baseline needs no
    confirmation."""
    out = _candidates(study, t)
    base = baseline_trial(study, t)
    return out + [base] if out and base is not None and base.number not in {tr.number for tr in out} else out


def baseline_trial(study: Any, t: TuneConfig) -> Optional[Any]:
    """The completed trial that ran the config as given (tune.baseline), unless refused."""
    return next((tr for tr in completed(study) if tr.user_attrs.get("baseline") and not refused(tr, t)), None)


def _candidates(study: Any, t: TuneConfig) -> List[Any]:
    done = [tr for tr in completed(study) if not refused(tr, t)]
    if not done or t.objective is Objective.both or t.confirm_top == 0:
        return []
    m = {tr.number: measured(tr) for tr in done}
    top = max(m[tr.number]["throughput"] for tr in done)
    if t.objective is Objective.utilization:
        score = dict(zip((tr.number for tr in done), expected_scores([m[tr.number] for tr in done], t.throughput_floor)))
    else:
        score = {tr.number: final_score(tr, t, top) for tr in done}
    by_score = sorted(done, key=lambda tr: -score[tr.number])[:t.confirm_top]
    leader = m[by_score[0].number]
    one = t.objective in (Objective.tokens, Objective.goodput)
    names = (FIGURE[t.objective],) if one else ("throughput", "utilization")
    contenders = [tr for tr in by_score if tr is by_score[0] or _may_beat(m[tr.number], leader, names)]
    fastest = max(done, key=lambda tr: m[tr.number]["throughput"])
    if t.objective is not Objective.utilization:
        return contenders
    floor_certain = leader.get("throughput_lo", 0.0) >= t.throughput_floor * m[fastest.number].get(
        "throughput_hi", float("inf"))
    out = contenders + ([] if floor_certain or fastest in contenders else [fastest])
    return out + _busier_near_the_floor(done, out, leader, top, t)


# a chance below this (or above 1 - it) that a trial keeps up with the floor is taken as settled
SETTLED = 0.05


def open_contest(confirmed_: Dict[str, Dict[str, Any]], t: TuneConfig) -> List[int]:
    """The confirmed trials (by number) to measure again because the pick between them is still
    within the noise: the leader by the objective's rule and those that may yet beat it; [] when
    the pick is settled. utilization: a candidate whose utilization interval reaches the leader's
    and that may keep up with the floor (chance > SETTLED), and the fastest while the leader itself
    may fall below its floor; other objectives: the deciding figure's intervals overlap."""
    numbers = list(confirmed_)
    if len(numbers) < 2 or t.objective is Objective.both:
        return []
    figs = [confirmed_[n] for n in numbers]
    if t.objective is Objective.utilization:
        scores = expected_scores(figs, t.throughput_floor)
        lead = max(range(len(figs)), key=lambda i: scores[i])
        fastest = max(range(len(figs)), key=lambda i: figs[i]["throughput"])
        leader_keeps_up = keeps_up(figs[lead], figs[fastest], t.throughput_floor)[0]

        def open_(i: int) -> bool:
            busier = _or(figs[i].get("utilization_hi"), float("inf")) >= _or(figs[lead].get("utilization_lo"), 0.0)
            return ((busier and keeps_up(figs[i], figs[fastest], t.throughput_floor)[0] > SETTLED)
                    or (i == fastest and leader_keeps_up < 1 - SETTLED))
    else:
        name = deciding(t) if t.objective is not Objective.mfu else "throughput"
        lead = max(range(len(figs)), key=lambda i: figs[i].get(name) or 0.0)

        def open_(i: int) -> bool:
            return _may_beat(figs[i], figs[lead], (name,))
    rest = [int(numbers[i]) for i in range(len(figs)) if i != lead and open_(i)]
    return [int(numbers[lead]), *rest] if rest else []


def _busier_near_the_floor(done: List[Any], chosen: List[Any], leader: Dict[str, Any], top: float,
                           t: TuneConfig) -> List[Any]:
    """The busiest trial measured just below the floor of the fastest (`top`) whose throughput
    interval reaches it and whose utilization beats the leader's: one short measurement put it
    under the floor, a longer one decides whether it keeps up (and then it wins): a smaller batch
    that moves as many samples as the fastest can measure just under the floor in one short trial."""
    m = {tr.number: measured(tr) for tr in done}
    near = [tr for tr in done if tr not in chosen and m[tr.number]["throughput"] < t.throughput_floor * top
            and m[tr.number].get("throughput_hi", 0.0) >= t.throughput_floor * top
            and m[tr.number]["utilization"] > leader["utilization"]]
    return [max(near, key=lambda tr: m[tr.number]["utilization"])] if near else []


def _may_beat(a: Dict[str, Any], leader: Dict[str, Any], names: Tuple[str, ...] = ("throughput", "utilization")) -> bool:
    """Do `a`'s 95% intervals reach the leader's on one of `names` (throughput or utilization;
    real tokens/s for the tokens objective)? Figures without an interval always may."""
    return any(_or(a.get(f"{n}_hi"), float("inf")) >= _or(leader.get(f"{n}_lo"), 0.0) for n in names)


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


def separation(study: Any, t: TuneConfig) -> Dict[str, Any]:
    """Is the winner ahead of the runner-up by more than the noise? Their 95% intervals of the
    deciding figure (utilization, or throughput for that objective or when the runner-up is
    below the floor; real tokens/s for tokens) must not overlap."""
    order = ranked(study, t)
    if len(order) < 2 or t.objective is Objective.both:
        return {}
    conf = confirmed(study)
    scale = scale_of(study)
    a, b = judged(order[0], figures(order[0], conf), scale), judged(order[1], figures(order[1], conf), scale)
    name = "utilization" if t.objective is Objective.utilization else deciding(t)
    if name == "utilization" and b["throughput"] < t.throughput_floor * a["throughput"]:
        name = "throughput"
    lo_a, hi_b = a.get(f"{name}_lo"), b.get(f"{name}_hi")
    return {"winner": order[0].number, "runner_up": order[1].number, "figure": name,
            "separated": None if lo_a is None or hi_b is None else lo_a > hi_b,
            "confirmed": str(order[0].number) in conf and str(order[1].number) in conf}


def versus_baseline(study: Any, t: TuneConfig) -> Dict[str, Any]:
    """The pick against the user's config: its samples/s over theirs with a 95% interval (the two
    figures' relative errors combined), and both utilizations; `side_by_side` when both were
    confirmed in the same interleaved rounds, else they are single trials, measured apart."""
    best, base = best_trials(study, t), baseline_trial(study, t)
    if not best or base is None or t.objective is Objective.both:
        return {}
    conf = confirmed(study)
    a, b = figures(best[0], conf), figures(base, conf)
    if not a.get("throughput") or not b.get("throughput"):
        return {}
    ratio = a["throughput"] / b["throughput"]

    def rel(f: Dict[str, Any]) -> float:
        lo, hi = f.get("throughput_lo"), f.get("throughput_hi")
        return (hi - lo) / (2 * Z95 * f["throughput"]) if lo is not None and hi is not None else 0.0

    err = Z95 * math.hypot(rel(a), rel(b)) * ratio
    return {"best": best[0].number, "baseline": base.number, "throughput_ratio": ratio,
            "throughput_ratio_lo": max(0.0, ratio - err), "throughput_ratio_hi": ratio + err,
            "utilization": a["utilization"], "baseline_utilization": b["utilization"],
            "side_by_side": str(best[0].number) in conf and str(base.number) in conf}


def final_score(trial: Any, t: TuneConfig, top_throughput: float) -> float:
    """The trial's score against the whole study (the stored value used the best seen so far), on
    its `measured` figures."""
    a = measured(trial)
    if t.objective in FIGURE:
        return a.get(FIGURE[t.objective]) or 0.0
    return utilization_score(a["utilization"], a["throughput"], top_throughput, t.throughput_floor)


def improves(new: Dict[str, Any], best: Dict[str, Any], t: TuneConfig) -> bool:
    """Does `new` beat `best` by more than the best's measured noise (past the top of its 95%
    interval; a figure without an interval is its own top)? utilization: the best falls below the
    floor of the new throughput, or the new one keeps up and its utilization is higher;
    throughput and mfu: a higher throughput (mfu moves with it for one model); tokens: more real
    tokens/s."""
    def hi(f: Dict[str, Any], name: str) -> float:
        return f.get(f"{name}_hi") if f.get(f"{name}_hi") is not None else f[name]

    if t.objective is Objective.utilization:
        if hi(best, "throughput") < t.throughput_floor * new["throughput"]:
            return True
        return new["throughput"] >= t.throughput_floor * best["throughput"] and new["utilization"] > hi(best, "utilization")
    name = deciding(t)
    return (new.get(name) or 0.0) > (hi(best, name) if best.get(name) is not None else 0.0)


def stale_streak(study: Any, t: TuneConfig) -> Tuple[int, Optional[int]]:
    """tune.patience: how many counted trials in a row, up to the newest finished one, did not
    improve on the best before them by more than its noise (a pruned or failed trial does not
    improve), and the number of that best trial. From the study's records, so every tuner process
    of a shared study sees the same streak."""
    import optuna

    done = [tr for tr in study.get_trials(deepcopy=False) if tr.state.is_finished()
            and not (tr.user_attrs.get("interrupted") or not_launched(tr))]
    streak, best = 0, None
    for tr in sorted(done, key=lambda tr: tr.number):
        a = measured(tr)
        ran = tr.state == optuna.trial.TrialState.COMPLETE and "utilization" in a
        if ran and (best is None or improves(a, measured(best), t)):
            streak, best = 0, tr
        else:
            streak += 1
            top = max(a.get("throughput", 0.0), measured(best)["throughput"]) if best is not None else 0.0
            if ran and final_score(tr, t, top) > final_score(best, t, top):
                best = tr  # ahead within the noise: the bar moves to it, the streak goes on
    return streak, None if best is None else best.number
