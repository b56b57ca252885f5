"""The meter is honest: an injected read latency shows up as data wait of the right size, the
shares tile the step, and warmup is excluded."""

from __future__ import annotations

import time

import pytest
import torch

from orchestrator.runtime.dist import Adapter
from orchestrator.runtime.meter import COMM, COMPUTE, DATA, H2D, OPTIMIZER, PHASES, StepMeter
from orchestrator.runtime.loop import train
from orchestrator.schema import to_config

from .conftest import TINY, compose_dict

LAT_MS, BATCH = 3.0, 4


def run(cfg):
    a = Adapter(cfg)
    a.setup()
    return train(cfg, a).meter


@pytest.fixture(scope="module")
def latency_runs():
    def make(*overrides):
        return to_config(compose_dict(TINY + ["tracking.enabled=false", *overrides]))

    common = ["experiment=transformer_lm", "data.args.size=256", f"data.batch_size={BATCH}", "trainer.max_steps=26",
              "trainer.warmup_steps=2", "trainer.window_steps=8"]
    return {
        "slow": run(make(*common, f"data.read_latency_ms={LAT_MS}")),
        "fast": run(make(*common, "data.read_latency_ms=0")),
        "workers": run(make(*common, f"data.read_latency_ms={LAT_MS}", "data.num_workers=2",
                            "data.persistent_workers=true")),
    }


def test_injected_latency_is_data_wait(latency_runs):
    slow = latency_runs["slow"]
    expected_s = BATCH * LAT_MS / 1000  # num_workers=0: the loop itself sleeps through every read
    assert 0.95 * expected_s <= slow["phase_s"]["data"] <= 1.5 * expected_s + 0.002, slow["phase_s"]
    # the share is that wait over the measured step, and it lands near the expected share
    expected_share = expected_s / slow["step_time_s"]
    assert slow["data_wait_frac"] == pytest.approx(expected_share, abs=0.08)
    assert slow["utilization_source"] == "cpu-busy"


def test_no_latency_no_wait(latency_runs):
    fast, slow = latency_runs["fast"], latency_runs["slow"]
    assert fast["data_wait_frac"] < slow["data_wait_frac"] - 0.2
    assert fast["utilization"] > slow["utilization"]
    assert fast["phase_s"]["data"] < 0.5 * slow["phase_s"]["data"]


def test_workers_hide_latency(latency_runs):
    assert latency_runs["workers"]["phase_s"]["data"] < 0.75 * latency_runs["slow"]["phase_s"]["data"]


def test_shares_tile_the_step(latency_runs):
    for m in latency_runs.values():
        per_step = sum(m["phase_s"].values())
        assert per_step == pytest.approx(m["step_time_s"], rel=0.01)
        for p in PHASES:  # each share is its phase's part of the step's wall time
            share = m[f"{p}_frac" if p != "data" else "data_wait_frac"]
            assert share == pytest.approx(m["phase_s"][p] / m["step_time_s"], abs=0.01), p
        assert 0.0 <= m["utilization"] <= 1.0
        assert m["peak_mem_mb"] > 0 and m["mem_source"] == "rss"


def test_meter_windows_exclude_warmup():
    m = StepMeter(torch.device("cpu"), window_steps=3, warmup_steps=2)
    m.start()
    for i in range(11):
        time.sleep(0.02 if i < 2 else 0.001)  # slow warmup steps must not count
        m.mark(DATA)
        m.mark(H2D)
        m.mark(COMPUTE)
        m.mark(COMM)
        m.mark(OPTIMIZER)
        m.end_step(samples=4)
    m.flush()
    s = m.summary()
    assert len(m.warmup_windows) == 1
    assert [w.steps for w in m.windows] == [3, 3, 3]
    assert s["measured_steps"] == 9 and s["warmup_excluded"]
    assert s["phase_s"]["data"] < 0.01
    assert s["throughput"] == pytest.approx(4 / s["step_time_s"], rel=0.2)


def test_ddp_hook_splits_backward_into_compute_and_comm():
    m = StepMeter(torch.device("cpu"), window_steps=1, warmup_steps=0)
    m.start()
    m.mark(DATA)
    time.sleep(0.02)  # backward computing
    m.comm_hook_fired()  # last bucket handed to the all-reduce
    time.sleep(0.03)  # waiting for it
    m.mark(COMPUTE)
    m.mark(OPTIMIZER)
    m.end_step(samples=1)
    s = m.summary()
    assert s["phase_s"]["compute"] == pytest.approx(0.02, abs=0.01)
    assert s["phase_s"]["comm"] == pytest.approx(0.03, abs=0.01)
