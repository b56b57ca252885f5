"""Entry point of one rank: `python -m orchestrator.rank RUN_DIR` (or `--pool POOL_DIR`).

Loads the resolved `RUN_DIR/config.yaml` the parent wrote (never runs Hydra), trains, and
writes `RUN_DIR/ranks/rank<R>.json` (its measured load) next to `rank<R>.jsonl` (events the
parent tails live). A failure writes the traceback to `rank<R>.err` and exits 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from .measure.results import RankResult
from .rundir import (OWNER_ENV, RecordError, config_path, pool_job_path, pool_owner_path, pool_stop_path, process_gone, rank_paths,
                     ranks_dir, read_job, write_atomic, write_json)


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


def run_one(root: Path, adapter, cfg, datasets: Optional[dict] = None) -> None:
    """Train the job in `root` (its config and job spec read by the caller) on an adapter that is
    set up; write this rank's result. `datasets` (kept-alive ranks) reuses a dataset built by an
    earlier job with the same arguments."""
    from .checkpoint import find_latest
    from .runtime.loop import EventLog, build_dataset, train

    dataset = None
    if datasets is not None:
        key = json.dumps([cfg.data._target_, cfg.data.args, cfg.sim.read_latency_ms, cfg.sim.latency_jump_at],
                         sort_keys=True, default=str)
        if key not in datasets:
            datasets.clear()  # one at a time: a study varies the loader, rarely the data
            datasets[key] = build_dataset(cfg)
        dataset = datasets[key]

    rank = adapter.rank
    paths = rank_paths(root, rank)
    events = EventLog(paths["events"])
    try:
        resume = find_latest(Path(cfg.trainer.resume)) if cfg.trainer.resume else None
        res = train(cfg, adapter, events, trace_path=paths["trace"], ckpt_dir=root, resume=resume, dataset=dataset,
                    mlflow_run_id=read_job(root).get("mlflow_run_id"))
    finally:
        events.close()
    state = adapter.consolidated_state_dict(res.model) if cfg.trainer.save_model else None  # all ranks: may gather
    if state is not None:
        from .checkpoint import saver

        write_atomic(root / "model.pt", saver(state))
    typed = RankResult.from_dict({
        "param_digest": res.param_digest,
        "rank": rank, "local_rank": adapter.local_rank, "world_size": adapter.world_size,
        "host": socket.gethostname(), "pid": os.getpid(), "device": str(adapter.device),
        "steps": res.steps, "epochs": res.epochs, "steps_per_epoch": res.steps_per_epoch,
        "item_bytes": res.item_bytes,
        "first_loss": res.first_loss, "final_loss": res.final_loss,
        "wall_s": res.wall_s, "setup_s": res.setup_s, **res.meter,
    })
    typed.windows_detail = res.windows
    result = typed.to_dict()
    write_json(paths["result"], result)
    # rank 0's run dir gets every rank's result, also those of ranks on other machines
    gathered = adapter.all_gather_object(result)
    if rank == 0:
        for other in gathered:
            write_json(rank_paths(root, other["rank"])["result"], other)


def _fail(root: Path, rank: int, exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return 130
    from .schema import ConfigError

    from .runtime.step import Diverged

    # a config the rank found wrong (a dataset of 0 items), a record it could not write (a full
    # disk): its one line, not a traceback
    text = f"{exc}\n" if isinstance(exc, (ConfigError, RecordError)) else traceback.format_exc()
    if isinstance(exc, Diverged):  # one line, with the checkpoint a resume can trust
        text = f"{exc}; {_good_checkpoint(root, exc.last_good)}\n"
    try:  # the parent reads it there, and says it once
        ranks_dir(root).mkdir(parents=True, exist_ok=True)
        write_atomic(rank_paths(root, rank)["error"], text)
    except OSError:  # no room for it either: the parent finds it in the rank's output
        sys.stderr.write(text)
    return 1


def _good_checkpoint(root: Path, last_good: int) -> str:
    """Which checkpoint of a diverged run holds weights that gave a good loss (kept on disk)."""
    from .checkpoint import good_before

    kept = good_before(root, last_good) if last_good >= 0 else None
    if kept is None:
        return "no checkpoint was written before it"
    return f"the last good checkpoint, step {int(kept.stem.split('_')[1])}, is kept: {kept}"


def _prefix_if_torchrun(rank: int) -> None:
    if os.environ.get("LOCAL_RANK") is not None and "HOROVOD_RANK" not in os.environ:
        prefix_output(f"[rank{rank}] ")  # torchrun merges every rank's output; horovodrun prefixes its own


def _hush_said_warnings() -> None:
    """Warnings the parent already said once, in its own words (app._say_workers_over_cores):
    torch's DataLoader repeats "suggested max number of worker" at every construction and iterator."""
    import warnings

    warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes in total",
                            category=UserWarning)


def main(run_dir: str) -> int:
    """One job: set up the backend, train, write the result, tear down."""
    _hush_said_warnings()
    root = Path(run_dir)
    ranks_dir(root).mkdir(parents=True, exist_ok=True)
    rank = _early_rank()
    adapter = None
    try:
        from .runtime.dist import make_adapter
        from .schema import load_config

        _warm_imports()
        _prefix_if_torchrun(rank)
        cfg = load_config(str(config_path(root)))
        _catch_checkpoint_signal(cfg)
        adapter = make_adapter(cfg)
        adapter.setup()
        rank = adapter.rank
        run_one(root, adapter, cfg)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        return _fail(root, rank, exc)
    finally:
        if adapter is not None:
            adapter.shutdown()


def _catch_checkpoint_signal(cfg) -> None:
    """trainer.checkpoint_signal at this rank (SLURM signals every process of a job step): noted,
    and acted on at a step boundary (runtime/hooks.SignalCheckpointHook), never the default
    action (USR1, USR2 would end the process). The rank's loader workers inherit the handler."""
    import signal

    from .runtime.hooks import on_checkpoint_signal

    signum = cfg.trainer.checkpoint_signal.signum
    if signum is not None and cfg.mode.value == "run":
        signal.signal(signum, on_checkpoint_signal)
        signal.siginterrupt(signum, False)  # SA_RESTART: a collective's threads in a system call carry on


POLL_S = 0.005
OWNER_CHECK_S = 1.0
WATCH_OWNER_S = 0.5


def watch_owner(tag: Optional[str] = None, every_s: float = WATCH_OWNER_S) -> Optional[threading.Thread]:
    """End this rank (and its loader workers) when the orchestrator process supervising it is gone
    (`OWNER_ENV`, `host:pid:start`): killed -9, it cannot stop its ranks, and nobody else would end
    them or record their job. A thread checking every `every_s`; none without the variable."""
    tag = tag if tag is not None else os.environ.get(OWNER_ENV, "")
    if not tag:
        return None

    def watch() -> None:
        while not process_gone(tag):
            time.sleep(every_s)
        try:
            print(f"[orchestrator] rank {_early_rank()}: its orchestrator process ({tag}) is gone; exiting",
                  file=sys.__stderr__, flush=True)
        except Exception:  # its output pipe went with it
            pass
        _end_children()
        os._exit(1)

    thread = threading.Thread(target=watch, name="owner-watch", daemon=True)
    thread.start()
    return thread


def _end_children() -> None:
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def next_job(pool_dir: Path, seq: int) -> Optional[dict]:
    """Wait for job `seq` (a JSON file the parent renames into place), the stop file, or the end
    of the process that started the pool (killed before it could write the stop file)."""
    path = pool_job_path(pool_dir, seq)
    owner_file = pool_owner_path(pool_dir)
    owner = owner_file.read_text() if owner_file.exists() else ""
    checked = time.monotonic()
    while True:
        if path.exists():
            return json.loads(path.read_text())
        if pool_stop_path(pool_dir).exists():
            return None
        if owner and time.monotonic() - checked > OWNER_CHECK_S:
            if process_gone(owner):
                return None
            checked = time.monotonic()
        time.sleep(POLL_S)


def _warm_imports() -> None:
    """What the first job would import, imported before it starts (a pool's ranks do it while
    they wait for it: the tuner starts them before its first trial is ready): the training loop;
    torch._dynamo, which the first optimizer imports (about 2 s on 2 cores); and scipy.special,
    which the first estimate imports (measure.stats.t95). Imported at the first measured window's
    stop check, inside the measured span, it would add about 0.4 s of "other" to the first job on
    fresh ranks (the user's config, a tuner's trial 0) and read it idler than its later runs."""
    import torch._dynamo  # noqa: F401

    from .measure.stats import t95
    from .runtime import loop  # noqa: F401

    t95(1)


def survivable(exc: BaseException, world_size: int) -> bool:
    """A failed job after which a kept-alive rank takes the next one: it ran out of memory
    (CUDA's allocator, the host's, or trainer.memory_cap_mb's check of the rank and its loader
    workers together) or diverged, and no peer waits for it in a collective it left (a world of one rank). The
    job's tensors and loader workers go with its frames (train() ends the workers; the pool then
    collects and trims); fresh ranks would cost the next trial a launch and the imports (about 7 s
    on 2 cores). A process that passes the cap alone is ended by the supervisor (over_memory)."""
    if world_size != 1:
        return False
    from .runtime.step import Diverged

    if isinstance(exc, Diverged):  # the job's weights went wrong, not the process
        return True
    torch = sys.modules.get("torch")
    cuda_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(exc, MemoryError) or (cuda_oom is not None and isinstance(exc, cuda_oom))


def _release_freed_memory(cuda_cache: bool = False) -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim) between a pool's jobs: on
    CPU a job's peak memory is its process's resident size, and without this the next job starts
    at the last one's high-water (a batch-128 job after a batch-256 one reads about 40% more than on
    fresh ranks), and its peak, the memory-bound verdict and the memory cap read that.
    `cuda_cache`: after a job that ran out of memory, CUDA's cached blocks (its fragments) too."""
    torch = sys.modules.get("torch")
    if cuda_cache and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another libc (musl): nothing to trim with
        pass


def pool_main(pool_dir: str) -> int:
    """Kept-alive ranks (tuning): the backend is set up once, then one job after another, each
    rebuilding its data loader, model and optimizer from its own config. A failed job ends the
    process (the parent starts fresh ranks), unless it only ran out of memory on a rank alone
    (`survivable`): then the rank writes its traceback and `rankN.survived`, and takes the next job."""
    _hush_said_warnings()
    pool = Path(pool_dir)
    rank = _early_rank()
    adapter = None
    root = pool
    try:
        import gc

        from .runtime.dist import make_adapter
        from .schema import load_config

        _warm_imports()
        _prefix_if_torchrun(rank)
        seq = 0
        datasets: dict = {}
        while True:
            job = next_job(pool, seq)
            if job is None:
                return 0
            root = Path(job["run_dir"])
            ranks_dir(root).mkdir(parents=True, exist_ok=True)
            cfg = load_config(str(config_path(root)))
            if adapter is None:
                adapter = make_adapter(cfg)
                adapter.setup()
                rank = adapter.rank
            adapter.cfg = cfg  # same backend and world size; the knobs are the job's own
            failed = False
            try:
                run_one(root, adapter, cfg, datasets)
            except Exception as exc:  # noqa: BLE001
                if not survivable(exc, adapter.world_size):
                    raise
                _fail(root, rank, exc)
                write_atomic(rank_paths(root, rank)["survived"], "")  # the parent sends the next job here
                failed = True
            gc.collect()  # the last job's loader workers and tensors go now, not later
            _release_freed_memory(cuda_cache=failed)
            seq += 1
    except BaseException as exc:  # noqa: BLE001
        return _fail(root, rank, exc)
    finally:
        if adapter is not None:
            adapter.shutdown()


if __name__ == "__main__":
    args = sys.argv[1:]
    watch_owner()
    if len(args) == 2 and args[0] == "--pool":
        rc = pool_main(args[1])
    elif len(args) == 1:
        rc = main(args[0])
    else:
        print("usage: python -m orchestrator.rank RUN_DIR | --pool POOL_DIR", file=sys.stderr)
        sys.exit(2)
    # Everything is written and the process group is destroyed. Skip interpreter teardown: with
    # gloo, a C++ thread destroyed there intermittently aborts the process ("terminate called
    # without an active exception", SIGABRT) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
