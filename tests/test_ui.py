"""End to end in a browser: `scripts/ui.sh` serves the MLflow UI over a store holding a run and a
study; headless Chromium sees the runs, the study's nested trials and an image artifact. And
optuna-dashboard's own server over a study's storage: the objective named, the pick in the notes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import pytest

from orchestrator.app import run_job
from orchestrator.tune.study import run_study

from .conftest import ROOT, free_port

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.fail("headless Chromium is missing: scripts/setup.sh installs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def wait_for(predicate, timeout=60.0, every=0.5, browser=None, what="condition"):
    """Poll `predicate`; on timeout save the page as outputs/ui_timeout.png for a look."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            value = predicate()
            if value:
                return value
        except Exception:
            pass
        time.sleep(every)
    if browser is not None:
        os.makedirs(ROOT / "outputs", exist_ok=True)
        browser.save_screenshot(str(ROOT / "outputs" / "ui_timeout.png"))
    raise TimeoutError(f"{what}: not seen in {timeout:g}s")


@pytest.mark.slow  # kept out of the suite's 10 minutes (make test-slow)
def test_mlflow_ui_shows_runs_trials_and_images(make_cfg, tmp_path, ui_server, browser):
    url, store = ui_server
    # log through the server: any tracking URI works, not only SQLite
    job = run_job(make_cfg(f"tracking.uri={url}", "tracking.experiment=ui-check", "trainer.max_steps=8"),
                  tmp_path / "job", echo=False)
    summary = run_study(make_cfg(f"tracking.uri={url}", "tracking.experiment=ui-check", "mode=tune",
                                 "tune.n_trials=2", "measure.trial_steps=4", "measure.window_steps=2", "measure.warmup_steps=1",
                                 "measure.rel_precision=0", "tune.confirm_top=0",
                                 f"tune.storage=sqlite:///{tmp_path}/optuna.db", "tune.space.num_workers.high=0"),
                        tmp_path / "study", echo=False)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp_id = client.get_experiment_by_name("ui-check").experiment_id
    run_name = client.get_run(job["mlflow_run_id"]).info.run_name
    parent_name = client.get_run(summary["mlflow_run_id"]).info.run_name

    # the training runs table (not MLflow's GenAI overview) with the key figures as columns, at the
    # URL the run's summary prints
    from orchestrator.tracking import Tracker

    tracker = Tracker(make_cfg(f"tracking.uri={url}", "tracking.experiment=ui-check").tracking)
    tracker.check()
    assert job["mlflow"].endswith(tracker.runs_url(url)) and exp_id == tracker.experiment_id
    browser.set_window_size(2200, 1000)  # the table renders the columns in view
    browser.get(tracker.runs_url(url))
    body = lambda: browser.find_element("tag name", "body").text  # noqa: E731
    wait_for(lambda: run_name in body() and parent_name in body(), browser=browser, what="runs table")
    headers = lambda: [h.text for h in browser.find_elements("css selector", "[role='columnheader']")]  # noqa: E731
    wait_for(lambda: {"throughput", "utilization_pct", "verdict"} <= set(headers()), browser=browser,
             what="throughput, utilization_pct and verdict columns")
    assert "Overview" not in headers() and "/overview" not in browser.current_url
    verdict = client.get_run(job["mlflow_run_id"]).data.tags["verdict"]
    wait_for(lambda: verdict in body(), browser=browser, what="the job's verdict in its row")

    # the study's trials are nested under it: expand the parent row
    expander = "button[data-component-id*='runnamecellrenderer']"  # the (+) before a parent run's name
    wait_for(lambda: browser.find_elements("css selector", expander), browser=browser, what="expander of the study's run")
    for button in browser.find_elements("css selector", expander):
        button.click()
    wait_for(lambda: "trial 0" in body() and "trial 1" in body(), browser=browser, what="nested trials")
    os.makedirs(ROOT / "outputs", exist_ok=True)
    browser.save_screenshot(str(ROOT / "outputs" / "ui_runs.png"))

    # docs/ui.md's filters work as written: the pick's row, by its tag
    from selenium.webdriver.common.keys import Keys

    search = browser.find_element("css selector", "input[placeholder*='metrics.rmse']")
    search.send_keys("tags.pick = 'true'", Keys.ENTER)
    pick = f"trial {summary['best']['number']}"
    other = f"trial {1 - summary['best']['number']}"
    wait_for(lambda: pick in body() and other not in body(), browser=browser, what="the pick's row alone")
    browser.save_screenshot(str(ROOT / "outputs" / "ui_pick_filter.png"))

    # the charts view opens on samples/s and utilization per run
    browser.get(tracker.runs_url(url) + "&compareRunsMode=CHART")
    from orchestrator.tracking import VIEW_SECTION

    wait_for(lambda: VIEW_SECTION in body() and "utilization_pct" in body()
             and body().index(VIEW_SECTION) < body().index("Model metrics"),
             browser=browser, what="the charts view's throughput and utilization section first")
    browser.save_screenshot(str(ROOT / "outputs" / "ui_charts.png"))

    # an image artifact of the job renders
    browser.get(f"{url}/#/experiments/{exp_id}/runs/{job['mlflow_run_id']}/artifacts/timeline.png")
    # the preview is an <img> (from a blob URL) holding the decoded PNG: 720 px wide at dpi 80
    img = wait_for(lambda: "timeline.png" in body() and
                   [i for i in browser.find_elements("tag name", "img")
                    if browser.execute_script("return arguments[0].naturalWidth", i) >= 700],
                   browser=browser, what="timeline.png artifact")
    assert img
    shot = ROOT / "outputs" / "ui_artifact.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    shutil.copy(shot, tmp_path / "ui_artifact.png")


@contextlib.contextmanager
def optuna_dashboard(storage: str, log_path) -> Iterator[str]:
    """optuna-dashboard's own server (its command, as docs/tuning.md gives it) on a free loopback
    port over `storage`; yields its URL once it answers, and stops it afterwards."""
    cli = os.path.join(os.path.dirname(sys.executable), "optuna-dashboard")
    if not os.path.exists(cli):
        pytest.fail("optuna-dashboard is missing: scripts/setup.sh installs the project's test and dashboard extras")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb")
    proc = subprocess.Popen([cli, storage, "--port", str(port), "--host", "127.0.0.1"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is None and urllib.request.urlopen(url + "/api/meta", timeout=2).status == 200,
                 timeout=60, what=f"optuna-dashboard on {url}")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow  # 15 s; tests/test_answer.py reads the same notes back without a browser
def test_optuna_dashboard_shows_the_pick_and_the_named_objective(make_cfg, tmp_path, browser):
    """A user opening the study in optuna-dashboard sees the objective by its name (not "Objective
    0"), the product's pick in the study's note (the Note page, beside the study's page whose "Best
    Trial" is Optuna's best_trial) and in the pick's own trial note."""
    import optuna

    from orchestrator.tune.answer import METRIC_NAMES

    from .test_tune import SHORT

    storage = f"sqlite:///{tmp_path}/optuna.db"
    cfg = make_cfg(*SHORT, "tune.n_trials=2", f"tune.storage={storage}", "tune.space.num_workers.high=0",
                   "tune.space.accumulation_steps.high=1")
    summary = run_study(cfg, tmp_path / "study", echo=False)
    pick = summary["best"]["number"]
    study = optuna.load_study(study_name=summary["study_name"], storage=storage)
    page = lambda: browser.find_element("tag name", "body").text  # noqa: E731
    with optuna_dashboard(storage, tmp_path / "dashboard.log") as url:
        browser.get(f"{url}/dashboard/studies/{study._study_id}")
        name = METRIC_NAMES[cfg.tune.objective][0]
        wait_for(lambda: name in page() and "Best Trial (number=" in page(), browser=browser,
                 what=f"the objective's name {name!r} on the study's page")
        assert "Objective 0" not in page()

        browser.get(f"{url}/dashboard/studies/{study._study_id}/note")
        wait_for(lambda: f"The product's pick: trial {pick}" in page(), browser=browser, what="the study's note")
        assert f"batch size {summary['best']['values']['data.batch_size']}, 0 DataLoader workers" in page()
        assert "within 0.95 of the fastest samples/s" in page()
        differs = study.best_trial.number != pick
        assert (f"\"Best Trial\", trial {study.best_trial.number}, is not the pick" in page()) == differs
        shot = tmp_path / "optuna_dashboard_note.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        browser.get(f"{url}/dashboard/studies/{study._study_id}/trials?numbers={pick}")
        wait_for(lambda: f"Trial {pick} (trial_id=" in page() and "This trial is the study's pick" in page(),
                 browser=browser, what="the pick's trial note")
