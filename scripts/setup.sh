#!/usr/bin/env bash
# One command from a fresh clone to a trained, tracked run:
#   .venv with torch (an existing torch is kept: a GPU user installs their CUDA build first),
#   the project and its dependencies, Horovod built against that torch (wheel cached), then
#   the default experiment. Idempotent; a second run only re-runs the experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # only used when the venv has no torch yet

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
PY=.venv/bin/python

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  "$PY" -m pip install -q "$TORCH_SPEC"
else
  echo "setup: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi

# Reinstall the project only when its dependency list changed.
STAMP=.venv/.orchestrator-deps
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] || ! "$PY" -c "import orchestrator, hydra, mlflow, optuna" >/dev/null 2>&1; then
  echo "setup: installing the project and its dependencies"
  "$PY" -m pip install -q -e ".[test,postgres,slurm,dashboard]"
  echo "$WANT" > "$STAMP"
fi

PY="$PY" bash scripts/install_horovod.sh

# Headless Chromium for the browser test of the MLflow UI (Debian's packages).
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing chromium and chromium-driver (browser test of the MLflow UI)"
    (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }) \
      || echo "setup: could not install chromium; tests/test_ui.py will fail until it is installed" >&2
  else
    echo "setup: install Debian's chromium and chromium-driver for the UI test (sudo apt-get install chromium chromium-driver)" >&2
  fi
fi

# PostgreSQL for the many-machines tests (a throwaway server per test run; Debian's package).
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing postgresql (tests of studies shared through PostgreSQL)"
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null 2>&1 || \
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }) \
      || echo "setup: could not install postgresql; tests/test_postgres.py will be skipped" >&2
  else
    echo "setup: install Debian's postgresql for tests/test_postgres.py (sudo apt-get install postgresql)" >&2
  fi
fi

# SLURM and munge for the cluster tests (a throwaway 2-node cluster on this machine: tests/slurm.py).
if ! command -v slurmctld >/dev/null && [ ! -x /usr/sbin/slurmctld ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing slurm-wlm and munge (tests of runs, sweeps and studies on SLURM)"
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || \
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }) \
      || echo "setup: could not install slurm-wlm and munge; tests/test_slurm.py's cluster tests will be skipped" >&2
  else
    echo "setup: install Debian's slurm-wlm and munge for tests/test_slurm.py (sudo apt-get install slurm-wlm munge)" >&2
  fi
fi

if [ "${SETUP_SKIP_RUN:-0}" != "1" ]; then
  echo "setup: running the default experiment (seed 000 workload) -> outputs/, MLflow in outputs/mlflow.db"
  "$PY" -m orchestrator "$@"
fi
