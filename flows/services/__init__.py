"""The services a run talks to: Ray and Prefect (runtime), MLflow (tracking, artifacts, the model registry, UI links), DVC (the remote, integrity checks against dvc.lock) and GPU placement."""
