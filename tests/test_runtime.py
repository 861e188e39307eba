"""Placement settings derived from the config (no Ray started here)."""

from flows import config as C
from flows import federation as F
from flows.runtime import ray_init_kwargs


def test_gpus_are_requested_only_for_cuda():
    assert F._gpus(C.compose(["device=cpu"])) == 0.0
    assert F._gpus(C.compose(["device=cuda"])) == 1.0
    assert F._gpus(C.compose(["device=cuda", "flow.gpus_per_task=0.5"])) == 0.5


def test_workers_get_the_driver_prefect_url(tmp_path):
    kw = ray_init_kwargs(num_cpus=2, prefect_api_url="http://127.0.0.1:1234/api", root=tmp_path)
    env = kw["runtime_env"]["env_vars"]
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:1234/api"
    assert str(tmp_path) in env["PYTHONPATH"] and kw["num_cpus"] == 2


def test_file_hash_is_recomputed_when_the_file_changes(tmp_path):
    import hashlib
    import os

    from flows.tracking import file_sha256

    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    assert file_sha256(p) == hashlib.sha256(b"abc").hexdigest()
    p.write_bytes(b"abcd")
    os.utime(p, ns=(1, 1))  # a different mtime even on coarse clocks
    assert file_sha256(p) == hashlib.sha256(b"abcd").hexdigest()
