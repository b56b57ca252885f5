"""The loop itself, in-process: every shipped task trains, loss falls on the learnable ones, and
gradient accumulation is the same math as one large batch."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.loop import build_dataset, build_loader, build_model, loss_fn, seed_everything, train


def held_out_loss(cfg, model) -> float:
    ds = build_dataset(cfg)
    xs, ys = zip(*(ds[i] for i in range(min(256, len(ds)))))
    x = torch.stack(xs)
    y = torch.stack(ys) if isinstance(ys[0], torch.Tensor) else torch.tensor(ys)
    with torch.no_grad():
        return float(loss_fn(cfg.model.loss)(model(x), y))


def run(cfg):
    adapter = Adapter(cfg)
    adapter.setup()
    return train(cfg, adapter)


# (preset, extra overrides, steps, learnable)
TASKS = [
    ("linear_classifier", ["trainer.lr=0.1"], 60, True),
    ("mlp_accumulation", [], 8, False),
    ("linear_regression", [], 60, True),
    ("input_bound", ["sim.read_latency_ms=0", "data.args.size=512", "data.batch_size=16", "trainer.lr=0.05",
                     "trainer.momentum=0.9"], 60, True),
    ("transformer_lm", ["data.args.size=512"], 40, True),
    ("comm_heavy", ["trainer.lr=0.05", "data.batch_size=32"], 60, True),
]


@pytest.mark.parametrize("preset, extra, steps, learnable", TASKS, ids=[t[0] for t in TASKS])
def test_every_shipped_task_trains(make_cfg, preset, extra, steps, learnable):
    cfg = make_cfg(f"experiment={preset}", f"trainer.max_steps={steps}", "trainer.epochs=50", *extra)
    seed_everything(cfg.trainer.seed)
    before = held_out_loss(cfg, build_model(cfg))
    res = run(cfg)
    assert res.steps == steps
    assert res.meter["measured_steps"] > 0
    after = held_out_loss(cfg, res.model)
    assert math.isfinite(after), after
    if learnable:
        assert after < 0.8 * before, (before, after)


def test_same_seed_same_result(make_cfg):
    a = run(make_cfg("trainer.max_steps=10"))
    b = run(make_cfg("trainer.max_steps=10"))
    c = run(make_cfg("trainer.max_steps=10", "trainer.seed=1"))
    assert a.param_digest == b.param_digest
    assert a.param_digest != c.param_digest


def test_a_run_turns_deterministic_algorithms_on_or_off_as_it_asks(make_cfg):
    """trainer.deterministic is the run's: a run after a deterministic one in the same process (a
    kept-alive rank's next trial) does not inherit it."""
    try:
        run(make_cfg("trainer.max_steps=2", "trainer.deterministic=true"))
        assert torch.are_deterministic_algorithms_enabled()
        run(make_cfg("trainer.max_steps=2"))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def _grads_after_one_step(cfg) -> dict:
    """Train one optimizer step with SGD lr=1 and return -delta params (= the averaged gradient)."""
    seed_everything(cfg.trainer.seed)
    model = build_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = train(cfg, _setup(cfg), model=model)
    assert res.steps == 1
    return {k: before[k] - v for k, v in res.model.state_dict().items()}


def _setup(cfg):
    a = Adapter(cfg)
    a.setup()
    return a


@pytest.mark.parametrize("n, b", [(4, 8), (3, 5)])
def test_accumulation_equals_one_large_batch(make_cfg, n, b):
    common = ["data.shuffle=false", "trainer.lr=1.0", "trainer.max_steps=1", "measure.warmup_steps=0"]
    small = _grads_after_one_step(make_cfg(*common, f"data.batch_size={b}", f"trainer.accumulation_steps={n}"))
    large = _grads_after_one_step(make_cfg(*common, f"data.batch_size={n * b}", "trainer.accumulation_steps=1"))
    for k in large:
        assert torch.allclose(small[k], large[k], rtol=1e-4, atol=1e-6), k
        assert large[k].abs().sum() > 0


def test_accumulation_steps_at_epoch_end(make_cfg):
    # 10 batches, accumulation 4: steps after 4, 8 and the remaining 2 (the epoch's end)
    cfg = make_cfg("data.args.size=320", "data.batch_size=32", "trainer.accumulation_steps=4", "trainer.epochs=2")
    res = run(cfg)
    assert res.steps == 2 * 3


def test_amp_bf16_on_cpu_trains(make_cfg):
    res = run(make_cfg("trainer.amp=true", "trainer.max_steps=5"))
    assert res.steps == 5 and math.isfinite(res.final_loss)


def test_loader_knobs_apply(make_cfg):
    cfg = make_cfg("data.num_workers=2", "data.prefetch_factor=3", "data.persistent_workers=true",
                   "data.pin_memory=true", "trainer.max_steps=6")
    adapter = Adapter(cfg)
    adapter.setup()
    loader = build_loader(cfg, build_dataset(cfg), adapter)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert loader.pin_memory is False  # pinning only applies to CUDA copies; this is a CPU run
    assert loader.batch_size == cfg.data.batch_size and loader.drop_last
    assert train(cfg, adapter).steps == 6


class _MarksAfterSleep(torch.utils.data.Dataset):
    """Items past the first batch take 1.5 s and then leave a file: a worker that is let finish
    its batch leaves one."""

    def __init__(self, marks) -> None:
        self.marks = marks

    def __len__(self) -> int:
        return 64

    def __getitem__(self, idx: int):
        if idx >= 4:
            import time

            time.sleep(1.5)
            (self.marks / f"{idx}").touch()
        return torch.zeros(2)


def _hold(lock, held):
    lock.acquire()
    held.set()
    import time

    time.sleep(60)


def test_ending_workers_does_not_wait_on_a_lock_a_terminated_worker_held(tmp_path):
    """A worker reads the iterator's done event under a lock shared between processes; terminated
    inside it, it leaves the lock held. Here a forked process holds it when it is killed: ending the
    workers still returns (torch's teardown sets that event, and waited for the lock forever)."""
    import multiprocessing as mp
    import threading

    from torch.utils.data import DataLoader, SequentialSampler

    from orchestrator.runtime.data import end_workers

    loader = DataLoader(_MarksAfterSleep(tmp_path), batch_size=4, num_workers=2, sampler=SequentialSampler(range(64)))
    it = iter(loader)
    assert next(it).shape == (4, 2)
    ctx = mp.get_context("fork")
    held = ctx.Event()
    holder = ctx.Process(target=_hold, args=(it._workers_done_event._cond, held))
    holder.start()
    assert held.wait(10)
    holder.kill()
    holder.join()
    ended = threading.Thread(target=end_workers, args=(it,), daemon=True)
    ended.start()
    ended.join(20)
    assert not ended.is_alive()  # the old teardown was still waiting here
    assert not any(w.is_alive() for w in it._workers)


def test_a_loader_stopped_mid_epoch_does_not_wait_for_its_workers_batches(tmp_path):
    """A stopped run (the stop rule, max_steps) ends its workers at once: torch's own teardown would
    let each finish the batch it is loading, which nobody reads."""
    from torch.utils.data import DataLoader, SequentialSampler

    from orchestrator.runtime.data import end_workers

    loader = DataLoader(_MarksAfterSleep(tmp_path), batch_size=4, num_workers=2, sampler=SequentialSampler(range(64)))
    it = iter(loader)
    assert next(it).shape == (4, 2)  # worker 0's batch; both workers are now inside a slow one
    end_workers(it)
    assert not any(w.is_alive() for w in it._workers)
    import time

    time.sleep(2.0)  # past the slow items: a worker still loading would have left its files by now
    assert not list(tmp_path.iterdir())
