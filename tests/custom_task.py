"""A user's own model and dataset, as a package outside `tasks/` would define them: plain
signatures, no **kwargs, so a leftover default argument would be refused."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_dataset(items: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(items, 16, generator=g), torch.randint(0, 4, (items,), generator=g))


class Elementwise(nn.Module):
    """No matmul, no convolution: nothing the FLOP counter has a formula for."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale)[:, :4]


class RecordingLinear(nn.Linear):
    """nn.Linear that appends the first feature of every sample it trains on (which names the
    sample: the features are random) to `record_dir`/rank<R>.txt: the order a rank trained in."""

    def __init__(self, in_features: int, out_features: int, record_dir: str) -> None:
        super().__init__(in_features, out_features)
        import os

        self.path = os.path.join(record_dir, f"rank{os.environ.get('RANK', '0')}.txt")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.path, "a") as f:
            f.write("".join(f"{v!r}\n" for v in x[:, 0].tolist()))
        return super().forward(x)


def not_a_module(width: int = 8) -> int:
    """A model factory that forgot to return its module."""
    return width


def with_kwargs(width: int, **rest: int) -> nn.Module:
    """A factory taking any keyword besides its one required argument."""
    return nn.Linear(16, width)


def cut_collate(items: list, pad_id: int = 0, keep: int = 64) -> dict:
    """tasks.sequences.pad_collate over each sequence's first `keep` tokens: a truncation length,
    the knob that changes the real tokens a sample holds (where tokens/s and samples/s part)."""
    from tasks.sequences import pad_collate

    return pad_collate([{"input_ids": it["input_ids"][:keep]} for it in items], pad_id)


def slow_accuracy(output: torch.Tensor, batch: tuple, sleep_s: float = 0.02) -> torch.Tensor:
    """A validation metric that takes `sleep_s` a batch: an evaluation long enough to see where its time goes."""
    import time

    time.sleep(sleep_s)
    return (output.argmax(dim=-1) == batch[1]).float().mean()


def needs_real_tensors(width: int = 8) -> nn.Module:
    """A factory that reads a tensor's value as it builds: it cannot build on the meta device."""
    scale = torch.ones(1).mul(width).item()
    return nn.Linear(16, int(scale))
