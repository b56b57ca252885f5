"""A zoo of user-like tasks for judging the tuner (bench/bench_zoo.py).

Each task is a user's own code (bench/zoo/tasks.py, loaded by `_target_` with `model=custom data=custom`,
docs/running.md, "Your own model and data") with a different bottleneck, and:
  * `overrides`: the user's config as they wrote it (their batch, workers, accumulation, lr ...);
  * `space`: a categorical search space over batch_size x num_workers x accumulation_steps
    (>= 24 points), which bench_zoo measures exhaustively and the tuner searches.

The package must be importable by the tuner's rank processes too: `_target_: bench.zoo.tasks.X`
imports from the repository root, the working directory of the benchmarks and of their ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List


def _user(model: str, data: str, batch: int, workers: int, accum: int = 1, lr: float = 0.05,
          extra: tuple = ()) -> List[str]:
    """A user's command line: `model` and `data` are `Target arg=value ...` strings."""
    out: List[str] = []
    for group, spec in (("model", model), ("data", data)):
        target, *args = spec.split()
        out += [f"{group}=custom", f"{group}._target_=bench.zoo.tasks.{target}", *(f"+{group}.args.{a}" for a in args)]
    return [*out, f"data.batch_size={batch}", f"data.num_workers={workers}", f"trainer.accumulation_steps={accum}",
            f"trainer.lr={lr}", *extra]


def _space(batch: List[int], workers: List[int], accum: List[int]) -> Dict[str, List[int]]:
    return {"batch_size": batch, "num_workers": workers, "accumulation_steps": accum}


MLP = "MLP in_features=128 hidden=256"
STORAGE_SPACE = _space([16, 32, 64], [0, 2, 4, 8], [1, 2])  # sleeping workers cost no CPU: beyond the 2 cores

TASKS: Dict[str, Dict[str, Any]] = {
    "storage_0p1": {
        "bottleneck": "storage latency 0.1 ms per item, tiny MLP",
        "overrides": _user(MLP, "StoredFeatures latency_ms=0.1", batch=32, workers=0),
        "space": STORAGE_SPACE,
    },
    "storage_1": {
        "bottleneck": "storage latency 1 ms per item, tiny MLP",
        "overrides": _user(MLP, "StoredFeatures latency_ms=1", batch=32, workers=0),
        "space": STORAGE_SPACE,
    },
    "storage_5": {
        "bottleneck": "storage latency 5 ms per item, tiny MLP",
        "overrides": _user(MLP, "StoredFeatures latency_ms=5", batch=16, workers=2),
        "space": STORAGE_SPACE,
    },
    "cpu_transform": {
        "bottleneck": "per-item CPU augmentation (~1.3 ms: crop, flip, 8 blur passes at 64x64), small convnet",
        "overrides": _user("ConvNet", "AugmentedImages image_size=64 blur_passes=8", batch=32, workers=0),
        "space": _space([16, 32, 64], [0, 1, 2, 4], [1, 2]),
    },
    "storage_cpu": {
        "bottleneck": "1 ms storage latency plus a light augmentation (~0.3 ms at 32x32), small convnet",
        "overrides": _user("ConvNet", "AugmentedImages image_size=32 blur_passes=2 latency_ms=1", batch=64, workers=1),
        "space": _space([16, 32, 64], [0, 2, 4, 8], [1, 2]),  # the user's workers=1 is not a grid point
    },
    "comm_ddp": {
        "bottleneck": "DDP on 2 ranks, 10M-parameter embedding bag, little compute: the all-reduce",
        "overrides": _user("BagOfEmbeddings", "TokenBags", batch=16, workers=0, lr=0.5,
                           extra=("backend=ddp", "parallelism.nproc_per_node=2")),
        "space": _space([8, 16, 32, 64], [0, 1], [1, 2, 4]),
    },
    "compute": {
        "bottleneck": "compute: a small transformer encoder on in-memory token sequences",
        "overrides": _user("SequenceClassifier d_model=64 seq_len=32", "Sequences seq_len=32", batch=8, workers=2, lr=0.001,
                           extra=("trainer.optimizer=adamw",)),
        "space": _space([8, 16, 32, 64], [0, 1, 2], [1, 2]),
    },
    "short_epochs": {
        "bottleneck": "300 items (0.5 ms each): large batches leave few steps per epoch, each epoch restarts the workers",
        "overrides": _user(MLP, "StoredFeatures size=300 latency_ms=0.5", batch=32, workers=2),
        "space": _space([8, 16, 32, 64], [0, 1, 2], [1, 2]),
    },
    "memory_cap": {
        "bottleneck": "activations grow with the batch; trainer.memory_cap_mb fails the largest batch",
        "overrides": _user("WideGatedMLP in_features=16 hidden=8192 depth=8", "StoredFeatures features=16 latency_ms=0", batch=128, workers=0,
                           extra=("trainer.memory_cap_mb=850",)),
        "space": _space([64, 128, 256, 512], [0, 1, 2], [1, 2]),
    },
    "already_best": {
        "bottleneck": "compute-bound MLP on in-memory data; the user's b64 w0 a1 is already (near) the best",
        "overrides": _user("MLP in_features=128 hidden=1024", "StoredFeatures latency_ms=0", batch=64, workers=0),
        "space": _space([8, 16, 32, 64], [0, 1, 2], [1, 2]),
    },
}
