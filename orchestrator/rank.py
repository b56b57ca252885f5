"""Entry point of one rank: `python -m orchestrator.rank RUN_DIR`.

Loads the resolved `RUN_DIR/config.yaml` the parent wrote (never runs Hydra), trains, and
writes `RUN_DIR/ranks/rank<R>.json` (its measured load) next to `rank<R>.jsonl` (events the
parent tails live). A failure writes the traceback to `rank<R>.err` and exits 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

RANKS_DIR = "ranks"


def rank_paths(run_dir: Path, rank: int) -> dict[str, Path]:
    d = run_dir / RANKS_DIR
    return {"events": d / f"rank{rank}.jsonl", "result": d / f"rank{rank}.json", "error": d / f"rank{rank}.err"}


def _early_rank() -> int:
    """Best guess of this rank before the backend is up (for naming the error file)."""
    for var in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


class _Prefixed:
    """Line-prefixing wrapper for sys.stdout / sys.stderr."""

    def __init__(self, stream, prefix: str) -> None:
        self._s, self._p, self._bol = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            out.append((self._p if self._bol else "") + piece)
            self._bol = piece.endswith("\n")
        self._s.write("".join(out))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._s, name)


def prefix_output(prefix: str) -> None:
    sys.stdout = _Prefixed(sys.stdout, prefix)  # type: ignore[assignment]
    sys.stderr = _Prefixed(sys.stderr, prefix)  # type: ignore[assignment]


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)  # the parent never reads a half-written file


def main(run_dir: str) -> int:
    root = Path(run_dir)
    (root / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    rank = _early_rank()
    adapter = None
    try:
        from .runtime.dist import make_adapter
        from .runtime.loop import EventLog, train
        from .schema import load_config

        if os.environ.get("LOCAL_RANK") is not None and "HOROVOD_RANK" not in os.environ:
            prefix_output(f"[rank{rank}] ")  # torchrun merges every rank's output; horovodrun prefixes its own
        cfg = load_config(str(root / "config.yaml"))
        adapter = make_adapter(cfg)
        adapter.setup()
        rank = adapter.rank
        paths = rank_paths(root, rank)
        events = EventLog(paths["events"])
        try:
            from .checkpoint import find_latest

            resume = find_latest(Path(cfg.trainer.resume)) if cfg.trainer.resume else None
            res = train(cfg, adapter, events, trace_path=root / RANKS_DIR / f"trace_rank{rank}.json",
                        ckpt_dir=root, resume=resume)
        finally:
            events.close()
        if cfg.trainer.save_model and rank == 0:
            import torch

            tmp_model = root / "model.pt.tmp"
            torch.save(res.model.state_dict(), tmp_model)
            tmp_model.replace(root / "model.pt")
        result = {
            "param_digest": res.param_digest,
            "rank": rank, "local_rank": adapter.local_rank, "world_size": adapter.world_size,
            "host": socket.gethostname(), "pid": os.getpid(), "device": str(adapter.device),
            "steps": res.steps, "epochs": res.epochs, "first_loss": res.first_loss, "final_loss": res.final_loss,
            "wall_s": res.wall_s, **res.meter, "windows_detail": res.windows,
        }
        _write_json(paths["result"], result)
        # rank 0's run dir gets every rank's result, also those of ranks on other machines
        gathered = adapter.all_gather_object(result)
        if rank == 0:
            for other in gathered:
                _write_json(rank_paths(root, other["rank"])["result"], other)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        if isinstance(exc, KeyboardInterrupt):
            return 130
        rank_paths(root, rank)["error"].write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    finally:
        if adapter is not None:
            adapter.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m orchestrator.rank RUN_DIR", file=sys.stderr)
        sys.exit(2)
    rc = main(sys.argv[1])
    # Everything is written and the process group is destroyed. Skip interpreter teardown: with
    # gloo, a C++ thread destroyed there intermittently aborts the process ("terminate called
    # without an active exception", SIGABRT) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
