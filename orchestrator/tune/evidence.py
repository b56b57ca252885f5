"""A warm study's evidence pooled with the study it started from, on a full match.

A study warm-started from an earlier study of the same job, layout and hardware (warm.py: match
`full`) measures some of that study's configs again (its pick first). The earlier study's
measurements of such a config are measurements of the same thing on the same kind of machine: its
trial of the config and its confirmed figure (the mean of its confirmation runs). One short trial
reads a config 10-20% off its steady figure on a busy host, so a warm study that judged the
config by its own trial alone could rank a config it measured once, slightly higher, above one
the earlier study measured high several times. Here a trial's own figures and the earlier
study's measurements of its config are combined as the confirmation combines its runs
(measure.stats.combine: each measurement one observation, their mean, from 3 their median; the
standard error the larger of their own, which include the run noise, and their spread), stored
on the trial as the user attribute `pooled`; the study ranks its trials and chooses the
candidates for its confirmation on those (rules.measured). The confirmation's own runs, measured
side by side in rounds, still decide among the candidates they measured. On a partial match
(another world size or machine) nothing is pooled: the figures are not this layout's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..measure.results import Estimate
from ..measure.stats import Z95, combine

POOLED_ATTR = "pooled"
NAMES = ("throughput", "utilization", "tokens_per_s")  # the figures pooled (each with its 95% interval)


def earlier_measurements(values: Dict[str, Any], trials: List[Any],
                         confirmed: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The earlier study's measurements of the config `values` (exactly the same knobs): each of
    its completed trials of it, then the confirmed figure of each such trial, with where it came
    from (`trial`, and `runs` for a confirmed figure)."""
    out: List[Dict[str, Any]] = []
    same = [tr for tr in trials if tr.user_attrs.get("values") == values and tr.user_attrs.get("throughput")]
    for tr in same:
        out.append({**_figures(tr.user_attrs), "trial": tr.number})
    for tr in same:
        conf = confirmed.get(str(tr.number))
        if conf and conf.get("throughput"):
            out.append({**_figures(conf), "trial": tr.number, "runs": int(conf.get("runs") or 1)})
    return out


def pool(own: Dict[str, Any], earlier: List[Dict[str, Any]], source: str) -> Optional[Dict[str, Any]]:
    """`own` (a trial's figures) combined with `earlier` (earlier_measurements of its config in
    study `source`): {"figures": the pooled figures, "measurements", "from", "trials", "runs",
    "words"}; None when there is nothing earlier."""
    if not earlier:
        return None
    parts = [own, *earlier]
    figures: Dict[str, Any] = {}
    for name in NAMES:
        if not all(p.get(name) for p in parts):
            continue  # real tokens/s: batches with an attention_mask only
        est = combine([_estimate(p, name) for p in parts])
        figures[name] = est.mean
        if est.interval:
            figures[f"{name}_lo"], figures[f"{name}_hi"] = est.interval
        if name == "throughput":
            figures["rel_se"] = est.rel_se
    if "throughput" not in figures or "utilization" not in figures:
        return None
    trials = sorted({e["trial"] for e in earlier})
    runs = sum(e.get("runs", 0) for e in earlier)
    return {"figures": figures, "measurements": len(parts), "from": source, "trials": trials, "confirmation_runs": runs,
            "words": words(len(parts), len(earlier), source, trials, runs)}


def words(total: int, earlier: int, source: str, trials: List[int], runs: int) -> str:
    """`3 measurements, 2 from study 'a' (its trial 4 and its confirmation of 2 runs)`."""
    what = f"its trial{'s' if len(trials) != 1 else ''} {', '.join(map(str, trials))}"
    if runs:
        what += f" and its confirmation of {runs} run{'s' if runs != 1 else ''}"
    return f"{total} measurements, {earlier} from study '{source}' ({what})"


def pooled_with(carried: Any, values: Dict[str, Any], own: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A trial's `pooled` record in a warm study: its own figures `own` pooled with what `carried`
    (warm.Carried of a full match: the earlier study's trials and confirmed figures) measured of
    `values`; None on a cold start, a partial match, or a config the earlier study did not measure."""
    if carried is None or not carried.source or not carried.trials:
        return None
    return pool(own, earlier_measurements(values, carried.trials, carried.confirmed), carried.source)


def _figures(attrs: Dict[str, Any]) -> Dict[str, Any]:
    keys = [k for n in NAMES for k in (n, f"{n}_lo", f"{n}_hi")] + ["windows", "measured_s"]
    return {k: attrs[k] for k in keys if attrs.get(k) is not None}


def _estimate(f: Dict[str, Any], name: str) -> Estimate:
    """One measurement of `name` as measure.stats.combine takes it: its mean and the relative
    standard error its 95% interval implies (the run noise included: each is a run, or the mean of
    a config's confirmation runs, apart from the others)."""
    mean, lo, hi = f[name], f.get(f"{name}_lo"), f.get(f"{name}_hi")
    se = (hi - lo) / (2 * Z95) if lo is not None and hi is not None else 0.0
    return Estimate(mean=mean, rel_se=se / mean if mean > 0 else None, interval=(lo, hi) if lo is not None else None,
                    windows=int(f.get("windows") or 1), measured_s=f.get("measured_s") or 0.0)
