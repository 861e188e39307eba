"""Fixtures for every layer: the environment, a seeded generator, and the services' teardown.

``tests/fedcore`` builds its tiny federation from fedcore alone (its own conftest); ``tests/flows`` and
``tests/e2e`` build it through the real stage code (``tests/flows/conftest.py``, shared below them).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_TMPDIR", "/tmp/fedcore-ray-test")
Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session", autouse=True)
def _stop_services():
    """Stop the temporary Prefect server the flows started, while pytest still owns stdout."""
    yield
    import sys

    if "flows.runtime" in sys.modules:  # a library-only run (tests/fedcore) never started one
        sys.modules["flows.runtime"].stop_prefect_api()
