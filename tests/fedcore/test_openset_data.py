"""The open-set split and the open-set view of a domain partition."""

from __future__ import annotations

import numpy as np
import pytest

from fedcore.data.domains import DomainPartition, DomainSet, build_domain_partition
from fedcore.data.openset import OpenSetData, OpenSetSplit, make_split, openset_view, pairwise_overlap, unknown_masks
from fedcore.engine.rounds import RoundData


def images(ids) -> np.ndarray:
    """uint8 (N, 2, 2, 3) images whose every pixel is the image's id: a sample is traceable."""
    return np.broadcast_to(np.asarray(ids, dtype=np.uint8)[:, None, None, None], (len(ids), 2, 2, 3)).copy()


def tiny_partition(client_y, test_y, client_domain=(0, 0, 1), domains=("a", "b"), num_classes=5):
    """A DomainPartition built directly; image ids count up over clients, then test sets."""
    sets = [np.asarray(ys, dtype=np.int64) for ys in list(client_y) + list(test_y)]
    starts = np.cumsum([0] + [len(ys) for ys in sets])
    xs = [images(range(a, a + len(ys))) for a, ys in zip(starts, sets)]
    n = len(client_y)
    return DomainPartition(
        dataset="toy",
        domains=tuple(domains),
        classes=tuple("vwxyz"[:num_classes]),
        num_classes=num_classes,
        client_domain=list(client_domain),
        client_x=xs[:n],
        client_y=sets[:n],
        client_indices=[np.arange(len(ys)) for ys in sets[:n]],
        test_x=xs[n:],
        test_y=sets[n:],
        test_indices=[np.arange(len(ys)) for ys in sets[n:]],
    )


@pytest.fixture
def part():
    # client 0 (a): ids 0..4   client 1 (a): ids 5..8   client 2 (b): ids 9..11
    # test a: ids 12..16       test b: ids 17..20
    return tiny_partition(client_y=[[0, 3, 2, 4, 2], [1, 1, 3, 0], [4, 2, 0]], test_y=[[0, 1, 2, 3, 4], [3, 2, 4, 4]])


def ids(x: np.ndarray) -> list:
    return x[:, 0, 0, 0].tolist()


# ---------------------------------------------------------------------------------------------
# make_split
# ---------------------------------------------------------------------------------------------


def test_an_int_takes_the_first_classes_as_known():
    split = make_split(10, known=6)
    assert split == OpenSetSplit(known=(0, 1, 2, 3, 4, 5), unknown=(6, 7, 8, 9))
    assert split.num_known == 6


def test_a_sequence_keeps_its_order_and_unknown_defaults_to_the_rest():
    assert make_split(6, known=[4, 1]) == OpenSetSplit(known=(4, 1), unknown=(0, 2, 3, 5))
    assert make_split(6, known=(4, 1), unknown=[5, 0]) == OpenSetSplit(known=(4, 1), unknown=(5, 0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"known": [0, 1], "unknown": [1, 2]}, r"class\(es\) \[1\] are both known and unknown; remove them from one"),
        ({"known": [0, 10]}, r"class id\(s\) \[10\] are outside 0..9.*use ids in that range"),
        ({"known": [0], "unknown": [-1]}, r"class ids must be >= 0"),
        ({"known": 11}, r"known=11 is outside 0..10.*use 1..9"),
        ({"known": 0}, r"no known class; give known at least one class id"),
        ({"known": []}, r"no known class"),
        ({"known": 10}, r"no unknown class; leave at least one class out of known"),
        ({"known": [1, 2], "unknown": []}, r"no unknown class"),
        ({"known": [1, 1]}, r"lists class\(es\) \[1\] more than once"),
        ({"known": "012"}, r"known must be an int .* or a sequence of class ids"),
        ({"known": [0.5]}, r"known must be a sequence of int class ids"),
    ],
)
def test_bad_splits_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_split(10, **kwargs)


def test_split_is_frozen_and_keyword_only():
    split = make_split(4, known=2)
    with pytest.raises(AttributeError):
        split.known = (0,)
    with pytest.raises(TypeError):
        make_split(4, 2)


# ---------------------------------------------------------------------------------------------
# openset_view
# ---------------------------------------------------------------------------------------------


def test_view_keeps_known_samples_relabelled_in_split_order(part):
    # Prepare: known classes 2 then 0 (relabelled 0 and 1), unknown 3 and 4; class 1 is in neither.
    split = make_split(5, known=[2, 0], unknown=[3, 4])
    # Execute
    view = openset_view(part, split)
    # Assert
    assert isinstance(view, OpenSetData) and isinstance(view.rounds, RoundData)
    assert view.num_known == 2 and view.split is split
    r = view.rounds
    assert [ids(x) for x in r.client_x] == [[0, 2, 4], [8], [10, 11]]
    assert [y.tolist() for y in r.client_y] == [[1, 0, 0], [1], [0, 1]]
    assert all(y.dtype == np.int64 for y in r.client_y)
    assert r.client_group == ["a", "a", "b"]
    assert {k: (ids(x), y.tolist()) for k, (x, y) in r.eval_sets.items()} == {"a": ([12, 14], [1, 0]), "b": ([18], [0])}
    assert {k: ids(x) for k, x in view.unknown_test.items()} == {"a": [15, 16], "b": [17, 19, 20]}


def test_unknown_training_samples_are_dropped(part):
    view = openset_view(part, make_split(5, known=3))  # known 0, 1, 2; unknown 3, 4
    kept = sum(len(y) for y in view.rounds.client_y)
    known_in_part = sum(int(np.isin(y, [0, 1, 2]).sum()) for y in part.client_y)
    assert kept == known_in_part == 8
    assert all(set(y.tolist()) <= {0, 1, 2} for y in view.rounds.client_y)
    assert all(x.shape[1:] == (2, 2, 3) for x in view.rounds.client_x)


def test_a_client_without_known_samples_names_client_domain_and_fix(part):
    with pytest.raises(
        ValueError,
        match=r"client 1 \(domain 'a'\) holds no sample of the known classes \[1\]; "
        r"choose other known classes or give this client more data",
    ):
        openset_view(tiny_partition(client_y=[[1, 2], [2, 3], [1]], test_y=[[1, 2], [1, 2]]), make_split(5, known=[1]))


def test_a_test_set_without_unknown_samples_names_the_domain_and_fix():
    part = tiny_partition(client_y=[[0, 1], [0], [0, 2]], test_y=[[0, 1, 2], [0, 1]])
    with pytest.raises(
        ValueError,
        match=r"domain 'b' has no sample of the unknown classes \[2, 3, 4\]; "
        r"choose other unknown classes or raise test_fraction",
    ):
        openset_view(part, make_split(5, known=2))


def test_a_test_set_without_known_samples_names_the_domain():
    part = tiny_partition(client_y=[[0, 1], [0], [0, 2]], test_y=[[0, 4], [3, 4]])
    with pytest.raises(ValueError, match=r"domain 'b' has no sample of the known classes \[0, 1\]"):
        openset_view(part, make_split(5, known=2))


def test_split_outside_the_partition_classes(part):
    with pytest.raises(ValueError, match=r"class id\(s\) \[7\] are outside 0..4 \(the data has 5 classes\)"):
        openset_view(part, OpenSetSplit(known=(0, 1), unknown=(7,)))
    with pytest.raises(ValueError, match="split must be an OpenSetSplit"):
        openset_view(part, (0, 1))


def test_view_of_a_built_partition_keeps_every_known_sample():
    # Prepare: two synthetic domains of 100 8x8 images (10 per class), through build_domain_partition
    rng = np.random.default_rng(0)
    ds = DomainSet(
        x=rng.integers(0, 256, size=(200, 8, 8, 3), dtype=np.uint8),
        y=np.tile(np.arange(10), 20),
        d=np.repeat([0, 1], 100),
        domains=("photo", "sketch"),
        classes=tuple("abcdefghij"),
    )
    part = build_domain_partition(ds, clients_per_domain={"photo": 2, "sketch": 1}, test_fraction=0.2, seed=1)
    # Execute
    view = openset_view(part, make_split(10, known=6))
    # Assert: per client, the known images in their original order; per domain, 2 test images a class
    for x, y, px, py in zip(view.rounds.client_x, view.rounds.client_y, part.client_x, part.client_y):
        np.testing.assert_array_equal(x, px[py < 6])
        np.testing.assert_array_equal(y, py[py < 6])  # the first 6 classes keep their ids
    assert {k: len(y) for k, (_, y) in view.rounds.eval_sets.items()} == {"photo": 12, "sketch": 12}
    assert {k: len(x) for k, x in view.unknown_test.items()} == {"photo": 8, "sketch": 8}


# ---------------------------------------------------------------------------------------------
# heterogeneous unknowns
# ---------------------------------------------------------------------------------------------


def test_unknown_masks_keep_each_domains_own_unknown_classes(part):
    view = openset_view(part, make_split(5, known=[0, 2]))  # unknown 1, 3, 4
    assert {d: v.tolist() for d, v in view.unknown_labels.items()} == {"a": [1, 3, 4], "b": [3, 4, 4]}
    masks = unknown_masks(view, {"mixed": {"a": [1], "b": [4, 3]}, "all": {"a": [1, 3, 4], "b": [3, 4]}})
    assert ids(view.unknown_test["a"][masks["mixed"]["a"]]) == [13]  # test a: ids 12..16, class 1 is id 13
    assert ids(view.unknown_test["b"][masks["mixed"]["b"]]) == [17, 19, 20]
    assert all(m.all() for m in masks["all"].values())


@pytest.mark.parametrize(
    "scenario, match",
    [
        ({"a": [1]}, r"misses \['b'\]"),
        ({"a": [1], "b": [3], "c": [4]}, r"names domain\(s\) \['c'\]"),
        ({"a": [0], "b": [3]}, r"class\(es\) \[0\] are not unknown classes .* a known class cannot be an unknown"),
        ({"a": [], "b": [3]}, "give a non-empty list of class ids"),
        ({"a": [1], "b": [1]}, r"domain 'b': its test set has no sample of class\(es\) \[1\]"),
    ],
)
def test_bad_unknown_scenarios_name_the_fix(part, scenario, match):
    view = openset_view(part, make_split(5, known=[0, 2]))
    with pytest.raises(ValueError, match=match):
        unknown_masks(view, {"s": scenario})


def test_pairwise_overlap_is_one_when_shared_and_zero_when_disjoint():
    assert pairwise_overlap({"a": [6, 7], "b": [7, 6], "c": [6, 7]}) == 1.0
    assert pairwise_overlap({"a": [6, 7], "b": [8, 9]}) == 0.0
    assert pairwise_overlap({"a": [6, 7, 8, 9], "b": [2, 3, 8, 9]}) == 0.5  # the paper's 50 % example
    assert pairwise_overlap({"a": [6], "b": [7], "c": [8], "d": [9], "e": [6]}) == pytest.approx(0.1)


def test_unknown_scenarios_refuse_bad_names_shapes_and_partly_absent_classes(part):
    view = openset_view(part, make_split(5, known=[0, 2]))  # test b has unknown classes 3 and 4 only
    with pytest.raises(ValueError, match="use letters, digits, '_' and '-' only"):
        unknown_masks(view, {"a.b": {"a": [1], "b": [3]}})
    with pytest.raises(ValueError, match="unknown_sets must map scenario names"):
        unknown_masks(view, [{"a": [1], "b": [3]}])
    with pytest.raises(ValueError, match=r"domain 'b': its test set has no sample of class\(es\) \[1\]"):
        unknown_masks(view, {"s": {"a": [1], "b": [1, 3]}})
