"""Class-incremental metrics from the accuracy matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedcore.incremental import average_incremental_accuracy, final_accuracy, forgetting, seen_accuracy

NAN = float("nan")

# acc[i, j]: accuracy on task j after training task i.
ACC = np.array(
    [
        [0.90, NAN, NAN],
        [0.70, 0.80, NAN],
        [0.60, 0.50, 0.85],
    ]
)


def test_seen_accuracy_golden():
    # Row means: 0.90; (0.70 + 0.80) / 2 = 0.75; (0.60 + 0.50 + 0.85) / 3 = 0.65.
    np.testing.assert_allclose(seen_accuracy(acc=ACC), [0.90, 0.75, 0.65], rtol=1e-12)


def test_seen_accuracy_weighted_by_task_sizes():
    # Sizes 100, 300, 100: row 1 = (70 + 240) / 400 = 0.775; row 2 = (60 + 150 + 85) / 500 = 0.59.
    np.testing.assert_allclose(seen_accuracy(acc=ACC, task_sizes=[100, 300, 100]), [0.90, 0.775, 0.59], rtol=1e-12)


def test_average_incremental_accuracy_golden():
    # (0.90 + 0.75 + 0.65) / 3 = 2.30 / 3.
    assert average_incremental_accuracy(acc_seen=seen_accuracy(acc=ACC)) == pytest.approx(2.30 / 3, abs=1e-12)


def test_forgetting_golden():
    # Task 0: best before the end max(0.90, 0.70) = 0.90, final 0.60 -> 0.30.
    # Task 1: best max(0.80) = 0.80, final 0.50 -> 0.30.   Mean (0.30 + 0.30) / 2 = 0.30.
    assert forgetting(acc=ACC) == pytest.approx(0.30, abs=1e-12)


def test_forgetting_uses_the_best_not_the_latest_earlier_accuracy():
    # Prepare: task 0 rises to 0.95 after task 1, then falls to 0.40; task 1 improves (−0.1).
    acc = np.array([[0.80, NAN, NAN], [0.95, 0.60, NAN], [0.40, 0.70, 0.90]])
    # Execute
    f = forgetting(acc=acc)
    # Assert: ((0.95 − 0.40) + (0.60 − 0.70)) / 2 = (0.55 − 0.10) / 2 = 0.225.
    assert f == pytest.approx(0.225, abs=1e-12)


def test_forgetting_of_one_task_is_undefined():
    assert math.isnan(forgetting(acc=[[0.9]]))


def test_final_accuracy_golden():
    assert final_accuracy(acc=ACC) == pytest.approx(0.65, abs=1e-12)
    assert final_accuracy(acc=ACC, task_sizes=[100, 300, 100]) == pytest.approx(0.59, abs=1e-12)


def test_entries_above_the_diagonal_are_ignored():
    full = np.where(np.isnan(ACC), 0.0, ACC)
    assert forgetting(acc=full) == pytest.approx(forgetting(acc=ACC))
    np.testing.assert_allclose(seen_accuracy(acc=full), seen_accuracy(acc=ACC))


@pytest.mark.parametrize("fn", [forgetting, final_accuracy, seen_accuracy])
@pytest.mark.parametrize(
    "acc, match",
    [
        (np.zeros((2, 3)), r"square \(T, T\) matrix.*got shape \(2, 3\)"),
        (np.zeros(3), r"got shape \(3,\)"),
        (np.zeros((0, 0)), "non-empty"),
        (ACC.T, r"acc\[1, 0\] is nan.*transposed"),
    ],
)
def test_bad_matrix_errors(fn, acc, match):
    with pytest.raises(ValueError, match=match):
        fn(acc=acc)


@pytest.mark.parametrize(
    "acc_seen, match",
    [
        ([], "non-empty 1-D"),
        (ACC, "use seen_accuracy"),
        ([0.5, NAN], "non-finite"),
    ],
)
def test_average_incremental_accuracy_errors(acc_seen, match):
    with pytest.raises(ValueError, match=match):
        average_incremental_accuracy(acc_seen=acc_seen)


def test_task_sizes_errors():
    with pytest.raises(ValueError, match="task_sizes must be 3 finite numbers > 0"):
        seen_accuracy(acc=ACC, task_sizes=[100, 0, 100])
    with pytest.raises(ValueError, match="task_sizes must be 3"):
        seen_accuracy(acc=ACC, task_sizes=[100, 100])
