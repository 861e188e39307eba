"""The tracking store moves with the project, and the Model Registry holds what a user would deploy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from fedcore.engine import ModelSpec
from flows.services import artifact_store, model_registry, tracking

SPEC = ModelSpec(name="cnn", num_classes=10, in_channels=1, norm="batch")


def _state(seed: int):
    torch.manual_seed(seed)
    return SPEC.build().state_dict()


def _log_and_register(project: Path, experiment: str, *, seed: int, acc: float, aliases=(), fingerprint=None):
    """One run in ``project``'s store: a text artifact, the model, and (maybe) a registry version."""
    tracking.setup(f"sqlite:///{project}/mlruns.db", experiment)
    with mlflow.start_run(run_name=f"cell-s{seed}") as run:
        mlflow.set_tags(
            {
                "method": "bpa",
                "aggregator": "ugsa",
                "privacy_form": "plain",
                "seed": str(seed),
                "git_commit": "abc123",
                "data_sha256": "d" * 64,
                **({"config_fingerprint": fingerprint} if fingerprint else {}),
            }
        )
        note = project / f"note-{seed}.txt"
        note.write_text(f"seed {seed}\n")
        mlflow.log_artifact(str(note), artifact_path="plots")
        uri = tracking.log_model(SPEC, _state(seed), example=np.zeros((2, 1, 16, 16), np.float32))
        version = model_registry.register(
            uri,
            name="bpfedctta-digits",
            run_id=run.info.run_id,
            summary={"final_avg_holdout_acc": acc, "final_avg_online_acc": acc - 0.1},
            metric="final_avg_holdout_acc",
            aliases=aliases,
            description=f"bpa+ugsa seed {seed}",
        )
    return run.info.run_id, version


def test_a_moved_project_opens_its_artifacts_and_models_and_writes_into_its_own_folder(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    run_id, version = _log_and_register(old, "store-test", seed=0, acc=0.7)
    exp = MlflowClient().get_experiment_by_name("store-test")
    assert exp.artifact_location == "fedcore-project:/mlartifacts/store-test"
    assert (old / "mlartifacts" / "store-test" / run_id / "artifacts" / "plots" / "note-0.txt").is_file()

    new = tmp_path / "moved"
    shutil.move(str(old), str(new))
    # A fresh process, as a user opening the moved project would be: MLflow finds the scheme by entry point.
    script = f"""
import json, mlflow, sys
from pathlib import Path
uri = "sqlite:///{new}/mlruns.db"
client = mlflow.MlflowClient(uri)
local = mlflow.artifacts.download_artifacts(run_id="{run_id}", artifact_path="plots/note-0.txt",
                                            tracking_uri=uri, dst_path="{tmp_path}/dl")
assert "flows.services.tracking" not in sys.modules, "the entry point alone must resolve the scheme"
from flows.services.tracking import load_registered
model = load_registered("bpfedctta-digits", "champion", tracking_uri=uri)
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("store-test")
with mlflow.start_run() as run:
    mlflow.log_text("written after the move", "after.txt")
print(json.dumps({{"note": Path(local).read_text(), "run": run.info.run_id,
                  "keys": sorted(model.state_dict())}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["note"] == "seed 0\n"
    assert got["keys"] == sorted(_state(0))
    assert (new / "mlartifacts" / "store-test" / got["run"] / "artifacts" / "after.txt").is_file()
    assert not old.exists(), "nothing may be written back into the folder the project came from"


def test_a_read_only_example_is_logged_without_torchs_non_writable_warning(tmp_path):
    # Arrange: the arrival flow's example comes from a memory-mapped, read-only partition
    import warnings

    example = np.zeros((2, 1, 16, 16), np.float32)
    example.flags.writeable = False
    tracking.setup(f"sqlite:///{tmp_path}/mlruns.db", "read-only-example")

    seen = []
    as_tensor = torch.as_tensor

    def recording(data, *args, **kwargs):  # torch warns only once per process, so look at what it is given
        if isinstance(data, np.ndarray):
            seen.append(data.flags.writeable)
        return as_tensor(data, *args, **kwargs)

    # Execute
    with (
        mlflow.start_run(),
        warnings.catch_warnings(record=True) as caught,
        mock.patch.object(torch, "as_tensor", recording),
    ):
        warnings.simplefilter("always")
        uri = tracking.log_model(SPEC, _state(0), example=example)

    # Assert: the model is logged from a writable copy, and the caller's array is left as it was
    assert uri.startswith("models:/")
    assert seen and all(seen), seen
    assert not [w for w in caught if "not writable" in str(w.message)]
    assert not example.flags.writeable


def test_a_local_store_is_put_in_write_ahead_log_mode_and_a_held_one_is_left_as_it_is(tmp_path, monkeypatch):
    import contextlib
    import sqlite3

    def mode(db: Path) -> str:
        with contextlib.closing(sqlite3.connect(db)) as con:
            return con.execute("PRAGMA journal_mode").fetchone()[0]

    # a new store, created by MLflow in setup(), ends in WAL mode and takes runs as before
    tracking.setup(f"sqlite:///{tmp_path}/mlruns.db", "wal-test")
    assert mode(tmp_path / "mlruns.db") == "wal"
    with mlflow.start_run() as run:
        mlflow.log_metric("m", 1.0)
    reader = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    assert reader.get_run(run.info.run_id).data.metrics == {"m": 1.0}
    assert tracking.write_ahead_log(f"sqlite:///{tmp_path}/mlruns.db") == "wal"  # a second call changes nothing

    # a store that another connection is writing to is left in its mode, without an error, and
    # changed by a later call once it is free
    held = tmp_path / "held store.db"
    with contextlib.closing(sqlite3.connect(held)) as con:
        con.execute("CREATE TABLE t (x)")
    holder = sqlite3.connect(held, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a writer mid-transaction: the mode can be read, not changed
    holder.execute("INSERT INTO t VALUES (1)")
    try:
        assert tracking.write_ahead_log(f"sqlite:///{tmp_path}/held%20store.db", timeout=0.05) == ""
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert mode(held) == "delete"
    assert tracking.write_ahead_log(f"sqlite:///{tmp_path}/held%20store.db?timeout=5") == "wal"  # as MLflow reads it

    # a relative path is the working directory's, as for MLflow; a store not created yet is left alone
    monkeypatch.chdir(tmp_path)
    with contextlib.closing(sqlite3.connect(tmp_path / "relative.db")) as con:
        con.execute("CREATE TABLE t (x)")
    assert mode(tmp_path / "relative.db") == "delete"
    assert tracking.write_ahead_log("sqlite:///relative.db") == "wal"
    assert mode(tmp_path / "relative.db") == "wal"
    assert tracking.write_ahead_log("sqlite:///absent.db") == ""
    assert not (tmp_path / "absent.db").exists()


def test_the_ui_server_resolves_the_store_from_its_backend_uri(tmp_path, monkeypatch):
    monkeypatch.setattr(mlflow, "get_tracking_uri", lambda: "http://127.0.0.1:1")
    monkeypatch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{tmp_path}/mlruns.db")
    repo = artifact_store.ProjectArtifactRepository("fedcore-project:/mlartifacts/x/r1/artifacts")
    assert Path(repo.artifact_dir) == tmp_path / "mlartifacts" / "x" / "r1" / "artifacts"
    monkeypatch.delenv("_MLFLOW_SERVER_FILE_STORE")
    with pytest.raises(Exception, match="relative to a local SQLite tracking store"):
        artifact_store.ProjectArtifactRepository("fedcore-project:/mlartifacts/x/r1/artifacts")


def test_champion_moves_only_to_a_better_version_and_other_aliases_always_move(tmp_path):
    results = [(0, 0.70), (1, 0.65), (2, 0.72)]
    versions = [_log_and_register(tmp_path, "registry-test", seed=s, acc=a, aliases=["nightly"])[1] for s, a in results]
    client = MlflowClient()
    champion = client.get_model_version_by_alias("bpfedctta-digits", "champion")
    assert champion.version == versions[2].version  # 0.72 beat 0.70; 0.65 did not move it (ties: below)
    assert client.get_model_version_by_alias("bpfedctta-digits", "nightly").version == versions[2].version
    first = client.get_model_version("bpfedctta-digits", versions[0].version)
    assert first.tags["metric.final_avg_holdout_acc"] == "0.7" and first.tags["seed"] == "0"
    assert first.tags["git_commit"] == "abc123" and first.tags["data_sha256"] == "d" * 64
    assert first.description == "bpa+ugsa seed 0"


def test_an_identical_rerun_adds_no_registry_version(tmp_path):
    """Same weights from the same config: the version it already has (its aliases move there); other weights
    or another config: a new version."""
    first = _log_and_register(tmp_path, "dedup", seed=0, acc=0.7, fingerprint="cfg-a")[1]
    again = _log_and_register(tmp_path, "dedup", seed=0, acc=0.7, fingerprint="cfg-a", aliases=["nightly"])[1]
    other_weights = _log_and_register(tmp_path, "dedup", seed=1, acc=0.6, fingerprint="cfg-a")[1]
    other_config = _log_and_register(tmp_path, "dedup", seed=0, acc=0.7, fingerprint="cfg-b")[1]
    client = MlflowClient()
    assert again.version == first.version
    assert len({first.version, other_weights.version, other_config.version}) == 3
    assert len(client.search_model_versions("name='bpfedctta-digits'")) == 3
    assert client.get_model_version_by_alias("bpfedctta-digits", "nightly").version == first.version


def test_a_champion_history_is_replayed_exactly():
    """The alias rule on its own: strictly better moves it; ties and NaN do not."""

    class Store:
        champion = None

        def get_model_version_by_alias(self, name, alias):
            from mlflow.exceptions import MlflowException

            if self.champion is None:
                raise MlflowException("no alias")
            return type("V", (), {"tags": {"metric.m": str(self.champion)}})()

    store, moves = Store(), []
    for value in (0.5, 0.5, float("nan"), 0.4, 0.6):
        moved = model_registry._beats_champion(store, "n", "m", value)
        if moved:
            store.champion = value
        moves.append(moved)
    assert moves == [True, False, False, False, True]


def test_unknown_register_mode_or_champion_metric_fails_before_any_work():
    from flows.config import compose as C

    with pytest.raises(ValueError, match="flow.register 'some'.*configured, all, none"):
        model_registry.check(C.compose(["flow.register=some"]))
    with pytest.raises(ValueError, match="flow.champion_metric 'forgetting'"):
        model_registry.check(C.compose(["flow.champion_metric=forgetting"]))
    assert model_registry.model_name(C.compose([])) == "bpfedctta-mnist5k"
    assert model_registry.model_name(C.compose(["variant=private"])) == "dptta-mnist5k"
    assert model_registry.model_name(C.compose(["variant=cifar10"])) == "bpfedctta-cifar10"
    assert model_registry.model_name(C.compose(["flow.register=none"])) is None


def test_lineage_names_the_dvc_outputs_a_run_reads_and_no_others(tmp_path):
    outs = {
        "prepare@mnist": "data/prepared/mnist.npz",
        "partition@mnist": "data/partitions/mnist",
        "pretrain@mnist": "models/source-mnist.pt",
        "pretrain@cifar10": "models/source-cifar10.pt",
        "fedpad@default": "results/fedpad/default",
    }
    lock = {"schema": "2.0", "stages": {s: {"outs": [{"path": p, "md5": f"md5-{s}"}]} for s, p in outs.items()}}
    (tmp_path / "dvc.lock").write_text(json.dumps(lock))  # JSON is YAML
    reads = [
        tmp_path / "data/prepared/mnist.npz",
        tmp_path / "data/partitions/mnist/client_003.npz",  # a file inside an output folder
        tmp_path / "models/source-mnist.pt",
        None,
    ]
    tags = tracking.dvc_lock_hashes(reads, root=tmp_path)
    assert tags == {
        "dvc.prepare:mnist.mnist.npz": "md5-prepare@mnist",
        "dvc.partition:mnist.mnist": "md5-partition@mnist",
        "dvc.pretrain:mnist.source-mnist.pt": "md5-pretrain@mnist",
    }
    # a folder the run reads names the outputs inside it
    assert tracking.dvc_lock_hashes([tmp_path / "models"], root=tmp_path) == {
        "dvc.pretrain:mnist.source-mnist.pt": "md5-pretrain@mnist",
        "dvc.pretrain:cifar10.source-cifar10.pt": "md5-pretrain@cifar10",
    }
    assert tracking.dvc_lock_hashes([tmp_path / "elsewhere"], root=tmp_path) == {}
    # a name that only begins like an output is not inside it, nor it inside the output
    assert (
        tracking.dvc_lock_hashes([tmp_path / "data/partitions/mnist5k", tmp_path / "models/source"], root=tmp_path)
        == {}
    )
    # the filesystem's root holds every output, as a folder does
    assert len(tracking.dvc_lock_hashes(["/"], root=tmp_path)) == len(outs)
    # relative to the root; links not followed (DVC's symlink cache type points outputs into the cache)
    assert tracking.dvc_lock_hashes(["data/partitions/mnist"], root=tmp_path) == {
        "dvc.partition:mnist.mnist": "md5-partition@mnist"
    }
    cache = tmp_path / "cache" / "ab12"
    cache.parent.mkdir()
    cache.write_bytes(b"weights")
    (tmp_path / "models").mkdir()
    (tmp_path / "models/source-mnist.pt").symlink_to(cache)
    assert tracking.dvc_lock_hashes([tmp_path / "models/source-mnist.pt"], root=tmp_path) == {
        "dvc.pretrain:mnist.source-mnist.pt": "md5-pretrain@mnist"
    }
    with pytest.raises(TypeError, match="list of paths"):
        tracking.dvc_lock_hashes(tmp_path / "models/source-mnist.pt", root=tmp_path)


@pytest.mark.parametrize(
    "overrides, stages",
    [
        ([], {"prepare:mnist", "partition:mnist", "pretrain:mnist"}),
        (["variant=cifar10"], {"prepare:cifar10", "partition:cifar10", "pretrain:cifar10"}),
        (["variant=private"], {"prepare:mnist", "partition:mnist", "pretrain:private"}),
    ],
)
def test_an_arrival_runs_lineage_in_the_real_lock_is_its_data_partition_and_source_model(overrides, stages):
    """What an arrival run reads (the paths its flow passes) against the project's own dvc.lock, where
    the outputs are folders: exactly the three stages upstream of it."""
    from flows.config import compose as C
    from flows.runs import tasks as T

    cfg = C.compose(overrides)
    tags = tracking.dvc_lock_hashes([T.prepared_path(cfg), T.partition_dir(cfg), T.source_model_path(cfg)])
    assert {k.split(".")[1] for k in tags} == stages
    rounds = tracking.dvc_lock_hashes([C.domains_dir(cfg, "fedpad", "quick")])
    assert list(rounds) == ["dvc.partition_domains:quick.quick"]


def test_lineage_names_a_commit_that_exists_and_lists_what_differs_from_it(tmp_path, monkeypatch):
    """A run in a tree whose dvc.lock it rewrote names the commit it was based on (no ``-dirty`` suffix,
    which no ``git checkout`` takes) and says what differs from it."""
    # Prepare: a repository with dvc.lock committed, then rewritten as a rebuild would
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t.invalid", "GIT_COMMITTER_NAME": "t"}
    for k, v in {**env, "GIT_COMMITTER_EMAIL": "t@t.invalid"}.items():
        monkeypatch.setenv(k, v)
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    for args in (["init", "-q"], ["add", "dvc.lock"], ["commit", "-qm", "lock"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    monkeypatch.setattr(tracking, "ROOT", repo)
    clean = tracking.lineage_tags(seed=0, prepared=None, partition_dir=repo / "none")
    (repo / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")

    # Execute
    tags = tracking.lineage_tags(seed=0, prepared=None, partition_dir=repo / "none")

    # Assert
    assert clean["git_changes"] == "none" and tags["git_changes"] == "dvc.lock"
    assert tags["git_commit"] == clean["git_commit"] and not tags["git_commit"].endswith("-dirty")
    assert subprocess.run(["git", "cat-file", "-e", f"{tags['git_commit']}^{{commit}}"], cwd=repo).returncode == 0
    assert tags["dvc_lock_sha256"] == tracking.sha256_file(repo / "dvc.lock") != clean["dvc_lock_sha256"]


def test_experiments_and_the_links_we_write_open_on_the_runs_table(tmp_path):
    """MLflow 3 opens an experiment on its GenAI overview unless told it is model development."""
    from flows.services import ui

    tracking.setup(f"sqlite:///{tmp_path}/mlruns.db", "kind-test")
    exp = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db").get_experiment_by_name("kind-test")
    assert exp.tags[tracking.EXPERIMENT_KIND] == tracking.MODEL_DEVELOPMENT == "custom_model_development"
    assert (
        ui.mlflow_page("http://127.0.0.1:5000/", "7")
        == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning"
    )
