"""Hydra multirun (`-m`): every job a real launch and MLflow run tagged with one sweep id; at the
end, one table of all jobs. A failing job does not stop the others; the sweep exits 1 if any failed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .measure.results import JobResult
from .progress import console
from .rundir import RecordError, Status, read_json, result_path, write_json

COLUMNS = ("world_size", "utilization", "throughput", "data_wait_frac", "comm_frac", "bottleneck", "val_loss",
           "time_to_target_s")


def collect(sweep_dir: Path) -> List[Dict[str, Any]]:
    """The sweep table's rows (sweep_summary.json): each job's overrides and its result's COLUMNS."""
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name)):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        if not overrides_file.exists():
            continue
        job = JobResult.from_dict(read_json(result_path(job_dir), {"status": Status.NOT_RUN}))
        rows.append({"job": job_dir.name, "overrides": " ".join(OmegaConf.load(overrides_file)),
                     **{k: job.get(k) for k in ("status", "mlflow_run_id", *COLUMNS)},
                     "error": (job.error or "").strip().splitlines()[:1]})
    return rows


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.table import Table

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        try:
            write_json(sweep_dir / "sweep_summary.json", rows, indent=2)
        except RecordError as exc:  # the table below is still printed
            print(f"error: {exc}", file=sys.stderr)
        table = Table(title=f"sweep {sweep_dir}")
        # validation's columns where a job evaluated (runtime/evaluate.py) or trained to a target loss
        extra = [(k, label) for k, label in (("val_loss", "val loss"), ("time_to_target_s", "to target s"))
                 if any(r.get(k) is not None for r in rows)]
        for col in ("job", "overrides", "status", "world size", "utilization", "throughput", "data wait", "comm",
                    "bottleneck", *(label for _, label in extra)):
            table.add_column(col)
        fmt = lambda v, pct=False: "-" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:.1f}")  # noqa: E731
        for r in rows:
            table.add_row(r["job"], r["overrides"], str(r["status"]), str(r["world_size"] or "-"),
                          fmt(r["utilization"], True), fmt(r["throughput"]),
                          fmt(r["data_wait_frac"], True), fmt(r["comm_frac"], True), str(r["bottleneck"] or "-"),
                          *("-" if r.get(k) is None else f"{r[k]:.4g}" for k, _ in extra))
        console().print(table)
        failed = [r for r in rows if r["status"] != Status.FINISHED]
        if failed:
            print(f"error: {len(failed)} of {len(rows)} sweep jobs did not finish: "
                  + ", ".join(f"job {r['job']} ({r['status']})" for r in failed), file=sys.stderr)
            sys.exit(1)
