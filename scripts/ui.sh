#!/usr/bin/env bash
# The MLflow UI over the project's database, lean: one worker, no job runner, loopback only.
#   bash scripts/ui.sh [PORT] [BACKEND_STORE_URI] [ARTIFACTS_DIR]
# The server proxies artifacts: experiments created through it get mlflow-artifacts:/ roots, kept in
# ARTIFACTS_DIR and uploaded through the server, whichever machine logs them. Runs logged straight
# into a SQLite DB keep theirs beside it (file://); the server reads those from its own disk.
# A database password belongs in the environment, not in the URL: PGPASSWORD or ~/.pgpass for
# PostgreSQL (libpq reads them when the URL has none). A URL given with one is handed to the server
# through its environment (MLFLOW_BACKEND_STORE_URI), never on its command line, and shown masked.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-5000}
STORE=${2:-${MLFLOW_BACKEND_STORE_URI:-sqlite:///$(pwd)/outputs/mlflow.db}}
ARTIFACTS=${3:-$(pwd)/outputs/mlartifacts}
mkdir -p outputs
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
export MLFLOW_BACKEND_STORE_URI="$STORE"  # read by `mlflow server` in place of --backend-store-uri (visible to ps)
SHOWN=$(printf '%s' "$STORE" | sed -E 's#(://[^/@:]*:)[^/@]+@#\1***@#')
echo "MLflow UI: http://127.0.0.1:$PORT  (store $SHOWN, artifacts $ARTIFACTS; Ctrl-C stops it)"
# each experiment's training runs table (the UI opens in its GenAI mode without workflowType=machine_learning)
MLFLOW_TRACKING_URI="$STORE" .venv/bin/python -m orchestrator.runs --links "http://127.0.0.1:$PORT" 2>/dev/null || true
exec .venv/bin/mlflow server --host 127.0.0.1 --port "$PORT" --workers 1 \
  --serve-artifacts --artifacts-destination "$ARTIFACTS" --default-artifact-root mlflow-artifacts:/
