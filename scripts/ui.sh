#!/usr/bin/env bash
# The MLflow UI over the project's database, lean: one worker, no job runner, loopback only.
#   bash scripts/ui.sh [PORT] [BACKEND_STORE_URI] [ARTIFACTS_DIR]
# The server proxies artifacts: experiments created through it get mlflow-artifacts:/ roots, kept in
# ARTIFACTS_DIR and uploaded through the server, whichever machine logs them. Runs logged straight
# into a SQLite DB keep theirs beside it (file://); the server reads those from its own disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-5000}
STORE=${2:-sqlite:///$(pwd)/outputs/mlflow.db}
ARTIFACTS=${3:-$(pwd)/outputs/mlartifacts}
mkdir -p outputs
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
echo "MLflow UI: http://127.0.0.1:$PORT  (store $STORE, artifacts $ARTIFACTS; Ctrl-C stops it)"
exec .venv/bin/mlflow server --backend-store-uri "$STORE" --host 127.0.0.1 --port "$PORT" --workers 1 \
  --serve-artifacts --artifacts-destination "$ARTIFACTS" --default-artifact-root mlflow-artifacts:/
