"""A job's fingerprint (orchestrator/fingerprint.py): what the tuner sets leaves it alone, what the
job is changes its `job` part, the world size its `layout`, the machine its `hardware`; stable across
processes."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.fingerprint import Fingerprint, describe, fingerprint, hardware_part

from .conftest import ROOT


def test_the_tuners_knobs_the_rate_and_the_epochs_leave_it_alone(make_cfg):
    base = fingerprint(make_cfg())
    for knobs in (["data.batch_size=64", "data.num_workers=2", "trainer.accumulation_steps=4"],
                  ["trainer.lr=0.5", "trainer.epochs=9", "trainer.seed=3", "trainer.eval_every=7",
                   "data.val_fraction=0.1"],
                  ["tune.n_trials=3", "tracking.enabled=false", "measure.window_steps=9"]):
        assert fingerprint(make_cfg(*knobs)) == base, knobs


def test_what_the_job_is_changes_its_job_part(make_cfg):
    base = fingerprint(make_cfg())
    for change in (["model.args.out_features=17"], ["trainer.optimizer=adamw"], ["trainer.amp=true"],
                   ["data.args.size=123"]):
        other = fingerprint(make_cfg(*change))
        assert other.job != base.job and other.id != base.id and base.matches(other) == "none", change
        assert other.layout == base.layout and other.hardware == base.hardware


def test_the_world_size_and_the_machine_are_a_partial_match(make_cfg):
    base = fingerprint(make_cfg())
    ddp = fingerprint(make_cfg("backend=ddp", "parallelism.nproc_per_node=2"))
    assert ddp.job == base.job and ddp.layout != base.layout and base.matches(ddp) == "job"
    elsewhere = fingerprint(make_cfg(), hardware={**hardware_part(), "cpu": "another CPU", "cores": 64})
    assert elsewhere.job == base.job and elsewhere.hardware != base.hardware and base.matches(elsewhere) == "job"
    assert base.matches(fingerprint(make_cfg())) == "full"


def test_tags_round_trip_and_the_summary_line(make_cfg):
    cfg = make_cfg()
    fp = fingerprint(cfg)
    tags = fp.tags()
    assert set(tags) == {"fingerprint", "fingerprint.job", "fingerprint.layout", "fingerprint.hardware"}
    assert Fingerprint.from_tags(tags) == fp and Fingerprint.from_tags({"fingerprint": fp.id}) is None
    line = describe(cfg)
    assert line.startswith(f"fingerprint {fp.id} (job {fp.job}: {cfg.model._target_}") and "cores" in line


def test_stable_across_processes(make_cfg):
    """No hash randomization, no address or time in it: another interpreter computes the same."""
    code = ("from tests.conftest import compose_dict;from orchestrator.schema import to_config;"
            "from orchestrator.fingerprint import fingerprint;import json,dataclasses;"
            "print(json.dumps(dataclasses.asdict(fingerprint(to_config(compose_dict([]))))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert Fingerprint(**json.loads(out.stdout.strip().splitlines()[-1])) == fingerprint(make_cfg(tiny=False))
