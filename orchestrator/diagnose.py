"""What bounds a job, and what to change: thresholds on the measured shares, advice in knobs.

A step's wall time is tiled by its phases (see runtime/meter.py), so the shares say where the
time went. The verdict is the first rule that holds, in this order:

  memory-bound          peak memory >= MEMORY_FULL of the device (CUDA total / host RAM, or trainer.memory_cap_mb on CPU):
                        nothing larger fits, whatever the other shares say
  input-bound           data wait + host-to-device >= INPUT_BOUND of the step
  communication-bound   exposed communication >= COMM_BOUND of the step
  compute-bound         otherwise (compute + optimizer dominate)

Advice must hold when a user follows it, so each piece weighs what the move costs and names the
evidence it rests on. The moves (config overrides, first = the one to try first) are machine
readable for the tuner and the advice benchmark (bench/bench_advice.py). The main cost weighed:
a DataLoader worker hands every batch to the training process at a measured cost per batch
(orchestrator/costs.py); when building a batch in process is cheaper than that, more workers
make the job slower, and a larger batch (which amortizes per-batch overheads) comes first.

Imbalance: a rank whose own work per step (step time minus its communication wait) exceeds the
fastest rank's by more than STRAGGLER_SPREAD is named as the straggler.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .jobmodel import JobModel, Run
from .measure.noise import efficiency
from .schema import BackendName, Config, OptimizerName

INPUT_BOUND = 0.30
COMM_BOUND = 0.30
MEMORY_FULL = 0.90
STRAGGLER_SPREAD = 0.20
WORKERS_WORTH_IT = 2.0  # workers are advised when a batch costs this many hand-offs to build in process

Handoff = Callable[[int, int], Dict[str, Any]]  # (batch bytes, batch size) -> {"seconds", "source"}


@dataclass
class Move:
    """One change to try: the config overrides and why (the evidence)."""

    set: Dict[str, Any]
    why: str

    @property
    def text(self) -> str:
        knobs = ", ".join(f"{k}={_fmt(v)}" for k, v in self.set.items())
        return f"{knobs}: {self.why}"


@dataclass
class Diagnosis:
    verdict: str  # input-bound | communication-bound | compute-bound | memory-bound
    reason: str
    moves: List[Move] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # advice with no single knob to turn

    @property
    def advice(self) -> List[str]:
        return [m.text for m in self.moves] + self.notes

    def as_dict(self) -> Dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "advice": self.advice,
                "moves": [{"set": m.set, "why": m.why} for m in self.moves]}


def _fmt(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(s: float) -> str:
    return f"{1000 * s:.2f} ms"


def _default_handoff(batch_bytes: int, batch_size: int) -> Dict[str, Any]:
    from .costs import handoff_s

    return handoff_s(batch_bytes, batch_size)


def _global_note(cfg: Config, factor: int, job: Dict[str, Any]) -> str:
    """What a larger global batch costs in samples to the same loss: at the run's measured gradient
    noise scale B each sample is worth E = (B + M0) / (B + M) of one at the user's M0 (a move pays
    only when it raises samples/s by more than 1/E), with the learning rate the linear rule gives."""
    g = cfg.data.batch_size * cfg.trainer.accumulation_steps * cfg.world_size
    grows = f"the global batch grows from {g} to {g * factor}"
    b = (job.get("noise_scale") or {}).get("b_simple")
    if b is None or not math.isfinite(b):
        return (f"{grows} (different optimization math: scale trainer.lr, or keep the global batch with "
                "trainer.accumulation_steps; the tuner holds it by default)")
    e = efficiency(g * factor, g, b)
    adam = cfg.trainer.optimizer is not OptimizerName.sgd
    lr = cfg.trainer.lr * (math.sqrt(factor) if adam else factor)
    return (f"{grows}: at this run's gradient noise scale ({b:.0f} samples) each sample is worth {e:.2f} of one now, "
            f"so it trains sooner only if samples/s grow more than {1 / e:.2f}x, with trainer.lr scaled to "
            f"{lr:.3g} ({'sqrt, for Adam' if adam else 'linear'})")


def diagnose(job: Dict[str, Any], cfg: Config, device_mem_mb: Optional[float],
             handoff: Handoff = _default_handoff) -> Diagnosis:
    """`job` is the merged result (report.merge); `device_mem_mb` the memory one rank can use;
    `handoff` the measured worker hand-off cost (only asked for when workers are in question)."""
    inp = job.get("data_wait_frac", 0.0) + job.get("h2d_frac", 0.0)
    comm = job.get("comm_frac", 0.0)
    cuda = str((job.get("per_rank") or [{}])[0].get("device", "cpu")).startswith("cuda")
    peak = job.get("peak_mem_mb") or 0.0
    mem_share = peak / device_mem_mb if device_mem_mb else 0.0
    # on CPU the cap is the limit (runtime/samplers.py memory_stats)
    dev = "the memory cap" if cfg.trainer.memory_cap_mb and not cuda else "the device"
    step = job.get("step_time_s") or 0.0

    if mem_share >= MEMORY_FULL:
        return _memory_bound(job, cfg, peak, mem_share, device_mem_mb, dev, cuda)
    if inp >= INPUT_BOUND:
        diag = Diagnosis("input-bound", f"the step waits on input {_pct(inp)} of the time (data "
                                        f"{_pct(job.get('data_wait_frac', 0))}, h2d {_pct(job.get('h2d_frac', 0))}; "
                                        f">= {_pct(INPUT_BOUND)})")
        _input_moves(diag, job, cfg, cuda, handoff)
        return diag
    if comm >= COMM_BOUND and job.get("world_size", 1) > 1 and cfg.backend.name is BackendName.fsdp:
        return Diagnosis("communication-bound", f"exposed communication (all-gathers, reduce-scatters) is {_pct(comm)} "
                                                f"of the step (>= {_pct(COMM_BOUND)})", _fsdp_comm_moves(cfg, comm, step, job))
    if comm >= COMM_BOUND and job.get("world_size", 1) > 1:
        return _allreduce_bound(job, cfg, comm, step, mem_share, dev)
    return _compute_bound(job, cfg, inp, comm, mem_share, dev, cuda)


def _memory_bound(job: Dict[str, Any], cfg: Config, peak: float, mem_share: float, device_mem_mb: Optional[float],
                  dev: str, cuda: bool) -> Diagnosis:
    """The peak memory is at the limit: half the batch at twice the accumulation (the same model
    math), sharding the model state when it is most of the peak, amp on a GPU."""
    d, t = cfg.data, cfg.trainer
    moves = [Move({"data.batch_size": max(1, d.batch_size // 2), "trainer.accumulation_steps": t.accumulation_steps * 2},
                  f"peak memory is {_pct(mem_share)} of {dev}; half the batch takes half the activations, and "
                  "twice the accumulation keeps the global batch (the same model math)")]
    shard = _shard_move(job, cfg, peak)
    if shard is not None:  # first when the replicated model state is most of the peak
        moves.insert(0 if shard[1] else 1, shard[0])
    if not t.amp and cuda:
        moves.append(Move({"trainer.amp": True}, "bf16/fp16 activations take half the memory"))
    return Diagnosis("memory-bound", f"peak memory {peak:.0f} MB is {_pct(mem_share)} of the {device_mem_mb:.0f} MB "
                                     f"available (>= {_pct(MEMORY_FULL)})", moves)


def _allreduce_bound(job: Dict[str, Any], cfg: Config, comm: float, step: float, mem_share: float,
                     dev: str) -> Diagnosis:
    """Exposed all-reduces (ddp, horovod): fewer of them per sample (a 4x batch where it fits,
    4x accumulation), half the bytes on horovod's wire; a note on the network across nodes."""
    d, t = cfg.data, cfg.trainer
    moves = []
    if mem_share and mem_share * 4 < MEMORY_FULL:  # 4x the activations fit: the larger batch first
        moves.append(Move({"data.batch_size": d.batch_size * 4},
                          f"exposed communication is {_ms(comm * step)} of a {_ms(step)} step; one all-reduce per "
                          f"4x the samples divides it by 4 per sample, and unlike accumulation the larger batch also "
                          f"runs larger kernels and pays the per-step overheads once per 4x the samples (peak memory "
                          f"is {_pct(mem_share)} of {dev}); {_global_note(cfg, 4, job)}"))
    moves.append(Move({"trainer.accumulation_steps": t.accumulation_steps * 4},
                      f"exposed communication is {_ms(comm * step)} of a {_ms(step)} step; one all-reduce per 4x the "
                      f"samples divides it by 4 per sample, at the same memory; {_global_note(cfg, 4, job)}"))
    if cfg.backend.name is BackendName.horovod and not cfg.backend.fp16_compression:
        moves.append(Move({"backend.fp16_compression": True}, "half the bytes on the wire, the same model math up to "
                                                              "fp16 rounding of the gradients"))
    notes = []
    if cfg.parallelism.nnodes > 1:
        notes.append("check the inter-node network: fewer, larger nodes communicate less")
    return Diagnosis("communication-bound", f"exposed communication is {_pct(comm)} of the step (>= {_pct(COMM_BOUND)})",
                     moves, notes)


def _compute_bound(job: Dict[str, Any], cfg: Config, inp: float, comm: float, mem_share: float, dev: str,
                   cuda: bool) -> Diagnosis:
    """None of the others: the device computes most of the step; amp on a GPU, a larger batch
    where twice fits."""
    busy = job.get("compute_frac", 0.0) + job.get("optimizer_frac", 0.0)
    moves = []
    if not cfg.trainer.amp and cuda:  # on CPU, bf16 autocast is often slower than fp32: not advised there
        moves.append(Move({"trainer.amp": True}, "tensor cores run bf16/fp16 several times faster than fp32"))
    if mem_share and mem_share < 0.5:
        moves.append(Move({"data.batch_size": cfg.data.batch_size * 2},
                          f"peak memory is {_pct(mem_share)} of {dev}, so twice the batch fits; larger batches run "
                          f"more efficient kernels and pay per-step overheads half as often; {_global_note(cfg, 2, job)}"))
    return Diagnosis("compute-bound", f"compute + optimizer take {_pct(busy)} of the step; input {_pct(inp)}, "
                                      f"communication {_pct(comm)}", moves,
                     ["the device is the limit: a faster model (fused ops, torch.compile) or more ranks"])


def _shard_move(job: Dict[str, Any], cfg: Config, peak: float) -> Optional[tuple]:
    """backend=fsdp for a memory-bound ddp run of several ranks: (the move, whether the replicated
    model state is at least half the peak, so that sharding it comes first)."""
    world = job.get("world_size", 1)
    if cfg.backend.name is not BackendName.ddp or world < 2:
        return None
    state = (job.get("per_rank") or [{}])[0].get("model_state_mb")
    if state:
        why = (f"parameters, gradients and optimizer state take {state:.0f} MB of the {peak:.0f} MB peak on every rank, "
               f"a full copy each; fsdp shards them over the {world} ranks (about {state / world:.0f} MB each; "
               "activations unchanged), the same model math, at the cost of all-gathering parameters every step")
    else:
        why = (f"each of the {world} ranks holds a full copy of the parameters, gradients and optimizer state; fsdp "
               "shards them over the ranks, the same model math")
    return Move({"backend.name": "fsdp"}, why), bool(state) and state >= 0.5 * peak


def _fsdp_comm_moves(cfg: Config, comm: float, step: float, job: Dict[str, Any]) -> List[Move]:
    """A communication-bound fsdp run: fewer all-gathers, collectives within a node, fewer steps."""
    b, p, d = cfg.backend, cfg.parallelism, cfg.data
    moves = []
    if b.reshard_after_forward:
        moves.append(Move({"backend.reshard_after_forward": False},
                          f"exposed communication is {_ms(comm * step)} of a {_ms(step)} step; keeping the gathered "
                          "parameters from forward to backward saves the backward all-gather (one of the three "
                          "collectives per step), at the cost of holding each unit's full parameters until its backward"))
    if p.nnodes > 1 and (p.shard_size or cfg.world_size) > p.nproc_per_node:
        moves.append(Move({"parallelism.shard_size": p.nproc_per_node},
                          f"shard within each node and replicate across the {p.nnodes} nodes (HSDP): the all-gathers and "
                          "reduce-scatters stay on the node's links and only an all-reduce of the gradient shards crosses "
                          f"the network; each rank then holds 1/{p.nproc_per_node} of the model state instead of "
                          f"1/{cfg.world_size}"))
    moves.append(Move({"data.batch_size": d.batch_size * 4},
                      f"fsdp all-gathers the whole model for every micro-batch whatever its size, so a 4x batch "
                      f"pays it a quarter as often per sample (activations grow 4x); {_global_note(cfg, 4, job)}"))
    return moves


def _input_moves(diag: Diagnosis, job: Dict[str, Any], cfg: Config, cuda: bool, handoff: Handoff) -> None:
    """The moves of an input-bound job: faster copies when host-to-device copies dominate, else
    loader workers, or a larger batch where a worker's hand-off would cost what it saves."""
    d, t = cfg.data, cfg.trainer
    if job.get("h2d_frac", 0.0) > job.get("data_wait_frac", 0.0):
        _copy_moves(diag, job, cfg, cuda)
        return
    step = job.get("step_time_s") or 0.0
    wait = step * job.get("data_wait_frac", 0.0) / t.accumulation_steps  # per micro-batch
    other = max(0.0, step / t.accumulation_steps - wait)  # what the rest of a micro-step takes
    batch_bytes = int(job.get("item_bytes") or 0) * d.batch_size
    cost = handoff(batch_bytes, d.batch_size) if batch_bytes else {"seconds": 1e-3, "source": "an estimate"}
    model = _job_model(job, cfg, handoff)
    cap = cfg.tune.max_workers if cfg.tune.max_workers is not None else \
        workers_cap((job.get("input_cost") or {}).get("cores") or (os.cpu_count() or 1))
    if d.num_workers == 0:
        _in_process_moves(diag, job, cfg, wait, other, cost, model, cap)
    else:
        _worker_moves(diag, job, cfg, wait, cost, model, cap)


def _copy_moves(diag: Diagnosis, job: Dict[str, Any], cfg: Config, cuda: bool) -> None:
    """Host-to-device copies take most of the input time: pinned memory on a GPU, compact inputs."""
    if cuda and not cfg.data.pin_memory:
        diag.moves.append(Move({"data.pin_memory": True}, f"host-to-device copies take {_pct(job['h2d_frac'])} of the "
                                                         "step; pinned memory makes them faster and asynchronous"))
    diag.notes.append("host-to-device copies dominate the input time: keep inputs compact (uint8 images, "
                      "converted on the device)")


def _in_process_moves(diag: Diagnosis, job: Dict[str, Any], cfg: Config, wait: float, other: float,
                      cost: Dict[str, Any], model: Optional[JobModel], cap: int) -> None:
    """The training process builds its batches (data.num_workers=0): workers, when a batch takes
    longer to build than a worker's hand-off costs; else a 4x batch amortizes the per-batch overhead."""
    d, t = cfg.data, cfg.trainer
    if wait > WORKERS_WORTH_IT * cost["seconds"]:
        if model is not None:
            n = model.best_workers(d.batch_size, t.accumulation_steps, cap)
            if n > 0:
                diag.moves.append(Move({"data.num_workers": n, "data.persistent_workers": True},
                                       _workers_why(model, cfg, n, cost)))
                return
        else:
            n = min(cap, max(2, math.ceil(wait / max(other, cost["seconds"]))))
            diag.moves.append(Move(
                {"data.num_workers": n, "data.persistent_workers": True},
                f"building a batch takes {_ms(wait)} in the training process, and handing one over from a worker "
                f"costs about {_ms(cost['seconds'])} ({cost['source']}); {n} workers build batches while the step "
                f"computes ({_ms(other)} of other work per batch)"))
            return
    diag.moves.append(Move({"data.batch_size": d.batch_size * 4}, (
        f"building a batch takes only {_ms(wait)} in the training process, less than the "
        f"{_ms(cost['seconds'])} a worker hand-off costs here ({cost['source']}), so workers would make "
        f"this job slower; the per-batch overhead dominates and a 4x batch amortizes it; "
        f"{_global_note(cfg, 4, job)}")))


def _worker_moves(diag: Diagnosis, job: Dict[str, Any], cfg: Config, wait: float, cost: Dict[str, Any],
                  model: Optional[JobModel], cap: int) -> None:
    """Workers build the batches and the step still waits: a 4x batch when the wait is the hand-off
    itself; else the number of workers the job model (or twice as many) says, a deeper queue, a 4x batch."""
    d, t = cfg.data, cfg.trainer
    bigger = Move({"data.batch_size": d.batch_size * 4}, "")
    if wait <= 1.5 * cost["seconds"]:  # the wait is the hand-off itself: more workers cannot lower it
        bigger.why = (f"the step waits {_ms(wait)} per batch, about what one worker hand-off costs here "
                      f"({_ms(cost['seconds'])}, {cost['source']}): more workers cannot lower it, a 4x batch pays it a "
                      f"quarter as often per sample; {_global_note(cfg, 4, job)}")
        diag.moves.append(bigger)
        diag.notes.append(f"or try data.num_workers=0 if building a batch in process takes less than "
                          f"{_ms(cost['seconds'])}")
        return
    n = model.best_workers(d.batch_size, t.accumulation_steps, cap) if model is not None else min(cap, 2 * d.num_workers)
    if n != d.num_workers:
        move = {"data.num_workers": n}
        if not d.persistent_workers:
            move["data.persistent_workers"] = True
        diag.moves.append(Move(move, _workers_why(model, cfg, n, cost) if model is not None else
                               f"{d.num_workers} workers do not keep up: the step still waits {_ms(wait)} per "
                               f"batch, more than the {_ms(cost['seconds'])} hand-off ({cost['source']})"))
        if n < d.num_workers:  # fewer workers is the fix: the queue is not the problem
            return
    if (d.prefetch_factor or 2) < 4:
        diag.moves.append(Move({"data.prefetch_factor": 4}, "a deeper queue per worker absorbs slow batches"))
    bigger.why = f"per-batch overheads amortize; {_global_note(cfg, 4, job)}"
    diag.moves.append(bigger)


def workers_cap(cores: float) -> int:
    """How many loader workers advice may ask for: 4 x the rank's cores (workers that wait on
    storage pay beyond the cores; the job model says how many), as far as a study widens them."""
    return max(2, 4 * int(cores))


def _job_model(job: Dict[str, Any], cfg: Config, handoff: Handoff) -> Optional[JobModel]:
    """The job model fitted to this run alone (jobmodel.py), when it measured its input cost."""
    if not job.get("input_cost"):
        return None
    values = {"data.batch_size": cfg.data.batch_size, "data.num_workers": cfg.data.num_workers,
              "trainer.accumulation_steps": cfg.trainer.accumulation_steps}
    run = Run.of(values, {**job, "rel_se": (job.get("estimate") or {}).get("rel_se")}, job.get("world_size", 1))
    if run is None:
        return None
    item = int(job.get("item_bytes") or 0)
    cost = job["input_cost"]
    return JobModel.fit([run], job.get("world_size", 1), cores=float(cost.get("cores") or 1),
                        threads=float(cost.get("threads") or 1),
                        handoff=(lambda b: handoff(item * b, b)["seconds"]) if item else None)


def _workers_why(model: JobModel, cfg: Config, n: int, cost: Dict[str, Any]) -> str:
    """The evidence for a worker count: what the loader and the training process cost per item,
    and the rates the job model predicts now and with `n` workers."""
    d, t = cfg.data, cfg.trainer
    now = model.predict(d.batch_size, d.num_workers, t.accumulation_steps)
    then = model.predict(d.batch_size, n, t.accumulation_steps)
    kind = ("it mostly waits, so workers beyond the cores pay" if (model.load_wait or 0) > (model.load_cpu or 0)
            else "it mostly computes, so its workers share the cores with the training process")
    return (f"the job model ({model.explain()}; a worker hand-off {_ms(cost['seconds'])}, {cost['source']}): "
            f"{kind}; it predicts {then.throughput:.0f} samples/s with {n} workers vs {now.throughput:.0f} with "
            f"{d.num_workers} ({then.bound}-bound then)")


def straggler_note(job: Dict[str, Any]) -> Optional[str]:
    imb = job.get("imbalance") or {}
    if imb.get("straggler_rank") is None:  # named by report.merge only past STRAGGLER_SPREAD
        return None
    at, bal = imb.get("at_shares"), job.get("balance") or {}
    if at and bal:  # balance=speed: judged at the shares the run ended with, not over the whole run
        r = imb["straggler_rank"]
        shares = " / ".join(f"{100 * s:.0f}%" for s in at["shares"])
        return (f"rank {r} is a straggler at the balanced shares ({shares} of the global batch): its own work per "
                f"window is {_pct(at['own_time_spread'])} above the fastest rank's (> {_pct(STRAGGLER_SPREAD)}) over "
                f"{at['windows']} windows at those shares; the shares follow its measured speed within "
                f"a tolerance of {bal.get('tolerance', 0):g}, so its speed varies more than they "
                "follow: check its device, its data shard and what else runs on its host")
    return (f"rank {imb['straggler_rank']} is a straggler: its own work per step is {_pct(imb['own_time_spread'])} above "
            f"the fastest rank's (> {_pct(STRAGGLER_SPREAD)}); the others wait for it in the all-reduce. Check its "
            "device, its data shard and what else runs on its host"
            + ("" if job.get("balance") else "; parallelism.balance=speed gives each rank a share of the global batch "
               "by its measured speed (the same math)"))
