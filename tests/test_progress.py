"""Live progress: a run and a study watched through a pseudo-terminal (rich's live line) and
through a pipe (plain lines), with the final table intact in both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from orchestrator.progress import JobProgress, StudyProgress, clock

from .conftest import ROOT

RUN = ["trainer.max_steps=60", "measure.warmup_steps=1", "measure.window_steps=10", "trainer.log_every=1"]
STUDY = ["mode=tune", "tune.n_trials=2", "measure.warmup_steps=1", "measure.window_steps=2", "measure.rel_precision=0",
         "measure.trial_steps=4", "tune.confirm_top=0", "tune.pruner=none", "tune.extend_edges=false",
         "tune.space.num_workers.high=0", "tune.global_batch=free"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def watch(args, tmp_path, pty: bool) -> str:
    """`python -m orchestrator args` with stdout on a pseudo-terminal (100 columns) or a pipe;
    returns what it printed (escape codes removed, carriage returns as line ends)."""
    cmd = [sys.executable, "-m", "orchestrator", *args, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
           f"hydra.run.dir={tmp_path}/run"]
    env = {**os.environ, "COLUMNS": "100", "LINES": "40", "TERM": "xterm"}
    if not pty:
        out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=240)
        assert out.returncode == 0, out.stdout.decode()[-3000:]
        return out.stdout.decode()
    import fcntl
    import pty as ptys
    import struct
    import termios

    main, child = ptys.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=240) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    os.close(main)
    return ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")


def table_rows(text: str, keys) -> None:
    """Each key's row of the final table is whole: one line, framed on both sides."""
    for key in keys:
        rows = [line for line in text.splitlines() if re.match(rf"^[│┃] {re.escape(key)}\s", line)]
        assert rows and all(line.rstrip()[-1] in "│┃" for line in rows), (key, text[-3000:])


@pytest.mark.parametrize("pty", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["pty", "pipe"])  # a study goes through the pipe below
def test_a_run_shows_its_progress_and_its_table(tmp_path, pty):
    text = watch(RUN, tmp_path, pty)
    if pty:  # rich's live line: the bar's step/total and the ETA
        assert re.search(r"training .*\b\d+/60\b.*ETA", text), text[-3000:]
    else:  # plain lines: the first step at once, the end; never a bar or an escape code
        lines = [line for line in text.splitlines() if line.startswith("[progress] ")]
        assert re.match(r"\[progress\] step 1/60 \(2%\)  loss [\d.]+  elapsed \d+:\d\d  ETA (\d+:\d\d|\?)$", lines[0])
        assert re.match(r"\[progress\] step 60/60 \(100%\)  loss [\d.]+  [\d.]+ samples/s  elapsed \d+:\d\d  ETA 0:00$",
                        lines[-1]), lines
        assert "\x1b[" not in text
    table_rows(text, ["status", "throughput", "bottleneck"])
    assert f"load report: {tmp_path}/run/load_report.md" in text.splitlines()  # a path on one line
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "FINISHED" and result["steps"] == 60 and (tmp_path / "run" / ".hydra" / "config.yaml").exists()


@pytest.mark.parametrize("pty", [pytest.param(True, marks=pytest.mark.slow), False], ids=["pty", "pipe"])
def test_a_study_shows_trial_k_of_n_the_best_and_its_table(tmp_path, pty):
    text = watch([*STUDY, f"tune.storage=sqlite:///{tmp_path}/optuna.db"], tmp_path, pty)
    # a plain line says "[tune]"; rich's live line on a terminal is the line itself, cut at its width
    # Optuna's trial number, as the trial's own line says it, and the count
    assert re.search(r"(\[tune\] | )trial 0 \(1/2\) \d+:\d\d: batch_size=\d+ .*\| ETA \?", text), text[-3000:]
    if pty:
        assert re.search(r" trial 1 \(2/2\) \d+:\d\d: .* \| best so far: trial \d+", text), text[-3000:]
    else:  # (the interval when the best has two windows or more)
        assert re.search(r"\[tune\] trial 1 \(2/2\) \d+:\d\d: .* \| best so far: trial \d+: utilization [\d.]+%, "
                         r"[\d.]+( \(-?[\d.]+--?[\d.]+\))? samples/s \| ETA \d+:\d\d", text), text[-3000:]
        # each trial's start and end name the same trial; the trial's own line comes before what it proposes
        lines = text.splitlines()
        for number in (0, 1):
            start = next(i for i, line in enumerate(lines) if line.startswith(f"[tune] trial {number} ("))
            end = next(i for i, line in enumerate(lines) if re.match(rf"\[tune\] trial +{number} [A-Z]+ ", line))
            after = [i for i, line in enumerate(lines) if line.startswith(f"[tune] after trial {number}:")]
            assert start < end and all(i > end for i in after), text[-3000:]
    assert "A new study created" not in text and not re.search(r"^\[I \d{4}-", text, re.M)  # Optuna's own log
    header = [line for line in text.splitlines() if "rank" in line and "knobs" in line]
    assert header and "notes" in header[0] and header[0].rstrip()[-1] in "┃│"
    assert re.search(r"^\[tune\] rerun it: \S+ -m orchestrator .*\+tuned=best$", text, re.M)


def test_plain_lines_say_step_total_loss_rate_and_eta(capsys):
    job = JobProgress(live=False, every_s=3600)
    job.start(100)
    job.t0 -= 10  # ten seconds in
    job.update(step=25, loss=0.5)
    job.update(throughput=1234.5)
    job.update(step=50)
    job.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[progress] step 25/100 (25%)  loss 0.5  elapsed 0:10  ETA 0:")
    assert lines[1].startswith("[progress] step 50/100 (50%)  loss 0.5  1234.5 samples/s  elapsed 0:10  ETA 0:")
    assert len(lines) == 2  # nothing between the first step and the end at every_s=3600
    assert clock(3725) == "1:02:05" and clock(None) == "?"


def test_a_study_eta_comes_from_its_trials(capsys):
    study = StudyProgress("s", 5, live=False, every_s=3600)
    study.start()
    study.trial(1, "batch_size=8")
    study.t_trial -= 20
    study.ended("trial 0: utilization 50.0%, 100.0 (90.0-110.0) samples/s")
    study.trial(2, "batch_size=16")
    study.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[tune] trial 1/5 0:00: batch_size=8 | ETA ?"
    assert lines[1].startswith("[tune] trial 2/5 0:00: batch_size=16 | best so far: trial 0: utilization 50.0%")
    assert lines[1].endswith("| ETA 1:20")  # 4 trials left at 20 s each


def test_a_piped_study_says_each_start_once_and_rarely_beats_between(capsys):
    """Piped, a study's plain line comes at each start; the heartbeat right after a start says
    nothing, and the heartbeat is rare (a line per minute at most, not every 5 s)."""
    study = StudyProgress("s", 5, live=False)
    assert study.every_s >= 30
    study = StudyProgress("s", 5, live=False, every_s=3600)
    study.start()
    study.confirm(10, 10, "trial 3: batch_size=8")
    study._tick()  # the ticker fires just after the start
    study.ended("trial 3: utilization 50.0%")
    study.confirm(11, 12, "trial 4: batch_size=16")
    study.stop()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[tune] confirmation run 10/10 0:00: trial 3: batch_size=8 | ETA ?"
    # the leader is not the pick yet: it is judged on its trial's figures until the confirmation ends
    assert lines[1].startswith("[tune] confirmation run 11/12 0:00: trial 4: batch_size=16 | leader before "
                               "confirmation: trial 3") and len(lines) == 2


def test_a_runs_progress_shows_the_samples_per_second_its_summary_reports():
    """The live rate is the measured windows' samples over their seconds so far (the summary's
    figure at the end), not the last window's: a window of queued batches read 3000/s where the
    run delivered 1200/s."""
    import types

    from orchestrator.livelog import LiveLog

    progress = JobProgress(live=False, every_s=3600)
    live = LiveLog(types.SimpleNamespace(log_metrics=lambda points: None, uri="-"), 1, progress=progress)
    window = {"type": "window", "utilization": 0.5, "data_wait_frac": 0.1, "comm_frac": 0.0, "step_time_s": 0.01,
              "tokens_per_s": None}
    live([(0, {**window, "step": 10, "throughput": 1000.0, "wall_s": 4.0})])
    live([(0, {**window, "step": 20, "throughput": 3000.0, "wall_s": 1.0})])
    assert progress.throughput == pytest.approx((1000.0 * 4 + 3000.0 * 1) / 5)  # 1400/s, not 3000/s
