"""The only module that imports Ray: Prefect API set-up and the Ray task runner.

With no Prefect API URL set, every Ray worker would start its own temporary Prefect server
(~170 MB and 5-6 s each). We start one temporary server here in the driver, or use the URL the
user exported, and pass it to the workers through Ray's ``runtime_env``.

Start-up is overlapped: the temporary server boots on a thread while Ray starts, and the local
Ray workers a flow will use then import the worker code (torch and fedcore: ``flows.runs.worker``)
before the first real task arrives.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Tuple

if TYPE_CHECKING:
    from prefect.server.api.server import SubprocessASGIServer

log = logging.getLogger(__name__)
_SERVER = None


def ensure_prefect_api() -> str:
    """The Prefect API URL to use: ``PREFECT_API_URL`` if set, else one temporary local server."""
    return _prefect_api()[1]()


def _prefect_api() -> Tuple[str, Callable[[], str]]:
    """The Prefect API URL now, and a wait() that returns it once the server answers.

    ``PREFECT_API_URL`` if set; else a temporary server booting on a thread. wait() returns the
    URL it ended up on (the server moves if its port was taken meanwhile).

    Prefect's server module, which holds the class that starts that server, takes 1.4 s to import
    in a flow's process. Unless it is imported already, the thread imports it too, so that the import
    overlaps Ray's start instead of coming before it: the URL planned here is that class's, for a
    free loopback port chosen now.
    """
    log_runs_at_info()
    flow_ends_without_heartbeat_wait()
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url, lambda: url
    if "prefect.server.api.server" in sys.modules:
        server = _temporary_server()
        port = server.port
    else:  # the thread makes it, on this port
        server, port = None, _free_loopback_port()
    planned = _server_url(port)
    errors: List[BaseException] = []

    def boot() -> None:
        global _SERVER
        try:
            _SERVER = _temporary_server(port) if server is None else server
            _SERVER.start(timeout=120)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
            errors.append(exc)

    thread = threading.Thread(target=boot, name="prefect-server", daemon=True)
    thread.start()

    def wait() -> str:
        thread.join()
        if errors:
            raise RuntimeError(
                f"the temporary Prefect server did not start: {errors[0]}; start one with "
                "`prefect server start --host 127.0.0.1` and export PREFECT_API_URL"
            ) from errors[0]
        os.environ["PREFECT_API_URL"] = _SERVER.api_url
        log.info("started a temporary Prefect server at %s", _SERVER.api_url)
        return _SERVER.api_url

    return planned, wait


def _server_url(port: int) -> str:
    """The API URL Prefect's ``SubprocessASGIServer`` serves on ``port`` (its ``api_url``), known before
    the class is imported (a test checks the two agree)."""
    return f"http://127.0.0.1:{port}/api"


def _free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs the temporary Prefect server as its child, in a session of its own, and ends it when the driver has gone:
# its stdin is a pipe whose other end only the driver holds, so the pipe closes however the driver ends
# (SIGKILL, a native crash, the OOM killer included). A SIGTERM (Prefect's own stop) is passed on to the server.
_SERVER_GUARD = r"""
import os, select, signal, subprocess, sys
server = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
signal.signal(signal.SIGTERM, lambda signum, frame: server.terminate())
signal.signal(signal.SIGINT, signal.SIG_IGN)
while server.poll() is None:
    try:
        ready = select.select([0], [], [], 0.5)[0]
    except InterruptedError:
        continue
    if ready and not os.read(0, 1):
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
sys.exit(server.wait())
"""
_GUARD_PIPES: List[int] = []  # the driver's ends, open for as long as it lives


class _OwnSession:
    """``subprocess`` as Prefect's server module sees it: the temporary server starts in a session of its own,
    under a guard (:data:`_SERVER_GUARD`) that ends it when the driver has gone.

    A terminal's Ctrl-C goes to the whole foreground process group. Had the server been in it, it would stop
    at the same moment as the run it serves, so the run could not mark its flow and task runs crashed, and
    Prefect's client would retry the dead server for a minute. The driver stops the server itself when it
    exits (Prefect's exit handler, or :func:`stop_temporary_server_now` after a stop signal); the guard
    covers an exit that runs neither."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 (subprocess's own name)
        command = list(kwargs.pop("args") if "args" in kwargs else args[0])
        read, write = os.pipe()  # not inherited by the driver's other children (PEP 446)
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _SERVER_GUARD, *command], stdin=read, start_new_session=True, **kwargs
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        _GUARD_PIPES.append(write)
        return process


def _temporary_server(port: int | None = None) -> "SubprocessASGIServer":
    """Prefect's own ephemeral-server singleton (no port key): a Prefect client in this process that
    finds no API URL in its settings then reuses this server instead of starting another. ``port``:
    the one to start it on, unless it already has one (default: a free loopback port)."""
    from prefect.server.api import server as prefect_server
    from prefect.server.api.server import SubprocessASGIServer

    if not isinstance(prefect_server.subprocess, _OwnSession):
        prefect_server.subprocess = _OwnSession()  # type: ignore[assignment]
    server = SubprocessASGIServer()
    if server.port is None:
        server.port = _free_loopback_port() if port is None else port
    return server


def log_runs_at_info() -> None:
    """Flow and task run logs at INFO reach the Prefect API (the UI's Logs tab), unless the user chose a level.

    Prefect sets its loggers' level from ``PREFECT_LOGGING_LEVEL`` when it is imported, and a
    logger below that level drops a record before its API handler sees it. A level the user set
    (environment, profile or ``.env``) stands; otherwise this process's ``prefect`` logger is put
    at INFO, and the variable exported so that Ray workers (:func:`ray_init_kwargs`) do the same.
    """
    from prefect.settings import get_current_settings

    # Prefect's settings are read when it is imported; the environment may have been set since.
    if "PREFECT_LOGGING_LEVEL" in os.environ or "level" in get_current_settings().logging.model_fields_set:
        return
    os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
    logging.getLogger("prefect").setLevel(logging.INFO)


def flow_ends_without_heartbeat_wait() -> bool:
    """A synchronous flow ends as soon as its work does, not up to a second later; True if patched.

    Prefect 3.9 emits a flow-run heartbeat (zombie-run detection) from a thread that sleeps in
    one-second steps, and a synchronous flow joins that thread when it ends: every flow then waits
    out the rest of the current second (0.5 s on average, measured 0.5-0.9 s at the end of the
    arrival flow). Prefect's asynchronous engine already leaves the thread to stop by itself
    (``join_on_exit=False``); this gives synchronous flows the same. The heartbeats are sent as
    before; the daemon thread stops within a second of the flow, without emitting again. Left as
    it is where Prefect's function has no ``join_on_exit`` (another Prefect version).
    """
    import inspect

    from prefect import flow_engine

    send = getattr(flow_engine, "_send_heartbeats", None)
    if send is None or getattr(send, "_fedcore_no_join", False):
        return send is not None
    if "join_on_exit" not in inspect.signature(send).parameters:
        return False
    patched = functools.partial(send, join_on_exit=False)
    patched._fedcore_no_join = True  # type: ignore[attr-defined]
    flow_engine._send_heartbeats = patched
    return True


def is_temporary_api(url: str | None = None) -> bool:
    """Whether ``url`` (default: ``PREFECT_API_URL``) is the temporary server started here.

    That server serves the API only, no UI, and stops with the run; its database is Prefect's
    default one, which ``prefect server start`` serves with the UI.
    """
    return _SERVER is not None and (url or os.environ.get("PREFECT_API_URL")) == _SERVER.api_url


def temporary_server_gone() -> bool:
    """Whether the temporary server started here has exited (it is in a session of its own, so a Ctrl-C to the
    run's process group does not stop it; it may still have died)."""
    process = getattr(_SERVER, "server_process", None)
    return process is not None and process.poll() is not None


def stop_temporary_server_now() -> None:
    """Send the temporary server SIGTERM without waiting for it (the process is about to exit)."""
    process = getattr(_SERVER, "server_process", None)
    if process is not None and process.poll() is None:
        process.terminate()


def stop_prefect_api() -> None:
    global _SERVER
    if _SERVER is not None:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)  # send queued flow/task logs while the server is still there
        _SERVER.stop()
        os.environ.pop("PREFECT_API_URL", None)
        _SERVER = None


@contextlib.contextmanager
def loopback_ray() -> Iterator[None]:
    """Within this block, a Ray started here binds loopback only (node, GCS, raylet, workers: 127.0.0.1).

    On Linux ``ray.init()`` takes the address the host routes outward, and maps
    ``_node_ip_address="127.0.0.1"`` to it too, so a local Ray would listen on the machine's network.
    Ray keeps a node on loopback where multi-node clusters are off (its constant ``ENABLE_RAY_CLUSTER``,
    read when a node's address is chosen). It is switched off only while the block runs: left off, a
    later ``ray start --address`` or a join of a real cluster from this process would be refused.
    """
    import ray._private.ray_constants as ray_constants

    _register_exit_hook()
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def ray_init_kwargs(*, num_cpus: int, prefect_api_url: str, root: Path, ship_code: bool = False) -> Dict[str, Any]:
    """``ray.init``'s arguments: the environment every worker gets, and with ``ship_code`` the code itself.

    ``ship_code`` (a flow that joins a cluster): ``fedcore`` and ``flows`` go to the workers as Ray
    ``py_modules``, uploaded once per version of the code, ahead of anything on the node's own path, so
    a node needs the Python dependencies but no checkout. Relative paths of the config still name the
    driver's checkout (``FEDCORE_PROJECT_ROOT``): the inputs are read at the same paths on every node.
    """
    # OMP_NUM_THREADS is left to Ray (it sets it from each task's num_cpus); tasks that get
    # several CPUs call torch.set_num_threads themselves.
    env = {
        "PREFECT_API_URL": prefect_api_url,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])),
        "FEDCORE_PROJECT_ROOT": str(root),
    }
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
        if key in os.environ:
            env[key] = os.environ[key]
    runtime_env: Dict[str, Any] = {"env_vars": env}
    if ship_code:
        import fedcore
        import flows

        runtime_env["py_modules"] = [str(Path(fedcore.__file__).parent), str(Path(flows.__file__).parent)]
        runtime_env["excludes"] = ["__pycache__", "*.pyc"]
        # A working_dir of its own, holding nothing: without one Ray puts the driver's current folder (the
        # checkout) first on every worker's path, on the assumption that each node has it at that path
        runtime_env["working_dir"] = str(_empty_job_dir())
    return {"num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": True, "runtime_env": runtime_env}


@functools.lru_cache(maxsize=1)
def _empty_job_dir() -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="fedcore-job-"))
    (folder / "README").write_text(
        "The working folder of a fedcore flow's Ray workers: the code comes as py_modules.\n"
    )
    return folder


def placement() -> Dict[str, str]:
    """Where the calling Ray task runs, as tags for its MLflow run: the node, the GPUs Ray gave it, and the
    folder its fedcore was imported from (a Ray ``runtime_resources`` folder when the code was shipped)."""
    import fedcore

    out = {"ray.node_id": "", "ray.gpu_ids": "", "code.fedcore": str(Path(fedcore.__file__).parent)}
    try:
        import ray

        if ray.is_initialized():
            out["ray.node_id"] = ray.get_runtime_context().get_node_id()
            out["ray.gpu_ids"] = ",".join(str(g) for g in ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - outside Ray: no node to name
        pass
    return out


def cpu_fallback_note(device: str, where: Mapping[str, str]) -> str | None:
    """What to log when Ray gave a task a GPU that torch cannot use (``device=auto`` on a node whose GPU
    count was declared, or whose CUDA is missing): the model then trains on the CPU."""
    import torch

    if where.get("ray.gpu_ids") and str(device) == "auto" and not torch.cuda.is_available():
        return (
            f"Ray placed this task on GPU {where['ray.gpu_ids']} of node {where['ray.node_id'][:12]}, but torch "
            "sees no CUDA here: the model runs on the CPU (device=auto)"
        )
    return None


def make_task_runner(*, address: str | None, num_cpus: int, root: Path):
    """prefect-ray's runner: a local Ray with ``num_cpus`` CPUs, or the cluster at ``address``."""
    from prefect_ray import RayTaskRunner

    # its workers run Prefect tasks (flows.runs.tasks), so they warm up with Prefect too
    return RayTaskRunner(
        address=address,
        init_kwargs=start_ray(address=address, num_cpus=num_cpus, root=root, warm_module="flows.runs.tasks"),
    )


def make_driver_runner(
    *, address: str | None, num_cpus: int, root: Path, max_workers: int = 16, warm_workers: int | None = None
):
    """Prefect tasks in driver threads whose bodies call Ray (see :func:`ray_call`); Ray started as above.

    A Prefect task on ``RayTaskRunner`` costs about 230 ms of fixed overhead here (settings
    serialised per task, rebuilt on the worker); a driver-side task that calls Ray costs
    22-42 ms (../shared/design/prefect-on-ray.md). Task states, retries and the UI stay.
    """
    from prefect.task_runners import ThreadPoolTaskRunner

    start_ray(address=address, num_cpus=num_cpus, root=root, warm_workers=warm_workers)
    return ThreadPoolTaskRunner(max_workers=max_workers)


_REMOTES: Dict[Tuple[Any, ...], Any] = {}


def ray_start(fn: Callable, /, *, num_cpus: float = 1, num_gpus: float = 0, **kwargs) -> Any:
    """Start ``fn(**kwargs)`` as a Ray task; returns its ObjectRef (ObjectRef arguments are resolved by Ray).

    The remote function is built once per (fn, resources), not per call. A task whose worker
    dies is rerun by Ray (up to 3 times); an exception raised by ``fn`` is not retried here.
    The ref resolves to ``(value, attempt)``: :func:`ray_call` and :func:`ray_as_completed` unpack it.
    """
    import ray

    key = (fn, float(num_cpus), float(num_gpus))
    if key not in _REMOTES:
        _REMOTES[key] = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=3)(_counting_attempts(fn))
    return _REMOTES[key].remote(**kwargs)


def ray_start_kept(
    fn: Callable, /, *, summary: Callable[[Any], Any], num_cpus: float = 1, num_gpus: float = 0, **kwargs
) -> Tuple[Any, Any]:
    """:func:`ray_start` for a large result that the caller fetches later, one at a time.

    Returns two ObjectRefs: ``head`` resolves to ``(summary(value), attempt)`` (small: wait on it with
    :func:`ray_as_completed`), ``value`` to the result itself, which stays in Ray's object store
    (spilling to disk when full) until the caller takes it with ``ray.get``. Reruns as :func:`ray_start` does.
    """
    import ray

    key = (fn, float(num_cpus), float(num_gpus), summary)
    if key not in _REMOTES:
        _REMOTES[key] = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=3, num_returns=2)(
            _summarised(fn, summary)
        )
    head, value = _REMOTES[key].remote(**kwargs)
    return head, value


def ray_stream(fn: Callable, /, *, num_cpus: float = 1, num_gpus: float = 0, **kwargs) -> Any:
    """Start the generator ``fn(**kwargs)`` as a Ray generator task: iterating the returned generator
    gives one ObjectRef per value, as soon as the worker yields it.

    Ray does not rerun it: a worker that dies surfaces as one of :data:`WORKER_DEATHS` when the
    next value is fetched, and the caller continues from what it already has (a rerun from the
    start would repeat every value already consumed).
    """
    import ray

    key = (fn, float(num_cpus), float(num_gpus), "stream")
    if key not in _REMOTES:
        _REMOTES[key] = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(fn)
    return _REMOTES[key].remote(**kwargs)


def worker_deaths() -> Tuple[type, ...]:
    """The errors Ray raises for a task whose worker or node died (not for an error the task raised)."""
    from ray import exceptions as e

    return (e.WorkerCrashedError, e.NodeDiedError, e.ObjectLostError)


def _counting_attempts(fn: Callable) -> Callable:
    """``fn`` returning ``(value, attempt)``, where attempt 1 is Ray's first execution of the task."""

    def counted(**kwargs):
        return fn(**kwargs), ray_attempt()

    return counted


def _summarised(fn: Callable, summary: Callable[[Any], Any]) -> Callable:
    """``fn`` returning ``((summary(value), attempt), value)``: two objects, for ``num_returns=2``."""

    def run(**kwargs):
        value = fn(**kwargs)
        return (summary(value), ray_attempt()), value

    return run


def ray_attempt() -> int:
    """Which execution of the running Ray task this is: 1 the first, 2 once Ray reran it after its worker died.

    Ray knows (it reruns a task whose worker died) but exposes the number only on its core
    worker, not in its public API; the public state API needs the dashboard, which local runs
    leave off, and a marker file would need a file system shared by every node. 1 outside a Ray
    task or if Ray drops the method (tests/flows/test_flows.py then fails: the rerun goes unreported).
    """
    from ray._private.worker import global_worker

    get = getattr(getattr(global_worker, "core_worker", None), "get_current_task_attempt_number", None)
    try:
        return int(get()) + 1 if get is not None else 1
    except Exception:  # noqa: BLE001 - not inside a task: the first attempt by definition
        return 1


def ray_call(
    fn: Callable,
    /,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    on_rerun: Callable[[int], None] | None = None,
    **kwargs,
) -> Any:
    """:func:`ray_start` and wait for the result; ``on_rerun(attempt)`` when Ray had to rerun the task."""
    import ray

    value, attempt = ray.get(ray_start(fn, num_cpus=num_cpus, num_gpus=num_gpus, **kwargs))
    if attempt > 1 and on_rerun is not None:
        on_rerun(attempt)
    return value


def ray_as_completed(
    refs: List[Any], *, on_rerun: Callable[[int, int], None] | None = None
) -> Iterator[Tuple[int, Any]]:
    """``(index, result)`` of each :func:`ray_start` ref in ``refs`` as it finishes; a task's error is raised when
    it arrives. ``on_rerun(index, attempt)`` when Ray had to rerun that task (its worker died)."""
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        # one blocking wait, then everything else already finished in one pass: a wait per result over
        # the whole pending list was quadratic in the clients of a round (1.1 s a round at 1,000)
        done, pending = ray.wait(pending, num_returns=1)
        if pending:
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            done += more
        for ref in done:
            value, attempt = ray.get(ref)
            if attempt > 1 and on_rerun is not None:
                on_rerun(index[ref], attempt)
            yield index[ref], value


def ray_settle(refs: List[Any]) -> None:
    """Wait until every task in ``refs`` has finished, whatever its outcome, without fetching results.

    A round whose client step raised waits for its other steps rather than cancelling them:
    ``ray.cancel`` racing a task that is just completing can fail a check inside Ray's core worker
    (``it != submissible_tasks_.end()``) and abort the whole driver process. The other steps are
    sub-second to minutes, and Prefect's retry reruns the clients not yet taken.
    """
    import ray

    if refs:
        ray.wait(list(refs), num_returns=len(refs))


def ray_cancel(refs: List[Any]) -> None:
    """Cancel Ray tasks that have not finished (finished ones are left alone)."""
    import ray

    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - already finished or gone: nothing to cancel
            pass


class PutOnce:
    """Values moved to Ray's object store once each, then passed to tasks by reference.

    ``refs(key, value)`` puts ``value`` the first time ``key`` is seen and returns its ObjectRef.
    The value is kept alive with its ref, so an ``id()`` key stays unique. ``keep``: hold at most
    this many (the oldest is dropped), e.g. 1 for a global state that changes every round.
    ``pack``: what is put instead of the value itself (``flows.runs.worker.pack``: tensors as arrays).
    """

    def __init__(self, keep: int | None = None) -> None:
        self._refs: Dict[Any, Tuple[Any, Any]] = {}
        self._keep = keep

    def __call__(self, key: Any, value: Any, *, pack: Callable[[Any], Any] | None = None) -> Any:
        if key not in self._refs:
            if self._keep is not None and len(self._refs) >= self._keep:
                del self._refs[next(iter(self._refs))]
            self._refs[key] = (value, put(pack(value) if pack is not None else value))
        return self._refs[key][1]


def put(value: Any) -> Any:
    """``ray.put``: an object moved to the store once, then passed to many tasks by reference."""
    import ray

    return ray.put(value)


def start_ray(
    *,
    address: str | None,
    num_cpus: int,
    root: Path,
    warm_workers: int | None = None,
    warm_module: str = "flows.runs.worker",
) -> Dict[str, Any]:
    """Start (or join) Ray with the Prefect API URL in every worker's environment; returns the init kwargs.

    A Ray started here gets ``warm_workers`` workers (default: one per CPU) that import
    ``warm_module`` (the code their tasks will run) while the flow sets itself up; a flow that runs
    one task at a time asks for one.
    """
    import ray

    _register_exit_hook()
    _check_joined_cluster(address)
    url, wait = _prefect_api()

    # ray.init(address=None) joins the cluster RAY_ADDRESS names; "auto" joins that or the last one started here
    target = os.environ.get("RAY_ADDRESS") if address in (None, "auto") else address
    joining = address == "auto" or (bool(target) and target != "local")

    def init_kwargs(api_url: str) -> Dict[str, Any]:
        kwargs = ray_init_kwargs(num_cpus=num_cpus, prefect_api_url=api_url, root=root, ship_code=joining)
        if joining:  # a cluster that exists has its own resources
            kwargs.pop("num_cpus")
            kwargs.pop("include_dashboard")
        return kwargs

    global _OWN_RAY
    kwargs = init_kwargs(url)
    # A Ray started here, or joined on this host's loopback, stays on loopback: Ray would otherwise map
    # 127.0.0.1 to the address the host routes outward (see loopback_ray)
    own_node = loopback_ray if not joining or (target and _on_loopback(target)) else contextlib.nullcontext
    try:
        if not ray.is_initialized():  # the runner then uses this Ray; shutdown_ray() stops it
            with own_node():
                ray.init(address=address, **kwargs)
            _OWN_RAY = True
            if not joining:
                _prewarm_workers(num_cpus if warm_workers is None else warm_workers, warm_module)
        moved = wait()
        if moved != url:  # the server had to move: tell the workers
            log.warning(
                "the temporary Prefect server came up at %s, not %s: Ray restarts so that its workers report there",
                moved,
                url,
            )
            stop_ray()
            kwargs = init_kwargs(moved)
            with own_node():
                ray.init(address=address, **kwargs)
    except BaseException:
        shutdown_ray()
        with contextlib.suppress(Exception):
            wait()  # the server's boot thread finishes, so that stop_prefect_api() finds the server it made
        raise
    return kwargs


def _on_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, or a ``ray://`` client URL) names this host's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _check_joined_cluster(address: str | None) -> None:
    """Refuse a ``flow.ray_address`` other than the cluster this process is already connected to.

    A Ray that is already up in the process is used as it is (and left running): a flow run from a
    notebook or a long-lived driver joins it. Were ``address`` another cluster, the run would
    silently go to the wrong one.
    """
    import ray

    if not ray.is_initialized() or not address or address in ("auto", "local") or "://" in address:
        return
    current = ray.get_runtime_context().gcs_address
    # Ray records the address it resolved (127.0.0.1 may become the host's outward one, a name its IP):
    # two addresses of one cluster share the port, so only a different port is surely another cluster
    if current.rpartition(":")[2] != address.rpartition(":")[2]:
        raise RuntimeError(
            f"this process is already connected to the Ray cluster at {current}, but flow.ray_address is "
            f"{address}: call ray.shutdown() first, or set flow.ray_address={current} (or null to use it)"
        )


_WARMING: List[Any] = []
_OWN_RAY = False  # whether make_task_runner started the Ray in this process (else someone else owns it)


def _warm(module: str) -> None:
    import importlib

    importlib.import_module(module)  # torch and fedcore (and Prefect, for flows.runs.tasks), once per worker process
    import torch._dynamo  # noqa: F401 - torch.optim imports it at a process's first optimizer: 1 s, paid here


def _prewarm_workers(n: int, module: str = "flows.runs.worker") -> None:
    """One import task per local worker, started now: it overlaps the flow's own set-up."""
    import ray

    remote = ray.remote(num_cpus=1)(_warm)
    _WARMING[:] = [remote.remote(module) for _ in range(max(1, n))]


@contextlib.contextmanager
def task_resources(*, num_gpus: float = 0, num_cpus: float = 1) -> Iterator[None]:
    """Ray resources for the tasks submitted inside the block (GPUs when the device asks)."""
    from prefect_ray.context import remote_options

    opts: Dict[str, Any] = {"num_cpus": num_cpus}
    if num_gpus:
        opts["num_gpus"] = num_gpus
    with remote_options(**opts):
        yield


def shutdown_ray() -> None:
    """Stop the Ray this module started; a Ray the caller had already started is left running."""
    global _OWN_RAY
    import ray

    _WARMING.clear()
    _REMOTES.clear()
    if _OWN_RAY and ray.is_initialized():
        stop_ray()
    _OWN_RAY = False


def _collect_then_pause_gc() -> bool:
    """Free every reference cycle now, in this thread, then turn automatic collection off; returns whether
    it was on (see :func:`stop_ray`)."""
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    return enabled


def _stop_autoscaler_monitor() -> None:
    """Kill the autoscaler monitor of a Ray this process started (SIGKILL, by its PID), before ``ray.shutdown``.

    ``ray.shutdown`` stops a local Ray's processes one after another: SIGTERM, up to a second's wait,
    then SIGKILL. The monitor never exited within its second (likely because its SIGTERM handler
    first reports its end to the GCS, which Ray stops before it), so every shutdown waited that
    second out: ``shutdown_ray`` took 1.43-1.50 s, and 0.23-0.57 s with the monitor gone first
    (docs/benchmarks.md). A single local node has nothing to autoscale, and Ray kills
    the monitor outright after the second anyway. A Ray this process only joined started no
    processes here, so nothing is killed; nor if Ray's record of its processes is not where this
    Ray version keeps it.
    """
    import subprocess

    import ray._private.ray_constants as ray_constants
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    if not isinstance(processes, dict):
        return
    for info in processes.get(getattr(ray_constants, "PROCESS_TYPE_MONITOR", "monitor"), []):
        proc = getattr(info, "process", None)
        if isinstance(proc, subprocess.Popen) and proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _before_ray_exits() -> None:
    """At exit: what :func:`stop_ray` does before ``ray.shutdown``, for a Ray still up then."""
    _collect_then_pause_gc()
    with contextlib.suppress(Exception):  # at exit nobody is left to warn; Ray's handler still stops it
        _stop_autoscaler_monitor()


@functools.cache
def _register_exit_hook() -> None:
    """At exit, Ray's own handler (registered when ray is imported) shuts down a Ray this process started
    and did not stop, or disconnects from one it joined; this one, registered later, runs before it
    (atexit runs handlers last in, first out) and does for it what :func:`stop_ray` does first
    (:func:`_before_ray_exits`). Registered once, when a Ray is started or joined."""
    import atexit

    import ray  # noqa: F401 - its handler must be registered before this one

    atexit.register(_before_ray_exits)


def stop_ray() -> None:
    """``ray.shutdown()``, with no reference cycles left to free while Ray's core worker goes down.

    ``ray.shutdown`` stops the core worker before Python lets go of it, and releases the GIL
    meanwhile. An ObjectRef freed in that window calls into the stopped core worker, and Ray then
    ends the whole process ("The core worker has already been shutdown ... The process will exit"),
    skipping its clean-up: the Prefect server it had started kept running. Seen three times in
    benchmark processes, two of them at a ``ray.shutdown()`` after several flows. A ref in a
    reference cycle (a flow's closures, a traceback) is freed by whichever thread runs a collection:
    one that an allocation triggers in any thread (Prefect's included), or the explicit
    ``gc.collect()`` of Ray's own GC thread, which turning automatic collection off does not stop.
    So every cycle is freed first, here, while the core worker is up (a full collection: about 0.2 s
    in a flow's process), and automatic collection stays off until Ray is down. A ref whose last
    plain reference another thread drops in the window is not covered.

    A Ray this process started has its autoscaler monitor killed first, which takes about a second
    off the shutdown (:func:`_stop_autoscaler_monitor`).
    """
    import gc

    import ray

    enabled = True
    try:
        enabled = _collect_then_pause_gc()
        try:
            _stop_autoscaler_monitor()
        except Exception as exc:  # noqa: BLE001 - a shortcut: Ray still goes down, only slower
            log.warning("could not stop Ray's autoscaler monitor first (%s); ray.shutdown waits for it", exc)
        ray.shutdown()
    finally:
        if enabled:
            gc.enable()


def largest_node_cpus() -> int:
    """CPUs of the biggest live Ray node: the most threads one task can be given."""
    import ray

    return int(max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=1)) or 1


class InChild:
    """``fn(*args)`` computed in a forked child process while this one goes on; :meth:`result` waits for it.

    For work that keeps one core busy for a second while the driver has other things to do on the
    other (the arrival flow's plots, drawn while it writes MLflow's nested runs and logs the
    model). The child starts from a copy of this process, so nothing is imported or pickled to
    start it, and its result comes back through a pipe. Where fork is not the platform's safe
    default (anything but Linux) or fails, or the child fails, dies or takes longer than
    ``timeout`` seconds, :meth:`result` computes ``fn(*args)`` here instead, with a warning: only
    the overlap is lost.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> None:
        import gc
        import multiprocessing
        import sys

        self._fn, self._args, self._timeout = fn, args, timeout
        self._name = getattr(fn, "__name__", "a call")
        self._proc: Any = None
        self._conn: Any = None
        self._done: Tuple[Any, ...] = ()
        if not sys.platform.startswith("linux"):
            return
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_call, args=(send, fn, args), daemon=True, name=f"fedcore-{self._name}")
        # The child must not collect the driver's garbage: a destructor there (a Ray reference, a
        # database connection) could wait on a lock that a thread of this process held at the fork.
        gc.freeze()
        try:
            proc.start()
        except OSError as exc:  # no memory or process slot for a child: computed here, at result()
            receive.close()
            log.warning("could not start a child process for %s (%s); it will be computed here", self._name, exc)
            return
        finally:
            gc.unfreeze()
            send.close()
        self._proc, self._conn = proc, receive

    def result(self) -> Any:
        """The child's result (waiting for it), or ``fn(*args)`` computed here; the same value on every call."""
        if self._done:
            return self._done[0]
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None:
            why = f"took longer than {self._timeout:g} s"
            try:
                if conn.poll(self._timeout):
                    kind, value = conn.recv()
                    if kind == "ok":
                        self._done = (value,)
                        return value
                    why = f"failed:\n{value}"
            except Exception as exc:  # noqa: BLE001 - a child that died mid-send, or a result that does not unpickle
                why = f"ended without a result ({type(exc).__name__})"
            finally:
                conn.close()
                _reap(proc)
            log.warning("%s in a child process %s; computing it here instead", self._name, why)
        value = self._fn(*self._args)
        self._done = (value,)
        return value

    def cancel(self) -> None:
        """Stop the child if it is still running (the caller gave up on its result)."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None:
            conn.close()
            _reap(proc, wait=0.0)


def _child_call(conn: Any, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
    import traceback

    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which computes it again
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _reap(proc: Any, *, wait: float = 1.0) -> None:
    """Wait up to ``wait`` seconds for a child to end, then kill it."""
    proc.join(timeout=wait)
    if proc.is_alive():
        proc.kill()
        proc.join()
