"""Time to a target validation loss: does the tuned config train the user's model sooner?

Per task and seed, on CPU, every run a real run of the orchestrator:
  1. the target: the user's config trains for --budget epochs (x BUDGET's factor on tasks whose
     epochs are short: the user's config trains to the target for ten seconds or more) with a held-out validation split
     (data.val_fraction); its final validation loss is the target;
  2. the user's config trains again to that target (trainer.target_loss), evaluating
     --evals-per-epoch times an epoch but at most every MIN_EVAL_STEPS steps, the same cadence
     in samples for every config below;
  3. one study per policy (--trials trials, tune.seed = the seed), and its pick (best.yaml's
     overrides: the batch, workers, accumulation and the learning rate it wrote) trains to the
     same target, right after the user's config trains to it once more beside it (the pick's
     ratio is to that run: both share the host's state of the moment):
       util     the utilization objective, the global batch free, the learning rate kept
                (what the tuner did before it knew about the global batch)
       held     the user's global batch held (micro-batch x accumulation, loader), ranked by
                goodput, which is samples/s there: the default with adamw (tune.global_batch=auto)
       goodput  tune.objective=goodput, the global batch free, the learning rate by
                tune.lr_scaling: the default with sgd
The "default" column is the policy tune.global_batch=auto takes for the task's optimizer.
Printed: per task, the wall time to the target of each pick as a ratio to the user's config
(> 1: sooner; median and worst over seeds; "miss" when a run never reached the target within
--cap x the budget), and the gradient noise scale the user's budget run measured in its second
half (`b_late`; a whole-run figure is printed as such and not judged) beside one measured offline by
the large/small-batch method over the training split at the weights of the same steps: at evenly
spaced whole epochs of its second half, at most MAX_LATE_INTERVALS apart (runs of the same config and
seed stopped there), pooled as the run pools its pairs (`late_points`). `--noise` refreshes only
these columns of cached entries.

Targets (issue: time to a trained model): the default pick >= 2x on every input- or
communication-bound task and >= 0.95x on every task; goodput >= held on every task; the noise
scale within 2x of the offline one (where goodput and held picked one config at a seed, that
seed counts held's figure for both: the difference is a rerun's). Where a policy picked the
user's own config, the user changes nothing and trains as before: the cell and the checks count
it 1.00 ("(k yours)"), and its measured ratio, a rerun of the user's config beside another, is
under "yours again": the run-to-run noise of that task on this host (1.0 on a quiet one).

Tasks: six of the zoo (bench/zoo; comm_ddp's tokens and compute's items changed, see TASKS) plus a
DDP task whose loader waits on storage, and the shipped sequence example
(experiment=variable_length_lm). Time on 2 cores: 5-15 minutes a task and seed.

    .venv/bin/python -m bench.bench_target --only storage_1 comm_ddp --seeds 1 [--again] [--policies held goodput]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from bench.lib import prepare, verdict
from bench.zoo import TASKS as ZOO
from bench.zoo import MLP, _user
from orchestrator.app import JobFailed, run_job
from orchestrator.compose import compose_config as compose_cfg
from orchestrator.schema import global_batch_mode
from orchestrator.runtime.data import build_dataset
from orchestrator.runtime.evaluate import validation_sets
from orchestrator.runtime.loop import build_model, loss_fn
from orchestrator.tune.study import run_study

# under the closing table
LEGEND = ("cells: the pick's wall time to the target as a ratio to the user's (> 1: sooner), median / worst seed; "
          "a pick that is the user's own config counts 1.00 (its measured reruns: yours again); B: the noise scale, "
          "medians over seeds, run/offline: each seed's run against the offline figure at its own weights (median, range)")
VAL_FRACTION = 0.2
POLICIES: Dict[str, List[str]] = {
    "util": ["tune.objective=utilization", "tune.global_batch=free", "tune.lr_scaling=none"],
    "held": ["tune.objective=goodput", "tune.global_batch=user"],  # the default with adamw: goodput is samples/s
    "goodput": ["tune.objective=goodput", "tune.global_batch=free"],  # the default with sgd
}
TASKS: Dict[str, List[str]] = {name: ZOO[name]["overrides"] for name in
                               ("storage_1", "cpu_transform", "compute", "short_epochs", "already_best")}
# the zoo's comm_ddp draws its tokens from all 40000 rows of the table, each seen ~1.3 times an epoch:
# its validation loss never falls below ln 10 (nothing to train to). Here the tokens come from 200 rows;
# the model, its 10M parameters and their all-reduce are the zoo's.
TASKS["comm_ddp"] = _user("BagOfEmbeddings", "TokenBags vocab=200", batch=16, workers=0, lr=0.5,
                          extra=("backend=ddp", "parallelism.nproc_per_node=2"))
TASKS["ddp_storage"] = _user(MLP, "StoredFeatures latency_ms=1", batch=32, workers=0,
                             extra=("backend=ddp", "parallelism.nproc_per_node=2"))
# the zoo's compute learns what its 1638 training items can teach in 2-4 s and overfits past 4 epochs
# (validation loss 7.0-7.6 at 40): a target met in seconds carries the reruns' spread. Here 4x the
# items; the model, batch, workers and optimizer the zoo's.
TASKS["compute"] = [*TASKS["compute"], "+data.args.size=8192"]
# a task whose runs changed: its cached entries of an earlier version are run again
TASK_VERSION = {"compute": 2}
TASKS["variable_length_lm"] = ["experiment=variable_length_lm"]
ORDER = ("comm_ddp", "storage_1", "ddp_storage", "cpu_transform", "compute", "short_epochs", "variable_length_lm",
         "already_best")  # the targets' tasks first
TASKS = {name: TASKS[name] for name in ORDER}
BOUND = {"storage_1", "cpu_transform", "comm_ddp", "ddp_storage"}  # input- or communication-bound
# x --budget epochs, so that the user's config trains for about ten seconds or more: a target met in
# a second measures the run's start and its noise, not the config (short_epochs: 240 items an epoch)
BUDGET = {"short_epochs": 15, "already_best": 10, "variable_length_lm": 10}
OLD_BUDGET = {"short_epochs": 5}  # what a cached entry without `budget_epochs` was run with
# evaluations at least this many of the user's steps apart: closer, they cost more than the training
# and their pauses hide the loading that a config with more loader workers was picked to overlap
# (docs/benchmarks.md, "Time to a target loss")
MIN_EVAL_STEPS = 8


def budget_epochs(name: str, args: argparse.Namespace) -> int:
    return args.budget * BUDGET.get(name, 1)


def cached(entry: Optional[Dict[str, Any]], name: str, args: argparse.Namespace) -> bool:
    """A cached result of this task and seed run with today's budget (an entry of another budget
    is run again: its target is another loss), by epochs where the task's config caps its steps."""
    if not entry or entry.get("task_version", 1) != TASK_VERSION.get(name, 1):
        return False
    if not entry.get("uncapped") and compose_cfg([*TASKS[name], "tracking.enabled=false"]).trainer.max_steps:
        return False
    if eval_steps(entry, name) < MIN_EVAL_STEPS:  # evaluated between (nearly) every step
        return False
    return entry.get("budget_epochs", args.budget * OLD_BUDGET.get(name, 1)) == budget_epochs(name, args)


def space_of(name: str) -> List[str]:
    """The zoo's searched space for its tasks (categorical), the default space for the others."""
    spec = ZOO.get(name)
    if spec is None:
        return []
    return [f"tune.space.{k}={{key: {key}, type: categorical, choices: {list(v)}}}"
            for k, v in spec["space"].items()
            for key in [{"batch_size": "data.batch_size", "num_workers": "data.num_workers",
                         "accumulation_steps": "trainer.accumulation_steps"}[k]]] + [
        "~tune.space.prefetch_factor", "~tune.space.pin_memory"]


def job(overrides: List[str], run_dir: Path) -> Dict[str, Any]:
    cfg = compose_cfg([*overrides, "tracking.enabled=false", "trainer.save_model=true"])
    try:
        return run_job(cfg, run_dir, echo=False)
    except JobFailed as exc:
        return {"status": "FAILED", "error": str(exc)}


def evals_every(result: Dict[str, Any], per_epoch_evals: int, batch_now: int, batch_user: int) -> int:
    """trainer.eval_every (steps) giving `per_epoch_evals` evaluations an epoch of the user's
    config, but none closer than MIN_EVAL_STEPS of its steps, in samples: the same cadence for
    every global batch. The user's config's divides its epoch where one does (its validation loss
    at the budget's last step is the target: on a noisy curve the steps beside it may never reach it)."""
    steps = int(result.get("steps_per_epoch") or 1) * batch_user // max(1, batch_now)
    want = max(1, steps // per_epoch_evals, MIN_EVAL_STEPS * batch_user // max(1, batch_now))
    if batch_now == batch_user:  # the user's config evaluates at its epochs' ends: the budget's last step, the target's own
        return min((d for d in range(want, steps + 1) if steps % d == 0), default=want)
    return want


def eval_steps(entry: Dict[str, Any], name: str) -> int:
    """The user's steps between evaluations of a cached entry (from its target run's samples and
    evaluations where it did not record them)."""
    if entry.get("eval_every"):
        return int(entry["eval_every"])
    user = entry.get("user") or {}
    if not user.get("evals") or not user.get("samples"):
        return MIN_EVAL_STEPS
    return round(user["samples"] / user["evals"] / global_batch(compose_cfg([*TASKS[name], "tracking.enabled=false"])))


def global_batch(cfg: Any) -> int:
    return cfg.data.batch_size * cfg.trainer.accumulation_steps * cfg.world_size


# the offline figure is measured at evenly spaced whole epochs of the budget run's second half, in at most
# this many intervals (a task whose |G|^2 falls fast there needs more than its half's two ends and middle)
MAX_LATE_INTERVALS = 8


def late_points(epochs: int) -> List[Tuple[int, float]]:
    """(epoch, weight): where in a run of `epochs` the offline figure is measured and the weights it
    pools them with, the trapezoid rule over the second half (the steps the run's late figure,
    b_late, pools): its ends and the most evenly spaced whole epochs between, up to MAX_LATE_INTERVALS."""
    if epochs % 2:
        raise ValueError(f"--budget: {epochs} epochs have no whole epoch at half of them")
    half = epochs // 2
    n = max(d for d in range(1, MAX_LATE_INTERVALS + 1) if half % d == 0)
    return [(half + k * half // n, (0.5 if k in (0, n) else 1.0) / n) for k in range(n + 1)]


# batches of each size the offline figure averages at each point: its |G|^2 is a small difference of two
# noisy means, and with 96 draws the figure of one task scattered 3.5x between seeds at the same steps
OFFLINE_DRAWS = 384


def offline_sums(overrides: List[str], weights: Path, small: int, big: int,
                 draws: int = OFFLINE_DRAWS) -> Tuple[float, float]:
    """Unbiased |G|^2 and tr(Sigma) by the large/small-batch method (McCandlish et al. 2018,
    appendix A) at the `weights`: |G_B|^2 averaged over `draws` batches of each size drawn from the
    run's training set (data.val_fraction's held-out items left out, as the run left them out). Late
    in training |G|^2 is small against one batch's noise, so it takes many draws: with a few dozen
    the figure scatters 2x either way, or is not measurable."""
    cfg = compose_cfg([*overrides, "tracking.enabled=false"])
    model = build_model(cfg)
    model.load_state_dict(torch.load(weights, map_location="cpu"))
    dataset, criterion = validation_sets(cfg, build_dataset(cfg))[0], loss_fn(cfg.model.loss)
    g = torch.Generator().manual_seed(1234)

    def sq_norm(b: int) -> float:
        idx = torch.randint(len(dataset), (b,), generator=g).tolist()
        x, y = torch.utils.data.default_collate([dataset[i] for i in idx])
        model.zero_grad()
        criterion(model(x), y).backward()
        return float(sum((p.grad.detach() ** 2).sum() for p in model.parameters() if p.grad is not None))

    gs = statistics.fmean(sq_norm(small) for _ in range(draws))
    gb = statistics.fmean(sq_norm(big) for _ in range(draws))
    return (big * gb - small * gs) / (big - small), (gs - gb) / (1 / small - 1 / big)


def offline_noise(base: List[str], epochs: int, budget: Dict[str, Any], here: Path) -> Dict[str, Any]:
    """The offline B_simple over the steps the budget run's late figure covers: |G|^2 and tr(Sigma)
    at the weights of `late_points` of its epochs (the budget run's own, and runs of the same config
    and seed stopped at the earlier points: the same steps up to there), pooled as b_late pools its
    pairs (the ratio of the weighted sums); `b_final`: at the final weights alone."""
    ns = budget.get("noise_scale") or {}
    small = int(ns.get("batch_small") or 16)
    big = max(int(ns.get("batch_big") or 0) or 256, 4 * small)
    points = []
    for at, weight in late_points(epochs):
        run_dir = here / "budget" if at == epochs else here / f"budget_{at}"
        if at != epochs:
            job([*base, f"trainer.epochs={at}"], run_dir)
        g2, tr = offline_sums(base, run_dir / "model.pt", small, big)
        points.append({"epochs": at, "weight": weight, "g2": g2, "trace": tr})
    g2 = sum(p["weight"] * p["g2"] for p in points)
    tr = sum(p["weight"] * p["trace"] for p in points)
    last = points[-1]
    return {"b_late": tr / g2 if g2 > 0 else None, "b_final": last["trace"] / last["g2"] if last["g2"] > 0 else None,
            "points": points}


def noise_reference(name: str, base: List[str], epochs: int, budget: Dict[str, Any], here: Path) -> Dict[str, Any]:
    """The offline figures beside the budget run's own (the shipped sequence example's batches are
    dicts: the offline method's (input, target) pairs do not fit it)."""
    if not (here / "budget" / "model.pt").exists() or name == "variable_length_lm":
        return {}
    off = offline_noise(base, epochs, budget, here)
    return {"noise_offline": off["b_late"], "noise_offline_final": off["b_final"], "noise_points": off["points"],
            "noise_draws": OFFLINE_DRAWS}


def budget_run(name: str, base: List[str], epochs: int, here: Path,
               offline: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The user's config for the budget's epochs: (its result, the entry's figures): the target (its
    final validation loss), the noise scale it measured (its second half's, `b_late`, where it has
    one: what the offline figure over the same steps is judged against) and the offline figures
    (`offline`: measured before, at the same weights: the same config and seed train alike)."""
    budget = job([*base, f"trainer.epochs={epochs}"], here / "budget")
    target = budget.get("val_loss")
    if target is None:
        return budget, {"error": f"the budget run gave no validation loss: {budget.get('error', budget.get('status'))}"}
    noise = budget.get("noise_scale") or {}
    out: Dict[str, Any] = {"target": target, "budget_epochs": epochs, "uncapped": True,
                           "noise_run": noise.get("b_late") or noise.get("b_simple"),
                           "noise_run_whole": noise.get("b_simple"), "noise_late": noise.get("b_late") is not None,
                           "noise_pairs": noise.get("n"), "noise_late_lo": noise.get("late_lo"),
                           "noise_late_hi": noise.get("late_hi")}
    out.update(offline if offline is not None else noise_reference(name, base, epochs, budget, here))
    return budget, out


def refresh_noise(name: str, seed: int, entry: Dict[str, Any], args: argparse.Namespace, tmp: Path) -> Dict[str, Any]:
    """--noise: the budget run of a cached entry once more, its noise figures and the offline ones
    replacing the entry's (its picks' runs kept); the target it reaches again is recorded beside the
    cached one (`target_again`: the same run, on another day)."""
    base = [*TASKS[name], "trainer.max_steps=0", f"trainer.seed={seed}", f"data.val_fraction={VAL_FRACTION}"]
    if args.noise_every:  # the same run estimating more steps: the estimator's accuracy, less its cadence's
        budget = job([*base, f"trainer.epochs={budget_epochs(name, args)}", f"measure.noise_every={args.noise_every}"],
                     tmp / f"{name}-{seed}" / "dense")
        ns = budget.get("noise_scale") or {}
        return {**entry, "noise_dense": {"every": args.noise_every, "run": ns.get("b_late") or ns.get("b_simple"),
                                         "late": ns.get("b_late") is not None, "pairs": ns.get("n"),
                                         "lo": ns.get("late_lo"), "hi": ns.get("late_hi")}}
    _, fresh = budget_run(name, base, budget_epochs(name, args), tmp / f"{name}-{seed}",
                          offline=same_offline(entry, budget_epochs(name, args)))
    if "error" in fresh:
        return {**entry, "noise_error": fresh["error"]}
    keep = {k: v for k, v in entry.items() if not k.startswith("noise")}
    return {**keep, **{k: v for k, v in fresh.items() if k.startswith("noise")}, "target_again": fresh["target"]}


def same_offline(entry: Optional[Dict[str, Any]], epochs: int) -> Optional[Dict[str, Any]]:
    """A cached entry's offline noise figures where they were measured at today's points with as many
    draws (the same config and seed train to the same weights: they need not be measured again)."""
    if not entry or [p["epochs"] for p in entry.get("noise_points") or []] != [at for at, _ in late_points(epochs)] \
            or entry.get("noise_draws", 96) != OFFLINE_DRAWS:
        return None
    return {k: v for k, v in entry.items() if k in ("noise_offline", "noise_offline_final", "noise_points", "noise_draws")}


def one(name: str, overrides: List[str], seed: int, args: argparse.Namespace, tmp: Path,
        offline: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    # epochs decide every run's length (the shipped sequence example caps its steps at 60: its budget
    # run, its target run and every pick's would stop there)
    base = [*overrides, "trainer.max_steps=0", f"trainer.seed={seed}", f"data.val_fraction={VAL_FRACTION}"]
    here = tmp / f"{name}-{seed}"
    epochs = budget_epochs(name, args)
    budget, out = budget_run(name, base, epochs, here, offline=offline)
    if "error" in out:
        return out
    user_gb = global_batch(compose_cfg(base))
    cap = [f"trainer.epochs={epochs * args.cap}", f"trainer.target_loss={out['target']}"]
    every = evals_every(budget, args.evals_per_epoch, user_gb, user_gb)
    out["eval_every"] = every
    user = job([*base, *cap, f"trainer.eval_every={every}"], here / "user")
    out["user"] = figures_of(user)
    for policy in args.policies:
        try:
            out[policy] = pick_to_target(name, policy, base, cap, budget, user_gb, seed, args, here, every)
        except Exception as exc:  # noqa: BLE001 - one policy's failure is its cell, the others still run
            out[policy] = {"reached": False, "error": f"{type(exc).__name__}: {exc}"}
            print(f"   {policy}: {out[policy]['error']}", flush=True)
    return out


def pick_to_target(name: str, policy: str, base: List[str], cap: List[str], budget: Dict[str, Any], user_gb: int,
                   seed: int, args: argparse.Namespace, here: Path, every: int) -> Dict[str, Any]:
    """The policy's study, then the user's config and its pick trained to the target one after the
    other (`user_again`: the pick's ratio is to the user's run beside it, which shares the host's
    state of the moment)."""
    t0 = time.monotonic()
    summary = run_study(compose_cfg([*base, "mode=tune", "tracking.enabled=false", f"tune.n_trials={args.trials}",
                                     f"tune.seed={seed}", f"tune.storage=sqlite:///{here}/optuna.db", "tune.warm_start=off",
                                     *space_of(name), *POLICIES[policy]]),
                        here / "studies" / policy, echo=False)
    picked = summary.get("rerun_overrides") or []
    picked = shlex.split(picked) if isinstance(picked, str) else list(picked)
    run = [*base, *picked]
    gb = global_batch(compose_cfg(run))
    again = figures_of(job([*base, *cap, f"trainer.eval_every={every}"], here / f"{policy}-user"))
    res = job([*run, *cap, f"trainer.eval_every={evals_every(budget, args.evals_per_epoch, gb, user_gb)}"],
              here / policy)
    return {**figures_of(res), "pick": picked, "global_batch": gb, "study_s": time.monotonic() - t0,
            "user_again": again}


def figures_of(result: Dict[str, Any]) -> Dict[str, Any]:
    """Wall time to the target, evaluation excluded (every config evaluates at the same cadence in
    samples, but a faster config spends a larger share of its time evaluating)."""
    reached = bool(result.get("target_reached"))
    wall = result.get("time_to_target_s")
    evals = [e for e in result.get("evals") or [] if wall is not None and e.get("wall_s", math.inf) <= wall]
    eval_s = sum(float(e.get("eval_s") or 0.0) for e in evals)
    return {"reached": reached, "time_s": (wall - eval_s) if reached and wall is not None else None, "evals": len(evals),
            "samples": result.get("samples_to_target"), "status": result.get("status"),
            "throughput": result.get("throughput")}


def ratio(user: Dict[str, Any], pick: Dict[str, Any]) -> Optional[float]:
    """The user's wall time to the target over the pick's: against the user's run beside the pick
    where there is one (`user_again`), else the task's first run of the user's config."""
    user = pick.get("user_again") if (pick.get("user_again") or {}).get("time_s") else user
    if not user.get("time_s") or not pick.get("reached") or not pick.get("time_s"):
        return None
    return user["time_s"] / pick["time_s"]


KNOBS = ("data.batch_size", "data.num_workers", "trainer.accumulation_steps", "trainer.lr")


def default_policy(name: str) -> str:
    """The policy tune.global_batch=auto takes for the task: goodput (the batch free) with sgd, held with adamw."""
    return "goodput" if global_batch_mode(compose_cfg([*TASKS[name], "tracking.enabled=false"])) == "free" else "held"


def is_users(name: str, pick: List[str], other: Optional[List[str]] = None) -> bool:
    """The pick is the user's own config (or `other`'s pick): the knobs a study sets, and the
    learning rate."""
    return knobs_of(name, tuple(pick)) == knobs_of(name, tuple(other or ()))


@functools.lru_cache(maxsize=None)
def knobs_of(name: str, overrides: Tuple[str, ...]) -> Tuple[Any, ...]:
    """KNOBS' values of the task's config with `overrides`."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(compose_cfg([*TASKS[name], "tracking.enabled=false", *overrides]))
    return tuple(OmegaConf.select(node, k) for k in KNOBS)


def report(results: Dict[str, Dict[int, Dict[str, Any]]], policies: List[str]) -> int:
    rows = [["task", "user s", *(f"{p} x" for p in policies), "yours again", "B run", "B offline", "run/offline",
             "checks"]]
    failed = 0
    for name, seeds in results.items():
        # a pick that is the user's own config trains as the user's does: 1.00 (its measured rerun,
        # the host's run-to-run noise, is under "yours again")
        own = {p: {s: is_users(name, r[p].get("pick") or []) for s, r in seeds.items() if "user" in r and p in r}
               for p in policies}
        by_seed = {p: {s: 1.0 if mine else ratio(seeds[s]["user"], seeds[s][p]) for s, mine in own[p].items()}
                   for p in policies}
        got = {p: list(by_seed[p].values()) for p in policies}
        cells = []
        for p in policies:
            vals = [v for v in got[p] if v is not None]
            misses, yours = len(got[p]) - len(vals), sum(own[p].values())
            cells.append("-" if not got[p] else
                         f"{statistics.median(vals) if vals else 0:.2f} / {min(vals) if vals and not misses else 0:.2f}"
                         + (f" ({misses} miss)" if misses else "") + (f" ({yours} yours)" if yours else ""))
        worst = {p: (min(v) if v and None not in v else 0.0) for p, v in got.items() if v}
        checks = []
        default = default_policy(name)
        if default in worst:
            need = 2.0 if name in BOUND else 0.95
            checks.append(f"default ({default})>={need:g}:{'ok' if worst[default] >= need else 'NO'}")
        again = [ratio(r["user"], r[p]) for r in seeds.values() if "user" in r for p in policies
                 if p in r and is_users(name, r[p].get("pick") or [])]
        cells.append(" ".join(f"{v:.2f}" for v in again if v is not None) or "-")
        if "held" in worst and "goodput" in worst:  # a seed whose two picks are one config: one figure, held's
            goodput = [by_seed["held"][s] if s in by_seed["held"] and is_users(
                name, seeds[s]["goodput"].get("pick") or [], seeds[s]["held"].get("pick") or []) else v
                for s, v in by_seed["goodput"].items()]
            low = min(goodput) if goodput and None not in goodput else 0.0
            checks.append(f"goodput>=held:{'ok' if low >= worst['held'] else 'NO'}")
        runs = [r for r in seeds.values() if "user" in r]
        # each run's second half against the offline figure over the same steps (late_points); a
        # whole-run figure leans on the first steps, where the noise scale may be several times lower
        late = [r for r in runs if r.get("noise_run") and r.get("noise_late")]
        b_run = [r["noise_run"] for r in late] or [r["noise_run"] for r in runs if r.get("noise_run")]
        b_off = [r["noise_offline"] for r in runs if r.get("noise_offline") and r.get("noise_points")]
        q = [r["noise_run"] / r["noise_offline"] for r in late if r.get("noise_offline") and r.get("noise_points")]
        if q:
            mid = statistics.median(q)
            checks.append(f"noise within 2x ({len(q)} of {len(runs)} seeds with a late figure):"
                          f"{'ok' if 0.5 <= mid <= 2 else 'NO'}")
            judged = [r for r in late if r.get("noise_offline") and r.get("noise_points")]
            bounded = [r for r in judged if r.get("noise_late_lo") is not None and r.get("noise_late_hi") is not None]
            inside = sum(r["noise_late_lo"] <= r["noise_offline"] <= r["noise_late_hi"] for r in bounded)
            checks.append(f"offline in the run's 95% interval: {inside} of {len(bounded)}"
                          + (f" ({len(judged) - len(bounded)} unbounded)" if len(judged) > len(bounded) else ""))
        elif b_off:
            checks.append("noise: no late estimate (under 4 pairs in the runs' second halves: raise --budget)")
        dense = [(r["noise_dense"], r["noise_offline"]) for r in runs
                 if (r.get("noise_dense") or {}).get("run") and (r.get("noise_dense") or {}).get("late")
                 and r.get("noise_offline") and r.get("noise_points")]
        if dense:  # not judged: the same runs estimating more steps than the product's cadence does
            qd = [d["run"] / off for d, off in dense]
            checks.append(f"every {dense[0][0]['every']}: run/offline {statistics.median(qd):.2f} "
                          f"({min(qd):.2f}-{max(qd):.2f}, {min(d['pairs'] for d, _ in dense)}+ pairs)")
        if any(r["user"].get("evals") == 1 for r in runs):  # the target says little about training
            checks.append("trivial target (the user's config met it at its first evaluation: raise --budget)")
        failed += sum("NO" in c for c in checks)
        user_s = [r["user"]["time_s"] for r in runs if r["user"].get("time_s")]
        rows.append([name, f"{statistics.median(user_s):.1f}" if user_s else "-", *cells,
                     (f"{statistics.median(b_run):.0f}" + ("" if late else " (whole run)")) if b_run else "-",
                     f"{statistics.median(b_off):.0f}" if b_off else "-",
                     f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f})" if q else "-", " ".join(checks)])
    return verdict(rows, LEGEND, failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=list(TASKS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=4, help="epochs of the user's config that set the target")
    ap.add_argument("--cap", type=int, default=4, help="a pick trains at most cap x budget epochs")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--evals-per-epoch", type=int, default=4)
    ap.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--cache", type=Path, default=Path("outputs/bench_target.json"))
    ap.add_argument("--noise", action="store_true",
                    help="only the noise-scale columns: run the cached entries' budget runs again with today's "
                         "code, and the offline figures over their second halves (the picks' cells are kept)")
    ap.add_argument("--noise-every", type=int, default=0,
                    help="with --noise: the budget runs estimate every N-th step (measure.noise_every), recorded "
                         "beside the default cadence's figures (the offline ones kept)")
    ap.add_argument("--again", action="store_true",
                    help="run the chosen tasks and seeds again whole, cached or not (their offline noise figures "
                         "kept where measured at the same points and draws)")
    args = ap.parse_args()
    tmp = prepare("bench_target_")
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    for seed in range(args.seeds):  # every task's seed 0 first: a partial run covers every task
        for name, overrides in TASKS.items():
            entry = cache.get(name, {}).get(str(seed))
            if args.noise and (not args.only or name in args.only) and cached(entry, name, args):
                print(f"== {name} seed {seed}: noise (load {os.getloadavg()[0]:.1f})", flush=True)
                cache[name][str(seed)] = refresh_noise(name, seed, entry, args, tmp)  # type: ignore[arg-type]
                args.cache.write_text(json.dumps(cache, indent=1, default=str))
            if args.noise or args.only and name not in args.only or (cached(entry, name, args) and not args.again):
                continue
            print(f"== {name} seed {seed} (load {os.getloadavg()[0]:.1f})", flush=True)
            offline = same_offline(entry, budget_epochs(name, args)) if cached(entry, name, args) else None
            cache.setdefault(name, {})[str(seed)] = {**one(name, overrides, seed, args, tmp, offline),
                                                     "task_version": TASK_VERSION.get(name, 1)}
            args.cache.write_text(json.dumps(cache, indent=1, default=str))
    chosen = {n: {int(s): r for s, r in v.items() if int(s) < args.seeds} for n, v in cache.items()
              if not args.only or n in args.only}
    return report(chosen, args.policies)


if __name__ == "__main__":
    sys.exit(main())
