"""The knobs a user sets: one measurement group for runs and trials, the storage simulation in its
own group, old keys answered in one line naming the new one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra.errors import HydraException

from orchestrator.compose import compose_dict
from orchestrator.errors import format_error
from orchestrator.moved import MOVED, RETIRED
from orchestrator.schema import (RUN_MEASURE, TRIAL_MEASURE, Config, ConfigError, DataConfig, MeasureConfig,
                                 ParallelismConfig, SimConfig, TrainerConfig, TuneConfig, load_config, plain, to_config, to_yaml)

from .conftest import ROOT, run_cli


def test_a_run_and_a_studys_trials_read_one_measure_group_with_their_own_defaults():
    run, study = (to_config(compose_dict(ov)) for ov in ([], ["mode=tune"]))
    assert {k: getattr(run.measure, k) for k in RUN_MEASURE} == RUN_MEASURE
    assert {k: getattr(study.measure, k) for k in TRIAL_MEASURE} == TRIAL_MEASURE
    given = to_config(compose_dict(["mode=tune", "measure.window_steps=7", "measure.rel_precision=0"]))
    assert given.measure.window_steps == 7 and given.measure.warmup_steps == TRIAL_MEASURE["warmup_steps"]
    from orchestrator.tune.launch import trial_config

    job = trial_config(given, {"data.batch_size": 16})
    assert job.measure.window_steps == 7 and job.trainer.log_every == 7 and job.data.batch_size == 16
    assert job.trainer.max_steps == TRIAL_MEASURE["warmup_steps"] + 20  # measure.trial_steps after the warmup
    assert not hasattr(run.trainer, "window_s") and not hasattr(run.tune, "window_s")


def test_the_storage_simulation_is_its_own_group_and_set_from_the_command_line():
    from orchestrator.runtime.data import LatencyDataset, build_dataset

    cfg = to_config(compose_dict(["sim.read_latency_ms=1.5", "data.args.size=64"]))
    assert not hasattr(cfg.data, "read_latency_ms")
    ds = build_dataset(cfg)
    assert isinstance(ds, LatencyDataset) and ds._delay.value == pytest.approx(0.0015)
    assert not isinstance(build_dataset(to_config(compose_dict(["data.args.size=64"]))), LatencyDataset)
    with pytest.raises(ConfigError, match=r"^sim.latency_after_ms: applies with sim.latency_jump_at > 0"):
        to_config(compose_dict(["sim.latency_after_ms=2"]))


@pytest.mark.parametrize("override, line", [
    ("trainer.window_s=2", "trainer.window_s: moved to measure.window_s; write measure.window_s=2"),
    ("data.read_latency_ms=1", "data.read_latency_ms: moved to sim.read_latency_ms; write sim.read_latency_ms=1"),
    ("tune.measure_steps=5", "tune.measure_steps: moved to measure.trial_steps; write measure.trial_steps=5"),
    ("parallelism.balance_tolerance=0.2", "parallelism.balance_tolerance: no longer a setting: "),
])
def test_an_old_key_on_the_command_line_is_one_line_naming_the_new_one(tmp_path, override, line):
    out = run_cli([override, f"hydra.run.dir={tmp_path / 'run'}"])
    assert out.returncode == 2 and out.stderr.startswith(f"error: {line}") and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run dir


def test_an_old_key_in_a_composed_or_written_config_is_one_line_naming_the_new_one():
    with pytest.raises(HydraException) as exc:
        compose_dict(["trainer.window_s=2"])
    assert format_error(exc.value, Config) == "trainer.window_s: moved to measure.window_s; write measure.window_s=2"
    record = plain(to_config(compose_dict([])))
    record["data"]["read_latency_ms"] = 1.0
    with pytest.raises(ConfigError, match=r"^data.read_latency_ms: moved to sim.read_latency_ms$"):
        to_config(record)


@pytest.mark.parametrize("mode", ["run", "tune"])
def test_a_config_written_before_the_moves_reads_with_the_new_names(tmp_path, mode):
    """A run's config.yaml from before (a resume reads it again): both copies of the measurement
    settings were written; the mode's own are the ones it ran with."""
    now = to_config(compose_dict([f"mode={mode}", "sim.read_latency_ms=2", "measure.window_steps=9"]))
    old = yaml.safe_load(to_yaml(now))
    measure, sim = old.pop("measure"), old.pop("sim")
    other = RUN_MEASURE if mode == "tune" else TRIAL_MEASURE  # the copy the mode did not use
    mine, theirs = ("tune", "trainer") if mode == "tune" else ("trainer", "tune")
    old[mine].update({k: measure[k] for k in RUN_MEASURE})
    old[theirs].update(other)
    old["trainer"].update({k: measure[k] for k in ("profile_steps", "peak_tflops", "noise_scale", "noise_every")})
    old["tune"]["measure_steps"] = measure["trial_steps"]
    old["data"].update(sim)
    old["tune"]["max_workers_cap"], old["parallelism"]["balance_tolerance"] = None, 0.1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load_config(str(path)) == now


def test_the_moved_keys_name_keys_the_schema_has():
    have = {f"{g}.{f.name}" for g, c in (("measure", MeasureConfig), ("sim", SimConfig), ("trainer", TrainerConfig),
                                        ("tune", TuneConfig), ("parallelism", ParallelismConfig), ("data", DataConfig))
            for f in dataclasses.fields(c)}
    assert set(MOVED.values()) <= have and not (set(MOVED) | set(RETIRED)) & have
    assert Path(ROOT / "conf" / "measure" / "default.yaml").exists()
