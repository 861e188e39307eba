"""iCaRL herding and the fixed-size exemplar memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.incremental import ExemplarMemory, herding


def unit_rows(f: np.ndarray) -> np.ndarray:
    return f / np.linalg.norm(f, axis=1, keepdims=True)


def running_distance(phi: np.ndarray, order: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """‖μ − mean of the first k picks‖ for k = 1..len(order)."""
    means = np.cumsum(phi[order], axis=0) / np.arange(1, len(order) + 1)[:, None]
    return np.linalg.norm(means - mu, axis=1)


def class_features(seed: int, n: int = 60, d: int = 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) + rng.normal(size=d)


# ---------------------------------------------------------------------------------------------
# herding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False])
def test_first_pick_is_the_sample_nearest_the_mean(normalize):
    # Prepare
    f = class_features(0)
    phi = unit_rows(f) if normalize else f
    # Execute
    order = herding(features=f, m=5, normalize=normalize)
    # Assert
    assert order[0] == np.argmin(np.linalg.norm(phi - phi.mean(axis=0), axis=1))


def test_all_picks_are_a_permutation_whose_running_mean_ends_at_the_mean():
    # Prepare
    f = class_features(1)
    phi = unit_rows(f)
    # Execute
    order = herding(features=f, m=len(f))
    # Assert
    assert sorted(order.tolist()) == list(range(len(f)))
    assert running_distance(phi, order, phi.mean(axis=0))[-1] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_herded_running_mean_beats_random_picks(seed):
    # Herding picks the sample closest to the class mean first, and its running mean converges
    # to the class mean at least as fast as random selection's, on average over random draws.
    # At k = n - 1 greedy herding has no such guarantee (the one sample it leaves out need not be
    # the one nearest μ, while random's average is over all leave-one-outs; it happens for about a
    # quarter of random classes) and at k = n both are exactly μ, so k runs over 1..n-2 here; the
    # memory keeps m << n exemplars, which is where the ordering matters.
    # Prepare
    f = class_features(10 + seed)
    phi = unit_rows(f)
    mu = phi.mean(axis=0)
    rng = np.random.default_rng(seed)
    n, draws = len(f), 300
    # Execute
    herded = running_distance(phi, herding(features=f, m=n), mu)
    rand = np.mean([running_distance(phi, rng.permutation(n), mu) for _ in range(draws)], axis=0)
    # Assert
    assert np.all(herded[: n - 2] <= rand[: n - 2])
    assert herded[9] < 0.5 * rand[9]  # at a memory-sized k herding is far closer, not just as close


def test_m_larger_than_n_returns_all_in_herding_order():
    f = class_features(2, n=8)
    assert herding(features=f, m=20).tolist() == herding(features=f, m=8).tolist()
    assert herding(features=f, m=3).tolist() == herding(features=f, m=8).tolist()[:3]


def test_herding_accepts_a_tensor():
    f = class_features(3, n=10)
    assert (
        herding(features=torch.from_numpy(f).float(), m=4).tolist()
        == herding(features=f.astype(np.float32), m=4).tolist()
    )


@pytest.mark.parametrize(
    "features, m, match",
    [
        (np.zeros((0, 4)), 2, "non-empty"),
        (np.zeros(4), 2, "non-empty"),
        (np.ones((3, 4)), 0, "m .* must be an integer >= 1"),
        (np.full((3, 4), np.nan), 1, "non-finite"),
    ],
)
def test_herding_errors(features, m, match):
    with pytest.raises(ValueError, match=match):
        herding(features=features, m=m)


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------


def class_samples(cls: int, n: int = 30) -> np.ndarray:
    """(n, 2, 3) uint8 'images' whose first pixel is the sample index, so order can be read back."""
    x = np.full((n, 2, 3), cls, dtype=np.uint8)
    x[:, 0, 0] = np.arange(n)
    return x


def fill(memory: ExemplarMemory, classes, n: int = 30):
    orders = {}
    for c in classes:
        orders[c] = np.random.default_rng(c).permutation(n)
        memory.update(cls=c, x=class_samples(c, n), order=orders[c])
    return orders


def test_memory_never_exceeds_capacity_and_follows_icarl_quota():
    # Prepare
    memory = ExemplarMemory(capacity=50, per_class=20)
    sizes = []
    # Execute: add 12 classes one by one.
    for c in range(12):
        fill(memory, [c])
        sizes.append((len(memory), memory.quota))
    # Assert: quota = min(20, 50 // classes); the memory holds classes * quota <= 50.
    for classes, (size, quota) in enumerate(sizes, start=1):
        assert quota == min(20, 50 // classes)
        assert size == classes * quota <= 50
    x, y = memory.data()
    assert len(x) == len(y) == len(memory) <= 50
    assert memory.classes == list(range(12))


def test_shrinking_keeps_the_first_herded():
    # Prepare: class 0 first fills 20 slots; two more classes cut every class to 50 // 3 = 16.
    memory = ExemplarMemory(capacity=50, per_class=20)
    orders = fill(memory, [0])
    x0_before = memory.data()[0].copy()
    # Execute
    orders.update(fill(memory, [1, 2]))
    x, y = memory.data()
    # Assert
    for c in range(3):
        kept = x[y == c][:, 0, 0]
        assert kept.tolist() == orders[c][:16].tolist()
    np.testing.assert_array_equal(x[y == 0], x0_before[:16])


def test_replacing_a_class_overwrites_it():
    # Prepare
    memory = ExemplarMemory(capacity=30, per_class=10)
    fill(memory, [0, 1])
    new = class_samples(1, 5) + 100
    # Execute
    memory.update(cls=1, x=new, order=[4, 3])
    x, y = memory.data()
    # Assert: still 2 classes; class 1 now holds just the two new samples, in the given order.
    assert memory.classes == [0, 1]
    np.testing.assert_array_equal(x[y == 1], new[[4, 3]])
    assert len(memory) == 10 + 2


def test_data_nbytes_and_empty_memory():
    memory = ExemplarMemory(capacity=10, per_class=4)
    x, y = memory.data()
    assert len(memory) == 0 and x.shape == (0,) and y.shape == (0,) and memory.nbytes == 0
    fill(memory, [3, 7])
    x, y = memory.data()
    assert x.shape == (8, 2, 3) and x.dtype == np.uint8
    assert y.tolist() == [3] * 4 + [7] * 4
    assert memory.nbytes == 8 * 6


def test_state_dict_round_trips_through_torch_load_weights_only(tmp_path):
    # Prepare
    memory = ExemplarMemory(capacity=40, per_class=12)
    fill(memory, [5, 1, 9])
    memory.update(cls=4, x=torch.rand(20, 2, 3).numpy().astype(np.uint8), order=np.arange(20))
    path = tmp_path / "memory.pt"
    # Execute
    torch.save(memory.state_dict(), path)
    loaded = ExemplarMemory.from_state_dict(torch.load(path, weights_only=True))
    # Assert
    assert (loaded.capacity, loaded.per_class, loaded.classes) == (40, 12, [1, 4, 5, 9])
    for a, b in zip(memory.data(), loaded.data()):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    loaded.update(cls=2, x=class_samples(2), order=np.arange(30))  # it keeps working: quota 40 // 5 = 8
    assert len(loaded) == 5 * 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"capacity": 10, "per_class": 11},
            r"m exemplars per class larger than the memory: per_class=11 > capacity=10",
        ),
        ({"capacity": 0, "per_class": 1}, "capacity must be an integer >= 1"),
        ({"capacity": 10, "per_class": 0}, "per_class must be an integer >= 1"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExemplarMemory(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cls": 2, "x": class_samples(2, 5), "order": [0, 5]}, r"outside \[0, 5\)"),
        ({"cls": 2, "x": class_samples(2, 5), "order": [1, 1]}, "repeats an index"),
        ({"cls": 2, "x": class_samples(2, 5), "order": []}, "non-empty 1-D"),
        (
            {"cls": 2, "x": np.zeros((5, 4)), "order": [0]},
            r"shape \(4,\) but the memory holds samples of shape \(2, 3\)",
        ),
        ({"cls": 2, "x": np.array([["a"], ["b"]]), "order": [0]}, "cannot be checkpointed"),
        ({"cls": 2.0, "x": class_samples(2, 5), "order": [0]}, "integer class label"),
        ({"cls": 3, "x": class_samples(3, 5), "order": [0]}, "cannot keep one exemplar for each of 3 classes"),
    ],
)
def test_update_errors_leave_the_memory_unchanged(kwargs, match):
    # Prepare: a memory of capacity 2 holding two classes.
    memory = ExemplarMemory(capacity=2, per_class=1)
    fill(memory, [0, 1])
    before = memory.data()
    # Execute / Assert
    with pytest.raises(ValueError, match=match):
        memory.update(**kwargs)
    for a, b in zip(before, memory.data()):
        np.testing.assert_array_equal(a, b)


def test_from_state_dict_rejects_a_broken_state():
    memory = ExemplarMemory(capacity=4, per_class=2)
    fill(memory, [0, 1])
    state = memory.state_dict()
    with pytest.raises(ValueError, match="missing exemplars"):
        ExemplarMemory.from_state_dict({k: v for k, v in state.items() if k != "exemplars"})
    with pytest.raises(ValueError, match="keep at most 2"):
        ExemplarMemory.from_state_dict({**state, "exemplars": [torch.zeros(3, 2, 3, dtype=torch.uint8)] * 2})
