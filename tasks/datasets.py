"""Datasets shipped with the orchestrator, all generated locally (nothing downloads).

A dataset factory is any importable callable named by `data._target_`; it is called with the
keyword arguments in `data.args` and returns a map-style `torch.utils.data.Dataset` whose items
are `(input, target)` tensors. It runs once per rank, so it must be deterministic given its
arguments (pass `seed: ${trainer.seed}` in `data.args` to tie it to the run's seed). The loader
knobs (`data.batch_size`, `data.num_workers`, ...) and a simulated read latency (`sim.read_latency_ms`)
are applied by the orchestrator around whatever the factory returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset


class _TensorPairs(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int):
        return self.x[idx], self.y[idx]


def random_classification(size: int = 4096, features: int = 1000, classes: int = 10, teacher: bool = True,
                          seed: int = 0) -> Dataset:
    """The default job's data (1000 features, 10 classes). With `teacher`, labels come from a fixed random
    linear map so the task is learnable; without, labels are noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, features, generator=g)
    if teacher:
        w = torch.randn(features, classes, generator=g)
        y = (x @ w).argmax(dim=1)
    else:
        y = torch.randint(0, classes, (size,), generator=g)
    return _TensorPairs(x, y)


class DummyDataset(_TensorPairs):
    """`DummyDataset`: 10 random features, 2 random classes (not learnable)."""

    def __init__(self, size: int = 1000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        super().__init__(torch.randn(size, 10, generator=g), torch.randint(0, 2, (size,), generator=g))


def random_regression(size: int = 1024, features: int = 10, targets: int = 10, teacher: bool = True,
                      noise: float = 0.01, seed: int = 0) -> Dataset:
    """A regression (10 -> 10, MSE). With `teacher`, targets are a fixed linear map of the
    inputs plus noise (learnable); without, targets are noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, features, generator=g)
    if teacher:
        w = torch.randn(features, targets, generator=g) / features**0.5
        y = x @ w + noise * torch.randn(size, targets, generator=g)
    else:
        y = torch.randn(size, targets, generator=g)
    return _TensorPairs(x, y)


class SyntheticImages(Dataset):
    """Input-bound image workload: each item is generated from its index and then put through a
    CPU-expensive per-sample transform (random crop, flip, `blur_passes` 5x5 blurs), as real
    decoding/augmentation pipelines are. Each class has its own colour/frequency template, so
    the task is learnable."""

    def __init__(self, size: int = 2048, image_size: int = 32, channels: int = 3, classes: int = 10,
                 blur_passes: int = 4, seed: int = 0) -> None:
        self.size, self.image_size, self.channels, self.classes = size, image_size, channels, classes
        self.blur_passes, self.seed = blur_passes, seed
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, channels, image_size + 8, image_size + 8, generator=g)
        self.kernel = torch.ones(channels, 1, 5, 5) / 25.0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        label = int(torch.randint(0, self.classes, (1,), generator=g))
        img = self.templates[label] + 0.5 * torch.randn(self.templates.shape[1:], generator=g)
        off = torch.randint(0, 9, (2,), generator=g)
        img = img[:, off[0]: off[0] + self.image_size, off[1]: off[1] + self.image_size]
        if bool(torch.randint(0, 2, (1,), generator=g)):
            img = img.flip(-1)
        img = img.unsqueeze(0)
        for _ in range(self.blur_passes):
            img = F.conv2d(F.pad(img, (2, 2, 2, 2), mode="reflect"), self.kernel, groups=self.channels)
        img = (img - img.mean()) / (img.std() + 1e-6)
        return img.squeeze(0).contiguous(), label


class SyntheticTokens(Dataset):
    """Token sequences for the language model: each sequence follows x[t+1] = (a*x[t] + b) mod vocab
    with a per-dataset (a, b) and a random start, so next-token prediction is learnable.
    Items are (tokens[:-1], tokens[1:])."""

    def __init__(self, size: int = 1024, seq_len: int = 64, vocab: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        a = int(torch.randint(1, vocab, (1,), generator=g)) | 1
        b = int(torch.randint(0, vocab, (1,), generator=g))
        seqs = torch.empty(size, seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, vocab, (size,), generator=g)
        for t in range(seq_len):
            seqs[:, t + 1] = (a * seqs[:, t] + b) % vocab
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, idx: int):
        s = self.seqs[idx]
        return s[:-1], s[1:]
