"""`python -m orchestrator.runs`: what the tracking store holds, without the UI: the recent runs,
studies and sweeps with their status and key figures, each study's best config and its rerun line.

    python -m orchestrator.runs [--uri URI] [--experiment NAME] [--last N] [--links BASE_URL]
    python -m orchestrator.runs tracking.uri=URI tracking.experiment=NAME   (as every other command)

`--uri` (or `tracking.uri=`) defaults to $MLFLOW_TRACKING_URI, else tracking.uri's default (sqlite:///outputs/mlflow.db;
a relative path is the project's, as a run's tracking.uri); `--links` prints each experiment's training
runs URL in the UI served at BASE_URL (scripts/ui.sh uses it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

from .progress import console
from .rundir import read_json
from .schema import TrackingConfig
from .stores import PROJECT, redact, resolve_uri, sqlite_path, store_error
from .tracking import runs_url


class Refused(Exception):
    """A bad option: one line naming it and what is allowed (exit 2)."""


def _client(uri: str) -> Any:
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        raise Refused(f"--uri: no MLflow store at {db} (a run creates it; or pass --uri sqlite:///PATH or http://HOST:PORT)")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _experiment(client: Any, name: str, uri: str) -> Any:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise Refused(f"--experiment: '{name}' is not in {redact(uri)}; allowed: {', '.join(names) or 'none yet'}")
    return exp


def _fig(run: Any, key: str, pct: bool = False) -> str:
    v = run.data.metrics.get(key)
    return "-" if v is None else f"{100 * v:.1f}%" if pct else f"{v:.1f}"


def _started(run: Any) -> str:
    from datetime import datetime

    return f"{datetime.fromtimestamp(run.info.start_time / 1000):%Y-%m-%d %H:%M}"


def _table(title: str, columns: List[str], rows: List[List[str]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console().print(table)


def _jobs(runs: List[Any], last: int) -> None:
    jobs = [r for r in runs if r.data.tags.get("run_kind", "job") == "job" and "mlflow.parentRunId" not in r.data.tags
            and r.data.tags.get("mode") != "tune" and "sweep_id" not in r.data.tags][:last]
    _table(f"runs (last {len(jobs)})", ["started", "name", "status", "backend x ranks", "throughput/s", "utilization",
                                        "mfu", "verdict", "run dir"],
           [[_started(r), r.info.run_name or "-", r.info.status,
             f"{r.data.tags.get('backend', '-')} x{r.data.tags.get('world_size', '?')}", _fig(r, "throughput"),
             _fig(r, "utilization", True), _fig(r, "mfu", True), r.data.tags.get("verdict") or r.data.tags.get("diagnosis", "-"),
             r.data.tags.get("run_dir", "-")] for r in jobs])


def _studies(runs: List[Any], last: int) -> None:
    parents = [r for r in runs if r.data.tags.get("mode") == "tune"][:last]
    trials = Counter(r.data.tags.get("mlflow.parentRunId") for r in runs if "trial" in r.data.tags)
    _table(f"studies (last {len(parents)})", ["started", "study", "status", "trials", "best throughput/s",
                                              "best utilization", "run dir"],
           [[_started(r), r.data.tags.get("study_name", "-"), r.info.status, str(trials[r.info.run_id]),
             _fig(r, "best_throughput"), _fig(r, "best_utilization", True), r.data.tags.get("run_dir", "-")]
            for r in parents])
    for r in parents:
        summary = read_json(Path(r.data.tags.get("run_dir", "")) / "summary.json", {}) if r.data.tags.get("run_dir") else {}
        if summary.get("best"):
            print(f"{r.data.tags.get('study_name')}: best trial {summary['best']['number']}: {summary['rerun_overrides']}")
            print(f"  rerun it: {summary['rerun']}")


def _sweeps(runs: List[Any], last: int) -> None:
    sweeps: Dict[str, List[Any]] = {}
    for r in runs:
        if "sweep_id" in r.data.tags:
            sweeps.setdefault(r.data.tags["sweep_id"], []).append(r)
    rows = []
    for sweep, jobs in list(sweeps.items())[:last]:
        states = Counter(j.info.status for j in jobs)
        fastest = max(jobs, key=lambda j: j.data.metrics.get("throughput", 0.0))
        rows.append([_started(jobs[-1]), sweep, str(len(jobs)), ", ".join(f"{n} {s}" for s, n in sorted(states.items())),
                     f"{fastest.info.run_name} ({_fig(fastest, 'throughput')}/s)"])
    _table(f"sweeps (last {len(rows)})", ["started", "sweep dir", "jobs", "status", "fastest"], rows)


def show(uri: str, experiment: str, last: int, links: Optional[str] = None) -> None:
    """Print the tables (or, with `links`, each experiment's runs URL). Raises Refused."""
    client = _client(uri)
    if links is not None:
        for exp in client.search_experiments():
            if client.search_runs([exp.experiment_id], max_results=1):
                print(f"  {exp.name}: {runs_url(links, exp.experiment_id)}")
        return
    exp = _experiment(client, experiment, uri)
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1000)
    print(f"MLflow store {redact(uri)}, experiment '{experiment}': {len(runs)} runs")
    _jobs(runs, last)
    _studies(runs, last)
    _sweeps(runs, last)


OVERRIDES = {"tracking.uri": "uri", "tracking.experiment": "experiment"}  # Hydra's keys -> the options


def _apply_overrides(args: argparse.Namespace) -> None:
    """`tracking.uri=...` and `tracking.experiment=...` (Hydra's form, as `python -m orchestrator`
    takes them) set --uri and --experiment; anything else is refused in one line."""
    for item in args.overrides:
        key, eq, value = item.lstrip("+").partition("=")
        if not eq or key not in OVERRIDES:
            raise Refused(f"{item}: not an option of this command; allowed: {', '.join(f'{k}=...' for k in OVERRIDES)}, "
                          "--uri, --experiment, --last, --links")
        setattr(args, OVERRIDES[key], value)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.runs", description=__doc__.splitlines()[0])
    parser.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI") or TrackingConfig.uri,
                        help="the tracking store (default: $MLFLOW_TRACKING_URI, else %(default)s)")
    parser.add_argument("--experiment", default=TrackingConfig.experiment, help="default: %(default)s")
    parser.add_argument("--last", type=int, default=10, help="rows per table (default: %(default)s)")
    parser.add_argument("--links", metavar="BASE_URL", help="print each experiment's training runs URL in that UI")
    parser.add_argument("overrides", nargs="*", metavar="tracking.uri=URI | tracking.experiment=NAME",
                        help="the store and experiment as a run's command line gives them")
    args = parser.parse_args(argv)
    try:
        _apply_overrides(args)
        if args.last < 1:
            raise Refused(f"--last: must be an integer >= 1, got {args.last}")
        show(resolve_uri(args.uri, PROJECT), args.experiment, args.last, args.links)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the store unreachable, a wrong password...
        print(f"error: --uri: cannot read {redact(args.uri)}: {store_error(exc, args.uri)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
