#!/usr/bin/env bash
# An MLflow tracking server with a real backend store (PostgreSQL) and an artifact root.
# The flows default to a local SQLite file; point them here with
#   python -m flows.stages sweep flow.tracking_uri=http://127.0.0.1:5000   (or FEDCORE_TRACKING_URI)
# Environment: MLFLOW_DB_URI (e.g. postgresql://mlflow:secret@127.0.0.1:5432/mlflow, needs psycopg2),
#              MLFLOW_ARTIFACTS (a folder or an object-store URI), MLFLOW_PORT.
# The store's URI reaches MLflow through its environment, not its command line, which every local user
# can read (ps); a password in it stays between this script and the server.
set -euo pipefail
# MLflow 3's job runner (a pool of huey consumers) serves GenAI jobs that fedcore never submits
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
: "${MLFLOW_DB_URI:=sqlite:///$(pwd)/mlruns.db}"
: "${MLFLOW_ARTIFACTS:=$(pwd)/mlartifacts}"
: "${MLFLOW_PORT:=5000}"
export MLFLOW_BACKEND_STORE_URI="$MLFLOW_DB_URI"
exec mlflow server --artifacts-destination "$MLFLOW_ARTIFACTS" --serve-artifacts --host 127.0.0.1 --port "$MLFLOW_PORT"
