"""Artifacts of runs logged through a tracking server (`scripts/ui.sh`) go through the server's
proxied store, whichever working directory (machine) logs them; runs logged straight into the
SQLite store keep theirs beside the DB, still served; the tracker refuses to mix the two."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.schema import ConfigError
from orchestrator.tracking import Tracker

from .conftest import TINY, run_cli


def _server_get(url: str, route: str, **query: str) -> bytes:
    return urllib.request.urlopen(f"{url}{route}?{urllib.parse.urlencode(query)}", timeout=10).read()


def test_artifacts_of_runs_logged_through_the_server_go_through_it(make_cfg, ui_server, tmp_path):
    url, store = ui_server
    served_dir = tmp_path / "mlartifacts"  # what the server serves, beside the DB

    # a run logged straight into the SQLite store: file:// artifacts beside the DB, read back through the server
    local = Tracker(make_cfg(f"tracking.uri={store}", "tracking.experiment=local").tracking)
    local.check()
    local.start("local-run", {}, {})
    note = tmp_path / "note.txt"
    note.write_text("logged into SQLite\n")
    local.log_artifact(note)
    local.end("FINISHED")
    local_uri = MlflowClient(store).get_run(local.run_id).info.artifact_uri
    assert local_uri == (served_dir / local.run_id / "artifacts").as_uri()
    listed = json.loads(_server_get(url, "/api/2.0/mlflow/artifacts/list", run_id=local.run_id))
    assert [f["path"] for f in listed["files"]] == ["note.txt"]
    assert _server_get(url, "/get-artifact", run_uuid=local.run_id, path="note.txt") == note.read_bytes()

    # that experiment's file:// root is refused through the server; a proxied one is refused over SQLite
    with pytest.raises(ConfigError, match=r"tracking.experiment: 'local' keeps its artifacts at file://.*tracking.uri=sqlite"):
        Tracker(make_cfg(f"tracking.uri={url}", "tracking.experiment=local").tracking).check()
    Tracker(make_cfg(f"tracking.uri={url}", "tracking.experiment=shared").tracking).check()  # created by the server
    with pytest.raises(ConfigError, match=r"tracking.experiment: 'shared' keeps its artifacts in a server's proxied store"):
        Tracker(make_cfg(f"tracking.uri={store}", "tracking.experiment=shared").tracking).check()

    # a job logged through the server from another working directory
    elsewhere = tmp_path / "other-machine"
    elsewhere.mkdir()
    proc = run_cli([*TINY, "trainer.max_steps=4", f"tracking.uri={url}", "tracking.experiment=shared"], cwd=elsewhere)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result_path,) = elsewhere.glob("outputs/runs/*/*/result.json")
    run_id = json.loads(result_path.read_text())["mlflow_run_id"]

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("shared")
    run = client.get_run(run_id)
    assert run.info.experiment_id == exp.experiment_id
    assert exp.artifact_location.startswith("mlflow-artifacts:/"), exp.artifact_location
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/"), run.info.artifact_uri
    assert {"result.json", "config.yaml"} <= {a.path for a in client.list_artifacts(run_id)}
    got = Path(client.download_artifacts(run_id, "result.json", str(tmp_path / "download")))
    assert got.read_bytes() == result_path.read_bytes()
    # the server stored them in its own directory; the logging side kept no artifact store of its own
    assert (served_dir / exp.experiment_id / run_id / "artifacts" / "result.json").read_bytes() == result_path.read_bytes()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["outputs"]
    assert sorted(p.name for p in (elsewhere / "outputs").iterdir()) == ["runs"]
