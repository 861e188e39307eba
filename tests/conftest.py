"""Fixtures for every layer: the environment, a seeded generator, the services' teardown, and a tiny digits
federation built through the real stage code (Hydra config, the prepare and partition steps).

``tests/fedcore`` overrides ``tiny`` and ``tiny_gn`` with its own, built from fedcore alone
(``tests/fedcore/conftest.py``), so that the library's tests import no orchestration.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("RAY_TMPDIR", "/tmp/fedcore-ray-test")
# Under pytest-xdist (`make test` runs two workers) each worker gets a Ray temp folder and a Prefect home of
# its own, named for the worker and the test run: a local Ray cluster is found through a file in its temp
# folder, and every temporary Prefect server keeps its database in the Prefect home, so two workers (or two
# runs) sharing either would attach to, or lock, each other's. Set before numpy and torch are imported: their
# thread pools are sized then.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER and f"-{WORKER}-" not in os.environ["RAY_TMPDIR"]:
    RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")[:6]  # short: Ray's socket paths are length-limited
    os.environ["RAY_TMPDIR"] += f"-{WORKER}-{RUN}"
    os.environ["PREFECT_HOME"] = str(Path(tempfile.gettempdir()) / f"fedcore-prefect-test-{WORKER}-{RUN}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the flows a test starts, too (see threads_per_test)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tests.fedcore.tiny import threads_per_test  # noqa: E402
from tests.helpers import tiny_overrides  # noqa: E402

torch.set_num_threads(threads_per_test())
Path(os.environ["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


class SharedRay:
    """One local Ray per test process, started before the first flow test and joined by every flow run in it.

    A flow that finds Ray running in its process uses it and leaves it up (``flows.services.runtime.start_ray``),
    as a notebook or a long-lived driver would. Its task workers stay warm from one test to the next:
    ``tests/flows/test_rounds_flow.py`` takes 43 s with it against 126 s with a Ray started and stopped per
    flow. Flows a test starts as subprocesses (``python -m flows.stages``, ``dvc repro``) join it through
    ``RAY_ADDRESS`` and report to the same Prefect server (``PREFECT_API_URL``), as they would join a
    team's cluster; a test of what a user's own process does (``tests/e2e/test_signals.py``) clears both.
    Tests marked ``own_ray`` get a process without it (they start, join or check Ray themselves).
    """

    started = False

    @classmethod
    def up(cls) -> None:
        import ray

        from flows.services import runtime

        if ray.is_initialized():
            return
        os.environ.pop("RAY_ADDRESS", None)  # a cluster named from outside the tests is not theirs to join
        url = runtime.ensure_prefect_api()  # the workers report to it; every flow of this process uses it
        with runtime.loopback_ray():
            ray.init(**runtime.ray_init_kwargs(num_cpus=2, prefect_api_url=url, root=Path(__file__).parents[1]))
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        cls.started = True

    @classmethod
    def down(cls) -> None:
        if not cls.started:
            return
        import ray

        from flows.services import runtime

        os.environ.pop("RAY_ADDRESS", None)
        if ray.is_initialized():
            runtime.stop_ray()
        cls.started = False


@pytest.fixture(autouse=True)
def _shared_ray(request):
    """The shared Ray for flow and end-to-end tests (:class:`SharedRay`); none for the library's tests."""
    layer = Path(request.node.path).parent.name
    if layer in ("flows", "e2e"):
        (SharedRay.down if request.node.get_closest_marker("own_ray") else SharedRay.up)()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_services():
    """Stop the shared Ray and the temporary Prefect server the flows started, while pytest still owns stdout."""
    yield
    import sys

    SharedRay.down()
    if "flows.services.runtime" in sys.modules:  # a library-only run (tests/fedcore) never started one
        sys.modules["flows.services.runtime"].stop_prefect_api()
    if WORKER:  # this worker's own Prefect home, its server stopped: its database is of no further use
        import shutil

        shutil.rmtree(os.environ["PREFECT_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Prepared digits, their partition and a FedAvg source model, made by the stage code (plain driver)."""
    from dataclasses import asdict

    from fedcore.data import Partition
    from fedcore.engine import run_rounds, source_round_data
    from flows.config import compose as C
    from flows.runs import federation as F
    from flows.runs.steps import partition as _partition
    from flows.runs.steps import prepare as _prepare

    tmp = tmp_path_factory.mktemp("tiny")
    cfg = C.compose(tiny_overrides(tmp))
    _prepare(cfg)
    _partition(cfg)
    part = Partition.load(F.partition_dir(cfg))
    spec = C.model_spec(cfg)
    torch.set_num_threads(threads_per_test())
    state = run_rounds(source_round_data(part), spec, C.pretrain_config(cfg)).final_state
    path = F.source_model_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": state, "spec": asdict(spec)}, path)
    return {"cfg": cfg, "tmp": tmp, "partition": part, "spec": spec, "source": state}


@pytest.fixture(scope="session")
def tiny_gn(tiny):
    """The same digits federation with a GroupNorm source model, for the private forms."""
    from dataclasses import replace

    from fedcore.engine import run_rounds, source_round_data
    from flows.config import compose as C

    spec = replace(tiny["spec"], norm="group")
    pcfg = C.pretrain_config(tiny["cfg"])
    pcfg = replace(pcfg, trainer_params={**pcfg.trainer_params, "local_epochs": 3})
    state = run_rounds(source_round_data(tiny["partition"]), spec, pcfg).final_state
    return {**tiny, "spec": spec, "source": state}


PLUGIN = "tests.flows.example_plugin"


@pytest.fixture
def plugin_sandbox(monkeypatch):
    """Registries a test may add to (systems, evaluations, strategies), restored after it; the example plug-in
    is imported afresh by whoever loads it."""
    import sys

    from fedcore.aggregate.base import STRATEGIES
    from flows import systems
    from flows.reports import evaluations

    monkeypatch.setattr(systems, "_SYSTEMS", dict(systems._SYSTEMS))
    monkeypatch.setattr(evaluations, "EVALUATIONS", dict(evaluations.EVALUATIONS))
    monkeypatch.setattr(STRATEGIES, "_items", dict(STRATEGIES._items))
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    yield PLUGIN
    sys.modules.pop(PLUGIN, None)
