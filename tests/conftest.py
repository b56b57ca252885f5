"""Shared fixtures: compose configs like the CLI does, tiny workloads, one MLflow DB per session,
an MLflow server started by scripts/ui.sh."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, List

import pytest
import torch

from orchestrator.compose import CONF, compose_dict  # noqa: F401 (tests import both from here)
from orchestrator.schema import Config, to_config

ROOT = Path(__file__).resolve().parents[1]

# In-process training shares 2 cores with the ranks other tests start; one intra-op thread keeps
# OpenMP from spinning against them (each rank gets its own OMP_NUM_THREADS from the launcher).
torch.set_num_threads(1)

# Small enough for 2 cores; every test overrides what it measures.
# The tuner's tests were written for the utilization objective at the user's global batch; the
# defaults (goodput, the batch free) have tests of their own (test_goodput.py).
TINY = ["measure.warmup_steps=1", "measure.window_steps=2", "trainer.log_every=1", "tune.objective=utilization",
        "tune.global_batch=user"]


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One SQLite store for the session: creating MLflow's schema takes seconds."""
    return "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")


@pytest.fixture
def make_cfg(mlflow_uri) -> Callable[..., Config]:
    def make(*overrides: str, tiny: bool = True) -> Config:
        ov = (TINY if tiny else []) + [f"tracking.uri={mlflow_uri}"] + list(overrides)
        return to_config(compose_dict(ov))

    return make


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(store: str, artifacts: Path, log_path: Path) -> Iterator[str]:
    """`scripts/ui.sh` on a free loopback port over `store`, serving `artifacts`; yields its URL
    once it answers, and stops it afterwards."""
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "ui.sh"), str(port), store, str(artifacts)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"scripts/ui.sh did not serve {url}: " + log_path.read_text()[-2000:])
            time.sleep(0.3)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # it had already exited
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        assert proc.poll() is not None  # the server is stopped


@pytest.fixture
def ui_server(tmp_path):
    """`scripts/ui.sh` over tmp_path/mlflow.db, serving the artifacts in tmp_path/mlartifacts
    (where SQLite runs of that DB keep theirs); yields (url, store) once it answers."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    with mlflow_ui(store, tmp_path / "mlartifacts", tmp_path / "ui.log") as url:
        yield url, store


def job_processes(run_dir: Path) -> list:
    """Every live process whose command line names this run dir (launchers, ranks, loader workers)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def run_cli(args: List[str], cwd: Path = ROOT, timeout: float = 180, env: dict | None = None,
            file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m orchestrator args`; `file_size_limit`: no file it (or its ranks) writes may grow
    past that many bytes (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG), a full
    disk as a test can make one."""
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})},
                          preexec_fn=None if file_size_limit is None else lambda: _limit_file_size(file_size_limit))


def _limit_file_size(limit: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
