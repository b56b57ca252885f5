"""Models shipped with the orchestrator. Any importable callable returning an `nn.Module` works
as `model._target_`; its keyword arguments go in `model.args`."""

from __future__ import annotations

import math

import torch
from torch import nn


class Linear(nn.Module):
    """A linear layer: the default job's classifier (1000 -> 10, cross-entropy) and the regression (10 -> 10, MSE)."""

    def __init__(self, in_features: int = 1000, out_features: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MLP(nn.Module):
    """A small MLP classifier over `DummyDataset` (10 features, 2 classes)."""

    def __init__(self, in_features: int = 10, hidden: int = 64, out_features: int = 2, layers: int = 2) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * (layers - 1)
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        blocks.append(nn.Linear(dims[-1], out_features))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ManySmallLayers(nn.Module):
    """Many parameter tensors and almost no compute: a communication-heavy workload. (Very narrow
    layers would make it bound by per-operator overhead on CPU instead, not by the all-reduce.)"""

    def __init__(self, in_features: int = 16, width: int = 128, depth: int = 16, out_features: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.out(x)


class SmallConvNet(nn.Module):
    """Classifier for `SyntheticImages`: cheap on purpose, so the input pipeline dominates."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class TinyTransformerLM(nn.Module):
    """A small causal transformer language model: compute-bound, returns (B, T, vocab) logits."""

    def __init__(self, vocab: int = 256, d_model: int = 128, n_heads: int = 4, n_layers: int = 2,
                 seq_len: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        mask = torch.triu(torch.full((seq_len, seq_len), -math.inf), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:, :t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        # nn.Linear on a (B, T, D) input computes a 2-D matmul and returns a view of it: FSDP2 hooks
        # the module's output for its backward all-gather, and an in-place op on a view drops that
        # hook (torch warns "returned a view tensor"). The logits are returned as their own tensor.
        return self.head(self.norm(h)).clone()
