"""Checkpoints: written by rank 0 (every rank for a sharded model), atomically, and only ever read
back whole.

Layout in a run dir:
    checkpoints/step_00000120.pt     model, optimizer, scaler, RNG states, position in the data
    checkpoints/step_00000120.json   the same metadata without tensors (for the parent)
    checkpoints/step_00000120.dcp/   backend=fsdp: model and optimizer, sharded (torch.distributed.
                                     checkpoint: every rank writes its part); the .pt holds the rest
    checkpoints/latest               name of the newest complete checkpoint

Each file is written to a temporary name and renamed (the sharded directory too, once every rank
wrote its part), and `latest` is updated last, so a process killed mid-write leaves at most a
stray `.tmp` that nothing reads. `find_latest` still verifies what it picks (a sharded one: every
part its metadata names is there, whole) and falls back to the previous checkpoint if the newest
does not load. Ranks on several machines need the run dir on a shared filesystem for a sharded
checkpoint to be complete.

Whether a job resumes one, and which, is resume.py's decision.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

from .rundir import write_atomic, write_json

__all__ = ["find_latest", "good_before", "load", "load_sharded", "meta_of", "save"]

DIR = "checkpoints"
KEEP = 2  # checkpoints kept on disk (the newest and the one before it)


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sharded_state(model: Any, optimizer: Any) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _save_sharded(path: Path, model: Any, optimizer: Any, rank: int) -> None:
    """Every rank writes its part of the model and optimizer into `path`.tmp (a collective);
    rank 0 renames it to `path` once all are written (dcp.save returns after the metadata)."""
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:  # a killed attempt's leftovers; no rank writes before all entered the save
        shutil.rmtree(tmp, ignore_errors=True)
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(tmp))
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        tmp.replace(path)


def _sharded_complete(path: Path) -> bool:
    """The metadata of a sharded checkpoint reads, and every part it names is there, whole."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data.values()
        return all((path / s.relative_path).stat().st_size >= s.offset + s.length for s in storage)
    except Exception:
        return False


def load_sharded(pt: Path, model: Any, optimizer: Any) -> None:
    """Every rank reads its part of the model and optimizer of the sharded checkpoint beside `pt`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(pt.with_suffix(".dcp")))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def save(run_dir: Path, step: int, state: Dict[str, Any], meta: Dict[str, Any],
         sharded: Optional[Tuple[Any, Any]] = None, rank: int = 0) -> Optional[Path]:
    """Rank 0 only, or with `sharded` (model, optimizer) every rank: those go to `<name>.dcp/`,
    rank 0 writes the rest. `state` holds tensors; `meta` is JSON (step, epoch, mlflow run id, ...).
    Returns the .pt's path on rank 0."""
    d = run_dir / DIR
    d.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    pt = d / f"{name}.pt"
    if sharded is not None:
        _save_sharded(pt.with_suffix(".dcp"), *sharded, rank)
        meta = {**meta, "sharded": True}
    if rank != 0:
        return None
    write_atomic(pt, saver({**state, "meta": meta}))
    write_json(d / f"{name}.json", meta)
    write_atomic(d / "latest", name)
    for old in sorted(d.glob("step_*.pt"))[:-KEEP]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
        shutil.rmtree(old.with_suffix(".dcp"), ignore_errors=True)
    return pt


def saver(obj: Any) -> Callable[[Path], None]:
    """A writer for rundir.write_atomic: torch.save of `obj` through a Python file, so that a full
    disk surfaces as its OSError (ENOSPC), not as torch's own "unexpected pos" error."""

    def save_to(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(obj, f)

    return save_to


def find_latest(run_dir: Path) -> Optional[Path]:
    """The newest checkpoint that loads; None if there is none."""
    d = run_dir / DIR
    names = sorted(p.stem for p in d.glob("step_*.pt"))
    pointer = d / "latest"
    if pointer.exists() and pointer.read_text().strip() in names:  # the pointer first, then older ones
        names.remove(pointer.read_text().strip())
        names.append(pointer.read_text().strip())
    return next((d / f"{name}.pt" for name in reversed(names) if _whole(d / f"{name}.pt")), None)


def _whole(path: Path) -> bool:
    """The checkpoint loads, with its metadata, and a sharded one has every part. What it holds is
    what counts: its `.json` sidecar (the metadata again, for a quick read) may be missing."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        return isinstance(ck["meta"]["step"], int) and (not ck["meta"].get("sharded")
                                                        or _sharded_complete(path.with_suffix(".dcp")))
    except Exception:
        return False  # half-written or damaged: never picked


def good_before(run_dir: Path, step: int) -> Optional[Path]:
    """The newest whole checkpoint of `run_dir` written before `step` (a step whose loss passed:
    the weights it holds gave a good loss after it); None if there is none."""
    older = [p for p in (run_dir / DIR).glob("step_*.pt") if int(p.stem.split("_")[1]) < step]
    return next((p for p in sorted(older, reverse=True) if _whole(p)), None)


def meta_of(path: Path) -> Dict[str, Any]:
    """The checkpoint's metadata: its `.json` sidecar, else the `.pt` itself."""
    try:
        return json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return load(path)["meta"]


def load(path: Path) -> Dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
