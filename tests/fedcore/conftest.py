"""The library's fixtures, built with fedcore alone: no Hydra, Prefect, Ray or MLflow is imported here."""

from __future__ import annotations

import pytest

from tests.fedcore.tiny import build_tiny


@pytest.fixture(scope="session")
def tiny():
    """Corrupted digits, their partition and a FedAvg source model (plain driver)."""
    return build_tiny()


@pytest.fixture(scope="session")
def tiny_gn():
    """The same federation with a GroupNorm source model (three local epochs), for the private forms."""
    return build_tiny(norm="group", local_epochs=3)
