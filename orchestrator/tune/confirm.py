"""The arithmetic of a study's confirmation runs (Tuner._confirm launches them): each candidate's
runs combined into one set of figures, compared within their rounds, less the runs the host's
other load disturbed. A run is its result (result.json: JobResult) with the round it was
measured in under CONFIRM_ROUND."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Set, Tuple

from ..measure.results import JobResult
from ..measure.stats import combine, disturbed, round_drift, with_run_noise

CONFIRM_ROUND = "confirm_round"  # the round a confirmation run's result was measured in
PRIOR_DOF = 2.0  # measured_run_noise: the weight of tune.run_noise, in degrees of freedom

Runs = Dict[int, List[Dict[str, Any]]]  # trial number -> its confirmation runs' results


def combined(runs: Runs, run_noise: float, measured_noise: bool = True) -> Dict[str, Dict[str, Any]]:
    """Trial number (str) -> the combined figures of its confirmation runs so far; the rates
    (samples/s, real tokens/s) of each run divided by its round's drift (measure.stats.round_drift:
    the candidates of a round ran one after another, on the machine as it was then), so that
    the candidates are compared within rounds. Runs the host's other load disturbed
    (measure.stats.disturbed) are left out first, of the figures and of the drift alike, and
    counted in `left_out`; the intervals are widened by `run_noise` (measure.stats.with_run_noise)."""
    jobs = _round_jobs(runs)
    out_runs = _disturbed(jobs)
    jobs = {n: [(r, job) for r, job in rs if (n, r) not in out_runs] for n, rs in jobs.items()}
    drift = round_drift(_rates(jobs))
    if measured_noise:
        run_noise = measured_run_noise(_rates(jobs), drift, run_noise)
    out: Dict[str, Dict[str, Any]] = {}
    for number, done in jobs.items():
        if not done:
            continue
        m: Dict[str, Any] = {"runs": len(done)}
        for name, key in JobResult.ESTIMATES:
            ests = [(r, getattr(job, key)) for r, job in done]
            if name == "tokens_per_s" and not all(e for _, e in ests):
                continue  # real tokens/s: batches with an attention_mask only
            rate = name != "utilization"  # a share of the time, not a rate: left as measured
            est = combine([_scaled(e.as_dict(), 1.0 / drift.get(r, 1.0) if rate else 1.0) for r, e in ests if e])
            m[name] = est["mean"]
            m[f"{name}_lo"], m[f"{name}_hi"] = est["interval"] or (None, None)
            if name == "throughput":
                m.update(rel_se=est["rel_se"], windows=est["windows"], measured_s=est["measured_s"])
        if left := sum(n == number for n, _ in out_runs):
            m["left_out"] = left
        if m["throughput"] is not None and m["utilization"] is not None:
            out[str(number)] = with_run_noise(m, run_noise, runs=len(done))
    return out


def measured_run_noise(rates: Dict[int, Dict[int, float]], drift: Dict[int, float], prior: float,
                       prior_dof: float = PRIOR_DOF) -> float:
    """The run noise (a relative standard deviation per run) of these confirmation runs: their
    spread about the fit log(rate) = config + round (measure.stats.round_drift), pooled over the
    candidates, shrunk toward `prior` (tune.run_noise) as if it were `prior_dof` degrees of freedom
    measured. 5 candidates in 4 rounds give 12."""
    import math

    logs = {c: {r: math.log(v / drift.get(r, 1.0)) for r, v in per.items() if v > 0} for c, per in rates.items()}
    resid = [v - statistics.fmean(per.values()) for per in logs.values() if len(per) > 1 for v in per.values()]
    shared = sum(sum(r in per for per in logs.values()) >= 2 for r in {r for per in logs.values() for r in per})
    dof = len(resid) - sum(len(per) > 1 for per in logs.values()) - max(0, shared - 1)
    if dof <= 0:
        return prior
    ss = sum(x * x for x in resid)
    return math.sqrt((prior_dof * prior * prior + ss) / (prior_dof + dof))


def left_out(runs: Runs) -> Dict[Tuple[int, int], str]:
    """(trial number, round) -> why that confirmation run is left out of the figures (`combined`)."""
    jobs = _round_jobs(runs)
    rates = _rates(jobs)
    said: Dict[Tuple[int, int], str] = {}
    for n, r in sorted(_disturbed(jobs)):
        others = statistics.median(v for q, v in rates[n].items() if q != r)
        said[n, r] = (f"read {rates[n][r]:.1f}/s, under half the median of its other runs ({others:.1f}/s): "
                            "slowed by the host's other load, left out")
    return said


def _round_jobs(runs: Runs) -> Dict[int, List[Tuple[int, JobResult]]]:
    return {n: [(res[CONFIRM_ROUND], JobResult.from_dict(res)) for res in results] for n, results in runs.items()}


def _rates(jobs: Dict[int, List[Tuple[int, JobResult]]]) -> Dict[int, Dict[int, float]]:
    """Each trial's samples/s per round (runs without a figure left aside)."""
    return {n: {r: job.estimate.mean for r, job in rs if job.estimate and job.estimate.mean} for n, rs in jobs.items()}


def _disturbed(jobs: Dict[int, List[Tuple[int, JobResult]]]) -> Set[Tuple[int, int]]:
    """The (trial number, round) runs under half the median of the same config's other runs."""
    return disturbed(_rates(jobs))


def _scaled(est: Dict[str, Any], factor: float) -> Dict[str, Any]:
    """An estimate (`Estimate.as_dict`) with its mean and interval times `factor`."""
    if factor == 1.0 or est.get("mean") is None:
        return est
    iv = est.get("interval")
    return {**est, "mean": est["mean"] * factor, "interval": [iv[0] * factor, iv[1] * factor] if iv else None}
