"""Pure pieces of the job runner, tested without launching anything: the event tail, the
world-size check, the pool key, and the resume rules."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import checkpoint
from orchestrator.runtime.dist import check_world
from orchestrator.schema import flatten
from orchestrator.supervise import EventTail
from orchestrator.tune.pool import pool_key

ROOT = Path(__file__).resolve().parents[1]


def test_event_tail_waits_for_the_end_of_a_line(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    tail = EventTail(tmp_path)
    with open(ranks / "rank1.jsonl", "w") as f:
        f.write(json.dumps({"type": "log", "step": 1}) + "\n" + '{"type": "window", "st')
        f.flush()
        assert tail.poll() == [(1, {"type": "log", "step": 1})]  # the half-written line waits
        assert tail.poll() == []
        f.write('ep": 2}\n')
        f.flush()
        assert tail.poll() == [(1, {"type": "window", "step": 2})]
    (ranks / "rank0.jsonl").write_text('{"type": "start"}\n')
    assert tail.poll() == [(0, {"type": "start"})]  # files that appear later are read from the start


def test_world_size_check(make_cfg):
    cfg = make_cfg("backend=ddp", "parallelism.nproc_per_node=2")
    check_world(cfg, 2)
    with pytest.raises(RuntimeError, match="the launcher started 3 ranks, the config asks for 2"):
        check_world(cfg, 3)
    check_world(make_cfg("backend=single", "parallelism.nproc_per_node=4"), 1)  # one process, whatever nproc says


def test_pool_key_changes_only_with_what_needs_new_processes(make_cfg):
    base = pool_key(make_cfg("backend=ddp", "parallelism.nproc_per_node=2"))
    # a trial's knobs run on the same ranks
    assert pool_key(make_cfg("backend=ddp", "parallelism.nproc_per_node=2", "data.batch_size=64",
                             "data.num_workers=2", "trainer.accumulation_steps=4")) == base
    for other in (["backend=horovod", "parallelism.nproc_per_node=2"], ["backend=ddp", "parallelism.nproc_per_node=1"],
                  ["backend=ddp", "parallelism.nproc_per_node=2", "backend.dist_backend=gloo"]):
        assert pool_key(make_cfg(*other)) != base, other


def test_resume_rules(make_cfg):
    from orchestrator import resume

    saved = make_cfg("trainer.max_steps=60", "sim.read_latency_ms=0.5")
    same = make_cfg("trainer.max_steps=100", "trainer.checkpoint_every=7", "data.num_workers=2",
                    "sim.read_latency_ms=0.5", "tracking.experiment=elsewhere")
    assert resume.changed_keys(flatten(saved), flatten(same)) == []  # what may change did
    other = make_cfg("trainer.max_steps=60", "data.batch_size=64", "trainer.seed=3")
    assert resume.changed_keys(flatten(saved), flatten(other)) == [  # data.args.seed follows trainer.seed
        ("data.args.seed", 0, 3), ("data.batch_size", 32, 64), ("sim.read_latency_ms", 0.5, 0.0), ("trainer.seed", 0, 3)]
    # finished after 60 steps of a 128-step epoch: more steps continue, the same limits do not
    t = saved.trainer
    assert not resume.trains_further(t, t, 60, 128)
    assert resume.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, 128)
    assert not resume.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, 60)  # the epoch ran out
    assert resume.trains_further(t, make_cfg("trainer.max_steps=0", "trainer.epochs=2").trainer, 60, 60)
    assert resume.trains_further(t, make_cfg("trainer.max_steps=100").trainer, 60, None)  # epoch length unknown


def test_handoff_cost_is_measured_once_per_size_class(tmp_path, monkeypatch):
    from orchestrator import costs

    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(costs, "measure_handoff", lambda nbytes, bs: calls.append((nbytes, bs)) or 0.002)
    assert costs.handoff_s(100_000, 32)["seconds"] == 0.002
    assert costs.handoff_s(120_000, 32)["seconds"] == 0.002  # the same power-of-two size class: cached
    assert calls == [(131072, 32)] and (tmp_path / "costs.json").exists()
    costs.handoff_s(1_000_000, 32)
    assert calls[-1] == (1048576, 32)


def test_measured_handoff_is_a_real_cost():
    from orchestrator.costs import measure_handoff

    assert 0 < measure_handoff(32 * 4000, 32, batches=10) < 1.0  # a worker costs something, and not seconds


def test_the_floors_hold():
    """import-linter's contracts (pyproject.toml, [tool.importlinter]): measure/ at the bottom, pure;
    the analysis over it; the rank side never reaching up; the parent and the tuner reading
    measurement from measure/; no circles between the modules of a package."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout



def test_the_rank_side_takes_the_typed_run():
    """The loop's state (runtime/state.py: Run = RunParts, built once, + LoopState, where the loop
    is) is what the step, the hooks, the evaluation and the noise probe take: no `run: Any`."""
    import ast
    import dataclasses

    from orchestrator.runtime.state import LoopState, Run, RunParts

    untyped = []
    for path in sorted((ROOT / "orchestrator" / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg == "run" and ast.unparse(node.annotation or ast.Name("Any")) == "Any":
                untyped.append(f"{path.name}:{node.lineno}")
    assert not untyped
    built, moving = {f.name for f in dataclasses.fields(RunParts)}, {f.name for f in dataclasses.fields(LoopState)}
    assert {"model", "optimizer", "loader", "cfg", "adapter", "meter"} <= built and {"step", "epoch", "b"} <= moving
    assert not built & moving and {f.name for f in dataclasses.fields(Run)} == built | moving


def test_the_tuner_is_parts_a_reader_can_hold():
    """orchestrator/tune/: no class over 300 lines and no function over 60 (DEVELOPERS.md); MLflow
    written only through tracking.Tracker (no tracker's `client` reached into); Optuna's private
    storage and trial ids only in the functions that say why no public call serves."""
    import ast

    allowed = {("answer.py", "dashboard_notes"), ("ownership.py", "_mark_interrupted")}
    long, reached = [], []
    for path in sorted((ROOT / "orchestrator" / "tune").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                size, limit = node.end_lineno - node.lineno + 1, 300 if isinstance(node, ast.ClassDef) else 60
                if size > limit:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({size} lines)")
            if isinstance(node, ast.FunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Attribute) and (
                            inner.attr == "client" or inner.attr in ("_storage", "_trial_id", "_study_id")
                            and (path.name, node.name) not in allowed):
                        reached.append(f"{path.name}:{inner.lineno} {node.name}: .{inner.attr}")
    assert not long, long
    assert not reached, sorted(set(reached))

TORCHRUN_REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-12-02_05:21:43
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10420)  (SIGKILL)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 10419)
"""
PEER_RESET = ("Traceback (most recent call last):\n  File \"loop.py\", line 603, in train\nRuntimeError: [pair.cc:537] "
              "Read error [127.0.0.1]:38795: Connection reset by peer.\n\nAt:\n  default_hooks.py(31): <lambda>\n")


@pytest.mark.parametrize("rank0_err, output, expected", [
    # rank 1 killed (-9), rank 0's connection reset written first, torchrun's root cause rank 0 (a tie)
    (PEER_RESET, TORCHRUN_REPORT, (1, "rank 1 was killed by SIGKILL")),
    (None, TORCHRUN_REPORT, (1, "rank 1 was killed by SIGKILL")),  # rank 0 ended by torchrun before it noticed
    (None, "Process name: 1\nExit code: 137\n", (1, "rank 1 was killed by SIGKILL")),  # horovodrun (gloo)
    ("Traceback (most recent call last):\nhorovod.common.exceptions.HorovodInternalError: Horovod has been shut down\n",
     "Process 0 exit with status code 1.\nProcess 1 exit with status code 137.\n", (1, "rank 1 was killed by SIGKILL")),
    # a rank's own error is its own, even if another rank was killed later
    ("Traceback (most recent call last):\nValueError: bad\n", TORCHRUN_REPORT, (0, "Traceback")),
    (PEER_RESET, "exitcode  : -15\n", (0, "Traceback")),  # no rank killed: the traceback it is
])
def test_the_rank_that_died_first_is_blamed(tmp_path, rank0_err, output, expected):
    from orchestrator.supervise import _first_error

    (tmp_path / "ranks").mkdir()
    if rank0_err is not None:
        (tmp_path / "ranks" / "rank0.err").write_text(rank0_err)
    rank, said = _first_error(tmp_path, output)
    assert (rank, said[:len(expected[1])]) == expected, said


def test_store_error_says_unreachable_with_the_drivers_words():
    import psycopg
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from optuna.exceptions import StorageInternalError

    from orchestrator.stores import store_error

    url = "postgresql+psycopg://u:secret@db:5432/optuna"
    driver = psycopg.OperationalError('connection failed: connection to server at "db", port 5432 failed: '
                                      'Connection refused\n\tIs the server running on that host?')
    try:
        try:
            try:
                raise driver
            except psycopg.OperationalError as e:
                raise sqlalchemy.exc.OperationalError("SELECT 1", {}, e) from e
        except sqlalchemy.exc.OperationalError as e:
            raise StorageInternalError("An exception is raised during the commit. This typically happens due to "
                                       "invalid data in the commit, e.g. exceeding max length. ") from e
    except StorageInternalError as exc:
        said = store_error(exc, url, "tune.storage")
    assert said == ('tune.storage postgresql+psycopg://u:***@db:5432/optuna unreachable: connection failed: '
                    'connection to server at "db", port 5432 failed: Connection refused'), said
    said = store_error(MlflowException("(psycopg.OperationalError) server closed the connection unexpectedly"), url)
    assert said.startswith("tracking store postgresql+psycopg://u:***@db:5432/optuna unreachable: (psycopg"), said
    assert store_error(ValueError("a name too long"), url) == "a name too long"
    import sqlite3
    locked = sqlalchemy.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
    assert "unreachable" not in store_error(locked, "sqlite:///x.db")


@pytest.mark.parametrize("text, shown", [
    ("http://user:S3c/retXY@127.0.0.1:9", "http://user:***@127.0.0.1:9"),  # '/' in the password
    ("postgresql+psycopg://u:S3cr@tXY@127.0.0.1:1/db", "postgresql+psycopg://u:***@127.0.0.1:1/db"),  # '@'
    ("postgresql+psycopg://u:S3cr%40tXY@h/db", "postgresql+psycopg://u:***@h/db"),  # percent-encoded
    ("postgresql+psycopg://u@h/db?sslmode=require&password=S3cr&x=1",
     "postgresql+psycopg://u@h/db?sslmode=require&password=***&x=1"),  # in the query
    ("- tune.storage=mysql\\://u\\:S3cr@h/db", "- tune.storage=mysql\\://u\\:***@h/db"),  # Hydra's escaped colons
    ("uri: 'https://u:S3cr@h:5000' and sqlite:///a/b.db", "uri: 'https://u:***@h:5000' and sqlite:///a/b.db"),
    ("mysql+pymysql://me:${oc.env:PW}@h/x", "mysql+pymysql://me:${oc.env:PW}@h/x"),  # no secret: kept
    ("http://127.0.0.1:5000/path", "http://127.0.0.1:5000/path"),
])
def test_every_form_of_a_url_password_is_masked(text, shown):
    from orchestrator.stores import redact

    assert redact(text) == shown


def test_a_password_the_driver_would_misread_is_refused_without_showing_it():
    from orchestrator.schema import ConfigError, TrackingConfig, TuneConfig

    with pytest.raises(ConfigError, match=r"^tracking.uri: the password in http://user:\*\*\*@127.0.0.1:9 holds '/', "
                                          r"where the driver ends the password; allowed: the password percent-encoded "
                                          r"\(/ as %2F\)"):
        TrackingConfig(uri="http://user:S3c/retXY@127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^tune.storage: the password in postgresql\+psycopg://u:\*\*\*@h:1/db holds "
                                          r"'@', .* \(@ as %40\)"):
        TuneConfig(storage="postgresql+psycopg://u:S3cr@tXY@h:1/db")
    TuneConfig(storage="postgresql+psycopg://u:S3cr%40tXY@h:1/db")  # encoded: read as written
    TuneConfig(storage="postgresql+psycopg://u:S3c/r@h:1/db")  # SQLAlchemy reads a '/' in the password
    TrackingConfig(uri="http://127.0.0.1:5000/a@b")  # an '@' in the path, no password


def test_a_write_that_fills_the_disk_is_one_line_and_leaves_no_temporary_file(tmp_path):
    """torch.save into a file says a full disk as a RuntimeError raised while handling the OSError:
    the write is still a RecordError naming the file, the cause and the free space."""
    import errno

    from orchestrator.rundir import RecordError, write_atomic
    from orchestrator.supervise import _first_error

    def torch_like(path):
        path.write_bytes(b"partial")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    with pytest.raises(RecordError) as info:
        write_atomic(tmp_path / "step_00000010.pt", torch_like)
    assert re.fullmatch(rf"{tmp_path}/step_00000010.pt: cannot write \(No space left on device; [\d.]+ [KMGT]?B free "
                        r"there\)", str(info.value)), info.value
    assert list(tmp_path.iterdir()) == []
    # a rank that could not write its error file either: the parent finds its line in the output
    said = f"[rank1] {info.value}"
    assert _first_error(tmp_path, f"noise\n{said}\nmore") == (1, str(info.value))


def test_target_arguments_bind_to_the_signature():
    from orchestrator.schema import ConfigError, check_target

    check_target("model", "tests.custom_task.with_kwargs", {"width": 2, "anything": 1})  # **kwargs takes any key
    with pytest.raises(ConfigError, match=r"^model.args.width: required by tests.custom_task.with_kwargs and not given"):
        check_target("model", "tests.custom_task.with_kwargs", {"anything": 1})


BUILT: list = []


def counted_net(width: int = 4):
    import torch

    BUILT.append(width)
    return torch.nn.Linear(width, 2)


def test_a_model_config_is_checked_once_per_process(make_cfg):
    """A study checks its model before every launch; building it again each time (on the meta
    device a layer's init still runs) only cost the tuner's time. Another config is checked again,
    and a bad one raises every time."""
    from orchestrator.runtime.loop import check_model
    from orchestrator.schema import ConfigError

    BUILT.clear()
    cfg = make_cfg("model=custom", "model._target_=tests.test_pure.counted_net", "+model.args.width=3")
    for _ in range(3):
        check_model(cfg)
    assert BUILT == [3]
    check_model(make_cfg("model=custom", "model._target_=tests.test_pure.counted_net", "+model.args.width=5"))
    assert BUILT == [3, 5]
    bad = make_cfg("model=custom", "model._target_=tests.custom_task.not_a_module")
    for _ in range(2):
        with pytest.raises(ConfigError, match="not a torch.nn.Module"):
            check_model(bad)


def test_a_model_its_arguments_cannot_build_is_refused_before_launch(make_cfg):
    """The meta build fails for the arguments (a negative size, a string for a number): one line
    naming model.args; a factory that fails for the meta device itself is left to the ranks."""
    from orchestrator.runtime.loop import check_model
    from orchestrator.schema import ConfigError

    with pytest.raises(ConfigError, match=r"^model.args: tests.custom_task.Net\(width=-5\) cannot be built: "
                                          r"RuntimeError: Trying to create tensor with negative dimension -5"):
        check_model(make_cfg("model=custom", "model._target_=tests.custom_task.Net", "+model.args.width=-5"))
    with pytest.raises(ConfigError, match=r"^model.args: tests.custom_task.Net\(width='abc'\) cannot be built: TypeError"):
        check_model(make_cfg("model=custom", "model._target_=tests.custom_task.Net", "+model.args.width=abc"))
    check_model(make_cfg("model=custom", "model._target_=tests.custom_task.needs_real_tensors"))


def test_checking_a_model_with_an_embedding_does_not_import_dynamo():
    """check_model builds on the meta device; an embedding's normal_ init ran through torch._refs
    there, whose first call imports torch._dynamo: 1.5-2.9 s of the tuner's time before its first
    trial. The random fills of meta tensors are skipped; the model is still built, checked and
    shaped (a fresh interpreter: this one may have imported dynamo already)."""
    code = (
        "import sys, torch\n"
        "from tests.conftest import compose_dict\n"
        "from orchestrator.schema import to_config\n"
        "from orchestrator.runtime.loop import _SkipRandomFills, check_model\n"
        "check_model(to_config(compose_dict(['model=seq_lm'])))\n"
        "with torch.device('meta'), _SkipRandomFills():\n"
        "    emb = torch.nn.Embedding(1000, 8)\n"
        "    w = torch.nn.init.normal_(torch.empty(3, 4), std=0.5)\n"
        "assert emb.weight.is_meta and tuple(emb.weight.shape) == (1000, 8) and tuple(w.shape) == (3, 4)\n"
        "x = torch.nn.init.normal_(torch.zeros(1000))  # a real tensor is still filled\n"
        "assert x.std() > 0.5\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dynamo imported: False" in out.stdout


def test_the_memory_cap_is_checked_at_most_every_memory_poll(tmp_path, monkeypatch):
    """A kept-alive pool's job is polled every 20 ms; walking /proc for its processes' memory at
    each poll took a fifth of a core from the job being measured. The cap is still enforced."""
    import collections
    import subprocess
    import sys
    import time

    from orchestrator import supervise

    calls = []

    def counting(proc, cap_mb):
        calls.append(time.monotonic())
        return ""

    class Launched:  # what watch() uses of supervise.Launched
        def __init__(self, seconds: float) -> None:
            self.proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
            self.reader, self.tail = type("R", (), {"join": lambda self, timeout=None: None})(), collections.deque()

        def kill(self, grace_s: float = 0.0) -> None:
            self.proc.kill()
            self.proc.wait()

    monkeypatch.setattr(supervise, "over_memory", counting)
    (tmp_path / "ranks").mkdir()
    started = time.monotonic()
    supervise.watch(Launched(1.0), tmp_path, done=lambda: False, memory_cap_mb=100, poll_s=0.01)
    took = time.monotonic() - started
    assert 1 <= len(calls) <= took / supervise.MEMORY_POLL_S + 1
    assert all(b - a >= supervise.MEMORY_POLL_S for a, b in zip(calls, calls[1:]))
    monkeypatch.setattr(supervise, "over_memory", lambda proc, cap_mb: "process 1 used 200 MB > trainer.memory_cap_mb=100")
    out = supervise.watch(Launched(30.0), tmp_path, done=lambda: False, memory_cap_mb=100, poll_s=0.01)
    assert out.over_memory.startswith("process 1 used 200 MB") and not out.ok


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="start in ticks since boot: /proc")
def test_an_owner_is_known_by_its_start_since_boot_not_by_the_clock(monkeypatch):
    """A live owner stays alive when the clock moves: psutil's epoch start is the boot time plus the
    process's ticks, and the boot time moves when the clock is slewed (seconds within minutes on a
    VM), which would end a live orchestrator's ranks. A recycled pid (another start) is still gone,
    and an epoch stamp (the older record format) still matches within 1 s."""
    import os
    import socket
    import subprocess
    import sys

    import psutil

    from orchestrator.rundir import owner_tag, process_gone

    tag = owner_tag()
    host, pid, stamp = tag.split(":")
    assert (host, int(pid)) == (socket.gethostname(), os.getpid()) and stamp.startswith("b")
    started = psutil.Process().create_time()
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: started + 12.0)  # the boot time moved
    assert not process_gone(tag)
    assert process_gone(f"{host}:{pid}:b{int(stamp[1:]) + 1}")  # the same pid, another process
    monkeypatch.undo()
    assert not process_gone(f"{host}:{pid}:{started:.2f}") and process_gone(f"{host}:{pid}:{started - 5:.2f}")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_gone(f"{host}:{child.pid}:b1") and not process_gone(f"elsewhere:{child.pid}")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="age since boot: /proc")
def test_a_process_start_for_file_times_reads_the_clock_of_now(monkeypatch):
    """process_start (compared with a checkpoint request's file time) is now minus the process's
    age, so a boot time that moved with the clock (psutil's start: boot time + ticks) does not move
    it; for a process started moments ago both agree."""
    import time

    import psutil

    from orchestrator.rundir import process_start

    started = psutil.Process().create_time()
    assert abs(process_start() - started) < 1.5 and process_start() <= time.time()  # btime: whole seconds
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: started + 12.0)
    assert abs(process_start() - started) < 1.5


def test_a_larger_global_batch_is_weighed_by_the_runs_noise_scale(make_cfg):
    """The diagnosis' note on a move that grows the global batch: at the run's measured noise scale
    B each sample is worth (B + M0) / (B + M) of one now (96 + 32) / (96 + 128) = 0.57, so samples/s
    must grow 1.75x for it to train sooner; the rate by the linear rule (sqrt for AdamW)."""
    from orchestrator.diagnose import _global_note

    cfg = make_cfg("data.batch_size=32", "trainer.lr=0.01")
    note = _global_note(cfg, 4, {"noise_scale": {"b_simple": 96.0}})
    assert "grows from 32 to 128" in note and "worth 0.57 of one now" in note and "more than 1.75x" in note
    assert note.endswith("trainer.lr scaled to 0.04 (linear)")
    adam = _global_note(make_cfg("data.batch_size=32", "trainer.lr=0.01", "trainer.optimizer=adamw"), 4,
                        {"noise_scale": {"b_simple": 96.0}})
    assert adam.endswith("trainer.lr scaled to 0.02 (sqrt, for Adam)")
    assert "the tuner holds it by default" in _global_note(cfg, 4, {"noise_scale": {"b_simple": None}})
