"""Backend adapters: what differs between single, DataParallel, DDP and Horovod inside a rank.

The training loop is the same for every backend; it asks its adapter to wrap the model and
optimizer, to build the sampler, whether a micro-step synchronizes, and to run the exposed
communication before the optimizer step. Training code does not know how it was launched:
it reads RANK / LOCAL_RANK / WORLD_SIZE (torchrun) or Horovod's own ranks.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager, Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler, Sampler

from ..schema import AmpDtype, BackendName, Config, ConfigError, Device, DistBackend, import_target


def check_devices(cfg: Config) -> None:
    """What the config asks of this machine's devices, checked by the parent before launch (and
    again by each rank on its own machine). Raises ConfigError naming the field."""
    cuda = torch.cuda.is_available()
    if cfg.backend.device is Device.cuda and not cuda:
        raise ConfigError("backend.device: cuda requested but torch.cuda.is_available() is False; allowed here: auto, cpu")
    on_cuda = cuda and cfg.backend.device is not Device.cpu
    if cfg.backend.dist_backend is DistBackend.nccl and not on_cuda and cfg.backend.name in (BackendName.ddp, BackendName.fsdp):
        raise ConfigError("backend.dist_backend: nccl needs CUDA devices; allowed on CPU: gloo, auto")


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    check_devices(cfg)
    if cfg.backend.device is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def amp_dtype(cfg: Config, device: torch.device, say: bool = True) -> torch.dtype:
    """trainer.amp_dtype on this device: bf16 where the GPU supports it, else fp16; fp16 autocast
    does not exist on CPU: bf16 there. `say`: print when it differs from the config."""
    dtype = torch.bfloat16 if cfg.trainer.amp_dtype is AmpDtype.bf16 else torch.float16
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        if say:
            print("[amp] bf16 not supported on this GPU: using fp16 with a GradScaler")
        dtype = torch.float16
    if device.type == "cpu" and dtype is torch.float16:
        if say:
            print("[amp] fp16 autocast is not supported on CPU: using bf16")
        dtype = torch.bfloat16
    return dtype


def check_world(cfg: Config, world_size: int) -> None:
    """The configured degree of parallelism must match what the launcher gave us."""
    expected = cfg.world_size
    if world_size != expected:
        raise RuntimeError(
            f"world size mismatch: the launcher started {world_size} ranks, the config asks for {expected} "
            f"(parallelism.nproc_per_node={cfg.parallelism.nproc_per_node}, nnodes={cfg.parallelism.nnodes})"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DDP."""
    wrapped = isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
    return model.module if wrapped else model


class Adapter:
    """One process, one device (backend=single)."""

    name = "single"
    exposed_comm = False  # True: the loop calls synchronize() before the step and times it as comm
    sharded_state = False  # True: every rank holds part of the model; checkpoints are written by all ranks
    rank = 0
    local_rank = 0
    world_size = 1

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = torch.device("cpu")

    def setup(self) -> None:
        self.device = pick_device(self.cfg, self.local_rank)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def sampler(self, dataset: Dataset, shuffle: bool, seed: int, drop_last: bool) -> Optional[Sampler]:
        return None  # the DataLoader shuffles with its own seeded generator

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        """Context for one micro-step's forward+backward in which gradients are all-reduced only
        when `enabled` (the last micro-step of an accumulation); one process: nothing to sync."""
        return contextlib.nullcontext()

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Exposed communication before the optimizer step (Horovod's allreduce wait)."""

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    def install_comm_hook(self, model: nn.Module, meter: Any, noise: Any = None) -> None:
        """Let the meter (runtime/meter.py StepMeter) see the exposed communication inside
        forward + backward: DDP's last gradient bucket, FSDP's waits for its collectives. With
        several ranks, `noise` (runtime/noise.NoiseProbe) is fed each rank's own gradient's
        squared norm before its reduction (and DDP's averaged one after it); `noise.fed` says so."""

    def consolidated_state_dict(self, model: nn.Module) -> Optional[dict]:
        """The whole model's state dict on rank 0 (model.pt), None on other ranks; every rank
        calls it (a sharded backend gathers)."""
        return model.state_dict() if self.rank == 0 else None

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def all_reduce_sum(self, values: list) -> list:
        """Element-wise sum of a few floats over the ranks (the same result on every rank)."""
        return list(values)

    def shutdown(self) -> None:
        pass


class DataParallelAdapter(Adapter):
    """`nn.DataParallel` over the visible GPUs in one process; without GPUs, one device."""

    name = "dp"

    def setup(self) -> None:
        super().setup()
        n = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if n < 2:
            print(f"[dp] {max(n, 1)} device visible ({self.device}): DataParallel runs on a single device")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if self.device.type == "cuda" and torch.cuda.device_count() > 1:
            return nn.DataParallel(model)
        return model


class DDPAdapter(Adapter):
    """DistributedDataParallel; started by torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*)."""

    name = "ddp"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))

    def setup(self) -> None:
        import torch.distributed as dist

        check_world(self.cfg, self.world_size)
        self.device = pick_device(self.cfg, self.local_rank)
        backend = self.cfg.backend.dist_backend
        if backend is DistBackend.auto:
            backend = DistBackend.nccl if self.device.type == "cuda" else DistBackend.gloo
        if backend is DistBackend.nccl and self.device.type != "cuda":
            raise ConfigError("backend.dist_backend: nccl needs CUDA devices; allowed on CPU: gloo, auto")
        kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
        dist.init_process_group(backend=backend.value, rank=self.rank, world_size=self.world_size, **kwargs)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def sampler(self, dataset: Dataset, shuffle: bool, seed: int, drop_last: bool) -> Optional[Sampler]:
        return DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                  seed=seed, drop_last=drop_last)

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        return contextlib.nullcontext() if enabled else model.no_sync()  # type: ignore[operator]

    def install_comm_hook(self, model: nn.Module, meter: Any, noise: Any = None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        on_bucket = meter.comm_hook_fired

        def timed_allreduce(state, bucket):  # no annotations: DDP checks them against GradBucket
            on_bucket()
            return default_hooks.allreduce_hook(state, bucket)

        def measured_allreduce(state, bucket):  # the norm first: the rank's own work, not communication
            if not noise.active:
                return timed_allreduce(state, bucket)
            noise.add_small(_norm(bucket.buffer()))  # before the hook averages the bucket in place
            on_bucket()
            return default_hooks.allreduce_hook(state, bucket).then(averaged)

        def averaged(fut):
            reduced = fut.value()
            noise.add_big(_norm(reduced))
            return reduced

        hook = timed_allreduce if noise is None else measured_allreduce
        model.register_comm_hook(None, hook)  # type: ignore[operator]
        if noise is not None:
            noise.fed = True

    def all_gather_object(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_sum(self, values: list) -> list:
        import torch.distributed as dist

        # NCCL reduces device tensors only; a handful of floats costs the same either way
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.barrier()  # nobody tears down gloo while a peer still talks to it
            except Exception:
                pass  # a peer already failed: the supervisor is ending the job
            dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) gradient's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor (a sharded one's local shard), in float32, on their device: one
    fused op, no sync (the gradient noise scale, runtime/noise.py)."""
    ts = [_local(t) for t in tensors if t is not None]
    return list(torch._foreach_norm(ts, 2, dtype=torch.float32)) if ts else []


def _norm(t: torch.Tensor) -> List[torch.Tensor]:
    """A flat tensor's L2 norm in float32, on its device (one reduction, no sync)."""
    return [torch.linalg.vector_norm(t, dtype=torch.float32)]


def shard_units(model: nn.Module, class_names: List[str], min_params: int) -> List[nn.Module]:
    """The modules `fully_shard` makes units of before the root, children before parents: those of
    the classes named; with none named, the repeated blocks: every item of an nn.ModuleList or
    nn.Sequential holding at least `min_params` parameters (the outermost such; a transformer's
    layers), or where there is none, every such child of the root. Not any large module: one whose
    parameters its parent uses directly (MultiheadAttention's out_proj) never runs its own forward,
    so its parameters would never be gathered."""
    if class_names:
        names = set(class_names)
        return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in names]

    def big(m: nn.Module) -> bool:
        return sum(p.numel() for p in m.parameters()) >= min_params

    units: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        listed = isinstance(module, (nn.ModuleList, nn.Sequential))
        for child in module.children():
            if listed and big(child):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units or [m for m in model.children() if big(m)]


def check_shard_modules(cfg: Config, model: Optional[nn.Module] = None) -> None:
    """backend=fsdp: every class in backend.shard_modules must name modules of the model. The
    parent checks before launch on a model built on the meta device (no memory, no init cost);
    a model that cannot be built there is checked by the ranks. Raises ConfigError."""
    names = cfg.backend.shard_modules
    if cfg.backend.name is not BackendName.fsdp or not names:
        return
    if model is None:
        try:
            with torch.device("meta"):
                model = import_target(cfg.model._target_)(**cfg.model.args)
        except Exception:
            return
    present = sorted({type(m).__name__ for m in model.modules() if m is not model})
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(f"backend.shard_modules: {', '.join(missing)} is no module class of {cfg.model._target_}; "
                          f"allowed: {', '.join(present)}")


def _fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc: allocations of `nbytes` and more get their own mapping, returned to the OS when freed.
    FSDP on CPU allocates and frees every unit's gathered parameters and gradients each step;
    under glibc's default (a threshold that rises to the largest block freed so far) those land on
    the heap, which fragments and keeps growing (transformer of 200 MB, 2 ranks: 1537 MB resident
    after 5 steps, 890 MB with this; ddp, which keeps its buffers, 1447 / 1412 MB). Elsewhere: no-op."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, nbytes)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


class FSDPAdapter(DDPAdapter):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over groups of
    `parallelism.shard_size` ranks (all ranks by default) and replicated across the groups (HSDP,
    a 2-D device mesh); started by torchrun like ddp. Checkpoints are sharded
    (torch.distributed.checkpoint, every rank writes its part); model.pt is gathered on rank 0."""

    name = "fsdp"
    sharded_state = True

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self._meshes: Dict[int, Any] = {}

    def setup(self) -> None:
        super().setup()
        if self.device.type == "cpu":
            _fixed_mmap_threshold()

    def mesh(self) -> Any:
        """1-D over all ranks, or (replicate, shard) with shard_size; kept-alive ranks (tuning) build
        each shape once."""
        world = self.world_size
        shard = self.cfg.parallelism.shard_size or world
        if shard not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            shape, dims = ((world,), ("shard",)) if shard == world else ((world // shard, shard), ("replicate", "shard"))
            self._meshes[shard] = init_device_mesh(self.device.type, shape, mesh_dim_names=dims)
        return self._meshes[shard]

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        b = self.cfg.backend
        check_shard_modules(self.cfg, model)
        kwargs: Dict[str, Any] = {"mesh": self.mesh(), "reshard_after_forward": b.reshard_after_forward}
        if self.device.type == "cuda" and self.cfg.trainer.amp:  # parameters gathered in the AMP dtype, fp32 reduce
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=amp_dtype(self.cfg, self.device, say=False),
                                                       reduce_dtype=torch.float32)
        for module in shard_units(model, b.shard_modules, b.shard_min_params):
            fully_shard(module, **kwargs)
        return fully_shard(model, **kwargs)

    @contextlib.contextmanager
    def grad_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        model.set_requires_gradient_sync(enabled)  # type: ignore[operator]  # no reduce-scatter on micro-steps
        yield

    def install_comm_hook(self, model: nn.Module, meter: Any, noise: Any = None) -> None:
        """FSDP's collectives and their waits are `comm`: the all-gathers (`unshard`, and
        `wait_for_unshard` with its copy-out), the reduce-scatter (+ HSDP all-reduce) in each group's
        `post_backward`, and the root's wait for the last one. On CPU (gloo) they block this
        process; on CUDA the meter's marks are events on the compute stream, so they time how long
        it stalled on the communication streams (what prefetching hid costs nothing)."""
        from ..measure.phases import COMM, COMPUTE

        if self.world_size == 1:  # nothing to communicate: the local copies are FSDP's compute
            return
        try:
            from torch.distributed.fsdp import FSDPModule

            states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
            groups = [g for st in states for g in st._fsdp_param_groups]
            for g in groups:
                g.unshard, g.wait_for_unshard, g.post_backward  # noqa: B018 - fail here, not mid-step
        except AttributeError as exc:  # private API: another torch may differ; then say so
            print(f"[fsdp] exposed communication is not measured (comm 0): FSDP2 internals differ here ({exc})")
            return
        depth = [0]

        def timed(fn: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                depth[0] += 1
                if depth[0] == 1:
                    meter.mark(COMPUTE)
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        meter.mark(COMM)
            return run

        for g in groups:
            g.unshard, g.wait_for_unshard, g.post_backward = (timed(g.unshard), timed(g.wait_for_unshard),
                                                              timed(g.post_backward))
        for st in states:
            st._root_post_backward_final_callback = timed(st._root_post_backward_final_callback)
        if noise is not None:
            _feed_unsharded_grads(groups, noise)

    def consolidated_state_dict(self, model: nn.Module) -> Optional[dict]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.rank == 0 else None


def _feed_unsharded_grads(groups: List[Any], noise: Any) -> None:
    """Each FSDP param group's post_backward, where it reduces: first the squared norm of this
    rank's unsharded gradients (the micro-steps' accumulated ones added in first, as post_backward
    itself does) into `noise`. Private API: where it differs, nothing is fed (noise.fed stays False)."""
    try:
        for g in groups:
            for fp in g.fsdp_params:
                fp.accumulate_unsharded_grad_if_needed, fp.unsharded_accumulated_grad  # noqa: B018
            g.reduce_grads  # noqa: B018
    except AttributeError:
        return

    def feeding(g: Any, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if g.reduce_grads and noise.active:
                local = []
                for fp in g.fsdp_params:
                    if not hasattr(fp, "_unsharded_param"):
                        continue
                    fp.accumulate_unsharded_grad_if_needed()  # idempotent: post_backward calls it again
                    acc = fp.unsharded_accumulated_grad
                    local.append(acc if acc is not None else fp.unsharded_param.grad)
                noise.add_small(norms(local))
            return fn(*args, **kwargs)
        return run

    for g in groups:
        g.post_backward = feeding(g, g.post_backward)
    noise.fed = True


class HorovodAdapter(Adapter):
    """Horovod: started by horovodrun; allreduce through `hvd.DistributedOptimizer`."""

    name = "horovod"
    exposed_comm = True

    def setup(self) -> None:
        try:
            import horovod.torch as hvd
        except ImportError as exc:
            raise RuntimeError(
                f"backend=horovod: horovod is not importable ({exc}); install it with scripts/install_horovod.sh"
            ) from None
        self.hvd = hvd
        hvd.init()
        self.rank, self.local_rank, self.world_size = hvd.rank(), hvd.local_rank(), hvd.size()
        check_world(self.cfg, self.world_size)
        self.device = pick_device(self.cfg, self.local_rank)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        compression = hvd.Compression.fp16 if self.cfg.backend.fp16_compression else hvd.Compression.none
        self.optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=self.cfg.trainer.accumulation_steps,
        )
        return self.optimizer

    def install_comm_hook(self, model: nn.Module, meter: Any, noise: Any = None) -> None:
        """Each gradient's squared norm as its (in-place) allreduce starts: this rank's own; the
        averaged one is the step's (runtime/noise.NoiseProbe.end_step after synchronize)."""
        launch = getattr(self, "optimizer", None) and getattr(self.optimizer, "_allreduce_grad_async", None)
        if noise is None or launch is None or self.world_size == 1:
            return

        def measured(p: torch.Tensor) -> Any:
            if noise.active:
                noise.add_small(_norm(p.grad))
            return launch(p)

        self.optimizer._allreduce_grad_async = measured  # type: ignore[union-attr]
        noise.fed = True

    def sampler(self, dataset: Dataset, shuffle: bool, seed: int, drop_last: bool) -> Optional[Sampler]:
        return DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                  seed=seed, drop_last=drop_last)

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.synchronize()  # type: ignore[attr-defined]

    def step(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            super().step(optimizer, scaler)

    def all_gather_object(self, obj: Any) -> list:
        return self.hvd.allgather_object(obj)

    def all_reduce_sum(self, values: list) -> list:
        return self.hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=self.hvd.Sum).tolist()

    def shutdown(self) -> None:
        try:
            self.hvd.shutdown()
        except Exception:
            pass


ADAPTERS = {
    BackendName.single: Adapter,
    BackendName.dp: DataParallelAdapter,
    BackendName.ddp: DDPAdapter,
    BackendName.fsdp: FSDPAdapter,
    BackendName.horovod: HorovodAdapter,
}


def make_adapter(cfg: Config) -> Adapter:
    return ADAPTERS[cfg.backend.name](cfg)
