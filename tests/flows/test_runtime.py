"""The runtime: placement settings, the Prefect API and Ray's start and shutdown, background logging,
work in a forked child (two tests start a local Ray of their own)."""

import os

import pytest

from flows.config import compose as C
from flows.services.runtime import ray_init_kwargs

# these tests start, join, stop or patch Ray in their own process
pytestmark = pytest.mark.own_ray


def test_gpus_are_requested_only_for_cuda():
    from flows.services.placement import gpus

    assert gpus(C.compose(["device=cpu"])) == 0.0
    assert gpus(C.compose(["device=cuda"])) == 1.0
    assert gpus(C.compose(["device=cuda", "flow.gpus_per_task=0.5"])) == 0.5


def test_auto_asks_for_gpus_when_the_joined_cluster_has_them(monkeypatch):
    from flows.services import placement

    cfg = C.compose(["device=auto", "flow.gpus_per_task=0.5"])
    monkeypatch.setattr(placement.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(placement, "_cluster_gpus", lambda: 0.0)
    assert placement.gpus(cfg) == 0.0
    monkeypatch.setattr(placement, "_cluster_gpus", lambda: 1.0)
    assert placement.gpus(cfg) == 0.5


def test_a_gpu_torch_cannot_use_is_said_only_for_auto(monkeypatch):
    import torch

    from flows.services import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    placed = {"ray.gpu_ids": "0", "ray.node_id": "abcdef0123456789"}
    assert "the model runs on the CPU" in runtime.cpu_fallback_note("auto", placed)
    assert runtime.cpu_fallback_note("cpu", placed) is None
    assert runtime.cpu_fallback_note("auto", {**placed, "ray.gpu_ids": ""}) is None


def test_a_flow_that_joins_a_cluster_ships_its_code_and_names_its_checkout(tmp_path):
    import fedcore
    import flows

    local = ray_init_kwargs(num_cpus=2, prefect_api_url="http://127.0.0.1:1234/api", root=tmp_path)
    assert "py_modules" not in local["runtime_env"] and "working_dir" not in local["runtime_env"]
    kw = ray_init_kwargs(num_cpus=2, prefect_api_url="http://127.0.0.1:1234/api", root=tmp_path, ship_code=True)
    env = kw["runtime_env"]
    assert env["py_modules"] == [os.path.dirname(fedcore.__file__), os.path.dirname(flows.__file__)]
    # an empty working folder: Ray would otherwise put the driver's own folder first on the workers' path
    assert os.listdir(env["working_dir"]) == ["README"]
    assert env["env_vars"]["FEDCORE_PROJECT_ROOT"] == str(tmp_path)


def test_relative_paths_and_the_default_store_follow_the_project_root(monkeypatch, tmp_path):
    cfg = C.compose([])
    monkeypatch.delenv(C.PROJECT_ENV, raising=False)
    monkeypatch.delenv(C.TRACKING_ENV, raising=False)
    assert C.resolve_path("data/x") == C.ROOT / "data" / "x"
    assert C.tracking_uri(cfg) == f"sqlite:///{C.ROOT / 'mlruns.db'}"
    monkeypatch.setenv(C.PROJECT_ENV, str(tmp_path))  # a worker that was shipped the code
    assert C.resolve_path("data/x") == tmp_path / "data" / "x"
    monkeypatch.setenv(C.TRACKING_ENV, "http://127.0.0.1:5055")  # a deployment's server
    assert C.tracking_uri(cfg) == "http://127.0.0.1:5055"
    assert C.tracking_uri(C.compose(["flow.tracking_uri=sqlite:////tmp/elsewhere.db"])) == "sqlite:////tmp/elsewhere.db"


def test_workers_get_the_driver_prefect_url(tmp_path):
    kw = ray_init_kwargs(num_cpus=2, prefect_api_url="http://127.0.0.1:1234/api", root=tmp_path)
    env = kw["runtime_env"]["env_vars"]
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:1234/api"
    assert str(tmp_path) in env["PYTHONPATH"] and kw["num_cpus"] == 2


def test_file_hash_is_recomputed_when_the_file_changes(tmp_path):
    import hashlib
    import os

    from flows.services.tracking import file_sha256

    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    assert file_sha256(p) == hashlib.sha256(b"abc").hexdigest()
    p.write_bytes(b"abcd")
    os.utime(p, ns=(1, 1))  # a different mtime even on coarse clocks
    assert file_sha256(p) == hashlib.sha256(b"abcd").hexdigest()


def test_task_module_is_light_for_ray_workers():
    """A worker unpickling a task imports flows.runs.tasks: it must not drag in MLflow or matplotlib."""
    import subprocess
    import sys

    probe = (
        "import sys, flows.runs.tasks; print(sorted(m for m in ('mlflow', 'matplotlib', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=C.ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_worker_module_is_lighter_still_for_plain_ray_tasks():
    """Arrivals and round clients run as plain Ray tasks from flows.runs.worker: a fresh worker imports torch and
    fedcore for them, not Prefect, OmegaConf, scipy.stats or the corruptions' image libraries (together about
    4 s of a cold worker's start)."""
    import subprocess
    import sys

    heavy = ("mlflow", "matplotlib", "ray", "prefect", "omegaconf", "scipy.stats", "scipy.ndimage", "cv2", "skimage")
    probe = f"import sys, flows.runs.worker; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=C.ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_background_arrival_log_keeps_order_nesting_and_errors(tmp_path):
    import mlflow
    import pytest

    from flows.services.tracking import BackgroundArrivalLog

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns.db")
    try:
        mlflow.set_experiment("background-log")
        with mlflow.start_run() as parent:
            log = BackgroundArrivalLog()
            for a in range(5):
                log(
                    {
                        "arrival": a,
                        "client_id": a % 2,
                        "corruption": "fog",
                        "pass": 0,
                        "online_acc": a / 10,
                        "privacy_refused": a == 4,
                    }
                )
            log.close()
        client = mlflow.MlflowClient()
        hist = client.get_metric_history(parent.info.run_id, "online_acc")
        assert sorted((m.step, m.value) for m in hist) == [(a, a / 10) for a in range(5)]
        children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(c.info.run_name for c in children) == [f"arrival-{a:03d}-fog" for a in range(5)]
        assert all(c.info.status == "FINISHED" for c in children)
        refused = [c.info.run_name for c in children if c.data.tags["privacy"].startswith("REFUSED")]
        assert refused == ["arrival-004-fog"]

        with mlflow.start_run():
            log = BackgroundArrivalLog()
            log({"arrival": 0})  # no corruption, client or pass: the thread fails, close() says so
            with pytest.raises(RuntimeError, match="logging an arrival to MLflow failed"):
                log.close()
    finally:
        mlflow.set_tracking_uri(before)


def test_background_log_batches_records_that_come_close_together(tmp_path):
    """A record is written at once after a quiet spell; those that follow within ``every`` seconds wait and
    go in one batch, in order, each with the time it was handed over."""
    import time

    import mlflow

    from flows.services.tracking import BackgroundLog

    # the log opens a client on the tracking URI: a store of this test's, not MLflow's default ./mlflow.db
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns.db")
    calls = []
    try:
        log = BackgroundLog(
            lambda rec, at_ms, **kw: calls.append([(rec["i"], at_ms)]),
            log_batch=lambda items, **kw: calls.append([(r["i"], at) for r, at in items]),
            every=1.5,
        )
    finally:
        mlflow.set_tracking_uri(before)

    def written(n, within):
        deadline = time.monotonic() + within
        while len(calls) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(calls) >= n

    try:
        log({"i": 0})
        assert written(1, within=1.0)  # the first at once
        handed = []
        for i in range(1, 5):
            log({"i": i})
            handed.append(int(time.time() * 1000))
        assert not written(2, within=0.5)  # the rest wait for the interval ...
        assert written(2, within=5.0)
        assert [i for i, _ in calls[1]] == [1, 2, 3, 4]  # ... and go together, in order,
        assert all(abs(at - h) <= 50 for (_, at), h in zip(calls[1], handed))  # timed when handed over
        time.sleep(1.6)
        t = time.monotonic()
        log({"i": 5})
        assert written(3, within=5.0) and time.monotonic() - t < 1.0  # after a quiet spell, at once again
        assert calls[2][0][0] == 5
    finally:
        log.close()
    assert [i for c in calls for i, _ in c] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("runs_at_end", [True, False])
def test_arrival_runs_are_written_at_close_or_live(tmp_path, runs_at_end):
    """flow.arrival_runs: the parent's per-arrival series is live either way; the nested runs wait for close()
    by default (at_end), and are written as each arrival comes with live. What close() holds is written even
    when the flow fails (close(raise_errors=False) on the error path)."""
    import time

    import mlflow

    from flows.services.tracking import BackgroundArrivalLog

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns.db")
    try:
        mlflow.set_experiment("arrival-runs")
        client = mlflow.MlflowClient()
        with mlflow.start_run() as parent:
            pid = parent.info.run_id

            def children():
                return client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{pid}'")

            log = BackgroundArrivalLog(runs_at_end=runs_at_end)
            for a in range(3):
                log({"arrival": a, "client_id": a, "corruption": "fog", "pass": 0, "online_acc": a / 10})
            deadline = time.monotonic() + 60
            while (
                len(client.get_metric_history(pid, "online_acc")) < 3 or (not runs_at_end and len(children()) < 3)
            ) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(client.get_metric_history(pid, "online_acc")) == 3  # live, both ways
            assert len(children()) == (0 if runs_at_end else 3)
            log.close(raise_errors=False)
            log.close()  # a second close does nothing
        got = children()
        assert sorted(c.info.run_name for c in got) == [f"arrival-{a:03d}-fog" for a in range(3)]
        # timed when each arrival came back, however late the nested run was written
        when = {m.step: m.timestamp for m in client.get_metric_history(pid, "online_acc")}
        assert all(c.info.start_time == c.info.end_time == when[int(c.data.tags["arrival"])] for c in got)
        assert all(
            c.info.status == "FINISHED" and c.data.metrics["online_acc"] == int(c.data.tags["arrival"]) / 10
            for c in got
        )
    finally:
        mlflow.set_tracking_uri(before)


def _double(x):
    import os

    return x * 2, os.getpid()


def _fails_in_a_child(parent_pid):
    import os

    if os.getpid() != parent_pid:
        raise RuntimeError("only in the child")
    return "here"


def test_in_child_computes_elsewhere_and_falls_back_here(monkeypatch, caplog):
    import os
    import sys

    from flows.services.runtime import InChild

    value, pid = InChild(_double, 21).result()
    assert value == 42 and pid != os.getpid()  # a child computed it
    with caplog.at_level("WARNING", logger="flows.services.runtime"):
        assert InChild(_fails_in_a_child, os.getpid()).result() == "here"  # the child failed: computed here
    assert "RuntimeError: only in the child" in caplog.text and "computing it here instead" in caplog.text
    call = InChild(_double, 5)
    first = call.result()
    assert call.result() == first and first[1] != os.getpid()  # asked twice: the child's value, not recomputed

    import multiprocessing.process

    def no_fork(self):
        raise OSError(12, "Cannot allocate memory")

    with monkeypatch.context() as m:
        m.setattr(multiprocessing.process.BaseProcess, "start", no_fork)
        with caplog.at_level("WARNING", logger="flows.services.runtime"):
            assert InChild(_double, 3).result() == (6, os.getpid())  # no child could start: computed here
    assert "could not start a child process for _double" in caplog.text
    monkeypatch.setattr(sys, "platform", "darwin")  # no fork there: computed here, at result()
    assert InChild(_double, 1).result() == (2, os.getpid())


def test_in_child_cancel_stops_a_child_still_running():
    import time

    from flows.services.runtime import InChild

    call = InChild(time.sleep, 60)
    proc = call._proc
    assert proc.is_alive()
    call.cancel()
    assert not proc.is_alive()
    call.cancel()  # again: nothing to stop


def test_plots_drawn_in_a_child_are_the_bytes_drawn_here(tmp_path):
    """The arrival flow draws its plots (DVC outputs of the adapt stages) in a child process: the files must be
    the ones the same call writes in this process."""
    import numpy as np

    from flows.runs.federation import _draw_plots
    from flows.services.runtime import InChild

    records = [
        {
            "arrival": a,
            "corruption": c,
            "online_acc": 0.5 + a / 20,
            "holdout_avg_seen": 0.6,
            "source_acc": 0.9,
            "weight": 1 / (a + 1),
            "sigma": 0.3,
            "drift_step": 0.1,
            "drift_total": a / 10,
            "eps_client_total": a / 4,
            "eps_budget_remaining": 8 - a / 4,
            "client_id": a % 3,
        }
        for a, c in enumerate(["fog", "snow", "frost", "fog", "snow", "frost"])
    ]
    acc = np.linspace(0, 1, 18).reshape(6, 3)
    args = (records, acc, ["fog", "snow", "frost"])
    here = _draw_plots(*args, tmp_path / "here", "t", True)
    there = InChild(_draw_plots, *args, tmp_path / "there", "t", True).result()
    assert [p.name for p in here] == [p.name for p in there] and len(here) == 5
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(here, there))


@pytest.mark.slow  # starts a Ray cluster
def test_a_ray_the_caller_started_is_left_running_and_ours_binds_loopback():
    """shutdown_ray() stops only the Ray that make_task_runner started; threads fit the largest node.
    A Ray started under loopback_ray() (as start_ray starts one) has its node and GCS on 127.0.0.1, and
    Ray's cluster switch is restored after, so joining a multi-node cluster later still works."""
    import ray
    import ray._private.ray_constants as ray_constants

    from flows.services import runtime

    before = ray_constants.ENABLE_RAY_CLUSTER
    with runtime.loopback_ray():
        ray.init(num_cpus=1, include_dashboard=False)
    try:
        assert ray_constants.ENABLE_RAY_CLUSTER == before
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        assert runtime.largest_node_cpus() == 1  # a 2-thread task would never be scheduled here
        runtime.shutdown_ray()
        assert ray.is_initialized()
        # a flow asking for another cluster than the one this process is connected to is refused, with the fix
        here = ray.get_runtime_context().gcs_address
        with pytest.raises(RuntimeError, match=f"connected to the Ray cluster at {here}.*flow.ray_address={here}"):
            runtime.start_ray(address="127.0.0.1:1", num_cpus=1, root=C.ROOT)
        runtime._check_joined_cluster(here)  # the cluster it is connected to, named: joined as it is
    finally:
        ray.shutdown()


@pytest.mark.slow  # starts a Ray cluster
def test_ray_goes_down_with_reference_cycles_freed_first_and_no_collection_meanwhile(monkeypatch):
    """Ray ends the process when a thread frees an ObjectRef while its core worker shuts down; a ref held in
    a reference cycle is freed by whichever thread runs a collection. So cycles go first, and automatic
    collection stays off until Ray is down, then on again, also when the shutdown raises."""
    import gc
    import weakref

    import ray

    from flows.services import runtime

    class Holder:
        pass

    def cycle():
        h = Holder()
        h.me = h  # as a flow's closures hold the partition's ref
        return weakref.ref(h)

    seen = []
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append((gone() is None, gc.isenabled())))
    gone = cycle()
    runtime.stop_ray()
    assert seen == [(True, False)] and gc.isenabled()

    # the flows' own shutdown goes the same way
    monkeypatch.setattr(runtime, "_OWN_RAY", True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    gone = cycle()
    runtime.shutdown_ray()
    assert seen[1:] == [(True, False)] and gc.isenabled() and runtime._OWN_RAY is False

    def fails():
        raise RuntimeError("raylet gone")

    monkeypatch.setattr(ray, "shutdown", fails)
    with pytest.raises(RuntimeError, match="raylet gone"):
        runtime.stop_ray()
    assert gc.isenabled()


def test_a_process_that_starts_or_joins_ray_frees_its_cycles_before_rays_own_exit_handler(monkeypatch):
    """Ray's atexit handler (registered when ray is imported) disconnects at exit; ours, registered once
    when a Ray is started or joined (loopback_ray and start_ray both ask), runs before it."""
    import atexit

    import ray  # noqa: F401 - imported before atexit is watched: Ray's own registration is not the one tested

    from flows.services import runtime

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    runtime._register_exit_hook.cache_clear()
    try:
        with runtime.loopback_ray():
            pass
        with runtime.loopback_ray():
            pass
    finally:
        runtime._register_exit_hook.cache_clear()
    assert registered == [runtime._before_ray_exits]

    # and what it does there: the cycles freed, collection off, Ray's autoscaler monitor stopped
    seen = []
    monkeypatch.setattr(runtime, "_collect_then_pause_gc", lambda: seen.append("cycles freed"))
    monkeypatch.setattr(runtime, "_stop_autoscaler_monitor", lambda: seen.append("monitor stopped"))
    runtime._before_ray_exits()
    assert seen == ["cycles freed", "monitor stopped"]


@pytest.mark.slow  # starts a Ray cluster
def test_a_ray_started_here_loses_its_autoscaler_monitor_before_ray_shuts_the_rest_down(monkeypatch):
    """ray.shutdown stops the monitor after the GCS, and the monitor (likely reporting its end to that GCS)
    outlives the second Ray gives it: stop_ray kills it (by PID) first, so ray.shutdown finds it gone."""
    import ray
    import ray._private.worker as ray_worker

    from flows.services import runtime

    with runtime.loopback_ray():
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        [monitor] = [info.process for info in ray_worker._global_node.all_processes["monitor"]]
        assert monitor.poll() is None
        at_shutdown = []
        shutdown = ray.shutdown
        monkeypatch.setattr(ray, "shutdown", lambda: (at_shutdown.append(monitor.poll()), shutdown()))
        runtime.stop_ray()
        assert at_shutdown == [-9] and not ray.is_initialized()
    finally:
        if ray.is_initialized():
            ray.shutdown()


def test_only_rays_autoscaler_monitor_is_stopped_and_a_failure_to_stop_it_still_shuts_ray_down(monkeypatch, caplog):
    """The other processes of Ray's node record are left to ray.shutdown; if stopping the monitor raises,
    stop_ray warns and shuts Ray down all the same."""
    import logging
    import subprocess
    import sys
    from types import SimpleNamespace

    import ray
    import ray._private.worker as ray_worker

    from flows.services import runtime

    # Arrange: a node record whose monitor and raylet are two sleeping processes of this test's
    sleeping = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        node = SimpleNamespace(
            all_processes={
                "monitor": [SimpleNamespace(process=sleeping[0])],
                "raylet": [SimpleNamespace(process=sleeping[1])],
            }
        )
        monkeypatch.setattr(ray_worker, "_global_node", node)
        # Act
        runtime._stop_autoscaler_monitor()
        # Assert: the monitor killed (SIGKILL), the raylet untouched
        assert sleeping[0].poll() == -9 and sleeping[1].poll() is None
    finally:
        for proc in sleeping:
            proc.kill()
            proc.wait()

    # a node record this Ray version keeps elsewhere, or a joined Ray's (none): nothing to do
    monkeypatch.setattr(ray_worker, "_global_node", None)
    runtime._stop_autoscaler_monitor()

    def fails():
        raise RuntimeError("node record moved")

    shut = []
    monkeypatch.setattr(runtime, "_stop_autoscaler_monitor", fails)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    with caplog.at_level(logging.WARNING, logger="flows.services.runtime"):
        runtime.stop_ray()
    assert shut == [True] and "node record moved" in caplog.text


@pytest.mark.parametrize("imported", [False, True])
def test_the_temporary_prefect_server_is_made_on_its_boot_thread_unless_its_module_is_loaded(monkeypatch, imported):
    """Prefect's server module takes over a second to import: a process that has not loaded it makes the
    server (importing it) on the thread that boots it, beside Ray's start, on the port planned before;
    one that has, makes it at once. Either way wait() gives the URL planned, and exports it."""
    import sys
    import threading

    from flows.services import runtime

    made = []

    class Server:
        def __init__(self, port):
            self.port, self.api_url = port, f"http://127.0.0.1:{port}/api"

        def start(self, timeout):
            made.append(("start", threading.current_thread().name))

    def temporary(port=None):
        made.append(("made", threading.current_thread().name, port))
        return Server(port or 5555)

    monkeypatch.setenv("PREFECT_API_URL", "")  # so that the URL wait() exports is taken back after the test
    monkeypatch.delenv("PREFECT_API_URL")
    if imported:
        monkeypatch.setitem(
            sys.modules, "prefect.server.api.server", sys.modules.get("prefect.server.api.server") or object()
        )
    else:
        monkeypatch.delitem(sys.modules, "prefect.server.api.server", raising=False)
    monkeypatch.setattr(runtime, "log_runs_at_info", lambda: None)  # both change Prefect for the whole process
    monkeypatch.setattr(runtime, "flow_ends_without_heartbeat_wait", lambda: True)
    monkeypatch.setattr(runtime, "_temporary_server", temporary)
    monkeypatch.setattr(runtime, "_SERVER", None)
    planned, wait = runtime._prefect_api()
    assert wait() == planned == os.environ["PREFECT_API_URL"] == runtime._SERVER.api_url
    port = int(planned.rsplit(":", 1)[1].split("/")[0])
    if imported:
        assert made == [("made", threading.main_thread().name, None), ("start", "prefect-server")] and port == 5555
    else:
        assert made == [("made", "prefect-server", port), ("start", "prefect-server")]


def test_the_url_planned_for_the_temporary_server_is_the_one_prefects_server_class_gives():
    """The URL handed to Ray's workers before the server exists is written here, not asked of Prefect's
    class: if a Prefect upgrade changed its form, every cold start would restart Ray."""
    from prefect.server.api.server import SubprocessASGIServer

    from flows.services import runtime

    server = object.__new__(SubprocessASGIServer)  # not the process-wide singleton, and nothing started
    server.port = 43210
    assert server.api_url == runtime._server_url(43210) == "http://127.0.0.1:43210/api"


@pytest.mark.parametrize("error, settled", [(RuntimeError("client step failed"), True), (KeyboardInterrupt(), False)])
def test_a_failed_client_step_lets_the_rounds_other_steps_finish_and_an_interrupt_cancels_them(
    monkeypatch, error, settled
):
    # Arrange: three client steps; the first finishes, then the next one's error arrives
    import logging

    import prefect
    import ray

    from flows.runs import tasks
    from flows.services import runtime

    refs, seen = [], {"settle": [], "cancel": []}

    def start(fn, **kw):
        refs.append(object())
        return refs[-1], ("update", len(refs) - 1)

    def as_completed(rs, on_rerun=None):
        yield 0, (4, 0.1)
        raise error

    monkeypatch.setattr(runtime, "ray_start_kept", start)
    monkeypatch.setattr(runtime, "ray_as_completed", as_completed)
    monkeypatch.setattr(runtime, "ray_settle", lambda rs: seen["settle"].append(list(rs)))
    monkeypatch.setattr(runtime, "ray_cancel", lambda rs: seen["cancel"].append(list(rs)))
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(prefect, "get_run_logger", lambda: logging.getLogger("test"))
    taken = []

    # Act
    with pytest.raises(type(error)):
        tasks.train_round_task.fn(
            calls=[{}, {}, {}],
            names=["c0", "c1", "c2"],
            take=lambda j, u: taken.append(u),
            progress=tasks.RoundProgress(),
        )

    # Assert: ray.cancel racing a completing task can abort the driver inside Ray's core worker
    assert seen == ({"settle": [refs], "cancel": []} if settled else {"settle": [], "cancel": [refs]})
    assert taken == [("update", 0)]  # the first finished before the error: the engine already has it


def test_the_round_task_hands_over_results_in_client_order_once_each_across_a_retry(monkeypatch):
    """Clients finish out of order; the engine must take them in order, while the rest still train. A retry
    after a failed client reruns only the clients not yet taken, and never hands over one twice."""
    import logging

    import prefect
    import ray

    from flows.runs import tasks
    from flows.services import runtime

    # Arrange: attempt 1 finishes clients 1, 0, 3 and then client 2 fails; attempt 2 reruns 2 and 3
    started, attempt = [], {"n": 0}
    finishing = {1: [1, 0, 3, "fail"], 2: [3, 2]}

    def start(fn, **kw):
        started.append((attempt["n"], kw["j"]))
        return ("head", kw["j"]), ("update", attempt["n"], kw["j"])

    def as_completed(rs, on_rerun=None):
        order = [("head", j) for j in (c for c in finishing[attempt["n"]] if c != "fail")]
        for head in order:
            yield rs.index(head), (4, 0.1)
        if "fail" in finishing[attempt["n"]]:
            raise RuntimeError("client step failed")

    monkeypatch.setattr(runtime, "ray_start_kept", start)
    monkeypatch.setattr(runtime, "ray_as_completed", as_completed)
    monkeypatch.setattr(runtime, "ray_settle", lambda rs: None)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(prefect, "get_run_logger", lambda: logging.getLogger("test"))
    taken, progress = [], tasks.RoundProgress()
    calls = [{"j": j} for j in range(4)]

    # Act: the task's first attempt, then Prefect's retry with the same arguments
    attempt["n"] = 1
    with pytest.raises(RuntimeError, match="client step failed"):
        tasks.train_round_task.fn(
            calls=calls, names=list("abcd"), take=lambda j, u: taken.append((j, u)), progress=progress
        )
    assert taken == [(0, ("update", 1, 0)), (1, ("update", 1, 1))]  # client 3 waits for client 2
    attempt["n"] = 2
    tasks.train_round_task.fn(
        calls=calls, names=list("abcd"), take=lambda j, u: taken.append((j, u)), progress=progress
    )

    # Assert
    assert [j for j, _ in taken] == [0, 1, 2, 3]
    assert taken[2:] == [(2, ("update", 2, 2)), (3, ("update", 2, 3))]
    assert started == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3)]  # the retry reran only 2 and 3


def test_an_error_while_taking_a_result_is_not_retried(monkeypatch):
    """The engine failing to fold an update in is not the clients' fault: a retry must not rerun them."""
    import logging

    import prefect
    import ray

    from flows.runs import tasks
    from flows.services import runtime

    started = []
    monkeypatch.setattr(runtime, "ray_start_kept", lambda fn, **kw: started.append(1) or (("h", len(started)), "u"))
    monkeypatch.setattr(runtime, "ray_as_completed", lambda rs, on_rerun=None: iter([(0, (4, 0.1))]))
    monkeypatch.setattr(runtime, "ray_settle", lambda rs: None)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    monkeypatch.setattr(prefect, "get_run_logger", lambda: logging.getLogger("test"))
    progress = tasks.RoundProgress()

    def take(j, u):
        raise ValueError("weights of another shape")

    for _ in range(2):
        with pytest.raises(ValueError, match="another shape"):
            tasks.train_round_task.fn(calls=[{}], names=["a"], take=take, progress=progress)
    assert len(started) == 1


def test_a_sync_flow_does_not_wait_for_its_heartbeat_thread(monkeypatch):
    """Prefect's heartbeat thread sleeps in one-second steps and a synchronous flow joined it when it ended,
    so every flow waited out the rest of a second. The patch passes ``join_on_exit=False`` (as Prefect's
    async engine does) and keeps every other argument; a Prefect without that parameter is left alone."""
    from prefect import flow_engine

    from flows.services import runtime

    calls = []

    def send(engine, join_on_exit: bool = True):
        calls.append((engine, join_on_exit))

    monkeypatch.setattr(flow_engine, "_send_heartbeats", send)
    assert runtime.flow_ends_without_heartbeat_wait() is True
    assert runtime.flow_ends_without_heartbeat_wait() is True  # once: not wrapped twice
    flow_engine._send_heartbeats("engine")
    assert calls == [("engine", False)]

    def other(engine):  # a Prefect whose function has no such switch
        calls.append(engine)

    monkeypatch.setattr(flow_engine, "_send_heartbeats", other)
    assert runtime.flow_ends_without_heartbeat_wait() is False
    assert flow_engine._send_heartbeats is other


def test_the_pinned_prefect_still_sends_heartbeats_under_the_patch(monkeypatch):
    """On the Prefect this project pins, the patch applies, and a real flow still emits its heartbeat."""
    import inspect

    from prefect import flow, flow_engine

    from flows.services import runtime

    real = flow_engine._send_heartbeats
    real = getattr(real, "func", real)  # already patched by an earlier flow in this process
    assert "join_on_exit" in inspect.signature(real).parameters
    monkeypatch.setattr(flow_engine, "_send_heartbeats", real)
    emitted = []
    monkeypatch.setattr(
        flow_engine.FlowRunEngine, "_emit_flow_run_heartbeat", lambda self, *a, **kw: emitted.append(self.flow_run.id)
    )
    runtime.ensure_prefect_api()
    assert getattr(flow_engine._send_heartbeats, "_fedcore_no_join", False)

    @flow(name="heartbeat-probe")
    def probe() -> int:
        return 7

    assert probe() == 7
    assert len(emitted) >= 1


def test_tensors_travel_to_and_from_workers_as_arrays_with_the_same_bits():
    """Client states cross processes as numpy arrays (Ray's zero-copy path, not torch's pickling); what
    arrives is the same tensors bit for bit, in memory of their own, and everything else is untouched."""
    import pickle

    import numpy as np
    import torch

    from fedcore.types import ClientUpdate
    from flows.runs.worker import Packed, pack, unpack

    g = torch.Generator().manual_seed(0)
    update = ClientUpdate(
        state={
            "w": torch.randn(3, 4, generator=g),
            "bn.num_batches_tracked": torch.tensor(7),
            "half": torch.ones(2).bfloat16(),
        },
        num_examples=40,
        metrics={"train_loss": 0.25},
        client_state={"c_i": {"w": torch.randn(3, 4, generator=g)[:, ::2]}},  # a non-contiguous view too
        payload={"delta_c": [torch.zeros(2)], "counts": (torch.arange(3),)},
    )
    x = np.arange(6.0)
    packed = pack({"update": update, "x": x})
    assert isinstance(packed["update"].state["w"], Packed) and packed["x"] is x
    assert isinstance(packed["update"].state["half"], torch.Tensor)  # numpy has no bfloat16: left a tensor
    back = unpack(pickle.loads(pickle.dumps(packed, protocol=5)))["update"]
    for a, b in [
        (update.state["w"], back.state["w"]),
        (update.state["bn.num_batches_tracked"], back.state["bn.num_batches_tracked"]),
        (update.client_state["c_i"]["w"], back.client_state["c_i"]["w"]),
        (update.payload["delta_c"][0], back.payload["delta_c"][0]),
        (update.payload["counts"][0], back.payload["counts"][0]),
    ]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.num_examples == 40 and back.metrics == {"train_loss": 0.25}
    assert isinstance(back.payload["counts"], tuple) and back.state["w"].numpy().flags.writeable


def test_a_ray_address_on_this_hosts_loopback_is_told_from_one_elsewhere():
    from flows.services.runtime import _on_loopback

    for here in ("127.0.0.1:6379", "127.0.1.1:6379", "localhost:6379", "ray://127.0.0.1:10001", "[::1]:6379"):
        assert _on_loopback(here), here
    for elsewhere in ("10.0.0.5:6379", "head.example.org:6379", "ray://192.0.2.7:10001"):
        assert not _on_loopback(elsewhere), elsewhere
