"""Datasets and models of the zoo (bench/bench_zoo.py), written the way a user writes their own:
outside `tasks/`, loaded by `_target_` (docs/running.md, "Your own model and data"), e.g. from the
repository root

    .venv/bin/python -m orchestrator model=custom model._target_=bench.zoo.tasks.MLP \\
        +model.args.in_features=128 data=custom data._target_=bench.zoo.tasks.StoredFeatures +data.args.latency_ms=1

Every dataset is map-style, returns `(input, target)` tensors, and is generated deterministically
from its `seed` (each rank builds its own copy); every model is a plain `nn.Module`.
"""

from __future__ import annotations

import time
from typing import Tuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


def _teacher(x: torch.Tensor, classes: int, g: torch.Generator) -> torch.Tensor:
    """Labels from a fixed random linear map of the (flattened) inputs: a learnable task."""
    w = torch.randn(x[0].numel(), classes, generator=g)
    return (x.flatten(1).float() @ w).argmax(dim=1)


# -- datasets ---------------------------------------------------------------------------------
class _InMemory(Dataset):
    """Items `(x[i], y[i])` of two tensors built by the subclass."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


class StoredFeatures(_InMemory):
    """Precomputed feature vectors behind a storage read: every item waits `latency_ms`
    (time.sleep: a disk or object-store round trip, which costs no CPU) before it is returned."""

    def __init__(self, size: int = 4096, features: int = 128, classes: int = 10, latency_ms: float = 1.0,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.y = _teacher(self.x, classes, g)
        self.delay_s = latency_ms / 1000.0

    def __getitem__(self, idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().__getitem__(idx)


def _gaussian(kernel: int, sigma: float) -> np.ndarray:
    x = np.arange(kernel) - (kernel - 1) / 2
    w = np.exp(-x ** 2 / (2 * sigma ** 2))
    return (w / w.sum()).astype(np.float32)


class AugmentedImages(Dataset):
    """Small images "decoded" per item (a per-class template plus noise, from the item's own seed)
    and augmented on the CPU in numpy, as PIL/OpenCV pipelines do (one thread per item): random
    crop, horizontal flip, `blur_passes` separable Gaussian blurs (kernel 7, reflect padded),
    per-channel normalisation. With `latency_ms`, each item is read from storage first. About
    0.35 ms + 0.13 ms per blur pass of CPU at 64x64."""

    def __init__(self, size: int = 2048, image_size: int = 32, channels: int = 3, classes: int = 10,
                 blur_passes: int = 2, latency_ms: float = 0.0, seed: int = 0) -> None:
        self.size, self.image_size, self.classes, self.seed = size, image_size, classes, seed
        self.blur_passes, self.delay_s, self.pad = blur_passes, latency_ms / 1000.0, image_size // 8
        side = image_size + 2 * self.pad
        self.templates = np.random.default_rng(seed).standard_normal((classes, channels, side, side), dtype=np.float32)
        self.kernel = _gaussian(7, 1.5)

    def __len__(self) -> int:
        return self.size

    def _blur(self, img: np.ndarray) -> np.ndarray:
        n, k = self.image_size, len(self.kernel)
        rows = np.pad(img, ((0, 0), (k // 2, k // 2), (0, 0)), mode="reflect")
        img = sum(w * rows[:, i: i + n, :] for i, w in enumerate(self.kernel))
        cols = np.pad(img, ((0, 0), (0, 0), (k // 2, k // 2)), mode="reflect")
        return sum(w * cols[:, :, i: i + n] for i, w in enumerate(self.kernel))

    def __getitem__(self, idx: int) -> Tuple[torch.Tensor, int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        rng = np.random.default_rng(self.seed * 1_000_003 + idx)
        label = int(rng.integers(self.classes))
        img = self.templates[label] + 0.5 * rng.standard_normal(self.templates.shape[1:], dtype=np.float32)
        ox, oy = rng.integers(0, 2 * self.pad + 1, 2)
        img = img[:, oy: oy + self.image_size, ox: ox + self.image_size]
        if rng.random() < 0.5:
            img = img[:, :, ::-1]
        for _ in range(self.blur_passes):
            img = self._blur(img)
        img = (img - img.mean((1, 2), keepdims=True)) / (img.std((1, 2), keepdims=True) + 1e-6)
        return torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)), label


class TokenBags(_InMemory):
    """Bags of `length` token ids out of `vocab` (a text classifier's input), in memory; the label
    is the bag's most frequent token group (ids mod `classes`)."""

    def __init__(self, size: int = 4096, length: int = 16, vocab: int = 40_000, classes: int = 10,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (size, length), generator=g)
        self.y = (self.x % classes).mode(dim=1).values


class Sequences(_InMemory):
    """Token sequences in memory (nearly free to load), labelled by a teacher over their one-hot
    counts: a sequence classifier's data."""

    def __init__(self, size: int = 2048, seq_len: int = 64, vocab: int = 512, classes: int = 10,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (size, seq_len), generator=g)
        counts = torch.zeros(size, vocab).scatter_add_(1, self.x, torch.ones(size, seq_len))
        self.y = _teacher(counts, classes, g)


# -- models -----------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, in_features: int = 128, hidden: int = 256, classes: int = 10, layers: int = 3) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * (layers - 1)
        blocks = [m for a, b in zip(dims[:-1], dims[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        self.net = nn.Sequential(*blocks, nn.Linear(dims[-1], classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """A small image classifier: `depth` stride-2 3x3 convolutions (width doubling), global
    average pooling, a linear head."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        layers = []
        for i in range(depth):
            out = width * 2 ** i
            layers += [nn.Conv2d(channels, out, 3, stride=2, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            channels = out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class BagOfEmbeddings(nn.Module):
    """A text classifier: a large embedding table (vocab x dim parameters, dense gradients), the
    bag's mean, a small head. Many parameters, little compute: under DDP the all-reduce of the
    table's gradient dominates."""

    def __init__(self, vocab: int = 40_000, dim: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


class SequenceClassifier(nn.Module):
    """A small transformer encoder over token sequences, mean-pooled into a linear head:
    compute-bound on CPU."""

    def __init__(self, vocab: int = 512, d_model: int = 128, heads: int = 4, layers: int = 2, seq_len: int = 64,
                 classes: int = 10) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.blocks(h).mean(dim=1))


class WideGatedMLP(nn.Module):
    """One wide hidden layer refined by `depth` gated residual steps (h + tanh(h * gate_i)):
    little arithmetic per sample but `depth` x 2 saved activations of batch x hidden floats each,
    so its memory grows fast with the batch size."""

    def __init__(self, in_features: int = 128, hidden: int = 16_384, classes: int = 10, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.gates = nn.ParameterList(nn.Parameter(torch.ones(hidden)) for _ in range(depth))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for gate in self.gates:
            h = h + torch.tanh(h * gate)
        return self.head(h)
