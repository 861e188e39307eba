"""Nothing the project reads back can run code: a file swapped for a pickle is refused unread.

Each tamper test swaps a real artifact (source model, partition, checkpoint, registered model)
for a pickle that writes a marker file when unpickled, checks first that the pickle really
does so when loaded the unsafe way, then that the project refuses it with a clear error and
the marker is never written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedcore.data import sha256_file
from fedcore.engine import CheckpointError, ModelSpec, init_state, load_network, load_state, save_state
from flows.config import compose as C
from flows.runs import tasks as T
from flows.services import integrity

SPEC = ModelSpec(name="cnn", in_channels=1, num_classes=10)


class _WritesMarker:
    """Unpickled, it runs code: it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",)


def _poison(path: Path, marker: Path, shape: dict) -> None:
    """Replace ``path`` with a torch file laid out like ``shape`` whose tensors are a code-running pickle."""
    torch.save({**shape, "state": _WritesMarker(marker)}, path)


def _assert_poison_is_live(tmp_path: Path, shape: dict) -> None:
    """The same pickle, loaded the unsafe way, does run its code (else the refusals below prove nothing)."""
    control, marker = tmp_path / "control.pt", tmp_path / "control.marker"
    _poison(control, marker, shape)
    torch.load(control, weights_only=False)
    assert marker.read_text() == "unpickled"


def _lock(root: Path, outs: dict[str, tuple[str, str]], *, cache: dict[str, dict[str, str]] = ()) -> None:
    """A ``dvc.lock`` at ``root`` recording ``{stage: (out path, md5)}``, and the cached folder listings."""
    stages = {
        stage: {"cmd": "true", "outs": [{"path": p, "hash": "md5", "md5": md5}]} for stage, (p, md5) in outs.items()
    }
    (root / "dvc.lock").write_text(json.dumps({"schema": "2.0", "stages": stages}))  # JSON is YAML
    for md5, listing in dict(cache).items():
        d = md5[: -len(".dir")]
        f = root / ".dvc" / "cache" / "files" / "md5" / d[:2] / f"{d[2:]}.dir"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps([{"md5": m, "relpath": r} for r, m in sorted(listing.items())]))


def _listing(folder: Path) -> dict[str, str]:
    return {q.relative_to(folder).as_posix(): integrity.md5_file(q) for q in folder.rglob("*") if q.is_file()}


def test_source_model_changed_after_dvc_wrote_it_is_refused_unread(tmp_path, monkeypatch):
    # Prepare: `dvc repro pretrain` wrote models/, recorded its md5 in dvc.lock and its listing in the cache.
    root = tmp_path / "repo"
    models = root / "models"
    models.mkdir(parents=True)
    path = models / "source.pt"
    torch.save({"state": init_state(SPEC, 0), "spec": asdict(SPEC)}, path)
    listing = {"source.pt": integrity.md5_file(path)}
    _lock(root, {"pretrain": ("models", integrity.folder_md5(listing))}, cache={integrity.folder_md5(listing): listing})
    monkeypatch.setattr(C, "ROOT", root)
    assert T.load_source(path, SPEC).keys() == init_state(SPEC, 0).keys()
    written = integrity.record(path)  # what a flow that wrote it itself would hand on
    _assert_poison_is_live(tmp_path, {"spec": asdict(SPEC)})
    marker = tmp_path / "source.marker"

    # Execute: the file is swapped for the pickle.
    _poison(path, marker, {"spec": asdict(SPEC)})

    # Assert: refused against dvc.lock, and against the writer's own record, before any unpickling.
    with pytest.raises(
        integrity.IntegrityError,
        match=r"source.pt does not match the md5 dvc.lock records for "
        r"stage 'pretrain'.*dvc checkout --force models.*dvc repro pretrain",
    ):
        T.load_source(path, SPEC)
    with pytest.raises(integrity.IntegrityError, match="recorded when this flow wrote it"):
        T.load_source(path, SPEC, written=written)
    assert not marker.exists()


def test_source_model_outside_any_stage_output_is_read_as_tensors_only(tmp_path):
    # Prepare: a file a user copied in, which no dvc.lock vouches for.
    path, marker = tmp_path / "copied-in.pt", tmp_path / "copied.marker"
    _assert_poison_is_live(tmp_path, {"spec": asdict(SPEC)})
    _poison(path, marker, {"spec": asdict(SPEC)})

    # Execute / Assert: not checked by hash, but weights_only=True refuses the pickle.
    assert integrity.verify(path) == 0
    with pytest.raises(ValueError, match="corrupt or not a fedcore checkpoint"):
        T.load_source(path, SPEC)
    assert not marker.exists()


def test_partition_changed_after_dvc_wrote_it_is_refused(tmp_path, monkeypatch):
    # Prepare: data/partitions/<name>/ as the partition stage wrote it; no listing in the cache,
    # so the output folder is checked as a whole.
    root = tmp_path / "repo"
    folder = root / "data" / "partitions" / "digits"
    folder.mkdir(parents=True)
    np.savez(folder / "partition.npz", x=np.zeros(3))
    (folder / "manifest.json").write_text("{}")
    _lock(root, {"partition": ("data/partitions", integrity.folder_md5(_listing(root / "data" / "partitions")))})
    monkeypatch.setattr(C, "ROOT", root)
    cfg = OmegaConf.create({"paths": {"partitions": "data/partitions"}, "data": {"name": "digits"}})
    assert integrity.verify(T.partition_dir(cfg)) == 2

    # Execute
    np.savez(folder / "partition.npz", x=np.ones(3))

    # Assert
    with pytest.raises(
        integrity.IntegrityError,
        match=r"partitions does not match the md5 dvc.lock records for "
        r"stage 'partition'.*no listing.*dvc repro partition",
    ):
        T.load_partition(cfg)


@pytest.mark.parametrize("fix", ["checkout", "repro", "commit"])
def test_the_commands_a_damaged_output_error_names_work_as_written(tmp_path, fix):
    """A partition truncated after DVC recorded it is refused; the restore and the rebuild the error names,
    run exactly as written, give back the recorded bytes, the record command records the new ones, and the
    check then passes."""
    # Prepare: a DVC pipeline whose stage writes a partition, run once
    import yaml

    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], check=True, **run)
    write = "import numpy as np, pathlib; p = pathlib.Path('data/partitions/digits'); p.mkdir(parents=True, exist_ok=True); np.savez(p / 'partition.npz', x=np.arange(1000))"
    stage = {"cmd": f'"{sys.executable}" -c "{write}"', "outs": ["data/partitions"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"partition_domains": stage}}))
    subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], check=True, **run)
    npz = tmp_path / "data" / "partitions" / "digits" / "partition.npz"
    recorded = npz.read_bytes()
    npz.write_bytes(recorded[: len(recorded) // 2])

    # Execute: the command the error names, as written
    with pytest.raises(integrity.IntegrityError) as err:
        integrity.verify(npz, root=tmp_path)
    commands = re.findall(r"`([^`]+)`", str(err.value))
    command = next(c for c in commands if c.startswith(f"dvc {fix}"))
    done = subprocess.run([sys.executable, "-m", *shlex.split(command)], **run)

    # Assert
    assert done.returncode == 0, f"`{command}` failed: {done.stdout}{done.stderr}"
    assert (npz.read_bytes() == recorded) is (fix != "commit")
    assert integrity.verify(npz, root=tmp_path) == 1


def test_checks_agree_with_dvc_itself(tmp_path):
    """The folder md5 and the cached listing are DVC's own: `dvc add` a folder, then tamper with it."""
    # Prepare
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.txt").write_text("hello\n")
    (out / "sub" / "b.bin").write_bytes(bytes(range(256)) * 5)
    dvc, env = [sys.executable, "-m", "dvc"], {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run(dvc + ["init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    subprocess.run(dvc + ["add", "-q", "out"], cwd=tmp_path, env=env, check=True)
    import yaml

    recorded = yaml.safe_load((tmp_path / "out.dvc").read_text())["outs"][0]["md5"]

    # Execute / Assert: the same folder md5, and the cache's listing checks files one by one.
    assert integrity.folder_md5(_listing(out)) == recorded
    _lock(tmp_path, {"make_out": ("out", recorded)})
    assert integrity.verify(out / "sub", root=tmp_path) == 1
    (out / "extra.txt").write_text("not the stage's")  # a file the stage did not write is not checked
    assert integrity.verify(out, root=tmp_path) == 2
    (out / "sub" / "b.bin").write_bytes(b"swapped")
    with pytest.raises(integrity.IntegrityError, match=r"b.bin does not match .* stage 'make_out'"):
        integrity.verify(out, root=tmp_path)


def test_checkpoint_swapped_with_its_sha256_is_refused_unread(tmp_path):
    # Prepare: a checkpoint as every loop writes it.
    folder = tmp_path / "ckpt"
    save_state(folder, {"global": init_state(SPEC, 0), "round": 1}, fingerprint="f")
    shape = {"version": 2, "fingerprint": "f"}
    _assert_poison_is_live(tmp_path, shape)
    marker = tmp_path / "ckpt.marker"

    # Execute: both the file and the sha256 beside it are replaced, as whoever can write one can.
    path = folder / "server_state.pt"
    torch.save({**shape, "payload": _WritesMarker(marker)}, path)
    (folder / "server_state.sha256").write_text(sha256_file(path) + "\n")
    swapped = path.read_bytes()

    # Assert
    with pytest.raises(CheckpointError, match="cannot be read as plain tensors"):
        load_state(folder, fingerprint="f")
    assert not marker.exists()
    assert path.read_bytes() == swapped, "a refused checkpoint is left as it was"


# ------------------------------------------------------------------------ the Model Registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Two versions of a registered model in a throwaway tracking store (sqlite file + local artifacts)."""
    import mlflow

    from flows.services import tracking

    tmp = tmp_path_factory.mktemp("registry")
    uri, before = f"sqlite:///{tmp}/mlruns.db", mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        exp = mlflow.create_experiment("safe-load", artifact_location=str(tmp / "artifacts"))
        x = np.random.default_rng(0).normal(size=(2, 1, 28, 28)).astype(np.float32)
        states = [init_state(SPEC, seed) for seed in (1, 2)]
        for state in states:
            with mlflow.start_run(experiment_id=exp):
                mlflow.register_model(tracking.log_model(SPEC, state, example=x), "fedcore-safe")
    finally:
        mlflow.set_tracking_uri(before)  # the tests below name the store; later modules get theirs back
    return {"tmp": tmp, "uri": uri, "x": x, "states": states}


def _expected_logits(state, x) -> np.ndarray:
    model = SPEC.build()
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(torch.as_tensor(x)).numpy()


def test_registered_model_loads_in_a_fresh_process_with_one_call(registry, tmp_path):
    # Prepare
    np.save(tmp_path / "x.npy", registry["x"])
    x, y = str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    code = (
        "import numpy as np, torch; from flows.services.tracking import load_registered; "
        f"m = load_registered('fedcore-safe', 1, tracking_uri={registry['uri']!r}); "
        f"np.save({y!r}, m(torch.as_tensor(np.load({x!r}))).detach().numpy())"
    )
    env = {**os.environ, "PYTHONPATH": str(C.ROOT)}

    # Execute
    subprocess.run([sys.executable, "-c", code], cwd=C.ROOT, env=env, check=True, capture_output=True)

    # Assert: the same network, the same outputs; and nothing pickled in what was logged.
    np.testing.assert_allclose(
        np.load(tmp_path / "y.npy"), _expected_logits(registry["states"][0], registry["x"]), rtol=1e-5, atol=1e-6
    )
    stored = list((registry["tmp"] / "artifacts").rglob("*"))
    assert not [p for p in stored if p.suffix in (".pkl", ".pickle")], stored


def test_registered_model_swapped_in_the_artifact_store_is_refused_unread(registry):
    import mlflow

    from flows.services import tracking

    # Prepare: version 2's stored weights are replaced by the pickle.
    client = mlflow.MlflowClient(registry["uri"], registry["uri"])
    stored = Path(client.get_model_version_download_uri("fedcore-safe", 2).removeprefix("file://"))
    weights = stored / "data" / tracking.NETWORK_DIR / "state_dict.pt"
    assert weights.is_file()
    marker = registry["tmp"] / "registry.marker"
    _assert_poison_is_live(registry["tmp"], {})
    torch.save(_WritesMarker(marker), weights)

    # Execute / Assert: refused against the run's sha256 tag; and by the weights-only loader without it.
    with pytest.raises(
        integrity.IntegrityError, match="state_dict.pt of version 2 of 'fedcore-safe' does not match the sha256 its run"
    ):
        tracking.load_registered("fedcore-safe", 2, tracking_uri=registry["uri"])
    with pytest.raises(ValueError, match="cannot be read as plain tensors"):
        load_network(weights.parent)
    with pytest.raises(ValueError, match="cannot be read as plain tensors"):
        mlflow.pyfunc.load_model(str(stored))  # MLflow's own loader, through this project's loader_module
    assert not marker.exists()

    # A version without the tags (as registered before this format) is refused too.
    run_id = client.get_model_version("fedcore-safe", 2).run_id
    client.delete_tag(run_id, tracking.MODEL_SHA256_TAG + "state_dict.pt")
    with pytest.raises(integrity.IntegrityError, match="has no tag"):
        tracking.load_registered("fedcore-safe", "latest", tracking_uri=registry["uri"])
    assert not marker.exists()
