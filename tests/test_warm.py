"""What earlier studies carry over (orchestrator/tune/warm.py): finding the studies of a job in an
Optuna storage by fingerprint, choosing one (auto, off, a name, an MLflow run id) and the configs
a new study starts from."""

from __future__ import annotations

import dataclasses
import os

import optuna
import pytest

from orchestrator.fingerprint import Fingerprint
from orchestrator.schema import ConfigError
from orchestrator.tune.warm import FP_ATTR, VALUES_ATTR, choose, find, seeds, tuned_values

FP = Fingerprint(job="j1", layout="l1", hardware="h1", id="full1")
OTHER_WORLD = Fingerprint(job="j1", layout="l2", hardware="h1", id="full2")
OTHER_JOB = Fingerprint(job="j2", layout="l1", hardware="h1", id="full3")


def make_study(storage: str, name: str, fp: Fingerprint, values=None, trials=(), run_id=None) -> None:
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_user_attr(FP_ATTR, dataclasses.asdict(fp))
    for value, knobs in trials:
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"values": knobs}))
    if values is not None:
        study.set_user_attr(VALUES_ATTR, values)
        study.set_user_attr("pick_trial", 0)
    if run_id:
        study.set_user_attr("mlflow_run_id", run_id)


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path_factory.mktemp('warm')}/optuna.db"
    make_study(url, "old-full", FP, {"data.batch_size": 64, "trainer.lr": 0.2},
               [(0.9, {"data.batch_size": 64}), (0.8, {"data.batch_size": 32}), (0.85, {"data.batch_size": 64}),
                (0.7, {"data.batch_size": 16})], run_id="a" * 32)
    make_study(url, "other-world", OTHER_WORLD, {"data.batch_size": 16}, [(0.5, {"data.batch_size": 16})])
    make_study(url, "other-job", OTHER_JOB, {"data.batch_size": 8}, [(0.99, {"data.batch_size": 8})])
    make_study(url, "no-pick", FP)  # stopped before any measured trial
    optuna.create_study(study_name="before-fingerprints", storage=url)
    return url


def test_find_gives_the_jobs_studies_full_matches_first(storage):
    found = find(storage, FP)
    assert [(e.name, e.match) for e in found][:2] in ([("no-pick", "full"), ("old-full", "full")],
                                                      [("old-full", "full"), ("no-pick", "full")])
    assert [(e.name, e.match) for e in found][2:] == [("other-world", "job")]
    assert find(storage, FP, exclude="old-full")[0].name == "no-pick"
    assert find(storage, Fingerprint("none", "x", "y", "z")) == []


def test_choose_auto_off_a_name_a_run_id_and_the_refusals(storage):
    found = find(storage, FP)
    assert choose("off", found) is None
    assert choose("auto", found).name == "old-full"  # the newest with a pick, full first
    assert choose("auto", [e for e in found if e.match == "job"]).name == "other-world"
    assert choose("other-world", found).match == "job"
    assert choose("a" * 32, found).name == "old-full"
    with pytest.raises(ConfigError, match=r"^tune.warm_start: no study named 'other-job' of this job.*allowed: auto, off"):
        choose("other-job", found)
    with pytest.raises(ConfigError, match=r"^tune.warm_start: study 'no-pick' has no pick yet"):
        choose("no-pick", found)
    assert choose("auto", []) is None


def test_seeds_are_the_pick_then_the_next_best_distinct_configs(storage):
    old = choose("old-full", find(storage, FP))
    assert seeds(storage, old) == [{"data.batch_size": 64, "trainer.lr": 0.2}, {"data.batch_size": 32},
                                   {"data.batch_size": 16}]
    assert seeds(storage, old, limit=1) == [{"data.batch_size": 64, "trainer.lr": 0.2}]


def test_a_plain_run_takes_a_full_match_only_and_refuses_in_one_line(storage):
    assert tuned_values(storage, FP, "auto").name == "old-full"
    with pytest.raises(ConfigError, match=r"^trainer.tuned: no study of this job with a pick .* fingerprint full4"):
        tuned_values(storage, Fingerprint("j1", "l3", "h1", "full4"), "auto")  # the job's studies: other layouts
    with pytest.raises(ConfigError, match=r"^trainer.tuned: no study named 'other-world'"):
        tuned_values(storage, FP, "other-world")


def test_drift_is_said_outside_the_confirmed_interval_only():
    from orchestrator.tune.advise import drift

    pick = {"figures": {"throughput": 100.0, "throughput_lo": 90.0, "throughput_hi": 110.0}}
    assert drift({"throughput": 95.0}, pick, "s1", "CMD") is None
    slow = drift({"throughput": 60.0}, pick, "s1", "python -m orchestrator mode=tune tune.warm_start=s1")
    assert slow.startswith("this run's 60.0 samples/s is below the interval study 's1' confirmed its pick at (90.0 to 110.0)")
    assert slow.endswith("re-tune from that study: python -m orchestrator mode=tune tune.warm_start=s1")
    assert "above" in drift({"throughput": 200.0}, pick, "s1", "CMD")
    assert drift({"throughput": 60.0}, {"figures": {"throughput": 100.0}}, "s1", "CMD") is None  # no interval


def test_the_drift_note_stays_in_the_load_report_beside_the_picks_advice(tmp_path):
    """A rerun of a study's pick writes its drift note, then its advice checked against the study,
    under its load_report.md: the advice's section (replaced when written again) leaves the drift
    note's alone."""
    import json

    from orchestrator.tune.advise import AGAINST, rerun_advice, study_drift

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=0.5, user_attrs={
        "values": {"data.batch_size": 32}, "throughput": 100.0, "utilization": 0.5}))
    study.set_user_attr("pick", {"trial": 0, "rule": "r", "figures": {
        "throughput": 100.0, "throughput_lo": 90.0, "throughput_hi": 110.0}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"diagnosis": {"verdict": "input-bound", "advice": ["a note"],
                                                               "moves": []}}))
    (run / "load_report.md").write_text("# Load report\n")
    note = study_drift(run, {"throughput": 50.0}, "s", storage, "CMD")
    assert note.startswith("this run's 50.0 samples/s is below")
    for _ in range(2):
        assert rerun_advice(run, "s", storage) is not None
    text = (run / "load_report.md").read_text()
    assert text.count("## Against the study's figures") == 1 and note in text
    assert text.count(f"\n{AGAINST}\n") == 1 and "- a note" in text


def test_a_partial_match_carries_the_loaders_per_item_costs_into_the_job_model(tmp_path):
    """The same job measured at another world size: its loader's CPU and wait per item seed a job
    model whose own runs do not show them (a first trial whose workers kept up)."""
    from orchestrator.jobmodel import JobModel, Run
    from orchestrator.tune.warm import Earlier, carry

    url = f"sqlite:///{tmp_path}/optuna.db"
    figures = {"throughput": 500.0, "step_time_s": 0.064, "data_wait_frac": 0.5, "rel_se": 0.05,
               "input_cost": {"data_wall_s": 1e-3, "data_cpu_s": 4e-4}}
    study = optuna.create_study(study_name="two-ranks", storage=url, direction="maximize")
    study.set_user_attr("world_size", 2)
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={
        "values": {"data.batch_size": 32, "data.num_workers": 0}, **figures}))
    carried = carry(url, Earlier("two-ranks", "job", None, dict(study.user_attrs)))
    assert carried.trials == [] and carried.loader["load_cpu"] == pytest.approx(4e-4)
    assert carried.loader["load_wait"] == pytest.approx(6e-4) and "loader's per-item costs" in carried.kept
    kept_up = Run(batch=32, workers=2, accum=1, rate=800.0, rel_se=0.05, consume=1e-3, consume_cpu=None,
                  busy_cpu=None, load_cpu=None, load_wait=None, data_wait=0.0)
    bare, seeded = JobModel.fit([kept_up]), JobModel.fit([kept_up], loader_prior=carried.loader)
    assert bare.load_cpu is None and seeded.load_cpu == pytest.approx(4e-4)
    full = carry(url, Earlier("two-ranks", "full", None, {}))
    assert len(full.trials) == 1 and full.loader == {} and "1 measured trials join" in full.kept


def test_a_second_study_of_the_job_starts_from_the_first_and_a_plain_run_applies_its_pick(make_cfg, tmp_path):
    """Two real studies of one job in one storage (the second after a change of learning rate,
    which leaves the fingerprint alone): the second enqueues the first's pick right after its
    baseline, its job model starts from the first's trials, and its summary says so; then a plain
    run with trainer.tuned=auto takes the newest pick, tagged as the rerun of best.yaml is."""
    from orchestrator.fingerprint import fingerprint
    from orchestrator.tune.study import run_study
    from orchestrator.tune.warm import apply_tuned

    from .test_tune import SHORT

    common = [*SHORT, f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.high=64",
              "tune.space.num_workers.high=0", "tune.space.accumulation_steps.high=1"]
    first = run_study(make_cfg(*common, "tune.n_trials=3"), tmp_path / "a", echo=False)
    assert first["warm_start"] is None and first["fingerprint"].startswith("fingerprint ")
    said: list = []
    second = run_study(make_cfg(*common, "tune.n_trials=2", "trainer.lr=0.02"), tmp_path / "b", echo=False)
    trials = optuna.load_study(study_name=second["study_name"], storage=second["storage"]).trials
    assert trials[0].user_attrs.get("baseline") and trials[1].user_attrs.get("warm_from") == first["study_name"]
    assert trials[1].user_attrs["values"]["data.batch_size"] == first["pick_values"]["data.batch_size"]
    warm = second["warm_start"]
    assert warm["from"] == first["study_name"] and warm["match"] == "full" and warm["enqueued"] >= 1
    assert "measured trials join the job model" in warm["kept"]
    # the first's measurement of its pick joins the second's measurement of it: trial 1's, or, where the
    # pick was the user's config, the baseline's (trial 1 then repeats it and is never launched)
    pick = first["pick_values"]["data.batch_size"]
    pooled = next(tr.user_attrs["pooled"] for tr in trials[:2]
                  if "pooled" in tr.user_attrs and tr.user_attrs["values"]["data.batch_size"] == pick)
    assert pooled["from"] == first["study_name"] and pooled["words"].startswith("2 measurements, 1 from study '")
    cold = run_study(make_cfg(*common, "tune.n_trials=1", "tune.warm_start=off"), tmp_path / "c", echo=False)
    assert cold["warm_start"] is None
    plain = make_cfg(f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.batch_size.high=64", "trainer.tuned=auto")
    tuned = apply_tuned(plain, said.append)
    assert tuned.tags["tuned_study"] == cold["study_name"]  # the newest with a pick
    assert tuned.data.batch_size == cold["pick_values"]["data.batch_size"]
    assert tuned.tags["tuned_storage"] == f"sqlite:///{tmp_path}/optuna.db"
    assert said and said[0].startswith("[tuned] trainer.tuned=auto: the pick of study '")
    assert fingerprint(tuned) == fingerprint(plain)  # the knobs it set are not the job
    with pytest.raises(ConfigError, match=r"^trainer.tuned: no study of this job"):
        apply_tuned(make_cfg(f"tune.storage=sqlite:///{tmp_path}/none.db", "trainer.tuned=auto"), said.append)
    with pytest.raises(ConfigError, match=r"^trainer.tuned: applies a study's pick to a plain run"):
        make_cfg(*common, "trainer.tuned=auto")


def test_a_config_moved_to_more_ranks_shares_the_cores_between_their_workers():
    from orchestrator.tune.warm import at_world

    pick = {"data.batch_size": 32, "data.num_workers": 4, "trainer.accumulation_steps": 1}
    assert at_world(pick, 1, 2) == {**pick, "data.num_workers": 2}
    assert at_world(pick, 1, 8)["data.num_workers"] == 1 and at_world(pick, 2, 1)["data.num_workers"] == 8
    assert at_world({**pick, "data.num_workers": 0}, 1, 2)["data.num_workers"] == 0
    assert at_world(pick, 2, 2) is pick


def test_a_carried_config_past_this_studys_space_widens_it(make_cfg):
    """An earlier study widened its workers past the space's top (edges.py) and picked 3; a warm
    study whose space stops at 2 widens it to hold 3, recorded as its `extended`, so that the
    enqueued config is the pick and not one whose workers the sampler chose."""
    from orchestrator.tune.space import SearchSpace
    from orchestrator.tune.warm import hold

    space = SearchSpace(make_cfg("tune.space.num_workers.high=2"))
    study = optuna.create_study(direction="maximize")
    pick = {"data.batch_size": 32, "data.num_workers": 3, "trainer.accumulation_steps": 1}
    param = {d.key: d.param for d in space.dims}
    workers, batch = param["data.num_workers"], param["data.batch_size"]
    assert workers not in space.params_of(pick) and batch in space.params_of(pick)
    hold(study, space, pick)
    assert study.user_attrs["extended"] == {"num_workers": 3} and workers in space.params_of(pick)
    hold(study, space, {**pick, "data.num_workers": 1})  # inside: nothing changes
    assert study.user_attrs["extended"] == {"num_workers": 3}


def test_a_config_moved_to_more_ranks_keeps_the_workers_that_wait_on_storage():
    """The job model's loader costs weigh the scaling: workers that mostly wait (storage latency)
    are as many a rank at any world size; those that mostly compute share the cores."""
    from orchestrator.tune.warm import at_world

    pick = {"data.batch_size": 32, "data.num_workers": 8, "trainer.accumulation_steps": 1}
    waits = {"load_cpu": 0.116e-3, "load_wait": 1.109e-3}  # storage_1 of the zoo: 1 ms an item
    assert at_world(pick, 1, 2, waits)["data.num_workers"] == 8
    computes = {"load_cpu": 1.6e-3, "load_wait": 0.0}
    assert at_world(pick, 1, 2, computes)["data.num_workers"] == 4
    half = {"load_cpu": 1e-3, "load_wait": 1e-3}
    assert at_world(pick, 1, 2, half)["data.num_workers"] == 6
    assert at_world(pick, 1, 2, {})["data.num_workers"] == 4


def test_a_resumed_study_borrows_again_from_the_study_it_recorded(storage, make_cfg):
    """A resumed warm-started study lends the job model the same trials again, by the name it
    recorded; one whose source was deleted since goes on with its own."""
    from types import SimpleNamespace

    from orchestrator.tune.warm import WARM_ATTR, start

    study = optuna.create_study(storage=storage, direction="maximize")
    study.set_user_attr(WARM_ATTR, {"from": "old-full", "match": "full", "kept": "", "enqueued": 1})
    lent = SimpleNamespace(warm_trials=[], warm_loader={})
    cfg = make_cfg()
    assert start(study, cfg, storage, study.study_name, None, lent, fresh=False, say=print)["from"] == "old-full"
    assert len(lent.warm_trials) == 4
    study.set_user_attr(WARM_ATTR, {"from": "deleted", "match": "full", "kept": "", "enqueued": 1})
    gone = SimpleNamespace(warm_trials=[], warm_loader={})
    assert start(study, cfg, storage, study.study_name, None, gone, fresh=False, say=print)["from"] == "deleted"
    assert gone.warm_trials == []


P, Q = {"data.batch_size": 64}, {"data.batch_size": 32}


def _figs(thr: float, util: float, half: float = 0.1) -> dict:
    return {"throughput": thr, "throughput_lo": thr * (1 - half), "throughput_hi": thr * (1 + half),
            "utilization": util, "utilization_lo": util - 0.05, "utilization_hi": util + 0.05,
            "windows": 8.0, "measured_s": 1.0, "rel_se": half / 1.96}


def _warm_study(storage: str, make_cfg, match: str, objective: str):
    """Study 'src' measured P high (a trial and a confirmation of 2 runs); a warm study of it
    measures P once low and Q once slightly higher, each told as a trial of the tuner is."""
    from types import SimpleNamespace

    from orchestrator.tune.launch import TrialLaunching, TrialRecord
    from orchestrator.tune.warm import Earlier, carry

    src = optuna.create_study(study_name="src", storage=storage, direction="maximize")
    src.add_trial(optuna.trial.create_trial(value=1000.0, user_attrs={"values": P, **_figs(1000.0, 0.8)}))
    src.set_user_attr("confirmed", {"0": {**_figs(1010.0, 0.8, 0.06), "runs": 2}})

    class Tuner(TrialLaunching):
        cfg = make_cfg(f"tune.objective={objective}", "tune.confirm_top=0")
        t, multi, offset, said = cfg.tune, False, 0.0, []
        proposals = SimpleNamespace(carried=carry(storage, Earlier("src", match, None)))

        def _say(self, line: str) -> None:
            self.said.append(line)

    tuner = Tuner()
    study = optuna.create_study(study_name=f"warm-{match}-{objective}", storage=storage, direction="maximize")
    study.set_user_attr("base_global_batch", 32)
    for values, figs in ((P, _figs(800.0, 0.70)), (Q, _figs(830.0, 0.72))):
        trial = study.ask()
        for k, v in {"values": values, "global_batch": values["data.batch_size"], **figs}.items():
            trial.set_user_attr(k, v)
        tuner._tell(study, trial, TrialRecord(trial.number, "RUNNING", values, metrics=dict(figs)))
    return study, tuner


@pytest.mark.parametrize("objective", ["throughput", "utilization"])
def test_a_full_match_pools_the_earlier_studys_measurements_of_a_config(make_cfg, tmp_path, objective):
    """One noisy trial does not outrank what the earlier study measured of the same config on the
    same job, layout and machine: P's figures are its own trial pooled with the source study's
    trial and confirmed figure, so the pick (and the value Optuna ranks by) is P, not Q."""
    from orchestrator.tune.report import pooled_words
    from orchestrator.tune.rules import best_trials, confirm_candidates, measured

    study, tuner = _warm_study(f"sqlite:///{tmp_path}/optuna.db", make_cfg, "full", objective)
    p, q = study.trials
    assert best_trials(study, tuner.t)[0].number == p.number
    assert max(study.trials, key=lambda tr: tr.values[0]).number == p.number  # what Optuna's samplers see
    assert measured(p)["throughput"] == pytest.approx(1000.0)  # the median of 800, 1000 and 1010
    assert p.user_attrs["throughput"] == 800.0 and "pooled" not in q.user_attrs  # its own kept; Q: its own only
    assert pooled_words(p) == "3 measurements, 2 from study 'src' (its trial 0 and its confirmation of 2 runs)"
    assert tuner.said == [f"[tune] trial 0 pooled, {pooled_words(p)}: utilization 80.0%  throughput 1000.0/s +-7%"]
    cfg3 = dataclasses.replace(tuner.t, confirm_top=3)
    assert confirm_candidates(study, cfg3)[0].number == p.number


def test_a_partial_match_pools_nothing(make_cfg, tmp_path):
    """Another world size or machine: the earlier figures are not this layout's; each trial stands alone."""
    from orchestrator.tune.rules import best_trials

    study, tuner = _warm_study(f"sqlite:///{tmp_path}/optuna.db", make_cfg, "job", "throughput")
    assert not any("pooled" in tr.user_attrs for tr in study.trials) and tuner.said == []
    assert best_trials(study, tuner.t)[0].number == 1  # Q, on its single measurement


@pytest.mark.slow  # two studies of one trial each: 36 s on a busy 2-core host
def test_a_warm_start_with_the_global_batch_free_runs_the_picks_at_the_new_studys_learning_rate(make_cfg, tmp_path):
    """tune.global_batch=free with SGD: the first study's pick trains another global batch than its
    base (64 where the base is 32) at the rate its rule gave (linear: 2 x 0.1). A second study of the
    job with another rate and rule (0.05, sqrt) runs that pick at the rate its own rule gives from
    its own base, not at the first study's."""
    from orchestrator.tune.study import run_study

    from .test_tune import SHORT

    common = [*SHORT, f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.global_batch=free", "trainer.optimizer=sgd",
              "data.batch_size=32", "tune.baseline=false", "tune.space.batch_size.type=categorical",
              "tune.space.batch_size.choices=[64]", "tune.space.num_workers.high=0",
              "tune.space.accumulation_steps.high=1", "tune.n_trials=1"]
    first = run_study(make_cfg(*common, "trainer.lr=0.1", "tune.lr_scaling=linear"), tmp_path / "a", echo=False)
    assert first["pick_values"]["data.batch_size"] == 64 and first["pick_values"]["trainer.lr"] == pytest.approx(0.2)
    second = run_study(make_cfg(*common, "trainer.lr=0.05", "tune.lr_scaling=sqrt"), tmp_path / "b", echo=False)
    assert second["warm_start"]["from"] == first["study_name"] and second["warm_start"]["match"] == "full"
    carried = optuna.load_study(study_name=second["study_name"], storage=second["storage"]).trials[0]
    assert carried.user_attrs["warm_from"] == first["study_name"] and carried.user_attrs["global_batch"] == 64
    assert carried.user_attrs["lr"] == pytest.approx(0.05 * 2 ** 0.5)  # the second study's rule, from its rate
    assert second["pick_values"]["trainer.lr"] == pytest.approx(0.05 * 2 ** 0.5)


# the simulated storage latency per item (the field that slows a run of the same job)
LATENCY = "sim.read_latency_ms"


@pytest.mark.slow  # a study, a plain run and the start of the re-tune, two through the CLI
def test_a_tuned_run_that_drifts_says_so_and_its_retune_command_starts_warm(make_cfg, tmp_path, mlflow_uri):
    """A plain run with trainer.tuned=auto of a tuned job now slowed by storage latency (the job's
    fingerprint unchanged) measures samples/s below the interval the study confirmed its pick at:
    the console says so with the command that re-tunes, and that command, run as printed where the
    run was (the project's root), starts a study warm from the old one (stopped once it says so,
    its run dir removed)."""
    import contextlib
    import shlex
    import shutil
    import signal
    import subprocess
    import threading
    from pathlib import Path

    from orchestrator.tune.study import run_study

    from .conftest import ROOT, TINY, run_cli
    from .test_tune import SHORT

    db = f"sqlite:///{tmp_path}/optuna.db"
    # one config, measured long enough for an interval well above 0 on a busy host
    study = [*SHORT, f"tune.storage={db}", "tune.space.batch_size.type=categorical", "tune.space.batch_size.choices=[8]",
             "tune.space.num_workers.high=0", "tune.space.accumulation_steps.high=1", "tune.n_trials=1",
             "measure.window_steps=2", "measure.min_measure_s=1.5", "measure.max_measure_s=3"]
    first = run_study(make_cfg(*study), tmp_path / "study", echo=False)
    name = first["study_name"]
    out = run_cli([*TINY, f"tracking.uri={mlflow_uri}", f"tune.storage={db}", "trainer.tuned=auto",
                   "trainer.max_steps=8", f"{LATENCY}=30", f"hydra.run.dir={tmp_path / 'plain'}"])
    assert out.returncode == 0, out.stderr
    drift = [line for line in out.stdout.splitlines() if line.startswith("[tuned] this run's")]
    assert drift and f"samples/s is below the interval study '{name}' confirmed its pick at" in drift[0], out.stdout
    assert "Against the study's figures" in (tmp_path / "plain" / "load_report.md").read_text()
    retune = drift[0].split("re-tune from that study: ", 1)[1]
    assert f"tune.warm_start={name}" in retune and "mode=tune" in retune and "trainer.tuned" not in retune
    proc = subprocess.Popen(shlex.split(retune), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    watchdog = threading.Timer(180, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    said = []
    try:
        for line in proc.stdout:
            said.append(line.rstrip())
            if line.startswith("[tune] warm start from"):
                break
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the study stops as on ctrl-C: its ranks end with it
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stdout.close()
        for line in said:  # its run dir, under the project's outputs/, and the dirs made for it
            if line.startswith("[orchestrator] run dir: "):
                run = Path(line.split(": ", 1)[1])
                shutil.rmtree(run, ignore_errors=True)
                for parent in run.parents:
                    if parent == ROOT / "outputs" or not parent.is_relative_to(ROOT / "outputs"):
                        break
                    with contextlib.suppress(OSError):  # not empty: another run's
                        parent.rmdir()
    assert said and said[-1].startswith(f"[tune] warm start from study '{name}' (the same job, layout and hardware"), \
        "\n".join(said)
