"""The data side of a rank: the dataset (and its simulated storage latency), the loader over the
adapter's sampler, an epoch started part-way (resume, loader switches) and the epoch arithmetic
the measurement reads. The loop (runtime/loop.py) only iterates what this builds."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import multiprocessing
import random
import threading
import time
from typing import Any, Callable, Dict, Optional, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from ..schema import Balance, Config, ConfigError, DataConfig, import_target
from .autotune import LoaderSettings
from .balance import ShareSampler
from .dist import Adapter


class LatencyDataset(Dataset):
    """Adds a per-item read latency, as remote storage would (`sim.read_latency_ms`). `set_latency`
    changes it in the loader's workers too (shared memory they inherit): `sim.latency_jump_at`."""

    def __init__(self, inner: Dataset, latency_ms: float) -> None:
        self.inner = inner
        self._delay = multiprocessing.RawValue("d", latency_ms / 1000.0)

    def set_latency(self, latency_ms: float) -> None:
        self._delay.value = latency_ms / 1000.0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, idx: int):
        delay = self._delay.value
        if delay:
            time.sleep(delay)
        return self.inner[idx]


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def build_dataset(cfg: Config) -> Dataset:
    ds = import_target(cfg.data._target_)(**cfg.data.args)
    size = len(ds) if hasattr(ds, "__len__") else None  # type: ignore[arg-type]
    if size == 0:  # else torch's "num_samples should be a positive integer"
        raise ConfigError(f"data._target_: {cfg.data._target_} returned a dataset of 0 items (data.args: "
                          f"{dict(cfg.data.args)}); it needs at least data.batch_size={cfg.data.batch_size} per rank")
    if cfg.sim.read_latency_ms > 0 or cfg.sim.latency_jump_at > 0:
        ds = LatencyDataset(ds, cfg.sim.read_latency_ms)
    return ds


class EpochSampler(Sampler):
    """The loader's sampler (the adapter's, or a seeded shuffle in one process), able to start an
    epoch part-way: with `skip` set, the next epoch's first `skip` indices are drawn (its order
    stays the same) but not handed to the loader, so batches already trained are never loaded.
    Resume and the loader autotune restart an epoch this way (`epoch_iterator`). The shuffle's own
    generator, apart from the DataLoader's (workers' base seeds), makes the order independent of
    num_workers and persistent_workers."""

    def __init__(self, inner: Sampler) -> None:
        self.inner, self.skip = inner, 0

    @property
    def generator(self) -> Optional[torch.Generator]:
        """The shuffle's generator, whose state at an epoch's start fixes its order (None: the
        order depends on the epoch alone, as DistributedSampler's)."""
        return getattr(self.inner, "generator", None) if isinstance(self.inner, RandomSampler) else None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __iter__(self):
        it, skip = iter(self.inner), self.skip
        self.skip = 0
        for _ in itertools.islice(it, skip):
            pass
        return it


def build_loader(cfg: Config, dataset: Dataset, adapter: Adapter) -> DataLoader:
    """The rank's loader: the adapter's sampler (an even split), or with parallelism.balance=speed
    its piece of every global micro-batch (`ShareSampler`, runtime/balance.py)."""
    d = cfg.data
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    if cfg.parallelism.balance is Balance.speed:
        return make_loader(d, dataset, ShareSampler(len(dataset), adapter.rank, adapter.world_size,  # type: ignore[arg-type]
                                                    d.batch_size, d.shuffle, cfg.trainer.seed, d.drop_last),
                           generator, adapter.device)
    sampler = adapter.sampler(dataset, d.shuffle, cfg.trainer.seed, d.drop_last)
    if sampler is None:  # one process: shuffled by its own seeded generator
        sampler = (RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.trainer.seed)) if d.shuffle
                   else SequentialSampler(dataset))
    return make_loader(d, dataset, EpochSampler(sampler), generator, adapter.device)


def make_loader(d: DataConfig, dataset: Dataset, sampler: Union[EpochSampler, ShareSampler], generator: torch.Generator,
                device: torch.device) -> DataLoader:
    """A DataLoader with `d`'s knobs over `sampler` (built once per run, kept across rebuilds): an
    EpochSampler of indices, or balance=speed's ShareSampler of whole micro-batches."""
    kwargs: Dict[str, Any] = {}
    if isinstance(sampler, ShareSampler):
        kwargs["batch_sampler"] = sampler
    else:
        kwargs.update(batch_size=d.batch_size, sampler=sampler, drop_last=d.drop_last)
    if d.num_workers > 0:
        kwargs["persistent_workers"] = d.persistent_workers
        if d.prefetch_factor is not None:
            kwargs["prefetch_factor"] = d.prefetch_factor
    return DataLoader(
        dataset,
        collate_fn=collate_fn(d),
        num_workers=d.num_workers,
        pin_memory=d.pin_memory and device.type == "cuda",
        worker_init_fn=_seed_worker if d.num_workers > 0 else None,
        generator=generator,
        **kwargs,
    )


def collate_fn(d: DataConfig) -> Optional[Callable[[list], Any]]:
    """data.collate_fn as the loaders call it, `fn(items, **args)`; None: torch's default collate."""
    if d.collate_fn is None:
        return None
    return functools.partial(import_target(d.collate_fn["_target_"]), **(d.collate_fn.get("args") or {}))


def epoch_iterator(loader: DataLoader, batches_done: int) -> Any:
    """An iterator over the epoch the sampler is set to, from its `batches_done`-th batch: the
    same batches in the same order as an uninterrupted epoch, those before not loaded (with
    balance=speed's ShareSampler, loaded and dropped: its shares schedule counts what was drawn)."""
    if isinstance(loader.batch_sampler, ShareSampler):
        it = iter(loader)
        for _ in range(batches_done):
            next(it)
        return it
    loader.sampler.skip = batches_done * (loader.batch_size or 1)  # type: ignore[union-attr]
    return iter(loader)


def reset_latency(cfg: Config, dataset: Dataset, step: int) -> None:
    """The per-item latency a run starting at `step` reads with (sim.latency_jump_at passed or
    not); a kept-alive rank's dataset may carry an earlier job's jump."""
    if isinstance(dataset, LatencyDataset):
        jumped = 0 < cfg.sim.latency_jump_at <= step
        dataset.set_latency(cfg.sim.latency_after_ms if jumped else cfg.sim.read_latency_ms)


def item_bytes(dataset: Dataset) -> int:
    """Bytes of one item's tensors, in any structure (what a DataLoader worker hands over per sample)."""
    try:
        item = dataset[0]
    except Exception:  # an iterable-style or failing dataset: unknown
        return 0

    def size(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.element_size() * x.nelement()
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        if isinstance(x, (tuple, list)):
            return sum(size(v) for v in x)
        return 8

    return size(item if isinstance(item, (tuple, list, dict)) else (item,))


def steps_per_epoch(loader: DataLoader, accumulation: int) -> int:
    """Optimizer steps in one epoch: every N micro-batches and once more for a remainder."""
    return math.ceil(len(loader) / accumulation)


# -- loader autotune (runtime/autotune.py decides; these apply its settings to the loop) ----------
def loader_config(cfg: Config, ck: Optional[Dict[str, Any]]) -> Config:
    """`cfg`, or with trainer.loader_autotune, `cfg` with the loader settings its checkpoint kept."""
    saved = (ck or {}).get("meta", {}).get("loader")
    if not cfg.trainer.loader_autotune or not saved:
        return cfg
    settings = LoaderSettings(int(saved["num_workers"]), saved.get("prefetch_factor"))
    return dataclasses.replace(cfg, data=settings.data(cfg.data))


def end_workers(it: Any) -> None:
    """End the workers of a loader iterator that was stopped part-way through its epoch (the stop
    rule, max_steps, a failure): their batches in flight would be thrown away, and torch's own
    teardown lets each worker finish the batch it is loading before it joins them: a batch's full
    loading time (0.35 s for 64 items of 5 ms) added to every stopped run, a tuning trial included.
    The workers are terminated, as that teardown does to workers that outlast its timeout, in its
    order: the pin-memory thread first, the worker pids out of torch's SIGCHLD watch before the
    signal. An exhausted iterator, one without workers, or a torch whose iterator lacks these
    attributes gets torch's teardown as it is."""
    shutdown = getattr(it, "_shutdown_workers", None)
    workers = getattr(it, "_workers", None)
    if shutdown is None or not workers or getattr(it, "_shutdown", True) or not hasattr(it, "_worker_pids_set"):
        if shutdown is not None:
            shutdown()
        return
    from torch.utils.data import _utils

    if hasattr(it, "_pin_memory_thread"):
        it._pin_memory_thread_done_event.set()
        it._worker_result_queue.put((None, None))  # wakes it; shutdown() sends another, harmlessly
        it._pin_memory_thread.join()
    if it._worker_pids_set:
        _utils.signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False
    for w in workers:
        if w.is_alive():
            w.terminate()
    for w in workers:
        w.join(timeout=_utils.MP_STATUS_CHECK_INTERVAL)
    # a worker reads that event under a lock shared between processes; one terminated inside it left
    # it held, and the teardown's own set() then waited forever (a tuning trial's rank hung there in
    # the test suite): the teardown sets an event of this process's own, nobody is left to read it
    it._workers_done_event = threading.Event()
    shutdown()


def switch_loader(cfg: Config, new: LoaderSettings, loader: DataLoader, it: Any, generator: Optional[torch.Generator],
                  epoch_generator: Optional[torch.Tensor], batches_done: int, device: torch.device) -> tuple:
    """(cfg, loader, iterator) with `new` loader settings, the iterator at the same batch of the
    same epoch: the old workers end, the sampler's order is restored to the epoch's start and the
    batches already trained are skipped unloaded (`epoch_iterator`, as a resume does)."""
    end_workers(it)
    cfg = dataclasses.replace(cfg, data=new.data(cfg.data))
    if generator is not None and epoch_generator is not None:
        generator.set_state(epoch_generator)
    loader = make_loader(cfg.data, loader.dataset, loader.sampler, loader.generator, device)  # type: ignore[arg-type]
    return cfg, loader, epoch_iterator(loader, batches_done)
