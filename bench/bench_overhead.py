"""Overhead of the orchestrator's training loop on seed 000's workload, in one process, on CPU.

Measures, side by side and interleaved (same seeds, fixed torch threads):

  * plain:  a hand-written loop as a user following seed 000 writes it (bench.plain.train_steps,
            the loop of bench_launch's plain ranks too): seed 000's SimpleModel around
            nn.Linear(1000, 10), cross-entropy, SGD lr 0.01, DataLoader batch 32 shuffle,
            num_workers=0 over tasks.datasets.random_classification(4096, 1000, 10);
  * orch:   `orchestrator.runtime.loop.train(cfg, Adapter(cfg))` on the same workload
            (cfg composed from conf/ with Hydra, backend=single, tracking off);
  * noop:   the same `train()` with `StepMeter.mark/end_step/comm_hook_fired`
            replaced by no-ops in this process only (the loop without its instrumentation);
  * quiet:  the same `train()` with measure.noise_scale=false (the gradient noise scale's cost is
            orch over quiet);
  * eval:   the same `train()` holding out --val-fraction of the items and evaluating every
            --eval-every steps (trainer.eval_every) and at the end: the evaluation's share of the
            training time is the run's own `eval_s` over its wall time less `eval_s` (evaluation is
            kept out of the step's figures; the issue's target: evaluation plus the noise scale's
            cost <= 2% of step time).

Per-step wall time is measured by the benchmark, never read from the meter:

  * steady state: the DataLoader iterator of both loops is wrapped to take a `perf_counter()`
    stamp at each batch fetch (one stamp per step, the same probe in every variant); a run's
    steady-state step time is (stamp[last] - stamp[skip]) / (last - skip), i.e. the mean over
    every step after the first `--skip` (window closes and logging included);
  * end to end: `TrainResult.wall_s / TrainResult.steps` for train(), and the same span
    (from `iter(loader)` to after the last step) for the plain loop.

The figure per variant is the median over rounds. Targets: orch / plain step-time ratio <= 1.03,
instrumentation overhead (orch - noop) / noop <= 1 %. Also printed, the ordinary step: each run's
median step time, paired per round (the rare steps and the host's preemptions left out: it
resolves a few tenths of a percent where the means' rounds spread +-5%).

    .venv/bin/python -m bench.bench_overhead [--rounds 9] [--steps 2560] [--threads 1] [--noise-every N]
        [--eval-every 128] [--val-fraction 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.plain import train_steps
from orchestrator.compose import compose_config
from orchestrator.runtime import data as data_mod, loop as loop_mod
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.meter import StepMeter
from orchestrator.schema import Config
from tasks.datasets import random_classification

SEED = 0
BATCH = 32
SIZE, FEATURES, CLASSES = 4096, 1000, 10


# -- the timing probe: one perf_counter stamp per batch fetched, same for every variant ---------
STAMPS: List[float] = []
CPU_STAMPS: List[float] = []  # the process's CPU time at the same points: steadier than wall time on a loaded host


class _ProbeIter:
    def __init__(self, inner) -> None:
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        STAMPS.append(time.perf_counter())
        CPU_STAMPS.append(time.process_time())
        return next(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


class ProbedLoader(DataLoader):
    """A DataLoader whose iterators stamp the time of every batch request."""

    def __iter__(self):  # type: ignore[override]
        return _ProbeIter(super().__iter__())


def steady_step_s(stamps: List[float], skip: int, end: float) -> float:
    """Mean step time after the first `skip` steps: stamps[i] is when step i asked for its batch;
    `end` closes the last step."""
    marks = stamps + [end]
    return (marks[-1] - marks[skip]) / (len(marks) - 1 - skip)


def typical_step_s(stamps: List[float], skip: int) -> float:
    """The median step time after the first `skip` steps: an ordinary step's, without the rare
    ones (a window's close, a step that reads the CPU clocks, an estimated step) and without the
    host's preemptions, which move a run's mean by +-5% on 2 shared cores."""
    return statistics.median(b - a for a, b in zip(stamps[skip:], stamps[skip + 1:]))


# -- the orchestrator's config, composed as the CLI composes it ---------------------------------
def seed_config(steps: int) -> Config:
    per_epoch = SIZE // BATCH
    epochs = -(-steps // per_epoch)
    cfg = compose_config([
        "backend=single", "backend.device=cpu", "tracking.enabled=false",
        f"trainer.max_steps={steps}", f"trainer.epochs={epochs}", f"trainer.seed={SEED}",
        "trainer.save_model=false",
    ])
    # seed 000's workload, checked rather than assumed
    assert cfg.model._target_ == "tasks.models.Linear" and cfg.model.args == {"in_features": FEATURES, "out_features": CLASSES}
    assert cfg.data._target_ == "tasks.datasets.random_classification"
    assert (cfg.data.args["size"], cfg.data.args["features"], cfg.data.args["classes"]) == (SIZE, FEATURES, CLASSES)
    assert cfg.data.batch_size == BATCH and cfg.data.num_workers == 0 and cfg.data.shuffle
    assert cfg.trainer.lr == 0.01 and cfg.trainer.optimizer.value == "sgd" and cfg.trainer.momentum == 0.0
    assert cfg.trainer.accumulation_steps == 1 and not cfg.trainer.amp
    return cfg


# -- the variants -------------------------------------------------------------------------------
class SimpleModel(nn.Module):
    """Seed 000's model, verbatim: a module holding nn.Linear(1000, 10)."""

    def __init__(self):
        super(SimpleModel, self).__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.fc(x)


def run_plain(steps: int, skip: int) -> Dict[str, float]:
    """Seed 000 as a user writes it (with the dataset the orchestrator's config names)."""
    torch.manual_seed(SEED)
    dataset = random_classification(size=SIZE, features=FEATURES, classes=CLASSES, seed=SEED)
    model = SimpleModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ProbedLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0,
                          generator=torch.Generator().manual_seed(SEED))
    STAMPS.clear()
    CPU_STAMPS.clear()
    done, first_loss = 0, float("nan")
    model.train()
    t0 = time.perf_counter()
    for done, loss in enumerate(train_steps(model, loader, opt, steps), 1):
        if done == 1:
            first_loss = loss.item()
    t1, c1 = time.perf_counter(), time.process_time()
    stamps = STAMPS[:steps]
    return {"steady": steady_step_s(stamps, skip, t1), "e2e": (t1 - t0) / done, "typical": typical_step_s(stamps, skip),
            "cpu": steady_step_s(CPU_STAMPS[:steps], skip, c1),
            "first_loss": first_loss, "loss": loss.item()}


def run_orch(cfg: Config, skip: int) -> Dict[str, float]:
    adapter = Adapter(cfg)
    adapter.setup()
    STAMPS.clear()
    CPU_STAMPS.clear()
    res = loop_mod.train(cfg, adapter)
    assert res.steps == cfg.trainer.max_steps, res.steps
    # the last step ends where train()'s loop ends: see _stamped_close
    stamps = STAMPS[:res.steps]
    noise = res.meter.get("noise_scale") or {}
    return {"steady": steady_step_s(stamps, skip, _train_end[0]), "e2e": res.wall_s / res.steps,
            "typical": typical_step_s(stamps, skip),
            "cpu": steady_step_s(CPU_STAMPS[:res.steps], skip, _train_end[1]),
            "first_loss": res.first_loss, "loss": res.final_loss,
            "noise_every": noise.get("every"), "noise_extra": noise.get("extra"), "noise_n": noise.get("n")}


def run_eval(cfg: Config) -> Dict[str, float]:
    """The evaluation's share of the training time: eval_s over (wall_s - eval_s), the run's own figures."""
    adapter = Adapter(cfg)
    adapter.setup()
    res = loop_mod.train(cfg, adapter)
    eval_s = res.meter["eval_s"]
    return {"eval_frac": eval_s / (res.wall_s - eval_s), "evals": len(res.meter["evals"])}


# train() computes wall_s just after its loop; record the matching perf_counter from the outside by
# wrapping StepMeter.close (called in train()'s `finally`, right after the loop and meter.flush()).
_train_end = [0.0, 0.0]
_real_close = StepMeter.close


def _stamped_close(self: StepMeter) -> None:
    _train_end[0], _train_end[1] = time.perf_counter(), time.process_time()
    _real_close(self)


StepMeter.close = _stamped_close  # type: ignore[method-assign]


@contextmanager
def meter_noops():
    """StepMeter without its per-step marks (end_step returns None: no window ever closes)."""
    saved = {k: getattr(StepMeter, k) for k in ("mark", "end_step", "comm_hook_fired")}

    def mark(self, phase):
        return None

    def end_step(self, samples, micro=1):
        return None

    def comm_hook_fired(self):
        return None

    StepMeter.mark, StepMeter.end_step, StepMeter.comm_hook_fired = (  # type: ignore[method-assign]
        mark, end_step, comm_hook_fired)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(StepMeter, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2560, help="steps per run (128 per epoch)")
    ap.add_argument("--skip", type=int, default=20, help="first steps left out of the steady state")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--noise-every", type=int, default=0,
                    help="measure.noise_every of orch and noop (0: the default); 1 prices a step of two halves")
    ap.add_argument("--eval-every", type=int, default=128,
                    help="trainer.eval_every of the eval variant (steps; 128: an epoch of the full dataset)")
    ap.add_argument("--val-fraction", type=float, default=0.1, help="data.val_fraction of the eval variant")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = seed_config(args.steps)
    if args.noise_every:
        cfg = dataclasses.replace(cfg, measure=dataclasses.replace(cfg.measure, noise_every=args.noise_every))
    data_mod.DataLoader = ProbedLoader  # the orchestrator's build_loader (runtime/data.py) gets the same probe

    def orch() -> Dict[str, float]:
        return run_orch(cfg, args.skip)

    def noop() -> Dict[str, float]:
        with meter_noops():
            return run_orch(cfg, args.skip)

    def plain() -> Dict[str, float]:
        return run_plain(args.steps, args.skip)

    quiet_cfg = dataclasses.replace(cfg, measure=dataclasses.replace(cfg.measure, noise_scale=False))

    def quiet() -> Dict[str, float]:
        return run_orch(quiet_cfg, args.skip)

    eval_cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, val_fraction=args.val_fraction),
        trainer=dataclasses.replace(cfg.trainer, eval_every=args.eval_every))

    def evaluating() -> Dict[str, float]:
        return run_eval(eval_cfg)

    variants: Dict[str, Callable[[], Dict[str, float]]] = {"plain": plain, "orch": orch, "noop": noop, "quiet": quiet,
                                                           "eval": evaluating}
    names = [n for n in variants if n != "eval"]  # the timed variants
    for name in variants:  # one warm-up run each, discarded (lazy init, allocator, caches)
        variants[name]()
    got: Dict[str, List[Dict[str, float]]] = {n: [] for n in names}
    evals: List[Dict[str, float]] = []
    t_bench = time.perf_counter()
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            gc.collect()
            got[name].append(variants[name]())
        gc.collect()
        evals.append(evaluating())
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(
            f"{n} {got[n][-1]['steady'] * 1e6:7.1f} us" for n in names), flush=True)

    med = {n: {k: statistics.median(g[k] for g in got[n]) for k in ("steady", "e2e")} for n in names}
    spread = {n: (min(g["steady"] for g in got[n]), max(g["steady"] for g in got[n])) for n in names}
    first = {n: got[n][-1]["first_loss"] for n in names}
    last = {n: got[n][-1]["loss"] for n in names}

    print()
    print(f"seed 000 workload, {args.steps} steps/run, {args.rounds} interleaved rounds, torch threads "
          f"{torch.get_num_threads()}, steady state = steps {args.skip + 1}..{args.steps} "
          f"({time.perf_counter() - t_bench:.0f} s; load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"{os.cpu_count()} cores)")
    print("loss first -> last: " + "  ".join(f"{n} {first[n]:.4f} -> {last[n]:.4f}" for n in names)
          + "  (same init and batches in epoch 1)")
    print(f"{'':28s}{'steady us/step':>16s}{'(min..max over rounds)':>26s}{'end-to-end us/step':>20s}")
    for n, label in (("plain", "plain loop"), ("orch", "orchestrator train()"), ("noop", "train(), meter no-ops"),
                     ("quiet", "train(), noise_scale=false")):
        lo, hi = spread[n]
        print(f"{label:28s}{med[n]['steady'] * 1e6:16.1f}{f'{lo * 1e6:.1f}..{hi * 1e6:.1f}':>26s}"
              f"{med[n]['e2e'] * 1e6:20.1f}")
    ratio = med["orch"]["steady"] / med["plain"]["steady"]
    ratio_e2e = med["orch"]["e2e"] / med["plain"]["e2e"]
    over = (med["orch"]["steady"] / med["noop"]["steady"] - 1) * 100
    over_e2e = (med["orch"]["e2e"] / med["noop"]["e2e"] - 1) * 100
    # paired per round (same round, adjacent runs): less sensitive to drift between rounds
    paired_ratio = statistics.median(o["steady"] / p["steady"] for o, p in zip(got["orch"], got["plain"]))
    paired_over = statistics.median((o["steady"] / q["steady"] - 1) * 100 for o, q in zip(got["orch"], got["noop"]))
    print()
    ok = lambda b: "MET" if b else "MISSED"  # noqa: E731
    print(f"step-time ratio orch/plain     : {ratio:.3f} steady (paired {paired_ratio:.3f}), "
          f"{ratio_e2e:.3f} end-to-end   target <= 1.03: {ok(ratio <= 1.03)}")
    print(f"instrumentation overhead       : {over:+.2f}% steady (paired {paired_over:+.2f}%), "
          f"{over_e2e:+.2f}% end-to-end   target <= 1%: {ok(over <= 1.0)}")
    # the ordinary step, paired per round: resolves a few tenths of a percent where the means do not
    for what, base in (("orch/plain", "plain"), ("orch/noop", "noop")):
        typ = [(o["typical"] / b["typical"] - 1) * 100 for o, b in zip(got["orch"], got[base])]
        q = statistics.quantiles(typ) if len(typ) > 1 else [typ[0]] * 3
        print(f"  ordinary step {what:11s}  : {statistics.median(typ):+.2f}% paired median step "
              f"(quartiles over rounds {q[0]:+.2f}..{q[2]:+.2f}%)")
    noise = [(o["steady"] / q["steady"] - 1) * 100 for o, q in zip(got["orch"], got["quiet"])]
    noise_cpu = [(o["cpu"] / q["cpu"] - 1) * 100 for o, q in zip(got["orch"], got["quiet"])]
    noise_e2e = [(o["e2e"] / q["e2e"] - 1) * 100 for o, q in zip(got["orch"], got["quiet"])]
    cost = statistics.median(noise)
    print(f"gradient noise scale's cost    : {cost:+.2f}% steady paired (rounds {min(noise):+.2f}..{max(noise):+.2f}%), "
          f"{statistics.median(noise_e2e):+.2f}% end-to-end (rounds {min(noise_e2e):+.2f}..{max(noise_e2e):+.2f}%)   "
          f"target <= 2%: {ok(cost <= 2.0)}")
    print(f"  in CPU time per step         : {statistics.median(noise_cpu):+.2f}% steady paired "
          f"(rounds {min(noise_cpu):+.2f}..{max(noise_cpu):+.2f}%; orch {statistics.median(g['cpu'] for g in got['orch']) * 1e6:.1f} "
          f"us, quiet {statistics.median(g['cpu'] for g in got['quiet']) * 1e6:.1f} us)")
    cadence = [(g["noise_every"], g["noise_extra"], g["noise_n"]) for g in got["orch"]]
    print("noise scale's cadence (orch)  : " + ", ".join(
        f"one in {e} ({'an estimated step ' + format(x, '+.0%') if x is not None else 'untimed'}, {n} estimated)"
        for e, x, n in cadence))
    share = [e["eval_frac"] * 100 for e in evals]
    eval_share = statistics.median(share)
    print(f"evaluation's share             : {eval_share:.2f}% of the training time (rounds {min(share):.2f}..{max(share):.2f}%; "
          f"{evals[-1]['evals']} evaluations of {args.val_fraction:g} of the items, every {args.eval_every} steps and at the end)")
    print(f"evaluation + noise scale       : {eval_share + cost:+.2f}% of step time   target <= 2%: {ok(eval_share + cost <= 2.0)}")


if __name__ == "__main__":
    main()
