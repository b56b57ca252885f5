"""MLflow: one run per job, written only by the parent (ranks never import MLflow).

The URI is checked before anything is launched, so a bad one is a one-line error and never a
run left RUNNING.
"""

from __future__ import annotations

import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from .measure.results import JobResult
from .rundir import describe_process, process_gone
from .schema import ConfigError, TrackingConfig
from .stores import PROJECT, redact, resolve_uri, sqlite_path, store_error, store_lock

PROJECT_STORE = PROJECT / "outputs" / "mlflow.db"  # what scripts/ui.sh (`make ui`) serves
UI_URL = "http://127.0.0.1:5000"  # `make ui`

# A job's summary metrics (record); per-window ones are logged live by livelog.LiveLog.
SUMMARY_METRICS = ("utilization", "throughput", "step_time_s", "data_wait_frac", "h2d_frac", "compute_frac",
                   "comm_frac", "optimizer_frac", "peak_mem_mb", "final_loss", "first_loss", "wall_s", "mfu",
                   "nvml_util", "sm_active", "flops_per_sample", "tokens_per_s", "padding_frac", "eval_s", "eval_frac",
                   "time_to_target_s", "samples_to_target")

# The runs table of MLflow 3.17's UI shows only Source, Models and Dataset by default, and opens
# in its GenAI mode unless the URL says `workflowType=machine_learning` (the UI's default workflow
# is GenAI whatever the experiment's kind). A shared view state (an experiment tag
# `mlflow.sharedViewState.<key>` holding the table's JSON UI state, read when the URL carries
# `viewStateShareKey=<key>`) opens it on the columns a user reads first.
VIEW_KEY = "training"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# (The UI orders metrics, then tags, each alphabetically; a study's run logs its pick's figures
# under the same names, so its row reads like its trials'.)
# MLflow shows a metric as logged, a fraction as 0.110927...: shares are also logged in percent, named so
PERCENT_METRICS = ("utilization", "mfu")
VIEW_COLUMNS = ("metrics.`throughput`", "metrics.`utilization_pct`", "metrics.`mfu_pct`",
                "metrics.`confirmed_throughput`", "metrics.`confirmed_utilization_pct`", "tags.`pick`",
                "tags.`verdict`", "tags.`trial_state`", "tags.`world_size`")
# Its charts view (compareRunsMode=CHART) opens on a section of bar charts, a bar per run: samples/s and
# utilization (as MLflow's charts state holds them: section and cards by uuid); MLflow adds its
# generated sections of the other metrics after it.
VIEW_SECTION = "throughput and utilization per run"
VIEW_CHARTS = ("throughput", "utilization_pct", "confirmed_throughput")  # a chart shows only where runs have it
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"  # the UI's training kind (not its GenAI one)

# Fail fast against an unreachable server instead of MLflow's minutes of retries.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
# MLflow prints "View run ... / View experiment at: <server>/#/experiments/<id>" for each run ended
# through a server: that page opens in the UI's GenAI mode. Tracker.where() says the training view.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def eval_points(event: Dict[str, Any], step: int) -> List[tuple[str, float, int]]:
    """An evaluation's MLflow metrics at its step: `val/loss` and `val/<metric>` (trainer.val_metric)."""
    return [("val/loss", event["val_loss"], step), *((f"val/{k}", v, step) for k, v in event["metrics"].items())]


def view_state() -> Dict[str, Any]:
    """The training view's UI state (VIEW_TAG): the runs table's columns, and the charts view's
    first section (VIEW_CHARTS)."""
    section = "section-training"
    return {"selectedColumns": list(VIEW_COLUMNS), "isAccordionReordered": True,  # generated sections come after
            "compareRunSections": [{"uuid": section, "name": VIEW_SECTION, "display": True, "isReordered": False,
                                    "deleted": False, "isGenerated": False}],
            "compareRunCharts": [{"uuid": f"chart-{key}", "type": "BAR", "runsCountToCompare": 100,
                                  "metricSectionId": section, "deleted": False, "isGenerated": False, "metricKey": key}
                                 for key in VIEW_CHARTS]}


def with_percent(points: List[tuple]) -> List[tuple]:
    """(name, value, step) points, and for each share of PERCENT_METRICS the same in percent (`<name>_pct`)."""
    return list(points) + [(f"{k}_pct", round(100 * v, 2), step) for k, v, step in points if k in PERCENT_METRICS]


def runs_url(base: str, experiment_id: str) -> str:
    """An experiment's training runs table, with the key columns (VIEW_TAG), in the UI at `base`."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}" \
           "&workflowType=machine_learning"


def noise_metrics(result: JobResult) -> List[tuple]:
    """The gradient noise scale's MLflow metrics: `noise_scale` (B_simple), its interval's ends
    (`noise_scale_lo`, `noise_scale_hi`) and the run's second half's (`noise_scale_late`, its interval's
    `noise_scale_late_lo`, `noise_scale_late_hi`), where measured."""
    noise, step = result.noise_scale, result.steps or 0
    if noise is None:
        return []
    return [(name, getattr(noise, key), step) for name, key in (("noise_scale", "b_simple"), ("noise_scale_lo", "lo"),
                                                                ("noise_scale_hi", "hi"), ("noise_scale_late", "b_late"),
                                                                ("noise_scale_late_lo", "late_lo"),
                                                                ("noise_scale_late_hi", "late_hi"))
            if getattr(noise, key) is not None]


class Tracker:
    """Thin wrapper over `MlflowClient` with an explicit run id (safe from helper threads)."""

    def __init__(self, cfg: TrackingConfig, enabled: bool = True) -> None:
        self.cfg = cfg
        self.uri = resolve_uri(cfg.uri, PROJECT)  # a relative store is the project's, from any directory
        self.shown = redact(self.uri)  # what messages show: the password masked
        self.enabled = cfg.enabled and enabled
        self.client: Any = None
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None

    def check(self) -> None:
        """Make sure the tracking store is usable; raises ConfigError naming tracking.uri."""
        if not self.enabled:
            return
        db = sqlite_path(self.uri)
        if db is not None:
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"tracking.uri: cannot create the directory of {db} ({exc.strerror})") from None
            if not os.access(db.parent, os.W_OK):
                raise ConfigError(f"tracking.uri: {db.parent} is not writable")
        elif self.uri.startswith(("http://", "https://")):
            try:
                parts = urllib.parse.urlsplit(self.uri)  # /health needs no credentials, and urllib takes none in the URL
                health = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl().rstrip("/") + "/health"
                urllib.request.urlopen(health, timeout=5).read()
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise ConfigError(f"tracking.uri: no MLflow server answers at {self.shown} ({reason})") from None
        from mlflow.tracking import MlflowClient

        # MLflow's INFO lines as it creates or upgrades a database's tables ("Creating initial MLflow
        # database tables...", "Updating database tables"): not the user's business, and on a store
        # that then fails they came before the one line that says why
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        try:
            # The first use of a fresh SQLite file creates MLflow's tables: one process at a time.
            with store_lock(self.uri):
                self.client = MlflowClient(tracking_uri=self.uri)
                exp = self._get_or_create_experiment()
            if exp.lifecycle_stage == "deleted":
                raise ConfigError(
                    f"tracking.experiment: '{self.cfg.experiment}' is deleted in {self.shown}; restore it or pick another name"
                )
            self.experiment_id = exp.experiment_id
            self._set_view(exp.tags)
        except ConfigError:
            raise
        except Exception as exc:  # driver missing, auth, schema, the server down...
            said = store_error(exc, self.uri)
            raise ConfigError(f"tracking.uri: {said}" if " unreachable: " in said
                              else f"tracking.uri: cannot use {self.shown}: {said}") from None
        self._check_artifact_home()

    def _set_view(self, tags: Dict[str, str]) -> None:
        """The experiment's kind (older experiments lack it) and its training view (VIEW_TAG)."""
        import json

        view = json.dumps(view_state())
        if tags.get(KIND_TAG) != KIND:
            self.client.set_experiment_tag(self.experiment_id, KIND_TAG, KIND)
        if tags.get(VIEW_TAG) != view:
            self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, view)

    def runs_url(self, base: str) -> str:
        return runs_url(base, str(self.experiment_id))

    def where(self) -> str:
        """Where this job logged and how to look at it, in one line: the UI's URL when `make ui`
        serves this store (the project's outputs/mlflow.db) or it is a server, else the command
        that serves it."""
        if not self.enabled or self.experiment_id is None:
            return "MLflow: off (tracking.enabled=false)"
        if self.uri.startswith(("http://", "https://")):
            return f"MLflow: {self.runs_url(self.shown)}"
        served = sqlite_path(self.uri) == PROJECT_STORE
        how = "`make ui`, then" if served else f"`bash {PROJECT / 'scripts' / 'ui.sh'} 5000 {self.shown}`, then"
        return f"MLflow: {self.shown} (experiment '{self.cfg.experiment}'); browse: {how} {self.runs_url(UI_URL)}"

    def _check_artifact_home(self) -> None:
        """An experiment keeps its artifacts either on the disk of its SQLite store's machine
        (file://, beside the DB) or in a server's proxied store (mlflow-artifacts:/). Runs logged
        through a server must not write a file:// path themselves (another machine cannot reach
        it), and a SQLite client cannot reach a proxied store: refuse both before any launch."""
        location = self.client.get_experiment(self.experiment_id).artifact_location
        scheme, name = urllib.parse.urlparse(location).scheme, self.cfg.experiment
        served = self.uri.startswith(("http://", "https://"))
        if served and scheme in ("", "file"):
            raise ConfigError(
                f"tracking.experiment: '{name}' keeps its artifacts at {location}, a path on the server's machine that "
                f"runs logged through {self.shown} cannot write; pick a new tracking.experiment (created through the "
                f"server, its artifacts go through it) or log on that machine with tracking.uri=sqlite:///<its DB>")
        if not served and scheme == "mlflow-artifacts":
            raise ConfigError(
                f"tracking.experiment: '{name}' keeps its artifacts in a server's proxied store ({location}); "
                f"log it through that server (tracking.uri=http://HOST:PORT) or pick another experiment")

    def _get_or_create_experiment(self) -> Any:
        """The experiment named tracking.experiment, created if missing. Another process (on this
        machine or another, on any store) may create it between our read and our create: its
        "already exists" is success, and we read the experiment back."""
        name = self.cfg.experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp
        try:
            # the UI shows training runs (not its GenAI views) for this kind of experiment
            self.client.create_experiment(name, self._artifact_root(), tags={KIND_TAG: KIND})
        except Exception:  # created meanwhile by someone else, or a real error: the read tells
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp
        return self.client.get_experiment_by_name(name)

    def sibling(self) -> "Tracker":
        """A tracker for another run in the same checked store and experiment (no second check)."""
        other = Tracker(self.cfg, enabled=self.enabled)
        other.client, other.experiment_id = self.client, self.experiment_id
        return other

    def _artifact_root(self) -> Optional[str]:
        """Artifacts of a SQLite store live beside the DB (not in the working directory)."""
        db = sqlite_path(self.uri)
        if db is not None:
            return (db.parent / "mlartifacts").as_uri()
        return None  # a server decides

    def start(self, run_name: Optional[str], params: Dict[str, Any], tags: Dict[str, str],
              parent_run_id: Optional[str] = None) -> Optional[str]:
        if not self.enabled:
            return None
        from mlflow.entities import Param

        all_tags = dict(tags)
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name,
                                     tags={k: str(v) for k, v in all_tags.items()})
        self.run_id = run.info.run_id
        # log_batch splits into the store's batch limits itself
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        return self.run_id

    def reopen(self, run_id: str, tags: Dict[str, Any]) -> Optional[str]:
        """Continue an existing run (a resumed job): back to RUNNING, steps go on."""
        if not self.enabled:
            return None
        from mlflow.entities import RunTag

        try:
            self.client.get_run(run_id)
        except Exception:
            raise ConfigError(f"trainer.resume: the checkpoint's MLflow run {run_id} is not in {self.shown}") from None
        self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        return run_id

    def last_step(self, key: str) -> int:
        """The last step of the metric `key` this run holds (-1: none, or no tracking): where a
        resumed run's earlier attempt got to."""
        if not self.run_id or self.client is None:
            return -1
        try:
            return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=-1)
        except Exception:  # tracking trouble: the points are logged again rather than lost
            return -1

    def close_dead_runs(self, where: str, why: str, unowned: bool = False) -> List[str]:
        """End FAILED, with the tag `closed_note`, the RUNNING runs matching the MLflow filter `where`
        whose owner (tag `owner`) is a process that died (killed -9: nobody left to end them); with
        `unowned`, also those without the tag (made before runs carried it). Returns their ids; one
        note line each. Tracking trouble is printed, never raised."""
        from datetime import datetime

        if not self.enabled or self.client is None:
            return []
        closed: List[str] = []
        try:
            runs = self.client.search_runs([self.experiment_id], f"{where} and attributes.status = 'RUNNING'",
                                           max_results=1000)
            for run in runs:
                owner = run.data.tags.get("owner")
                if not (process_gone(owner) if owner else unowned):
                    continue
                who = describe_process(owner) if owner else "owner unknown"
                note = f"closed FAILED at {datetime.now():%Y-%m-%d %H:%M:%S}: its process ({who}) died while it ran; {why}"
                self.client.set_tag(run.info.run_id, "closed_note", note)
                self.client.set_terminated(run.info.run_id, status="FAILED")
                closed.append(run.info.run_id)
                print(f"[tracking] note: MLflow run {run.info.run_id} ({run.info.run_name}) was left RUNNING by a "
                      f"process that died ({who}): closed FAILED")
        except Exception as exc:
            print(f"[tracking] could not close runs left RUNNING by dead processes: {str(exc).splitlines()[0][:300]}")
        return closed

    def log_metrics(self, points: Iterable[tuple[str, float, int]]) -> None:
        """(key, value, step) points; NaN/inf are dropped (MLflow rejects them on some stores)."""
        if not self.run_id:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics: List[Any] = [
            Metric(k, float(v), now, int(s)) for k, v, s in points
            if v is not None and float(v) == float(v) and abs(float(v)) != float("inf")
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def set_tags(self, tags: Dict[str, Any]) -> None:
        if not self.run_id:
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def run_info(self, run_id: str) -> Any:
        """Another run of this store (MLflow's RunInfo: its experiment, its status), or None: no
        tracking, or a run this store does not hold (another store's, or deleted)."""
        if not self.enabled or self.client is None:
            return None
        try:
            return self.client.get_run(run_id).info
        except Exception:
            return None

    def log_to(self, run_id: Optional[str], metrics: Optional[Dict[str, float]] = None,
               tags: Optional[Dict[str, Any]] = None) -> None:
        """Metrics (as given, at step 0) and tags on another run of this store: a trial's, a
        study's. Nothing without tracking."""
        if not run_id or self.client is None:
            return
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in (metrics or {}).items()],
                              tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])

    def end_run(self, run_id: Optional[str], status: str) -> None:
        """End another run of this store (a trial's) with MLflow's `status`. Nothing without tracking."""
        if run_id and self.client is not None:
            self.client.set_terminated(run_id, status)

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None) -> None:
        if self.run_id and path.exists():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def record(self, result: JobResult, files: List[Path], ranks_dir: Path, status: str,
               end_as: Optional[str] = None) -> None:
        """A finished job's record: summary metrics, tags, the files and the ranks' traces and
        tracebacks as artifacts; then the run ends with `status` (tag `status`), or with MLflow's
        word `end_as` where the status is none of MLflow's (CHECKPOINTED). Tracking trouble is
        printed, never raised: the job's outcome matters more."""
        try:
            figures = {k: v for k in SUMMARY_METRICS if isinstance(v := result.get(k), (int, float)) and not math.isnan(v)}
            self.log_metrics(with_percent([(f"final/{k}" if k in ("final_loss", "first_loss") else k, v,
                                            result.steps or 0) for k, v in figures.items()]))
            self.log_metrics(noise_metrics(result))
            tags = {"status": str(status)}
            if result.utilization_source:
                tags["utilization_source"] = result.utilization_source
            if result.per_rank:
                tags["device"] = result.per_rank[0].get("device")
                tags["bottleneck"] = result.bottleneck or "-"
            noise = result.noise_scale
            if noise:  # how it was measured: method, the two batch sizes, the steps estimated
                tags["noise_scale_method"] = (f"{noise.method} ({noise.batch_small} vs {noise.batch_big} "
                                              f"samples, {noise.n} steps)")
            if result.diagnosis:
                tags["diagnosis"] = tags["verdict"] = result.diagnosis["verdict"]
            self.set_tags(tags)
            for path in files:
                self.log_artifact(path)
            for trace in sorted(ranks_dir.glob("trace_rank*.json")):
                self.log_artifact(trace, "traces")
            for err in sorted(ranks_dir.glob("rank*.err")):
                self.log_artifact(err, "errors")
        except Exception as exc:
            print(f"[tracking] could not record the result: {store_error(exc, self.uri)}")
        finally:
            self.end(end_as or status)

    def end(self, status: str) -> None:
        """FINISHED | FAILED | KILLED. Never raises: the run's outcome matters more."""
        if not self.run_id:
            return
        try:
            self.client.set_terminated(self.run_id, status=str(status))  # MLflow wants its plain word
        except Exception as exc:
            print(f"[tracking] could not mark MLflow run {self.run_id} {status}: {store_error(exc, self.uri)}")
