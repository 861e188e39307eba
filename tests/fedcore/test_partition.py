import json

import numpy as np
import pytest

from fedcore.data import Partition, build_partition, load_dataset
from fedcore.data.partition import dirichlet_label_split, order_stream


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def part(digits):
    return build_partition(
        digits,
        dataset="digits",
        num_source_clients=3,
        dirichlet_alpha=0.5,
        corruptions=["fog", "contrast"],
        severity=2,
        stream_size=100,
        holdout_size=50,
        seed=3,
    )


def test_dirichlet_split_is_a_partition(rng):
    labels = rng.integers(0, 10, size=2000)
    parts = dirichlet_label_split(labels, num_clients=7, alpha=0.3, seed=0)
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    assert min(len(p) for p in parts) >= 10


def test_small_alpha_skews_labels_more(rng):
    labels = rng.integers(0, 10, size=5000)

    def mean_tv(alpha):
        parts = dirichlet_label_split(labels, num_clients=5, alpha=alpha, seed=1)
        return np.mean([0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - 0.1).sum() for p in parts])

    assert mean_tv(0.1) > mean_tv(100.0) + 0.2


def test_streams_and_holdouts_are_disjoint_and_corrupted(part, digits):
    for t in part.targets:
        assert not set(t.stream_indices) & set(t.holdout_indices)
        assert np.array_equal(t.stream_y, digits.y[t.stream_indices])
        assert not np.array_equal(t.stream_x, digits.x[t.stream_indices])
    src = np.concatenate(part.source_clients)
    tgt = np.concatenate([np.r_[t.stream_indices, t.holdout_indices] for t in part.targets])
    assert not set(src) & set(tgt), "target clients must not hold source training images"


def test_same_seed_same_partition(digits, part):
    again = build_partition(
        digits,
        dataset="digits",
        num_source_clients=3,
        dirichlet_alpha=0.5,
        corruptions=["fog", "contrast"],
        severity=2,
        stream_size=100,
        holdout_size=50,
        seed=3,
    )
    assert json.dumps(again.manifest()) == json.dumps(part.manifest())


def test_class_sorted_stream_is_in_runs(rng):
    labels = rng.integers(0, 10, size=300)
    y = labels[order_stream(labels, order="class_sorted", rng=np.random.default_rng(0))]
    assert (np.diff(y) != 0).sum() == 9
    with pytest.raises(ValueError, match="valid names are: shuffled, class_sorted"):
        order_stream(labels, order="sorted", rng=rng)


def test_save_load_roundtrip_and_manifest(part, tmp_path):
    part.save(tmp_path)
    back = Partition.load(tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["target_clients"][1]["corruption"] == "contrast"
    assert m["target_clients"][0]["stream_indices"] == part.targets[0].stream_indices.tolist()
    assert np.array_equal(back.targets[1].holdout_x, part.targets[1].holdout_x)


def test_tampered_partition_is_refused(part, tmp_path):
    part.save(tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["target_clients"][0]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"rebuild it with `dvc repro partition@mnist` \(or `python -m flows"):
        Partition.load(tmp_path)


def test_missing_partition_names_the_stage(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Build it with `dvc repro partition@mnist` \(or `python -m flows"):
        Partition.load(tmp_path / "nope")


def test_bad_partition_requests(digits):
    with pytest.raises(ValueError, match="repeats"):
        build_partition(
            digits,
            dataset="d",
            num_source_clients=2,
            dirichlet_alpha=1,
            corruptions=["fog", "fog"],
            severity=1,
            stream_size=10,
            holdout_size=10,
        )
    with pytest.raises(ValueError, match="exceed the target pools"):
        build_partition(
            digits,
            dataset="d",
            num_source_clients=2,
            dirichlet_alpha=1,
            corruptions=["fog"],
            severity=1,
            stream_size=10_000,
            holdout_size=10,
        )
