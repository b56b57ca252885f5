"""Launch latency and steady-state step time of the orchestrator's CLI against hand-written
DDP and Horovod scripts, 2 ranks on CPU (gloo), seed 000's workload.

For each backend (ddp, horovod), interleaved `--reps` times (default 5), runs
  plain: `python -m bench.plain ddp` under `python -m torch.distributed.run --nproc-per-node=2`, or
         `python -m bench.plain horovod` under `horovodrun --gloo -np 2 -H localhost:2`;
  orch:  `python -m orchestrator backend=<b> parallelism.nproc_per_node=2 tracking.enabled=false
         hydra.run.dir=<tmp> trainer.max_steps=N trainer.epochs=E`,
both with OMP_NUM_THREADS=1 and the same number of steps, and measures
  launch latency: wall time from Popen to rank 0's first optimizer step, seen by this process,
    which polls every 10 ms for both: the plain script's `FIRST_STEP` stdout line, the
    orchestrator's first `{"type": "log", "step": 1}` line in RUN_DIR/ranks/rank0.jsonl;
  steady-state step time: rank 0's median over 10-step windows after 5 warm-up steps
    (orchestrator: rank0.json `step_time_s`; plain: the same statistic, printed by the script).
Reports medians over repetitions, and the medians of the per-rep paired figures (orch next to its
plain run), which drift less when other work shares the machine (the load average is printed).

Targets: orch/plain step-time ratio <= 1.03, orchestrator launch latency <= plain + 2 s.

    .venv/bin/python -m bench.bench_launch [--steps 600] [--reps 5] [--backends ddp horovod]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional

from bench.lib import ROOT

PY = sys.executable
HOROVODRUN = str(Path(PY).with_name("horovodrun"))
POLL_S = 0.010
STEPS_PER_EPOCH_PER_RANK = 4096 // 32 // 2  # seed 000's dataset, batch 32, 2 ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A launched command in its own session; stdout+stderr drained by a thread."""

    def __init__(self, cmd: List[str], env: Dict[str, str], needle: Optional[str] = None) -> None:
        self.lines: deque = deque(maxlen=400)
        self.needle, self.seen = needle, threading.Event()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
                                  start_new_session=True)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.needle and self.needle in line:
                self.seen.set()

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # the session this benchmark started
        except ProcessLookupError:
            pass

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.lines)[-n:])


def first_log_step(events: Path) -> bool:
    try:
        with open(events) as f:
            for line in f:
                if line.endswith("\n"):
                    ev = json.loads(line)
                    if ev.get("type") == "log" and ev.get("step") == 1:
                        return True
    except FileNotFoundError:
        pass
    return False


def run_one(kind: str, backend: str, steps: int, env: Dict[str, str], timeout_s: float) -> Dict[str, float]:
    """One job; returns launch_s (Popen -> rank 0's first step), step_s, total_s."""
    run_dir: Optional[Path] = None
    if kind == "plain":
        if backend == "ddp":
            cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                   "-m", "bench.plain", "ddp", str(steps)]
        else:
            cmd = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", PY, "-m", "bench.plain", "horovod", str(steps)]
        proc = Proc(cmd, env, needle="FIRST_STEP")
        started = proc.seen.is_set
    else:
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench_launch_{backend}_"))
        epochs = -(-steps // STEPS_PER_EPOCH_PER_RANK)
        cmd = [PY, "-m", "orchestrator", f"backend={backend}", "parallelism.nproc_per_node=2",
               "tracking.enabled=false", f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}",
               f"trainer.epochs={epochs}"]
        proc = Proc(cmd, env)
        events = run_dir / "ranks" / "rank0.jsonl"
        started = lambda: first_log_step(events)  # noqa: E731
    launch_s = None
    try:
        while True:
            if launch_s is None and started():
                launch_s = time.monotonic() - proc.t0
            if proc.p.poll() is not None:
                break
            if time.monotonic() - proc.t0 > timeout_s:
                raise RuntimeError(f"{kind} {backend}: timed out after {timeout_s:.0f}s\n{proc.tail()}")
            time.sleep(POLL_S)
        total_s = time.monotonic() - proc.t0
        proc.reader.join(timeout=10)
        if launch_s is None and started():  # the first step and the exit fell in one poll period
            launch_s = total_s
        if launch_s is None:
            raise RuntimeError(f"{kind} {backend}: exit {proc.p.returncode}, no first step seen\n{proc.tail()}")
        try:
            if kind == "plain":
                line = next(l for l in proc.lines if "STEP_TIME_S" in l)
                step_s = float(line.split("STEP_TIME_S", 1)[1].split()[0])
                loss = float(line.split("LOSS", 1)[1].split()[0])
            else:
                assert run_dir is not None
                r0 = json.loads((run_dir / "ranks" / "rank0.json").read_text())
                if r0["steps"] != steps or not r0.get("warmup_excluded"):
                    raise RuntimeError(f"rank 0 ran {r0['steps']} steps (wanted {steps})")
                step_s, loss = float(r0["step_time_s"]), float(r0["final_loss"])
        except (StopIteration, OSError, ValueError, KeyError, RuntimeError) as exc:
            raise RuntimeError(f"{kind} {backend}: exit {proc.p.returncode}, no measurement ({exc!r})\n{proc.tail()}")
        # a job that trained and measured, then exited non-zero (e.g. a rank aborted in teardown),
        # still has valid figures: keep them, and report the exit code
        return {"launch_s": launch_s, "step_s": step_s, "total_s": total_s, "loss": loss, "rc": proc.p.returncode,
                "why": next((l.strip() for l in proc.lines if "terminate called" in l or "error:" in l), "")}
    finally:
        proc.kill()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600, help="steps per job (both kinds)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["ddp", "horovod"], choices=["ddp", "horovod"])
    ap.add_argument("--timeout", type=float, default=300.0, help="per job, seconds")
    args = ap.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    got: Dict[tuple, List[Dict[str, float]]] = {}
    t_bench = time.monotonic()
    load0 = os.getloadavg()[0]
    for rep in range(args.reps):
        for backend in args.backends:
            order = ("plain", "orch") if rep % 2 == 0 else ("orch", "plain")  # alternate who goes first
            for kind in order:
                r = run_one(kind, backend, args.steps, env, args.timeout)
                got.setdefault((backend, kind), []).append(r)
                print(f"rep {rep + 1}/{args.reps} {backend:7s} {kind:5s}: launch {r['launch_s']:6.2f} s  "
                      f"step {r['step_s'] * 1e3:6.3f} ms  total {r['total_s']:6.2f} s  loss {r['loss']:.4f}"
                      + (f"  EXIT {r['rc']} after training ({r['why']})" if r["rc"] else ""),
                      flush=True)

    med = {k: {f: statistics.median(x[f] for x in v) for f in ("launch_s", "step_s", "total_s")} for k, v in got.items()}
    print()
    print(f"2 ranks on CPU (gloo), OMP_NUM_THREADS=1, {args.steps} steps, medians of {args.reps} interleaved reps "
          f"({time.monotonic() - t_bench:.0f} s; load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after, "
          f"{os.cpu_count()} cores)")
    hdr = (f"{'backend':8s} {'plain launch s':>14s} {'orch launch s':>13s} {'delta s':>8s} {'plain step ms':>13s} "
           f"{'orch step ms':>12s} {'ratio':>6s}  {'ratio<=1.03':>11s}  {'delta<=2s':>9s}  {'plain/orch total s':>18s}")
    print(hdr)
    print("-" * len(hdr))
    for b in args.backends:
        p, o = med[(b, "plain")], med[(b, "orch")]
        delta = o["launch_s"] - p["launch_s"]
        ratio = o["step_s"] / p["step_s"]
        print(f"{b:8s} {p['launch_s']:14.2f} {o['launch_s']:13.2f} {delta:+8.2f} {p['step_s'] * 1e3:13.3f} "
              f"{o['step_s'] * 1e3:12.3f} {ratio:6.3f}  {'MET' if ratio <= 1.03 else 'MISSED':>11s}  "
              f"{'MET' if delta <= 2.0 else 'MISSED':>9s}  {p['total_s']:8.2f} /{o['total_s']:8.2f}")
    print()
    for b in args.backends:
        pairs = list(zip(got[(b, "plain")], got[(b, "orch")]))
        pr = statistics.median(o["step_s"] / p["step_s"] for p, o in pairs)
        pd = statistics.median(o["launch_s"] - p["launch_s"] for p, o in pairs)
        print(f"paired per rep, {b:7s}: step-time ratio {pr:.3f} ({'MET' if pr <= 1.03 else 'MISSED'}), "
              f"launch delta {pd:+.2f} s ({'MET' if pd <= 2.0 else 'MISSED'})")
    print("spread over reps (min..max): " + "; ".join(
        f"{b} {k}: launch {min(x['launch_s'] for x in got[(b, k)]):.2f}..{max(x['launch_s'] for x in got[(b, k)]):.2f} s, "
        f"step {min(x['step_s'] for x in got[(b, k)]) * 1e3:.3f}..{max(x['step_s'] for x in got[(b, k)]) * 1e3:.3f} ms"
        for b in args.backends for k in ("plain", "orch")))
    bad = {k: sum(1 for x in v if x["rc"]) for k, v in got.items()}
    if any(bad.values()):
        print("runs that trained and measured but exited non-zero: " + ", ".join(
            f"{b} {k} {n}/{len(got[(b, k)])}" for (b, k), n in bad.items() if n))


if __name__ == "__main__":
    main()
