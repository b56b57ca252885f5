"""What plugs into the loop (runtime/loop.py) at a few points instead of living inside it: the
profiler, balance by speed, checkpoints, the storage-latency jump, the loader autotune and the
learning-rate warmup.

A hook sees the run's state (`state.Run`: step, epoch, batch in the epoch, loader, meter, events)
and overrides only the points it needs; the loop calls a point only on the hooks that override
it, so a run with none of these features pays nothing per step:

- `before_step(run)`: at the top of an optimizer step;
- `after_step(run) -> bool`: after the step was counted and its window handled; True when it did
  bookkeeping (then the time since is nobody's data wait). A hook whose after_step acts only on
  multiples of `after_every` steps says so: the loop calls it on those steps only;
- `on_window(run, win) -> bool`: a measured, whole window closed; True when it is not steady (the
  hook changed what the next windows measure): its figures then feed nothing;
- `on_figures(run, win, figures)`: the job's figures of a steady window (measure.results.WindowFigures
  by job_window: throughput summed, the slowest rank's step time; the same on every rank);
- `start(run)`: before the first step; `finish(run)`: the loop ended normally; `close(run)`: always, last; `summary(run, out)`: add to
  the rank's result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from .. import checkpoint
from ..rundir import BalanceEvent, CheckpointEvent, LoaderEvent
from ..schema import Config
from .autotune import LoaderSettings, LoaderTuner
from .balance import Balancer
from .data import item_bytes
from .dist import Adapter, unwrap
from .state import Hook, Run
from .step import Diverged


class ProfilerHook(Hook):
    """measure.profile_steps: the `n` steps from `start` (the end of the warmup) are profiled; they
    are kept out of the measured windows, and so is their teardown (trace export) and the loader
    queue that filled up meanwhile: the meter warms up again."""

    def __init__(self, profiler: "Profiler", start: int, n: int) -> None:
        self.profiler, self.start, self.n = profiler, start, n

    def before_step(self, run: Run) -> None:
        if self.profiler.at_step(run.step, self.start, self.n):
            run.meter.rewarm("profiler")

    def close(self, run: Run) -> None:
        self.profiler.stop()

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        out["profile"] = {"steps": self.n, "trace": str(self.profiler.trace_path), "top_ops": self.profiler.top_ops}


class BalanceHook(Hook):
    """parallelism.balance=speed: the shares follow the measured speeds (runtime/balance.py); a
    change of shares restarts the warmup (the loader's queue holds micro-batches split the old way)."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    def write_shares(self, run: Run) -> None:
        if run.adapter.rank == 0:  # the same on every rank; the parent logs rank<R>/share
            run.events.write(BalanceEvent(type="balance", step=run.step, shares=self.balancer.shares))

    def on_window(self, run: Run, win: Any) -> bool:
        # the run's step (the meter counts from this process's start, a resume's too)
        if self.balancer.on_window(win.wall_s, win.phases_s["comm"], win.samples, win.steps, run.step):
            self.write_shares(run)
            run.meter.rewarm("balance")
            return True
        return False

    def start(self, run: Run) -> None:
        self.write_shares(run)

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        out["balance"] = self.balancer.summary()


class CheckpointHook(Hook):
    """trainer.checkpoint_every: a checkpoint every that many steps and at the end of the run
    (raising max_steps or epochs then continues from there); see orchestrator/checkpoint.py and resume.py."""

    def __init__(self, ckpt_dir: Path, every: int, mlflow_run_id: Optional[str], start_step: int) -> None:
        self.ckpt_dir, self.every, self.mlflow_run_id, self.start_step = ckpt_dir, every, mlflow_run_id, start_step
        self.after_every = max(1, every)

    def after_step(self, run: Run) -> bool:
        if run.step % self.every == 0 and run.checkpointed != run.step:
            self.save(run)
            return True
        return False

    def finish(self, run: Run) -> None:
        if run.step % self.every != 0 and run.step > self.start_step and run.checkpointed != run.step:
            self.save(run)

    def save(self, run: Run) -> None:
        # the loss is checked on logged steps only: weights that diverged in between are never
        # written, so a resume always finds the last finite checkpoint (rotation keeps the newest)
        adapter, step = run.adapter, run.step
        if not weights_finite(run.model, adapter):
            raise Diverged(step, "the weights are not finite (NaN or inf), not checkpointed", run.logged_step)
        state = {"scaler": run.scaler.state_dict() if run.scaler is not None else None,
                 "rng": checkpoint.rng_state(), "loader_generator": run.epoch_generator}
        if not adapter.sharded_state:
            state.update(model=unwrap(run.model).state_dict(), optimizer=run.optimizer.state_dict())
        loader = run.loader_tuner.settled if run.loader_tuner is not None else LoaderSettings.of(run.cfg.data)
        balancer = run.balancer
        checkpoint.save(self.ckpt_dir, step, state,
                        {"step": step, "epoch": run.epoch, "batch_in_epoch": run.b, "world_size": adapter.world_size,
                         "backend": run.cfg.backend.name.value, "mlflow_run_id": self.mlflow_run_id,
                         "loader": loader.as_dict(),
                         "balance": {"sizes": balancer.sampler.sizes} if balancer is not None else None},
                        sharded=(run.model, run.base_optimizer) if adapter.sharded_state else None, rank=adapter.rank)
        run.checkpointed = step
        if adapter.rank == 0:
            run.events.write(CheckpointEvent(type="checkpoint", step=step))


# trainer.checkpoint_signal arrived at this rank (rank.py installs `on_checkpoint_signal`)
_signalled: List[int] = []


def on_checkpoint_signal(signum: int, frame: Any) -> None:
    _signalled.append(signum)


class SignalCheckpointHook(Hook):
    """trainer.checkpoint_signal: the rank got the signal (SLURM signals a job step's processes:
    `sbatch --signal=USR1@<s>`), or the parent did and wrote `checkpoint.request` in the run dir
    (`--signal=B:USR1@<s>`, or `kill -USR1` of the orchestrator): the run checkpoints at a step
    boundary (CheckpointHook.save, the same code path as the periodic checkpoints) and stops there.
    Several ranks agree on the step: every `every` steps they all-reduce whether any of them was
    asked (one float), so they all save and stop after the same step. One rank stops at the next
    step after its own signal, and looks for the parent's file every `every` steps. A run at its
    last step finishes instead (its end is checkpointed by CheckpointHook when that is on)."""

    def __init__(self, saver: Optional[CheckpointHook], request: Optional[Path], every: int) -> None:
        self.saver, self.request, self.every = saver, request, every  # request: rank 0 reads the parent's file

    def after_step(self, run: Run) -> bool:
        if run.step >= run.total:
            return False
        looks = run.step % self.every == 0
        if run.adapter.world_size > 1:
            if not looks:
                return False
            asked = run.adapter.all_reduce_sum([float(self._asked(looks))])[0] > 0
        else:
            asked = self._asked(looks)
        if asked:
            if self.saver is not None and run.checkpointed != run.step:
                self.saver.save(run)
            run.stop, run.stopped_by = True, "checkpoint_signal"
        return looks or asked

    def _asked(self, look_at_file: bool) -> bool:
        return bool(_signalled) or (look_at_file and self.request is not None and self.request.exists())


class LatencyJumpHook(Hook):
    """sim.latency_jump_at: from that step on the dataset reads with sim.latency_after_ms."""

    def __init__(self, at: int, after_ms: float) -> None:
        self.at, self.after_ms = at, after_ms

    def after_step(self, run: Run) -> bool:
        if run.step == self.at:
            run.dataset.set_latency(self.after_ms)
        return False


class LoaderAutotuneHook(Hook):
    """trainer.loader_autotune: every `every` steps the tuner (runtime/autotune.py) reads the
    windows since and may switch the loader's settings (`loop.Run.change_loader`)."""

    def __init__(self, tuner: LoaderTuner, every: int) -> None:
        self.tuner, self.every = tuner, every
        self.after_every = every

    def on_figures(self, run: Run, win: Any, figures: Any) -> None:
        self.tuner.add(figures.throughput, win.phases_s, win.steps)

    def after_step(self, run: Run) -> bool:
        if run.stop or run.step % self.every != 0 or run.step >= run.total:
            return False
        new = self.tuner.at_step(run.step)
        if new is not None:  # every rank switches here, at the same batch of the epoch
            run.change_loader(new)
        return True

    def summary(self, run: Run, out: Dict[str, Any]) -> None:
        if run.adapter.rank == 0:
            self.tuner.finish(run.step)  # the last try: kept or reverted, never left open
            out["loader_autotune"] = self.tuner.summary()


# -- the profiler, the loader tuner and the weights' checks the hooks above use ------------------
class Profiler:
    """torch.profiler over the steps [warmup, warmup + n): CPU, and CUDA where present, with shapes."""

    def __init__(self, device: torch.device, trace_path: Path) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.cuda, self.trace_path = device.type == "cuda", trace_path
        self.prof = profile(activities=acts, record_shapes=True)
        self.running = self.done = False
        self.top_ops: list = []

    def at_step(self, step: int, start: int, n: int) -> bool:
        """Start or stop at the top of `step`; True when it just stopped (its teardown ran)."""
        if step == start and not self.running and not self.done:
            self.prof.start()
            self.running = True
        elif step == start + n and self.running:
            self.stop()
            return True
        return False

    def stop(self) -> None:
        if not self.running:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.stop()
        self.running, self.done = False, True
        self.prof.export_chrome_trace(str(self.trace_path))
        self.top_ops = top_ops(self.prof, self.cuda)


def top_ops(prof: Any, cuda: bool, n: int = 15) -> list:
    """The operators that took the most device time (self time: children not double counted)."""
    def dev(e: Any) -> float:
        return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)

    events = [e for e in prof.key_averages(group_by_input_shape=True) if not e.key.startswith("ProfilerStep")]
    events.sort(key=(dev if cuda else (lambda e: e.self_cpu_time_total)), reverse=True)
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000.0,
             "self_device_ms": dev(e) / 1000.0, "input_shapes": str(e.input_shapes)[:200]} for e in events[:n]]


def loader_tuner(cfg: Config, adapter: Adapter, dataset: Dataset, events: Any,
                 ck: Optional[Dict[str, Any]]) -> Optional[LoaderTuner]:
    """The run's loader tuner (trainer.loader_autotune), its starting settings recorded (rank 0)."""
    if not cfg.trainer.loader_autotune:
        return None

    def emit(ev: LoaderEvent) -> None:
        if adapter.rank == 0:
            events.write(ev)
            if ev["action"] != "start":
                print(f"[loader-autotune] step {ev['step']}: {ev['action']} "
                      f"{LoaderSettings(ev['num_workers'], ev['prefetch_factor']).text} "
                      f"(was {LoaderSettings(ev['from_workers'], ev['from_prefetch']).text}): {ev['reason']}", flush=True)

    settings = LoaderSettings.of(cfg.data)
    tuner = LoaderTuner(cfg, settings, rank=adapter.rank, world_size=adapter.world_size, device=str(adapter.device),
                        item_bytes=item_bytes(dataset), emit=emit, all_reduce_sum=adapter.all_reduce_sum)
    step = ck["meta"]["step"] if ck is not None else 0
    tuner.record(step, "start", settings, settings, "resumed with the checkpoint's settings" if ck else "configured")
    return tuner


def weights_finite(model: nn.Module, adapter: Adapter) -> bool:
    """Every parameter is finite. Sharded weights (fsdp): every rank's part, agreed by all ranks
    (a collective; each of them writes its part of a checkpoint)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    bad = float(not bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all())) if local else 0.0
    if adapter.sharded_state:
        bad = adapter.all_reduce_sum([bad])[0]
    return bad == 0


class LrWarmupHook(Hook):
    """trainer.warmup_lr_steps: the learning rate rises linearly from lr/n to lr over the first n
    optimizer steps (torch's LambdaLR), the warmup a rate scaled up with the global batch needs
    (Goyal et al. 2017). A resumed run continues the ramp at its step."""

    def __init__(self, lr: float, steps: int) -> None:
        self.lr, self.steps = lr, steps
        self.scheduler: Optional[torch.optim.lr_scheduler.LambdaLR] = None

    def start(self, run: Run) -> None:
        for group in run.optimizer.param_groups:
            group["initial_lr"] = self.lr
        n = self.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: min(1.0, (s + 1) / n),
                                                           last_epoch=run.step - 1)

    def after_step(self, run: Run) -> bool:
        if self.scheduler is not None and self.scheduler.last_epoch < self.steps:  # past the ramp: the rate stays
            self.scheduler.step()
        return False
