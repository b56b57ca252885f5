"""A run dir's attempts: each start or resume in it is one. What an earlier attempt recorded is
kept under attempts/<n>/ before the next one writes (nothing recorded is lost, and the supervisor
reads no earlier rank's error as this job's); an attempt whose process died mid-job is recorded
FAILED first; a checkpoint request an earlier process left is cleared.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, Optional

from .measure.results import JobResult
from .resume import ResumeFrom
from .rundir import (Status, attempt_dir, checkpoint_request_path, config_path, process_start, ranks_dir, read_job,
                     read_json, report_paths, result_path, write_json)


def open_attempt(run_dir: Path, resumed: Optional[ResumeFrom]) -> None:
    """Once the job is checked: make the run dir, or for a resume archive the earlier attempt. A
    new start in a run dir an earlier job used archives that job's rank files too: its error file
    would be read as this job's (and end it)."""
    if resumed is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        if ranks_dir(run_dir).exists():
            archive_attempt(run_dir)
        return
    print(f"[orchestrator] resuming {run_dir} from step {resumed.step}")
    archive_attempt(run_dir)


def close_dead_attempt(run_dir: Path, previous: Dict[str, Any], resuming: bool) -> None:
    """The attempt of an owner that died mid-job (killed -9) never wrote its result: it is recorded
    FAILED, saying so, and (unless this job resumes it) its files are archived, not mixed in (its
    MLflow run is closed once the tracker is up: app._run_owned)."""
    out = result_path(run_dir)
    if read_json(out, {}).get("status") != Status.FINISHED:
        write_json(out, JobResult(status=Status.FAILED, extra={
            "run_dir": str(run_dir), "mlflow_run_id": read_job(run_dir).get("mlflow_run_id"),
            "error": f"its process died while it ran (host {previous.get('host')}, pid {previous.get('pid')})"}).to_dict(),
                   indent=2)
    if not resuming and ranks_dir(run_dir).exists():
        archive_attempt(run_dir)


def clear_stale_request(run_dir: Path) -> None:
    """A checkpoint request an earlier process left (killed before it could remove it) would stop
    this attempt at once; one written since this process started (the signal came early) stays."""
    path = checkpoint_request_path(run_dir)
    try:
        if path.stat().st_mtime < process_start():
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def archive_attempt(run_dir: Path) -> None:
    """Keep what the earlier attempt recorded under attempts/<n>/ (its rank files, config, result
    and load report), so the new attempt overwrites nothing and the supervisor starts clean."""
    n = 1
    while attempt_dir(run_dir, n).exists():
        n += 1
    dest = attempt_dir(run_dir, n)
    dest.mkdir(parents=True)
    if ranks_dir(run_dir).exists():
        ranks_dir(run_dir).rename(ranks_dir(dest))
    for path in (config_path(run_dir), result_path(run_dir), *report_paths(run_dir)):
        if path.exists():
            shutil.copy2(path, dest / path.name)
