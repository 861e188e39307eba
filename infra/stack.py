"""A real fedcore deployment on this machine's loopback: PostgreSQL, an MLflow server and a Prefect
server on it, a Ray cluster of two nodes, an SSH server for the DVC remote, and a Prefect worker that
runs every system's nightly deployment.

    python infra/stack.py up        # `make services-up`: start what is not running, print how to use it
    python infra/stack.py down      # `make services-down`: stop every process it started, by process id
    python infra/stack.py status    # each service: running or not, and where
    python infra/stack.py env       # the shell exports a client of the stack needs
    python infra/stack.py stop|restart <service>   # one service (restart: then start what is not running)
    python infra/stack.py exec -- <command>        # with the stack's settings, inside its network (joins Ray)

Every address is 127.0.0.1 and every port can be set (the variables below); the data of every
service lives under one folder, ``FEDCORE_STACK_DIR`` (default ``<repo>/.stack``), whose ``stack.json``
records each process id and ``env`` the exports. ``up`` is idempotent; ``down`` keeps the data, and
``down --purge`` removes the folder.

What runs, in order (docs/deployment.md walks through it):

* ``postgres``: a PostgreSQL cluster of its own (``initdb`` from the system's packages, never the
  system service), databases ``mlflow`` and ``prefect``, a password in ``<dir>/postgres.password``;
* ``mlflow``: ``infra/mlflow-server.sh`` with the PostgreSQL store, serving artifacts from ``<dir>/mlartifacts``;
* ``prefect``: ``prefect server start`` with the PostgreSQL database;
* ``sshd``: an SSH server with a host key and a client key made here (the key opens SFTP only), serving
  ``<dir>/dvc-remote`` as the DVC remote ``ssh://<user>@127.0.0.1:<port><dir>/dvc-remote``;
* ``netns`` (as root): a network namespace whose only interface is loopback, for Ray's nodes (which listen
  on every interface of their network), the worker and its flow runs, and a forwarder that makes the
  MLflow, Prefect and SSH ports of this host's loopback reachable inside it;
* ``ray-head`` and ``ray-worker``: ``ray start --head`` and ``ray start --address``; the worker node runs in
  an empty folder and declares ``FEDCORE_RAY_WORKER_GPUS`` GPUs, so GPU placement is exercised. Flows that
  join the cluster ship ``fedcore`` and ``flows`` to its workers through Ray's ``runtime_env``, so no node
  needs a checkout;
* ``worker``: the work pool ``fedcore-process`` (one flow run at a time), the deployments of
  ``infra/prefect.yaml`` and a ``prefect worker``, whose flow runs join the Ray cluster, track to the MLflow
  server and push to the SSH remote.

Run as root, PostgreSQL runs as the ``postgres`` user (it refuses root) and ``sshd`` as root; as any
other user, both run as that user, and there is no namespace.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "fedcore-process"
SERVICES = ("postgres", "mlflow", "prefect", "sshd", "netns", "ray-head", "ray-worker", "worker")
PORTS = {  # variable -> default
    "FEDCORE_PG_PORT": 55432,
    "FEDCORE_MLFLOW_PORT": 5055,
    "FEDCORE_PREFECT_PORT": 4299,
    "FEDCORE_RAY_PORT": 6399,
    "FEDCORE_SSH_PORT": 2299,
}


class StackError(RuntimeError):
    """A service that could not start, with what to do."""


class Stack:
    def __init__(self, folder: Optional[str] = None):
        self.dir = Path(folder or os.environ.get("FEDCORE_STACK_DIR") or ROOT / ".stack").resolve()
        self.state_file = self.dir / "stack.json"
        self.state: Dict[str, Any] = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        saved = self.state.get("ports", {})
        # while any service is recorded, the settings it was started with win over the environment's
        live = any(name in self.state for name in SERVICES)
        self.ports = {k: int((saved.get(k) if live else None) or os.environ.get(k) or v) for k, v in PORTS.items()}
        gpus = self.state.get("gpus") if live else None
        self.gpus = int(gpus if gpus is not None else os.environ.get("FEDCORE_RAY_WORKER_GPUS", 1))
        self.user = getpass.getuser()
        self.root_user = os.geteuid() == 0
        # Ray's nodes listen on every interface of their network (and map 127.0.0.1 to the address the host
        # routes outward): as root they run, with the worker and its flow runs, in a network namespace of
        # their own whose only interface is loopback (FEDCORE_STACK_NETNS=0 turns it off)
        wanted = self.state.get("netns_wanted") if live else os.environ.get("FEDCORE_STACK_NETNS", "auto")
        self.netns: Optional[str] = (
            self.state.get("netns_name")
            if live
            else f"fedcore-{self.ports['FEDCORE_RAY_PORT']}"
            if wanted != "0" and self.root_user and shutil.which("ip")
            else None
        )
        self.state["netns_wanted"] = wanted

    # ---------- where things are
    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def _pg_password(self) -> str:
        f = self.dir / "postgres.password"
        if not f.is_file():
            _write_secret(f, secrets.token_hex(16))
        return f.read_text().strip()

    def db_uri(self, db: str, driver: str = "postgresql") -> str:
        return f"{driver}://fedcore:{self._pg_password()}@127.0.0.1:{self.ports['FEDCORE_PG_PORT']}/{db}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.ports['FEDCORE_MLFLOW_PORT']}"

    @property
    def prefect_api(self) -> str:
        return f"http://127.0.0.1:{self.ports['FEDCORE_PREFECT_PORT']}/api"

    @property
    def ray_address(self) -> str:
        return f"127.0.0.1:{self.ports['FEDCORE_RAY_PORT']}"

    @property
    def ray_temp(self) -> str:
        # Ray's socket paths must fit in 107 bytes: a short folder in /tmp, named for the port
        return f"/tmp/fedcore-stack-ray-{self.ports['FEDCORE_RAY_PORT']}"

    @property
    def ssh_key(self) -> Path:
        return self.dir / "ssh" / "client_key"

    @property
    def dvc_remote(self) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.ports['FEDCORE_SSH_PORT']}{self.dir / 'dvc-remote'}"

    def env(self) -> Dict[str, str]:
        """What a client of the stack exports: the flows, `make push`/`make pull` and the Prefect CLI read these."""
        return {
            "PREFECT_API_URL": self.prefect_api,
            "FEDCORE_TRACKING_URI": self.mlflow_uri,
            "RAY_ADDRESS": self.ray_address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self._ray_token()),
            "FEDCORE_DVC_REMOTE": self.dvc_remote,
            "FEDCORE_DVC_REMOTE_KEYFILE": str(self.ssh_key),
        }

    def _base_env(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PREFECT_API_URL")}
        env.update(
            FEDCORE_STACK=str(self.dir),  # every process the stack starts carries it: how `down` finds strays
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            PREFECT_HOME=str(self.dir / "prefect-home"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_CLI_PROMPT="false",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self._ray_token()),
            RAY_USAGE_STATS_ENABLED="0",
            MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true",  # a line per run in the worker's log otherwise
        )
        return env

    def _ray_token(self) -> Path:
        """The Ray cluster's token (``ray start`` turns token authentication on): every node and driver presents it."""
        f = self.dir / "ray_auth_token"
        if not f.is_file():
            self.dir.mkdir(parents=True, exist_ok=True)
            _write_secret(f, secrets.token_hex(32))
        return f

    # ---------- process bookkeeping
    def _save(self) -> None:
        self.state["ports"] = self.ports
        self.state["gpus"] = self.gpus
        self.state["netns_name"] = self.netns
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)
        (self.dir / "env").write_text("".join(f"export {k}={v}\n" for k, v in self.env().items()))

    def running(self, name: str) -> bool:
        """Whether the service's recorded processes are alive and still this stack's (a pid can be reused)."""
        pids = self.state.get(name, {}).get("pids", [])
        return bool(pids) and all(_alive(p) and self._ours(name, p) for p in pids)

    def _ours(self, name: str, pid: int) -> bool:
        """Whether ``pid`` is still the process the stack recorded for ``name`` (same start time), or one
        that carries the stack's mark; a recorded pid may belong to another process after a reboot."""
        started = self.state.get(name, {}).get("started", {}).get(str(pid))
        return _start_time(pid) == started if started is not None else _is_marked(pid, self.dir)

    def _record(self, name: str, pids: List[int], **extra: Any) -> None:
        self.state[name] = {"pids": pids, "started": {str(p): _start_time(p) for p in pids}, **extra}
        self._save()

    def _spawn(self, name: str, cmd: List[str], *, env: Dict[str, str], cwd: Path = ROOT) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._record(name, [proc.pid], group=True)
        return proc.pid

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            pids = self.state.get(name, {}).get("pids", [])
            if pids and not all(_alive(p) for p in pids):
                break
            time.sleep(0.5)
        tail = _tail(self.logs / f"{name}.log")
        raise StackError(f"{name} did not come up within {timeout:.0f} s; the end of {self.logs / name}.log:\n{tail}")

    def in_netns(self, cmd: List[str]) -> List[str]:
        """``cmd`` run inside the stack's network namespace (where the Ray cluster is), when it has one."""
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    # ---------- the services
    def up_netns(self) -> None:
        """The namespace, its loopback up, and a forwarder that makes the MLflow, Prefect and SSH ports of
        this host's loopback reachable at the same addresses inside it."""
        if self.netns is None:
            return
        have = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if self.netns not in have:
            _run(["ip", "netns", "add", self.netns], "ip netns add", self.logs)
        _run(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], "loopback up", self.logs)
        ports = [self.ports[k] for k in ("FEDCORE_MLFLOW_PORT", "FEDCORE_PREFECT_PORT", "FEDCORE_SSH_PORT")]
        log = self.logs / "netns.log"
        seen = log.stat().st_size if log.is_file() else 0
        self._spawn(
            "netns",
            [sys.executable, str(Path(__file__).resolve()), "forward", self.netns, *map(str, ports)],
            env=self._base_env(),
        )
        self._wait("netns", lambda: log.is_file() and b"listening in" in log.read_bytes()[seen:], timeout=30)

    def _as_postgres(self, cmd: List[str]) -> List[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if self.root_user else cmd

    def up_postgres(self) -> None:
        data = self.dir / "postgres"
        pg_bin = _pg_bin()
        if self.root_user:  # postgres refuses to run as root: its folder belongs to the postgres user
            probe = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(self.dir)])
            if probe.returncode != 0:
                raise StackError(
                    f"the postgres user cannot reach {self.dir}: set FEDCORE_STACK_DIR to a folder every user "
                    "can traverse, for example /var/tmp/fedcore-stack"
                )
        if not (data / "PG_VERSION").is_file():
            data.mkdir(parents=True, exist_ok=True)
            pwfile = self.dir / "postgres.pwfile"
            _write_secret(pwfile, self._pg_password() + "\n")
            try:
                if self.root_user:
                    shutil.chown(data, "postgres")
                    shutil.chown(pwfile, "postgres")
                cmd = [str(pg_bin / "initdb"), "-D", str(data), "-U", "fedcore", f"--pwfile={pwfile}"]
                cmd += ["--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "--encoding=UTF8", "--locale=C"]
                _run(self._as_postgres(cmd), "initdb", self.logs)
            finally:
                pwfile.unlink(missing_ok=True)
        sock = self.dir / "postgres-run"
        sock.mkdir(exist_ok=True)
        if self.root_user:
            shutil.chown(sock, "postgres")
        opts = f"-p {self.ports['FEDCORE_PG_PORT']} -c listen_addresses=127.0.0.1 -c unix_socket_directories={sock}"
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / "postgres.log"
        log.touch()
        if self.root_user:
            shutil.chown(log, "postgres")
        start = [str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "120", "start"]
        _run(self._as_postgres(start), "pg_ctl start", self.logs, self._base_env())
        pid = int((data / "postmaster.pid").read_text().split()[0])
        self._record("postgres", [pid], group=False, data=str(data))
        env = {**self._base_env(), "PGPASSWORD": self._pg_password()}
        for db in ("mlflow", "prefect"):
            psql = [str(pg_bin / "psql"), "-h", "127.0.0.1", "-p", str(self.ports["FEDCORE_PG_PORT"]), "-U", "fedcore"]
            have = subprocess.run(
                [*psql, "-d", "postgres", "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{db}'"],
                env=env,
                capture_output=True,
                text=True,
            )
            if have.stdout.strip() != "1":
                _run([*psql, "-d", "postgres", "-c", f"CREATE DATABASE {db}"], f"create database {db}", self.logs, env)

    def up_mlflow(self) -> None:
        env = {
            **self._base_env(),
            "MLFLOW_DB_URI": self.db_uri("mlflow", "postgresql+psycopg2"),
            "MLFLOW_ARTIFACTS": str(self.dir / "mlartifacts"),
            "MLFLOW_PORT": str(self.ports["FEDCORE_MLFLOW_PORT"]),
        }
        self._spawn("mlflow", ["bash", str(ROOT / "infra" / "mlflow-server.sh")], env=env, cwd=self.dir)
        self._wait("mlflow", lambda: _http_ok(f"{self.mlflow_uri}/health"))

    def up_prefect(self) -> None:
        env = {**self._base_env(), "PREFECT_API_DATABASE_CONNECTION_URL": self.db_uri("prefect", "postgresql+asyncpg")}
        port = str(self.ports["FEDCORE_PREFECT_PORT"])
        self._spawn(
            "prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port], env=env
        )
        self._wait("prefect", lambda: _http_ok(f"{self.prefect_api}/health"))

    def _ray_start(self, name: str, args: List[str], cwd: Path) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        env = self._base_env()
        env.pop("PYTHONPATH", None)  # a node imports nothing from a checkout
        node = ["--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={self.ray_temp}"]
        node.append(f"--object-store-memory={int(os.environ.get('FEDCORE_RAY_OBJECT_STORE_MB', 1024)) << 20}")
        before = set(_marked(self.dir))
        _run(self.in_netns([str(BIN / "ray"), "start", *args, *node]), f"ray start ({name})", self.logs, env, cwd=cwd)
        # what this `ray start` left running: the daemons it detached (adopted by a process outside the stack:
        # init, or a subreaper), and theirs; not what the stack's other processes started meanwhile
        new = set(_marked(self.dir)) - before
        roots = [p for p in new if _parent(p) not in new and not _is_marked(_parent(p), self.dir)]
        pids = sorted({*roots, *(d for r in roots for d in _descendants(r))})
        raylet = [p for p in pids if _cmd(p)[:1] and _cmd(p)[0].endswith("/raylet")]
        if not raylet:
            raise StackError(f"ray start ({name}) left no raylet running; see {self.logs / 'commands.log'}")
        # the node's raylet stands for the node; its agents (renamed ray::...) are found below it
        pids = sorted({*pids, *_descendants(raylet[0])})
        self._record(name, raylet, all=pids, group=False)

    def up_ray_head(self) -> None:
        port = self.ports["FEDCORE_RAY_PORT"]
        self._ray_start(
            "ray-head",
            ["--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=1", "--num-gpus=0"],
            self.dir / "ray-head",
        )

    def up_ray_worker(self) -> None:
        self._ray_start(
            "ray-worker",
            [f"--address={self.ray_address}", "--num-cpus=1", f"--num-gpus={self.gpus}"],
            self.dir / "ray-worker",  # empty: the code arrives through runtime_env
        )
        self._wait("ray-worker", lambda: self.ray_nodes() >= 2, timeout=60)

    def up_sshd(self) -> None:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).is_file():
            raise StackError(
                "no sshd here: install it (`apt-get install openssh-server`, which `make deploy-setup` runs)"
            )
        keys = self.dir / "ssh"
        keys.mkdir(parents=True, exist_ok=True)
        keys.chmod(0o700)
        for key in ("host_key", "client_key"):
            if not (keys / key).is_file():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)], "ssh-keygen", self.logs)
        # the key opens SFTP and nothing else (no shell, pty, agent or port forwarding)
        _write_secret(keys / "authorized_keys", "restrict " + (keys / "client_key.pub").read_text())
        (self.dir / "dvc-remote").mkdir(exist_ok=True)
        config = keys / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.ports['FEDCORE_SSH_PORT']}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {keys / 'host_key'}",
                    f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                    f"PidFile {keys / 'sshd.pid'}",
                    f"AllowUsers {self.user}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "StrictModes no",
                    "UsePAM no",
                    "Subsystem sftp internal-sftp",
                    "ForceCommand internal-sftp",
                    "DisableForwarding yes",
                    "PermitTTY no",
                    "",
                ]
            )
        )
        if self.root_user:
            Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation folder
        # -D: in the foreground of its own session, so that the recorded pid is sshd's own
        self._spawn("sshd", [sshd, "-D", "-e", "-f", str(config)], env=self._base_env())
        self._wait("sshd", lambda: _port_open(self.ports["FEDCORE_SSH_PORT"]), timeout=30)

    def up_worker(self) -> None:
        # the flow runs import this checkout's code ahead of any other installed copy
        env = {**self._base_env(), **self.env(), "PYTHONPATH": str(ROOT)}
        prefect = str(BIN / "prefect")
        _run([prefect, "work-pool", "create", POOL, "--type", "process", "--overwrite"], "work-pool", self.logs, env)
        # one nightly run at a time: each records its stages in the one checkout's dvc.lock
        _run([prefect, "work-pool", "set-concurrency-limit", POOL, "1"], "work-pool limit", self.logs, env)
        _run([prefect, "deploy", "--all", "--prefect-file", "infra/prefect.yaml"], "prefect deploy", self.logs, env)
        self._crash_orphans()
        self._spawn("worker", self.in_netns([prefect, "worker", "start", "--pool", POOL, "--type", "process"]), env=env)
        self._wait("worker", lambda: _pool_has_worker(self.prefect_api), timeout=120)

    def _crash_orphans(self) -> None:
        """Mark CRASHED the pool's flow runs that a stopped worker left RUNNING or PENDING: no worker runs them,
        and with one run at a time, one of them would hold the pool's only slot for good."""
        body = {
            "flow_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING", "CANCELLING"]}}},
            "work_pools": {"name": {"any_": [POOL]}},
        }
        for run in _post(f"{self.prefect_api}/flow_runs/filter", body) or []:
            state = {"type": "CRASHED", "message": "its worker was stopped (infra/stack.py down) while it ran"}
            _post(f"{self.prefect_api}/flow_runs/{run['id']}/set_state", {"state": state, "force": True})
            print(
                f"flow run {run['name']} ({run['id']}) was left {run['state_type']} by a stopped worker: marked CRASHED"
            )

    # ---------- commands
    def up(self) -> None:
        if not self.dir.is_dir():  # made here: every user may traverse it (PostgreSQL runs as its own user)
            self.dir.mkdir(parents=True)
            self.dir.chmod(0o755)
        _check_ports_free({k: v for k, v in self.ports.items() if not self._port_is_ours(k)})
        steps = {
            "postgres": self.up_postgres,
            "mlflow": self.up_mlflow,
            "prefect": self.up_prefect,
            "sshd": self.up_sshd,
            "netns": self.up_netns,
            "ray-head": self.up_ray_head,
            "ray-worker": self.up_ray_worker,
            "worker": self.up_worker,
        }
        for name, start in steps.items():
            if name == "netns" and self.netns is None:
                continue
            if self.running(name):
                print(f"{name:10s} already running (pid {self.state[name]['pids'][0]})")
                continue
            self.stop(name, quiet=True)  # what a dead service left behind (orphaned agents holding its ports)
            t0 = time.monotonic()
            start()
            print(f"{name:10s} up in {time.monotonic() - t0:4.1f} s (pid {self.state[name]['pids'][0]})", flush=True)
        self._save()
        print(f"\nThe stack is up. Its settings: source {self.dir / 'env'}")
        print(f"MLflow {self.mlflow_uri}   Prefect {self.prefect_api.removesuffix('/api')}   Ray {self.ray_address}")
        print(f"DVC remote {self.dvc_remote}")

    def ray_nodes(self) -> int:
        """The Ray cluster's live nodes, as ``ray status`` sees them from inside its network."""
        cmd = self.in_netns([str(BIN / "ray"), "status", f"--address={self.ray_address}"])
        try:
            out = subprocess.run(cmd, env=self._base_env(), capture_output=True, text=True, timeout=60).stdout
        except subprocess.TimeoutExpired:
            return 0
        active = out.split("Active:")[-1].split("Pending:")[0]
        return sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))

    def _port_is_ours(self, var: str) -> bool:
        owner = {
            "FEDCORE_PG_PORT": "postgres",
            "FEDCORE_MLFLOW_PORT": "mlflow",
            "FEDCORE_PREFECT_PORT": "prefect",
            "FEDCORE_RAY_PORT": "ray-head",
            "FEDCORE_SSH_PORT": "sshd",
        }[var]
        return self.running(owner)

    def stop(self, name: str, quiet: bool = False) -> None:
        """Stop one service by its process ids (PostgreSQL with ``pg_ctl stop -m fast``)."""
        entry = self.state.get(name)
        if not entry:
            return
        if name == "postgres" and self.running("postgres"):
            cmd = [str(_pg_bin() / "pg_ctl"), "-D", entry["data"], "-m", "fast", "-w", "stop"]
            subprocess.run(self._as_postgres(cmd), capture_output=True)
        pids = entry.get("all", entry["pids"])
        if name.startswith("ray-"):  # and the agents and workers its raylet started (renamed: ray::...)
            pids = sorted({*pids, *(d for p in entry["pids"] for d in _descendants(p))})
        if name == "ray-head":  # the head and every process left of the cluster
            pids = sorted({*pids, *_ray_pids(self.ray_temp, self.dir)})
        # only processes that are still this stack's: a recorded pid may belong to another by now
        _stop([p for p in pids if self._ours(name, p)], group=entry.get("group", False))
        if not quiet:
            print(f"{name:10s} stopped")
        self.state.pop(name, None)
        self._save()

    def down(self, purge: bool = False) -> None:
        for name in reversed(SERVICES):
            self.stop(name)
        strays = [p for p in _marked(self.dir) if p not in _ancestors()]
        if strays:  # left by a service that died before its children (a killed raylet's agents)
            _stop(strays, group=False)
            print(f"stopped {len(strays)} stray process(es) of this stack")
        if Path(self.ray_temp).exists() and not _ray_pids(self.ray_temp, self.dir):
            shutil.rmtree(self.ray_temp, ignore_errors=True)
        if self.netns and self.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        if purge:
            shutil.rmtree(self.dir, ignore_errors=True)
            print(f"removed {self.dir}")
        elif self.dir.is_dir():
            self._save()

    def status(self) -> int:
        where = {
            "postgres": f"127.0.0.1:{self.ports['FEDCORE_PG_PORT']}",
            "mlflow": self.mlflow_uri,
            "prefect": self.prefect_api,
            "ray-head": self.ray_address,
            "ray-worker": f"joined {self.ray_address}, {self.gpus} GPU(s) declared",
            "sshd": self.dvc_remote,
            "netns": f"network namespace {self.netns}: Ray, the worker and its flow runs",
            "worker": f"pool {POOL}",
        }
        up = 0
        wanted = [n for n in SERVICES if n != "netns" or self.netns]
        for name in wanted:
            ok = self.running(name)
            up += ok
            pid = self.state.get(name, {}).get("pids", ["-"])[0]
            print(f"{name:10s} {'running' if ok else 'stopped':8s} pid {pid!s:8s} {where[name]}")
        if self.netns is None:
            print("no network namespace (not root, or FEDCORE_STACK_NETNS=0): Ray's nodes listen on every interface")
        return 0 if up == len(wanted) else 1


# ---------- helpers
def _pg_bin() -> Path:
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise StackError(
            "no PostgreSQL here: install it (`apt-get install postgresql`, which `make deploy-setup` runs)"
        )
    return found[-1].parent


def _run(cmd: List[str], what: str, logs: Path, env: Optional[Dict[str, str]] = None, cwd: Path = ROOT) -> None:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "commands.log").open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        out = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise StackError(f"{what} failed (exit {proc.returncode}):\n{out}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _stop(pids: List[int], *, group: bool, timeout: float = 30) -> None:
    """SIGTERM each process (its whole session when ``group``), then SIGKILL what is left after ``timeout``."""

    def send(sig: int) -> None:
        for pid in pids:
            try:
                if group:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    if any(_alive(p) for p in pids):
        send(signal.SIGKILL)


def _cmd(pid: int) -> List[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` in the process tree."""
    children: Dict[int, List[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            children.setdefault(_parent(int(proc.name)), []).append(int(proc.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _start_time(pid: int) -> int:
    """When the process started (clock ticks since boot): with its pid, it names one process for good."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _is_marked(pid: int, folder: Path) -> bool:
    try:
        return f"FEDCORE_STACK={folder}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _write_secret(path: Path, text: str) -> None:
    """A file only its owner can read, from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _ancestors() -> List[int]:
    """This process and those above it (a shell `stack.py exec` opened carries the stack's mark too)."""
    found, pid = [], os.getpid()
    while pid > 1:
        found.append(pid)
        pid = _parent(pid)
    return found


def _marked(folder: Path) -> List[int]:
    """The processes this stack started, and theirs: their environment names its folder (``FEDCORE_STACK``)."""
    mark = f"FEDCORE_STACK={folder}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if mark in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def _ray_pids(temp_dir: str, folder: Path) -> List[int]:
    """The processes of this stack's Ray cluster: this stack's (``FEDCORE_STACK``) whose command line names its
    temp folder, as a whole path (``/tmp/...-6399`` is not ``/tmp/...-63990``)."""

    def names(arg: str) -> bool:
        at = arg.find(temp_dir)
        return at >= 0 and arg[at + len(temp_dir) : at + len(temp_dir) + 1] in ("", "/")

    return [p for p in _marked(folder) if any(names(a) for a in _cmd(p))]


def _forward(netns: str, ports: List[int]) -> None:
    """Listen on 127.0.0.1:<port> inside ``netns`` and relay each connection to 127.0.0.1:<port> of this host.

    A thread's network namespace is its own (``setns``): each listener enters the namespace before it
    binds, and each relay returns to the host's before it connects.
    """
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    host = os.open("/proc/self/ns/net", os.O_RDONLY)
    inner = os.open(f"/run/netns/{netns}", os.O_RDONLY)

    def enter(fd: int) -> None:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns failed")

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def relay(conn: socket.socket, port: int) -> None:
        enter(host)
        try:
            out = socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            conn.close()
            return
        out.settimeout(None)
        threading.Thread(target=pump, args=(conn, out), daemon=True).start()
        pump(out, conn)

    failed: List[str] = []

    def listen(port: int, ready: threading.Event) -> None:
        try:
            enter(inner)
            srv = socket.socket()
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("127.0.0.1", port))
            srv.listen(64)
        except OSError as exc:
            failed.append(f"port {port}: {exc}")
            return
        finally:
            ready.set()
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=relay, args=(conn, port), daemon=True).start()

    for port in ports:
        ready = threading.Event()
        threading.Thread(target=listen, args=(port, ready), daemon=True).start()
        ready.wait(10)
    if failed:
        print(f"could not listen in {netns}: {'; '.join(failed)}", flush=True)
        sys.exit(1)
    print(f"listening in {netns} on 127.0.0.1 ports {', '.join(map(str, ports))}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _check_ports_free(ports: Dict[str, int]) -> None:
    taken = [f"{k}={v}" for k, v in ports.items() if _port_open(v)]
    if taken:
        raise StackError(f"ports in use on 127.0.0.1: {', '.join(taken)}; set those variables to free ports")


def _post(url: str, body: dict) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _pool_has_worker(api: str) -> bool:
    req = urllib.request.Request(
        f"{api}/work_pools/{POOL}/workers/filter", data=b"{}", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return any(w.get("status") == "ONLINE" for w in json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python infra/stack.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["forward"]:  # the forwarder process up_netns starts
        _forward(argv[1], [int(p) for p in argv[2:]])
        return 0
    if argv[:1] == ["exec"]:  # a command with the stack's settings, inside its network (Ray's side)
        stack = Stack()
        cmd = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not cmd:
            print("usage: python infra/stack.py exec -- <command> [args...]", file=sys.stderr)
            return 2
        return subprocess.call(stack.in_netns(cmd), env={**stack._base_env(), **stack.env()})
    ap.add_argument("command", choices=["up", "down", "status", "env", "stop", "restart", "exec"])
    ap.add_argument("service", nargs="?", choices=SERVICES, help="with stop and restart: the one service")
    ap.add_argument("--purge", action="store_true", help="with down: remove the stack's folder too")
    args = ap.parse_args(argv)
    stack = Stack()
    try:
        if args.command == "up":
            try:
                stack.up()
            except BaseException:
                print(
                    f"the stack did not come up; stop what started with `python {Path(__file__).name} down`",
                    file=sys.stderr,
                )
                raise
        elif args.command == "down":
            stack.down(purge=args.purge)
        elif args.command in ("stop", "restart"):
            if not args.service:
                ap.error(f"{args.command} takes a service: {', '.join(SERVICES)}")
            stack.stop(args.service)
            if args.command == "restart":
                stack.up()
        elif args.command == "status":
            return stack.status()
        else:
            print("".join(f"export {k}={v}\n" for k, v in stack.env().items()), end="")
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
