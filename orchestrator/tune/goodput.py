"""Time to a trained model: the learning rate that follows the global batch, the statistical
efficiency of a global batch (Pollux's goodput) and the guard that keeps a pick that its own
figures predict reaches the user's target slower than the user's config.

A trial that trains another global batch M than the user's M0 (batch x accumulation x world)
takes a step of another size per sample. With the user's learning rate it needs more samples to
the same loss (on the communication-bound benchmark task, nearly 32x the samples at 32x the batch), so a
config that moves more samples per second can reach the loss later. Two figures answer that:

- the learning rate of `tune.lr_scaling` (linear: lr0 x M/M0; sqrt: lr0 x sqrt(M/M0); adascale:
  lr0 x the AdaScale gain ratio r(M), from the measured gradient noise scale), applied in every
  trial, confirmation run, best.yaml and rerun line whose global batch differs from M0;
- the statistical efficiency E(M) = (B + M0) / (B + M), B the gradient noise scale
  B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018; Pollux, OSDI 2021): the progress a sample
  makes at M relative to one at M0. Goodput = throughput x E(M); the time to the user's target
  relative to the user's config is (throughput x E(M)) / the user's throughput.

AdaScale's gain (AdaptDL, adascale.py: `(var + sqr) / (var / scale + sqr)` with var the gradient's
variance at M0, tr(Sigma)/M0, sqr = |G|^2 and scale = M/M0) is, divided through by |G|^2,
r(M) = (B/M0 + 1) / (B/M + 1) = (M/M0) x E(M): linear scaling while B >> M, none once M >> B.
For Adam-family optimizers AdaptDL takes its square root (AdamScale), as here.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

from ..measure.noise import efficiency
from ..schema import Config, LrScaling, Objective, OptimizerName, TuneConfig

LR_KEY = "trainer.lr"
WARMUP_KEY = "trainer.warmup_lr_steps"
WARMUP_ABOVE = 2.0  # the learning rate grown more than this x: best.yaml warms it up
WARMUP_SHARE = 0.05  # ... over this share of the first epoch's optimizer steps (at least 1)
SGD_FAMILY = (OptimizerName.sgd,)


def global_batch(cfg: Config) -> int:
    """Samples per optimizer step over the whole job: batch x accumulation x world size."""
    return cfg.data.batch_size * cfg.trainer.accumulation_steps * cfg.world_size


def rule_of(cfg: Config) -> LrScaling:
    """tune.lr_scaling with `auto` resolved: linear for the SGD family, sqrt for Adam's."""
    rule = cfg.tune.lr_scaling
    if rule is not LrScaling.auto:
        return rule
    return LrScaling.linear if cfg.trainer.optimizer in SGD_FAMILY else LrScaling.sqrt


def scaled_lr(lr0: float, m0: float, m: float, rule: LrScaling, b_noise: Optional[float],
              adam: bool = False) -> Tuple[float, str]:
    """The learning rate at global batch `m` under `rule` from `lr0` at `m0`, and the rule used
    (adascale without a measured noise scale falls back to sqrt and says so)."""
    if m == m0 or rule is LrScaling.none:
        return lr0, rule.value
    scale = m / m0
    if rule is LrScaling.linear:
        return lr0 * scale, "linear"
    if rule is LrScaling.sqrt:
        return lr0 * math.sqrt(scale), "sqrt"
    if b_noise is None:
        return lr0 * math.sqrt(scale), "sqrt (adascale without a measured noise scale)"
    gain = scale * efficiency(m, m0, b_noise)  # AdaScale's gain ratio r(M)
    return lr0 * (math.sqrt(gain) if adam else gain), "adascale"


def lr_for(cfg: Config, job: Config, values: Dict[str, Any], b_noise: Optional[float]) -> Dict[str, Any]:
    """The `trainer.lr` override of `job` (the base config `cfg` with a trial's `values`) under
    tune.lr_scaling: {} when its global batch is the base's, the rule is none, or the space
    searches the rate."""
    m0, m = global_batch(cfg), global_batch(job)
    if m == m0 or LR_KEY in values:  # the same math, or a rate the space sets
        return {}
    lr, _ = scaled_lr(cfg.trainer.lr, m0, m, rule_of(cfg), b_noise, adam=cfg.trainer.optimizer not in SGD_FAMILY)
    return {LR_KEY: lr} if lr != cfg.trainer.lr else {}


def warmup_steps(lr: float, lr0: float, steps_per_epoch: Optional[int]) -> int:
    """trainer.warmup_lr_steps for a rate grown more than WARMUP_ABOVE x: WARMUP_SHARE of the first
    epoch's optimizer steps, at least 1 (0 when it grew less, or the epoch is not known)."""
    if lr <= WARMUP_ABOVE * lr0 or not steps_per_epoch:
        return 0
    return max(1, math.ceil(WARMUP_SHARE * steps_per_epoch))


def pooled_noise(trials: List[Any]) -> Optional[Dict[str, Any]]:
    """The study's noise scale: the median of its completed trials' measured B_simple (each run's
    `noise_scale`, trial 0 first in the list of those it rests on); None when none measured it."""
    found = [(tr.number, b) for tr in sorted(trials, key=lambda tr: tr.number)
             if (b := measured_b(tr.user_attrs.get("noise_scale"))) is not None]
    if not found:
        return None
    b = statistics.median(v for _, v in found)
    numbers = [n for n, _ in found]
    return {"b_simple": b, "trials": numbers,
            "how": f"median of B_simple over trial{'s' if len(numbers) != 1 else ''} {', '.join(map(str, numbers))}"}


def measured_b(noise: Any) -> Optional[float]:
    """A run's B_simple from its `noise_scale` record, read defensively (absent, None, not a
    finite number >= 0: not measured)."""
    b = noise.get("b_simple") if isinstance(noise, dict) else None
    return float(b) if isinstance(b, (int, float)) and math.isfinite(b) and b >= 0 else None


def with_goodput(f: Dict[str, Any], m: Optional[int], m0: int, b_noise: Optional[float]) -> Dict[str, Any]:
    """`f` (a trial's figures) with `efficiency` and `goodput` (samples/s x E(M)) and its interval."""
    if m is None or f.get("throughput") is None:
        return f
    e = efficiency(m, m0, b_noise)
    out = {**f, "efficiency": e, "goodput": f["throughput"] * e}
    for end in ("lo", "hi"):
        if f.get(f"throughput_{end}") is not None:
            out[f"goodput_{end}"] = f[f"throughput_{end}"] * e
    return out


def speedup(pick: Dict[str, Any], user: Dict[str, Any]) -> Optional[float]:
    """The predicted time to the user's target of the user's config over the pick's: the pick's
    goodput over the user's samples/s (> 1: the pick gets there sooner)."""
    if not user.get("throughput") or pick.get("goodput") is None:
        return None
    return pick["goodput"] / user["throughput"]


Scale = Tuple[Optional[int], Optional[float]]


def scale_of(study: Any) -> Scale:
    """(M0, B): the user's global batch as the study recorded it (user attribute
    `base_global_batch`) and its pooled noise scale (user attribute `noise_scale`, see
    pooled_noise), read once (on a database each read of the attributes is a query). A study that
    keeps the learning rate (user attribute `lr_scaling` "none") gives no B: E(M) assumes the rate
    follows the batch, and with the rate kept a larger batch's step makes about the progress of a
    smaller one's, so a sample is worth the worst case, M0/M."""
    attrs = study.user_attrs
    m0, pooled = attrs.get("base_global_batch"), attrs.get("noise_scale")
    b = pooled.get("b_simple") if isinstance(pooled, dict) and attrs.get("lr_scaling") != "none" else None
    return (int(m0) if m0 else None), b


def study_b(study: Any) -> Optional[float]:
    """The study's pooled noise scale (None: not measured)."""
    return scale_of(study)[1]


def judged(trial: Any, f: Dict[str, Any], scale: Scale) -> Dict[str, Any]:
    """A trial's figures `f` with its goodput at the study's `scale` (as they are when the study
    did not record the user's global batch)."""
    m0, b = scale
    return with_goodput(f, trial.user_attrs.get("global_batch"), m0, b) if m0 else f


def guard(order: List[Any], fig: Dict[int, Dict[str, Any]], base: Optional[Any], m0: Optional[int],
          t: TuneConfig, measured: bool = True) -> Tuple[Optional[Any], Optional[str]]:
    """The pick that its own figures do not predict reaching the user's target slower than the
    user's config: `order[0]` when its global batch is the user's, or when its goodput beats the
    user's samples/s; else the best-ranked trial with the user's global batch (the user's config
    itself when there is none) and why, in one line (`measured`: the figures rest on a measured
    noise scale, not its worst case)."""
    if not order or m0 is None or t.objective is Objective.both:
        return (order[0] if order else None), None
    pick = order[0]
    if pick.user_attrs.get("global_batch") in (None, m0) or base is None or base.number not in fig:
        return pick, None
    ratio = speedup(fig[pick.number], fig[base.number])
    if ratio is None or ratio > 1:  # no figures to judge it by, or sooner to the target
        return pick, None
    held = next((tr for tr in order if tr.user_attrs.get("global_batch") == m0), base)
    m = pick.user_attrs["global_batch"]
    e = fig[pick.number].get("efficiency")
    worth = f"each sample worth {e if e is not None else 1.0:.2g} of yours" + (
        "" if measured else " at worst: no noise scale measured")
    return held, (f"trial {pick.number} (global batch {m}, {m / m0:.3g}x yours) is predicted to reach your target "
                  f"{1 / ratio if ratio else float('inf'):.2f}x slower than your config ({worth}): the pick is trial "
                  f"{held.number}, at your global batch {m0}")


def time_to_target(study: Any, cfg: Config, pick: Any, fig: Dict[str, Any], user: Optional[Dict[str, Any]],
                   guard_note: Optional[str]) -> Dict[str, Any]:
    """summary.json `time_to_target`: the noise scale the study used and how it was pooled, the
    learning-rate rule and the rate best.yaml writes (`set`: the overrides it adds), the pick's
    figures in the user's units and one line saying them (`line`), and why a pick was set aside
    (`guard`)."""
    m0, m = global_batch(cfg), pick.user_attrs.get("global_batch") or global_batch(cfg)
    pooled = study.user_attrs.get("noise_scale")
    b = pooled.get("b_simple") if isinstance(pooled, dict) else None
    rule = rule_of(cfg)
    lr, used = scaled_lr(cfg.trainer.lr, m0, m, rule, b, adam=cfg.trainer.optimizer not in SGD_FAMILY)
    searched = LR_KEY in (pick.user_attrs.get("values") or {})
    out: Dict[str, Any] = {
        "user_global_batch": m0, "global_batch": m, "noise_scale": pooled, "lr_scaling": rule.value, "rule_used": used,
        "lr": None if searched else lr, "user_lr": cfg.trainer.lr, "set": {}, "guard": guard_note,
        "efficiency": fig.get("efficiency"), "goodput": fig.get("goodput")}
    if m != m0 and not searched and lr != cfg.trainer.lr:
        out["set"][LR_KEY] = lr
        warm = warmup_steps(lr, cfg.trainer.lr, pick.user_attrs.get("steps_per_epoch"))
        if warm:
            out["set"][WARMUP_KEY] = warm
    ratio = speedup(fig, user) if user else None
    out["speedup"] = ratio
    out["line"] = _line(pick.number, fig, user, m, m0, out, b) if m != m0 else None
    return out


def _line(number: int, fig: Dict[str, Any], user: Optional[Dict[str, Any]], m: int, m0: int, out: Dict[str, Any],
          b: Optional[float]) -> str:
    """The pick in the user's units: `trial 2: 2.9x your samples/s at 64x your global batch; each
    sample is worth 0.9 of yours at lr 0.32 (linear): 2.6x faster to the same loss`."""
    thr = (f"{fig['throughput'] / user['throughput']:.2g}x your samples/s" if user and user.get("throughput")
           else f"{fig['throughput']:.1f} samples/s")
    lr = f"lr {out['lr']:.3g} ({out['rule_used']})" if out["lr"] is not None else "the lr the space set"
    e = out["efficiency"]
    worst = ("the learning rate kept" if out["rule_used"] == LrScaling.none.value else "no noise scale measured")
    worth = f"worth {e:.2g} of yours" + ("" if b is not None and out["rule_used"] != LrScaling.none.value
                                          else f" at least ({worst}: the worst case)")
    ratio = out["speedup"]
    end = ("not recommended" if ratio is not None and ratio <= 1 else
           f"{ratio:.2g}x faster to the same loss" if ratio is not None else "no figure of your config to compare")
    return f"trial {number}: {thr} at {m / m0:.3g}x your global batch; each sample is {worth} at {lr}: {end}"


GOODPUT_ATTRS = ("efficiency", "goodput", "goodput_lo", "goodput_hi")


def record_trial(study: Any, trial: Any, metrics: Dict[str, Any], noise: Any, m0: int) -> Dict[str, Any]:
    """A measured trial's noise scale (its run's `noise_scale`, when it measured one) pooled into
    the study's (user attribute `noise_scale`), and `metrics` with its goodput at that scale, also
    set on the trial (GOODPUT_ATTRS). Finished trials are not updated (Optuna refuses it): whatever
    ranks them reads their goodput at the study's scale of the moment (`judged`)."""
    if measured_b(noise) is not None:
        trial.set_user_attr("noise_scale", noise)
        done = [tr for tr in study.get_trials(deepcopy=False)
                if tr.state.name == "COMPLETE" or tr.number == trial.number]
        study.set_user_attr("noise_scale", pooled_noise(done))
    out = with_goodput(metrics, trial.user_attrs.get("global_batch"), m0, study_b(study))
    for k in GOODPUT_ATTRS:
        if k in out:
            trial.set_user_attr(k, out[k])
    return out
