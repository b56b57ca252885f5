"""A study's confirmation: its best candidates measured again in interleaved rounds of longer
runs, by one tuner process of the study (`Confirmation`, mixed into study.Tuner, which gives it
`cfg`, `t`, `name`, `storage`, `run_dir`, `optuna`, `_launch`, `_stop_if_disk_full`, `_reclaim_orphans`,
`_say` and `_show`); and the arithmetic of its runs: each candidate's runs combined into one set
of figures, compared within their rounds, less the runs the host's other load disturbed. A run
is its result (JobResult) with the round it was measured in (`ConfirmRun`)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..app import JobFailed
from ..measure.results import Estimate, JobResult
from ..measure.stats import combine, disturbed, round_drift, with_run_noise
from ..rundir import process_tag
from .goodput import judged, scale_of, study_b
from .launch import trial_config
from .report import best_words
from .rules import confirm_candidates, confirmed, failed_confirmation, open_contest, reference_only
from .space import knob_words
from .steer import CONFIRM_LONGER, CONFIRM_MAX_ROUNDS, CONFIRM_ROUNDS, WAIT_FOR_TRIALS_S
from .storage import study_lock

PRIOR_DOF = 2.0  # measured_run_noise: the weight of tune.run_noise, in degrees of freedom


@dataclasses.dataclass(frozen=True)
class ConfirmRun:
    """A confirmation run: the round it was measured in and its result."""

    round: int
    job: JobResult


Runs = Dict[int, List[ConfirmRun]]  # trial number -> its confirmation runs


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
            est = combine([_scaled(e, 1.0 / drift.get(r, 1.0) if rate else 1.0) for r, e in ests if e])
            m[name] = est.mean
            m[f"{name}_lo"], m[f"{name}_hi"] = est.interval or (None, None)
            if name == "throughput":
                m.update(rel_se=est.rel_se, windows=est.windows, measured_s=est.measured_s)
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
    return {n: [(run.round, run.job) for run in rs] for n, rs in runs.items()}


def _rates(jobs: Dict[int, List[Tuple[int, JobResult]]]) -> Dict[int, Dict[int, float]]:
    """Each trial's samples/s per round (runs without a figure left aside)."""
    return {n: {r: job.estimate.mean for r, job in rs if job.estimate and job.estimate.mean} for n, rs in jobs.items()}


def _disturbed(jobs: Dict[int, List[Tuple[int, JobResult]]]) -> Set[Tuple[int, int]]:
    """The (trial number, round) runs under half the median of the same config's other runs."""
    return disturbed(_rates(jobs))


def _scaled(est: Estimate, factor: float) -> Estimate:
    """An estimate with its mean and interval times `factor`."""
    if factor == 1.0 or est.mean is None:
        return est
    iv = est.interval
    return dataclasses.replace(est, mean=est.mean * factor, interval=(iv[0] * factor, iv[1] * factor) if iv else None)


class Confirmation:
    """The confirmation rounds of a study (see the module's docstring)."""

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
        """Re-measure the best candidates (rules.confirm_candidates) in CONFIRM_ROUNDS interleaved
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
        runs: Runs = {tr.number: [] for tr in top}
        failed: Dict[str, str] = {}  # a candidate whose run failed is out: no more rounds, never the pick
        active, done, total = top, 0, CONFIRM_ROUNDS * len(top)
        for r in range(CONFIRM_MAX_ROUNDS):
            if r >= CONFIRM_ROUNDS:  # past the planned rounds: only while the pick is still open
                active = self._still_open(study, top, runs)
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
        self._store_confirmed(study, runs, failed)

    def _still_open(self, study: Any, top: List[Any], runs: Runs) -> List[Any]:
        """The candidates still within the leader's noise on their runs so far (rules.open_contest)."""
        ref = reference_only(study, self.t)  # measured beside them, not in the contest
        still = set(open_contest(self._judged(study, combined({n: rs for n, rs in runs.items() if n != ref},
                                                               self.t.run_noise)), self.t))
        return [tr for tr in top if tr.number in still]

    def _store_confirmed(self, study: Any, runs: Runs, failed: Dict[str, str]) -> None:
        """The candidates' combined figures (`confirmed`), the runs left out and the candidates whose
        runs failed, in the study's user attributes; each said."""
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
                     runs: Runs, failed: Dict[str, str]) -> None:
        """One confirmation run of trial `tr` (round `r`), its result added to `runs`, or why it
        failed to `failed`."""
        tags = {"study_name": self.name, "run_kind": "confirm"} if parent else {}
        cfg = trial_config(self.cfg, tr.user_attrs["values"], longer=CONFIRM_LONGER, b_noise=study_b(study))
        self._show(lambda p: p.confirm(done, total, f"trial {tr.number}: {knob_words(tr.user_attrs['values'])}"))
        try:
            runs[tr.number].append(ConfirmRun(r, self._launch(
                cfg, self.run_dir / "confirm" / f"{tr.number:04d}-{r}",
                extra_tags={**tags, "confirm_of": str(tr.number), "mlflow.parentRunId":  # under the trial
                            tr.user_attrs.get("mlflow_run_id") or parent} if tags else None, plots=False,
                run_name=f"confirm trial {tr.number}")))
        except JobFailed as exc:
            self._stop_if_disk_full(exc, f"the confirmation of trial {tr.number}")
            failed[str(tr.number)] = why = str(exc).splitlines()[0][:300]
            runs.pop(tr.number, None)  # its earlier runs do not make it a contender again
            self._say(f"[tune] confirmation of trial {tr.number} failed: {why}; a config that fails when run again "
                      "is not the pick")
        self._show(lambda p: p.ended(best_words(study, self.t)))

    def _confirmation_due(self, study: Any) -> bool:
        """Two or more candidates to confirm, not yet confirmed (a study interrupted there)."""
        numbers = sorted(tr.number for tr in confirm_candidates(study, self.t))
        return len(numbers) >= 2 and sorted(map(int, [*confirmed(study), *failed_confirmation(study)])) != numbers

    def _judged(self, study: Any, conf: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
        """Confirmed figures with their goodput at the study's noise scale."""
        trials, scale = {str(tr.number): tr for tr in study.get_trials(deepcopy=False)}, scale_of(study)
        return {n: judged(trials[n], f, scale) if n in trials else f for n, f in conf.items()}


def _trials_words(numbers: List[int]) -> str:
    return f"trial{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"
