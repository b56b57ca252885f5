#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh on a GPU machine whose Python (3.12 by default) has torch with CUDA,
# nvidia-ml-py, psutil, rich, pyyaml and matplotlib, but no network: hydra-core, omegaconf, optuna
# and what they need, downloaded here into DIR (default .whl, keep it out of git), about 5 MB.
# MLflow is not needed there: the check runs with tracking.enabled=false.
#   bash scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${2:-3.12}
PY=${PY:-.venv/bin/python}
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "hydra-core==1.3.2" "omegaconf>=2.3,<2.4" "optuna>=4,<5" \
  "sqlalchemy>=2" "alembic" "Mako" "MarkupSafe" "colorlog" "tqdm" "greenlet" "typing-extensions" "packaging"
# omegaconf pins antlr4 4.9.*, published as an sdist only: build its (pure Python) wheel here
"$PY" -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3"
du -sh "$DIR"
