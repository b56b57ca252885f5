"""The knobs a user sets: one measurement group for runs and trials, the storage simulation in its
own group, old keys answered in one line naming the new one, and every knob listed in the docs."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml
from hydra.errors import HydraException

from orchestrator.compose import compose_dict
from orchestrator.errors import format_error
from orchestrator.moved import MOVED, RETIRED
from orchestrator.schema import RUN_MEASURE, TRIAL_MEASURE, Config, ConfigError, SimConfig, load_config, plain, to_config, to_yaml

from .conftest import ROOT, run_cli

# Every key a user may set, counted so that adding one is a decision made here (the aim: fewer, at
# most 60; the training features keep trainer at 26 and the study's at 25), and each one documented.
KNOBS = 103


def knobs(cls: type = Config, prefix: str = "") -> list:
    """Every leaf field of the schema as a dotted key (a mapping such as model.args or tune.space
    is one knob), less sim.* (benchmarks and tests)."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out += knobs(hints[f.name], key + ".") if dataclasses.is_dataclass(hints[f.name]) else [key]
    return [k for k in out if not k.startswith("sim.")]


def test_the_knobs_a_user_sets_are_counted_and_each_is_in_the_docs():
    docs = "\n".join(p.read_text() for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"])
    table = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|(.*)\|$", (ROOT / "README.md").read_text(), re.M)}
    found = knobs()
    assert len(found) == KNOBS, f"{len(found)} knobs: {found}"
    unlisted = [k for k in found if f"`{k}" not in docs and not (
        "." in k and f"`{k.split('.', 1)[1]}`" in table.get(k.split(".", 1)[0], ""))]
    assert unlisted == [], f"not in docs/*.md or README.md's table: {unlisted}"
    assert not any(k.split(".", 1)[0] == "sim" or k in MOVED or k in RETIRED for k in found)
    for group, row in table.items():  # README's table names no key its group lacks
        fields = {k.split(".", 1)[1] for k in found if k.startswith(f"{group}.")}
        named = re.findall(r"`(\w+)`", re.sub(r"\([^()]*\)|\[[^\]]*\]\([^)]*\)", "", row))
        assert not fields or set(named) <= fields, f"README's {group} row: {sorted(set(named) - fields)}"


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
    have = set(knobs()) | {f"sim.{f.name}" for f in dataclasses.fields(SimConfig)}
    assert set(MOVED.values()) <= have and not (set(MOVED) | set(RETIRED)) & have
    assert Path(ROOT / "conf" / "measure" / "default.yaml").exists()
