"""Time to a trained model: the learning rate that follows the global batch, goodput, the guard
that keeps a pick predicted slower to the user's target, and the held global batch by default."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import yaml

from orchestrator.measure.results import NoiseScale
from orchestrator.schema import ConfigError, LrScaling, Objective
from orchestrator.tune import goodput, launch as launch_mod
from orchestrator.tune.goodput import efficiency, guard, pooled_noise, scaled_lr, time_to_target, warmup_steps
from orchestrator.tune.space import ACCUM_KEY, BATCH_KEY, SearchSpace
from orchestrator.tune.study import run_study, trial_config

SHORT = ["mode=tune", "measure.warmup_steps=2", "measure.window_steps=4", "measure.window_s=0.05", "measure.rel_precision=0.1",
         "measure.min_measure_s=0.1", "measure.max_measure_s=0.6", "tune.confirm_top=0", "tune.pruner=none",
         "tune.extend_edges=false"]


def test_efficiency_is_pollux_arithmetic():
    assert efficiency(64, 64, 10.0) == 1.0
    assert efficiency(256, 64, 100.0) == pytest.approx(164 / 356)
    assert efficiency(16, 64, 100.0) == 1.0  # below the user's batch: no gain counted (Pollux's lower bound)
    assert efficiency(4096, 64, 1e9) == pytest.approx(1.0, rel=1e-5)  # far below the noise scale: free
    assert efficiency(256, 64, None) == 0.25  # not measured: a larger batch is assumed to buy nothing
    assert efficiency(16, 64, None) == 1.0


def test_lr_rules():
    assert scaled_lr(0.01, 64, 64, LrScaling.linear, None) == (0.01, "linear")
    assert scaled_lr(0.01, 64, 256, LrScaling.linear, None)[0] == pytest.approx(0.04)
    assert scaled_lr(0.01, 64, 256, LrScaling.sqrt, None)[0] == pytest.approx(0.02)
    assert scaled_lr(0.01, 64, 256, LrScaling.none, None) == (0.01, "none")
    # AdaScale's gain (var + sqr) / (var / scale + sqr), var = tr(Sigma)/M0, B = tr(Sigma)/|G|^2
    b, m0, m = 100.0, 64, 256
    sqr, var = 1.0, b / m0
    gain = (var + sqr) / (var / (m / m0) + sqr)
    assert scaled_lr(0.01, m0, m, LrScaling.adascale, b) == (pytest.approx(0.01 * gain), "adascale")
    assert gain == pytest.approx((m / m0) * efficiency(m, m0, b))
    assert scaled_lr(0.01, m0, m, LrScaling.adascale, b, adam=True)[0] == pytest.approx(0.01 * math.sqrt(gain))
    lr, used = scaled_lr(0.01, m0, m, LrScaling.adascale, None)
    assert lr == pytest.approx(0.02) and used == "sqrt (adascale without a measured noise scale)"
    assert warmup_steps(0.04, 0.01, 40) == 2 and warmup_steps(0.02, 0.01, 40) == 0 and warmup_steps(0.04, 0.01, 5) == 1


def test_auto_rule_follows_the_optimizer(make_cfg):
    assert goodput.rule_of(make_cfg("mode=tune")) is LrScaling.linear
    assert goodput.rule_of(make_cfg("mode=tune", "trainer.optimizer=adamw")) is LrScaling.sqrt
    assert goodput.rule_of(make_cfg("mode=tune", "trainer.optimizer=adamw", "tune.lr_scaling=none")) is LrScaling.none


@pytest.mark.parametrize("override, expected", [
    ("tune.global_batch=huge", "tune.global_batch: must be auto (free with sgd, user with adamw), user (hold your "
                               "config's batch x accumulation x world size), free, or an integer >= 1, got 'huge'"),
    ("tune.global_batch=0", "tune.global_batch: must be auto"),
    ("tune.global_batch=null", "tune.global_batch: must be auto"),
    ("tune.global_batch=true", "tune.global_batch: must be auto"),
    ("trainer.warmup_lr_steps=-1", "trainer.warmup_lr_steps: must be an integer >= 0 (0 = off), got -1"),
])
def test_bad_values_are_one_line(make_cfg, override, expected):
    with pytest.raises(ConfigError) as info:
        make_cfg("mode=tune", override)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_by_default_a_study_ranks_by_goodput_the_batch_free_with_sgd_and_held_with_adam(make_cfg):
    cfg = make_cfg("mode=tune", tiny=False)  # the tests' TINY pins the utilization objective at the user's batch
    assert cfg.tune.objective is Objective.goodput and cfg.tune.global_batch == "auto"
    assert cfg.tune.lr_scaling is LrScaling.auto and ACCUM_KEY in SearchSpace(cfg).keys  # sgd: the batch free
    adam = SearchSpace(make_cfg("mode=tune", "trainer.optimizer=adamw", "data.batch_size=32", tiny=False))
    assert adam.global_batch == 32 and ACCUM_KEY not in adam.keys  # the Adam family: held at the user's
    assert "tune.global_batch=auto holds it with adamw" in adam.left_out["accumulation_steps"]


def test_tune_global_batch_user_holds_the_users_global_batch(make_cfg):
    space = SearchSpace(make_cfg("mode=tune", "data.batch_size=32", "trainer.accumulation_steps=2"))
    assert space.global_batch == 64 and ACCUM_KEY not in space.keys
    assert next(d for d in space.dims if d.key == BATCH_KEY).choices == [8, 16, 32, 64]
    assert "the global batch is held at 64 (yours; free it with tune.global_batch=free)" in space.left_out[
        "accumulation_steps"]
    odd = SearchSpace(make_cfg("mode=tune", "data.batch_size=12"))  # no power of two reaches 12: its own batch does
    assert next(d for d in odd.dims if d.key == BATCH_KEY).choices == [12]
    free = SearchSpace(make_cfg("mode=tune", "tune.global_batch=free"))
    assert free.global_batch is None and ACCUM_KEY in free.keys
    assert SearchSpace(make_cfg("mode=tune", "tune.global_batch=128")).global_batch == 128


def test_a_trial_trains_at_the_scaled_rate(make_cfg):
    cfg = make_cfg("mode=tune", "data.batch_size=16", "trainer.lr=0.01", "tune.global_batch=free")
    assert trial_config(cfg, {BATCH_KEY: 64}).trainer.lr == pytest.approx(0.04)
    assert trial_config(cfg, {BATCH_KEY: 8, ACCUM_KEY: 2}).trainer.lr == 0.01  # the same global batch
    assert trial_config(cfg, {BATCH_KEY: 64, "trainer.lr": 0.5}).trainer.lr == 0.5  # a rate the space searches
    adam = make_cfg("mode=tune", "data.batch_size=16", "trainer.optimizer=adamw", "tune.global_batch=free")
    assert trial_config(adam, {BATCH_KEY: 64}).trainer.lr == pytest.approx(0.02)
    ada = make_cfg("mode=tune", "data.batch_size=16", "tune.lr_scaling=adascale", "tune.global_batch=free")
    assert trial_config(ada, {BATCH_KEY: 64}, b_noise=16.0).trainer.lr == pytest.approx(0.01 * 4 * 32 / 80)


def _trial(number, m, **attrs):
    return SimpleNamespace(number=number, user_attrs={"global_batch": m, **attrs})


def test_guard_sets_aside_a_pick_predicted_slower_to_the_target():
    t = SimpleNamespace(objective=Objective.utilization)
    user, held, big = _trial(0, 64), _trial(1, 64), _trial(2, 4096)
    fig = {0: {"throughput": 100.0, "goodput": 100.0}, 1: {"throughput": 120.0, "goodput": 120.0},
           2: {"throughput": 300.0, "efficiency": 0.05, "goodput": 15.0}}
    pick, why = guard([big, held, user], fig, user, 64, t)
    assert pick is held and why.startswith("trial 2 (global batch 4096, 64x yours) is predicted to reach your target "
                                           "6.67x slower than your config")
    fig[2].update(efficiency=0.9, goodput=270.0)
    assert guard([big, held, user], fig, user, 64, t) == (big, None)
    fig[2].update(efficiency=0.05, goodput=15.0)
    assert guard([big, user], fig, user, 64, t)[0] is user  # no other trial at the user's batch: the user's config
    assert guard([big, user], fig, user, 64, t, measured=False)[1].endswith(
        "(each sample worth 0.05 of yours at worst: no noise scale measured): the pick is trial 0, at your global batch 64")


def test_noise_is_pooled_as_the_median_and_read_defensively():
    trials = [_trial(2, 64, noise_scale={"b_simple": 30.0}), _trial(0, 64, noise_scale={"b_simple": 10.0}),
              _trial(1, 64, noise_scale={"b_simple": None}), _trial(3, 64),
              _trial(4, 64, noise_scale={"b_simple": 20.0}), _trial(5, 64, noise_scale={"b_simple": float("nan")})]
    assert pooled_noise(trials) == {"b_simple": 20.0, "trials": [0, 2, 4],
                                    "how": "median of B_simple over trials 0, 2, 4"}
    assert pooled_noise([_trial(0, 64, noise_scale="n/a")]) is None


def test_summary_names_the_rule_and_the_rate(make_cfg):
    cfg = make_cfg("mode=tune", "data.batch_size=16", "trainer.optimizer=adamw", "trainer.lr=0.001")
    study = SimpleNamespace(user_attrs={"noise_scale": {"b_simple": 1000.0, "how": "median of B_simple over trial 0"}})
    pick = _trial(3, 256, steps_per_epoch=40, values={BATCH_KEY: 256})
    fig = goodput.with_goodput({"throughput": 500.0}, 256, 16, 1000.0)
    tt = time_to_target(study, cfg, pick, fig, {"throughput": 100.0}, None)
    assert tt["rule_used"] == "sqrt" and tt["set"] == {"trainer.lr": pytest.approx(0.004), "trainer.warmup_lr_steps": 2}
    assert tt["line"] == ("trial 3: 5x your samples/s at 16x your global batch; each sample is worth 0.81 of yours at "
                          "lr 0.004 (sqrt): 4x faster to the same loss")
    slow = time_to_target(study, cfg, pick, goodput.with_goodput({"throughput": 500.0}, 256, 16, 1.0),
                          {"throughput": 100.0}, None)
    assert slow["line"].endswith("each sample is worth 0.066 of yours at lr 0.004 (sqrt): not recommended")
    unmeasured = SimpleNamespace(user_attrs={})
    worst = time_to_target(unmeasured, cfg, pick, goodput.with_goodput({"throughput": 2000.0}, 256, 16, None),
                           {"throughput": 100.0}, None)
    assert worst["noise_scale"] is None and worst["line"] == (
        "trial 3: 20x your samples/s at 16x your global batch; each sample is worth 0.062 of yours at least (no noise "
        "scale measured: the worst case) at lr 0.004 (sqrt): 1.2x faster to the same loss")


def _faked_runs(monkeypatch, b):
    """The trials' runs report a gradient noise scale `b` (the runtime's estimate is another item),
    and samples/s of 1,000 at batch 8 and 3,000 at batch 128 (+-5%): the study's decisions rest on
    a premise the machine's load cannot move (a first trial in fresh processes can read 60x
    slower than a later one of 16x its batch)."""
    real = launch_mod.run_job_result

    def run_job_result(cfg, run_dir, **kwargs):
        result = real(cfg, run_dir, **kwargs)
        result.noise_scale = NoiseScale(b_simple=b, lo=b / 2, hi=b * 2, g2=1.0, trace_sigma=b, n=10, method="faked",
                                        batch_small=8, batch_big=64)
        rate = 3000.0 if cfg.data.batch_size == 128 else 1000.0
        result.estimate = dataclasses.replace(result.estimate, mean=rate, rel_se=0.02,
                                              interval=(0.95 * rate, 1.05 * rate))
        return result

    monkeypatch.setattr(launch_mod, "run_job_result", run_job_result)


def _study_cfg(make_cfg, tmp_path, *extra):
    return make_cfg(*SHORT, "data.batch_size=8", "trainer.lr=0.01", "tune.global_batch=free", "tune.sampler=grid",
                    "tune.n_trials=2", f"tune.storage=sqlite:///{tmp_path}/optuna.db",
                    "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[8,128]",
                    "tune.space.accumulation_steps.high=1", "tune.space.num_workers.high=0", *extra)


@pytest.mark.slow  # two trials, about 10 s
def test_a_pick_predicted_slower_to_the_target_is_set_aside(make_cfg, tmp_path, monkeypatch, capsys):
    """A small noise scale: batch 128 moves 3x the samples/s of the user's 8, but each is worth
    (1 + 8) / (1 + 128) of the user's; the throughput objective ranks it first and the study
    hands back the user's global batch, saying why."""
    _faked_runs(monkeypatch, 1.0)
    summary = run_study(_study_cfg(make_cfg, tmp_path, "tune.objective=throughput"), tmp_path)
    out = capsys.readouterr().out
    tt = summary["time_to_target"]
    assert summary["best"]["values"][BATCH_KEY] == 8
    assert tt["noise_scale"]["how"].startswith("median of B_simple over trials 0, ")
    assert "(global batch 128, 16x yours) is predicted to reach your target 4.78x slower than your config (each " \
           "sample worth 0.07 of yours)" in tt["guard"]
    assert "[tune] set aside: trial " in out
    assert "trainer.lr" not in yaml.safe_load((tmp_path / "tuned" / "best.yaml").read_text()).get("trainer", {})


@pytest.mark.slow  # two trials, about 10 s
def test_goodput_picks_a_larger_batch_at_its_scaled_rate(make_cfg, tmp_path, monkeypatch, capsys, mlflow_uri):
    """A large noise scale: batch 128 loses nothing per sample; the goodput objective picks it, its
    trial trained at the linear rule's rate, and best.yaml and the rerun line carry the rate and a
    warmup (16x the rate)."""
    _faked_runs(monkeypatch, 1e6)
    summary = run_study(_study_cfg(make_cfg, tmp_path, "tune.objective=goodput"), tmp_path)
    out = capsys.readouterr().out
    tt = summary["time_to_target"]
    assert summary["best"]["values"][BATCH_KEY] == 128 and tt["guard"] is None
    assert tt["speedup"] == pytest.approx(3.0 * 1e6 / (1e6 + 120), rel=1e-6)
    assert tt["lr"] == pytest.approx(0.16) and tt["rule_used"] == "linear"
    best = yaml.safe_load((tmp_path / "tuned" / "best.yaml").read_text())
    assert best["trainer"]["lr"] == pytest.approx(0.16) and best["trainer"]["warmup_lr_steps"] >= 1
    assert "trainer.lr=0.16" in summary["rerun_overrides"]
    assert summary["best"]["lr"] == pytest.approx(0.16)  # the trial itself trained at it
    assert f"[tune] {tt['line']}" in out and "x faster to the same loss" in tt["line"]
    import mlflow

    metrics = mlflow.tracking.MlflowClient(mlflow_uri).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["best_lr"] == pytest.approx(0.16) and metrics["best_goodput"] == pytest.approx(tt["goodput"])


def test_lr_warmup_ramps_the_rate_in_the_ranks(make_cfg):
    """trainer.warmup_lr_steps: lr/n, 2lr/n, ... lr over the first n optimizer steps, then lr; a
    resumed run continues the ramp at its step; the loop adds the hook only when it is set."""
    import torch

    from orchestrator.runtime.hooks import LrWarmupHook
    from orchestrator.runtime.loop import build_hooks

    def run_at(step):
        return SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), step=step)

    run, hook, seen = run_at(0), LrWarmupHook(0.1, 4), []
    hook.start(run)
    for step in range(6):
        seen.append(run.optimizer.param_groups[0]["lr"])
        run.optimizer.step()
        run.step = step + 1
        hook.after_step(run)
    assert seen == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])
    resumed = run_at(2)
    LrWarmupHook(0.1, 4).start(resumed)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.075)

    def hooks(*overrides):
        cfg = make_cfg(*overrides, "measure.noise_scale=false")
        run = SimpleNamespace(cfg=cfg, adapter=SimpleNamespace(rank=0, sharded_state=False, world_size=1), balancer=None,
                              step=0, dataset=None, loader_tuner=None, val_set=None, noise=None)
        return [type(h).__name__ for h in build_hooks(run, None, None, None)]

    assert "LrWarmupHook" in hooks("trainer.warmup_lr_steps=3") and "LrWarmupHook" not in hooks()


def test_goodput_ranks_and_prunes_by_what_a_sample_is_worth(make_cfg, tmp_path):
    """Batch 256 moves 4x the samples/s of the user's 16, but at a noise scale of 16 each is worth
    (16 + 16) / (16 + 256) of one: the goodput objective ranks the user's batch first, and a
    window of another batch-256 trial is pruned on its goodput, in those words."""
    import optuna

    from orchestrator.tune.goodput import record_trial
    from orchestrator.tune.rules import best_trials, ranked
    from orchestrator.tune.study import Tuner

    cfg = make_cfg("mode=tune", "data.batch_size=16", "tune.global_batch=free", "tune.objective=goodput",
                   "tune.pruner=interval", f"tune.storage=sqlite:///{tmp_path}/o.db")
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("base_global_batch", 16)
    for batch, thr in ((16, 1000.0), (256, 4000.0)):
        trial = study.ask()
        trial.set_user_attr("global_batch", batch)
        f = record_trial(study, trial, {"throughput": thr, "throughput_lo": 0.9 * thr, "throughput_hi": 1.1 * thr,
                                        "utilization": 0.5}, {"b_simple": 16.0}, 16)
        for k, v in {**f, "values": {BATCH_KEY: batch}}.items():
            trial.set_user_attr(k, v)
        study.tell(trial, f["goodput"])
    a = {tr.number: tr.user_attrs for tr in study.trials}
    assert a[1]["efficiency"] == pytest.approx(32 / 272) and a[1]["goodput"] == pytest.approx(4000 * 32 / 272)
    assert study.user_attrs["noise_scale"]["how"] == "median of B_simple over trials 0, 1"
    t = cfg.tune
    assert [tr.number for tr in ranked(study, t)] == [0, 1] and best_trials(study, t)[0].number == 0
    tuner = Tuner(cfg, tmp_path, echo=False)
    trial = study.ask()
    trial.set_user_attr("global_batch", 256)
    pruned = {"flag": False}
    monitor = tuner._monitor(study, trial, pruned)
    stops = [monitor(i, {"throughput": 5000.0 + i, "utilization": 0.5}) for i in range(4)]
    assert stops == [False, False, False, True] and pruned["reason"].startswith("goodput 588.")


def test_resuming_a_study_with_another_global_batch_is_refused(make_cfg, tmp_path):
    """A study holds one global batch (or none) for all its trials and tuner processes."""
    from orchestrator.tune.study import Tuner

    common = [*SHORT, "tune.study_name=one-batch", f"tune.storage=sqlite:///{tmp_path}/optuna.db"]
    Tuner(make_cfg(*common), tmp_path / "a", echo=False)._study()
    Tuner(make_cfg(*common, "tune.global_batch=32"), tmp_path / "b", echo=False)._study()  # 32 is the user's
    with pytest.raises(ConfigError) as info:
        Tuner(make_cfg(*common, "tune.global_batch=free"), tmp_path / "c", echo=False)._study()
    assert str(info.value) == ("tune.global_batch: study 'one-batch' was made with the global batch 32, this call "
                               "gives free; resume it with its own tune.global_batch, or start another study (a new "
                               "tune.study_name)")


def test_with_the_learning_rate_kept_a_sample_is_worth_the_worst_case():
    """E(M) assumes the rate follows the batch: a study that keeps it (tune.lr_scaling=none) values a
    sample at 4x the batch at 1/4, whatever noise scale it measured; with a rule, at (B + M0)/(B + M)."""
    from types import SimpleNamespace

    from orchestrator.tune.goodput import judged, scale_of

    trial = SimpleNamespace(user_attrs={"global_batch": 64})
    for rule, worth in (("none", 16 / 64), ("linear", (1000 + 16) / (1000 + 64))):
        study = SimpleNamespace(user_attrs={"base_global_batch": 16, "lr_scaling": rule,
                                            "noise_scale": {"b_simple": 1000.0}})
        assert judged(trial, {"throughput": 100.0}, scale_of(study))["efficiency"] == pytest.approx(worth)

