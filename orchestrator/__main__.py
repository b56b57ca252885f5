"""`python -m orchestrator [overrides]`: Hydra glue around `app.run_job`.

Errors are ours to print: a bad config is one line naming the field and the allowed values
(exit 2); a failed job shows the failing rank's traceback (exit 1); Ctrl-C/SIGTERM end the whole
job (exit 130/143).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from .errors import format_error
from .schema import ConfigError, Mode, register_configs, to_config

register_configs()

EXIT_CONFIG, EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 2, 1, 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every rank ends, the MLflow run ends KILLED."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    tags = {"sweep_id": hc.sweep.dir, "sweep_job": str(hc.job.num)} if multirun else {}
    # the user's own overrides, for the tuner's "rerun the best" line
    overrides = [o for o in hc.overrides.task if not o.lstrip("+~").startswith(("mode=", "tune.", "hydra."))]
    code = run_from_cli(dcfg, run_dir, tags, overrides)
    if code and not multirun:
        sys.exit(code)
    # in a sweep, a failed job is recorded and the next one runs; SweepSummary sets the exit code


def run_from_cli(dcfg: DictConfig, run_dir: Path, tags: dict, overrides: list) -> int:
    """Run one job and print its outcome; returns the exit code."""
    from .app import JobFailed, print_summary, run_job
    from .tune.study import StudyFailed

    try:
        cfg = to_config(dcfg)
        print(f"[orchestrator] run dir: {run_dir}")
        if cfg.mode is Mode.tune:
            from .tune.study import run_study

            run_study(cfg, run_dir, overrides=overrides)
            return 0
        result = run_job(cfg, run_dir, extra_tags=tags)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        (run_dir / "result.json").write_text(json.dumps({"status": "INVALID", "error": str(exc)}))
        return EXIT_CONFIG
    except StudyFailed as exc:
        print(f"error: tune: study stopped: {exc} (run dir: {run_dir})", file=sys.stderr)
        return EXIT_FAILED
    except JobFailed as exc:
        print(exc.result.get("error", str(exc)), file=sys.stderr)
        print(f"error: job failed: {exc} (run dir: {exc.result.get('run_dir')})", file=sys.stderr)
        return EXIT_FAILED
    except Terminated:
        print("error: terminated (SIGTERM); every rank was stopped", file=sys.stderr)
        sys.exit(EXIT_SIGTERM)
    except KeyboardInterrupt:
        print("error: interrupted; every rank was stopped", file=sys.stderr)
        sys.exit(EXIT_SIGINT)
    print_summary(result, run_dir)
    return 0


def cli() -> None:
    # We print Hydra's compose errors ourselves (one line); HYDRA_FULL_ERROR makes Hydra raise them.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main()
    except (HydraException, OmegaConfBaseException, ConfigError) as exc:  # compose-time errors
        print(f"error: {format_error(exc)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


if __name__ == "__main__":
    cli()
