"""MFU: FLOPs per sample against closed forms, the peak table, the CPU peak cache, and mfu on
the shipped workloads (runtime/flops.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tasks.models as models
from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.flops import StepCounter, table_peak
from orchestrator.runtime.loop import loss_fn, train
from orchestrator.schema import Loss

from .custom_task import Elementwise


def counted(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with StepCounter() as counter:
        loss_fn(Loss.cross_entropy)(model(x), y).backward()
    return counter.per_sample(x.shape[0])["flops"]


def _linear(i: int, o: int, first: bool = False) -> int:
    """Forward 2io; backward 2io for the weight gradient plus 2io for the input's (not for the
    first layer, whose input needs none)."""
    return 2 * i * o * (2 if first else 3)


def test_flops_match_closed_forms():
    b = 4
    assert counted(models.Linear(1000, 10), torch.randn(b, 1000), torch.randint(0, 10, (b,))) == _linear(1000, 10, True)
    mlp = counted(models.MLP(10, 64, 2, 2), torch.randn(b, 10), torch.randint(0, 2, (b,)))
    assert mlp == _linear(10, 64, True) + _linear(64, 2)
    # convnet on 3x32x32: conv1 (no input gradient), conv2 at 16x16 after pooling, the head
    conv1, conv2 = 2 * 3 * 9 * 16 * 32 * 32, 2 * 16 * 9 * 32 * 16 * 16
    conv = counted(models.SmallConvNet(), torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,)))
    assert conv == pytest.approx(2 * conv1 + 3 * conv2 + _linear(32, 10), rel=0.01)
    # transformer, per token: each layer's projections (qkv, out, 4x FFN) 24 d^2 forward and twice
    # that backward (the embedding makes every input need gradients); attention 4 T d forward and
    # 10 T d backward (the flash kernel recomputes the scores: PyTorch's own formula); the head 2 d V x 3
    d, t, layers, vocab = 128, 64, 2, 256
    tokens = torch.randint(0, vocab, (b, t))
    lm = counted(models.TinyTransformerLM(vocab, d, 4, layers, t), tokens, tokens)
    assert lm == pytest.approx(t * (layers * (3 * 24 * d * d + 14 * t * d) + 3 * 2 * d * vocab), rel=0.01)


def test_a_model_without_counted_operators_says_so():
    with StepCounter() as counter:
        Elementwise()(torch.randn(4, 16)).sum().backward()
    got = counter.per_sample(4)
    assert got["flops"] is None and got["reason"].startswith("not counted: no operator with a FLOP formula")


def test_peak_table():
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16")["flops"] == 989.4e12
    assert table_peak("NVIDIA H100 PCIe", "bf16")["flops"] == 756e12
    assert table_peak("NVIDIA H200", "fp32")["flops"] == 67e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "tf32")["flops"] == 156e12
    assert table_peak("Tesla V100-SXM2-16GB", "bf16")["flops"] is None  # V100 has no bf16
    unknown = table_peak("Imaginary GPU 9000", "bf16")
    assert unknown["flops"] is None and "measure.peak_tflops" in unknown["source"]


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    from orchestrator import costs

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(costs, "measure_matmul_flops", lambda dtype: calls.append(dtype) or 5e10)
    assert costs.cpu_peak_flops("fp32", 2)["flops"] == 5e10
    assert costs.cpu_peak_flops("fp32", 2)["flops"] == 5e10 and calls == [torch.float32]
    costs.cpu_peak_flops("fp32", 1)  # another thread count is another measurement
    assert len(calls) == 2
    assert costs.cpu_peak_flops("tf32", 2)["flops"] is None  # no such thing on a CPU


@pytest.mark.parametrize("preset", ["linear_classifier", "transformer_lm", "input_bound"])
def test_mfu_on_shipped_workloads(make_cfg, preset):
    cfg = make_cfg(f"experiment={preset}", "trainer.max_steps=8", "sim.read_latency_ms=0")
    adapter = Adapter(cfg)
    adapter.setup()
    res = train(cfg, adapter).meter
    assert 0 < res["mfu"] <= 1, res["mfu_source"]
    assert res["flops_per_sample"] > 0 and res["mfu_dtype"] == "fp32"
    assert "FlopCounterMode" in res["mfu_source"] and "TFLOP/s" in res["mfu_source"]


def test_no_warmup_step_no_count(make_cfg):
    cfg = make_cfg("trainer.max_steps=4", "measure.warmup_steps=0")
    adapter = Adapter(cfg)
    adapter.setup()
    res = train(cfg, adapter).meter
    assert res["mfu"] is None and "measure.warmup_steps=0" in res["mfu_source"]
