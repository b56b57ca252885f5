"""Launch commands as built, per backend, without spawning anything."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from orchestrator.launch import RANK_MODULE, build_launch

RUN = Path("/runs/x")


def launch(make_cfg, *overrides, environ=None, **kw):
    return build_launch(make_cfg(*overrides), RUN, environ=environ or {}, cpu_count=8, **kw)


def test_single_and_dp_run_the_rank_module_directly(make_cfg):
    for backend in ("single", "dp"):
        ln = launch(make_cfg, f"backend={backend}", "parallelism.nproc_per_node=4")
        assert ln.cmd == [sys.executable, "-m", RANK_MODULE, str(RUN)]
        assert ln.world_size == 1


def test_torchrun_one_node(make_cfg):
    ln = launch(make_cfg, "backend=ddp", "parallelism.nproc_per_node=2", "parallelism.master_port=29600")
    assert ln.cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--nproc-per-node=2", "--nnodes=1", "--node-rank=0", "--master-addr=127.0.0.1",
            "--master-port=29600", "--max-restarts=0"} <= set(ln.cmd)
    assert ln.cmd[-3:] == ["--module", RANK_MODULE, str(RUN)]
    assert ln.env["OMP_NUM_THREADS"] == "4"  # 8 cores over 2 local ranks
    assert ln.world_size == 2


def test_only_a_plain_torchrun_agent_is_killed_with_its_orchestrator(make_cfg):
    """SIGTERM to a torchrun agent whose orchestrator died left about one agent in five hanging
    forever (tests/test_faults); its ranks are local and watch the orchestrator themselves, so the
    agent gets SIGKILL. horovodrun and srun get SIGTERM: they end ranks on other hosts."""
    assert launch(make_cfg, "backend=ddp", "parallelism.nproc_per_node=2").death_signal == signal.SIGKILL
    assert launch(make_cfg, "backend=single").death_signal == signal.SIGTERM
    assert launch(make_cfg, "backend=horovod", "parallelism.nproc_per_node=2",
                  horovodrun="/x/horovodrun").death_signal == signal.SIGTERM


def test_torchrun_standalone_and_user_threads(make_cfg):
    ln = launch(make_cfg, "backend=ddp", "parallelism.nproc_per_node=2", environ={"OMP_NUM_THREADS": "3"})
    assert "--standalone" in ln.cmd  # one node, no port given: torchrun picks one
    assert not any(a.startswith(("--master-port", "--master-addr", "--nnodes")) for a in ln.cmd)
    assert "OMP_NUM_THREADS" not in ln.env  # the user's setting wins


def test_torchrun_many_nodes(make_cfg):
    ln = launch(make_cfg, "backend=ddp", "parallelism.nproc_per_node=4", "parallelism.nnodes=2",
                "parallelism.node_rank=1", "parallelism.master_addr=10.0.0.1", "parallelism.master_port=29500")
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=29500"} <= set(ln.cmd)
    assert ln.world_size == 8 and ln.local_ranks == 4


def test_horovodrun_local(make_cfg):
    ln = launch(make_cfg, "backend=horovod", "parallelism.nproc_per_node=2", horovodrun="/x/horovodrun")
    assert ln.cmd == ["/x/horovodrun", "-np", "2", "--gloo", "-H", "localhost:2",
                      sys.executable, "-m", RANK_MODULE, str(RUN)]


def test_horovodrun_two_hosts(make_cfg):
    ln = launch(make_cfg, "backend=horovod", "parallelism.hosts='node1:2,node2:2'", horovodrun="/x/horovodrun")
    assert ln.cmd[:6] == ["/x/horovodrun", "-np", "4", "--gloo", "-H", "node1:2,node2:2"]
    assert ln.world_size == 4 and ln.env["OMP_NUM_THREADS"] == "4"


def test_horovodrun_hostfile_and_mpi(make_cfg, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=3\n")
    ln = launch(make_cfg, "backend=horovod", "backend.gloo=false", f"parallelism.hostfile={hostfile}",
                "parallelism.nproc_per_node=3", horovodrun="/x/horovodrun")
    assert "--gloo" not in ln.cmd
    assert ln.cmd[1:5] == ["-np", "3", "-hostfile", str(hostfile)]


def test_horovod_missing_says_how_to_install(make_cfg, monkeypatch):
    import orchestrator.launch as launch_mod
    from orchestrator.schema import ConfigError

    monkeypatch.setattr(launch_mod.sys, "executable", "/nonexistent/python")
    monkeypatch.setattr(launch_mod.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="horovodrun not found; install Horovod with scripts/install_horovod.sh"):
        build_launch(make_cfg("backend=horovod", "parallelism.nproc_per_node=2"), RUN, environ={}, cpu_count=2)
