#!/usr/bin/env bash
# The MLflow UI over the project's database, lean: one worker, no job runner, loopback only.
#   bash scripts/ui.sh [PORT] [BACKEND_STORE_URI] [ARTIFACTS_DIR]
# Runs logged through this server (tracking.uri=http://127.0.0.1:PORT) keep artifacts in ARTIFACTS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-5000}
STORE=${2:-sqlite:///$(pwd)/outputs/mlflow.db}
ARTIFACTS=${3:-$(pwd)/outputs/mlartifacts}
mkdir -p outputs
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
echo "MLflow UI: http://127.0.0.1:$PORT  (store $STORE; Ctrl-C stops it)"
exec .venv/bin/mlflow server --backend-store-uri "$STORE" --host 127.0.0.1 --port "$PORT" --workers 1 \
  --artifacts-destination "$ARTIFACTS"
