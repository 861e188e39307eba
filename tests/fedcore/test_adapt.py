import copy
import math

import pytest
import torch

from fedcore.adapt import collect_norm_params, create_method, prior_precision
from fedcore.models import create_model


def model(norm="batch"):
    torch.manual_seed(0)
    return create_model("cnn", in_channels=1, num_classes=10, norm=norm)


@pytest.fixture
def x():
    torch.manual_seed(1)
    return torch.randn(32, 1, 16, 16)


def changed(before, after):
    return {k for k in before if not torch.equal(before[k], after[k])}


def test_tent_updates_only_norm_affine_parameters(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    method = create_method("tent", m, lr=0.05)
    method(x)
    diff = changed(before, m.state_dict())
    _, names = collect_norm_params(m)
    params_changed = {k for k in diff if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert params_changed and params_changed <= set(names)


def test_reset_restores_the_snapshot(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    method = create_method("tent", m, lr=0.05)
    method(x)
    method.reset()
    assert not changed(before, m.state_dict())


def test_tent_lowers_entropy_on_repeated_batch(x):
    from fedcore.adapt import softmax_entropy

    method = create_method("tent", model(), lr=0.1)
    first = softmax_entropy(method(x)).mean()
    for _ in range(10):
        last = softmax_entropy(method(x)).mean()
    assert last < first


def test_bn_moves_statistics_but_no_parameters(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    create_method("bn", m)(x + 3.0)
    diff = changed(before, m.state_dict())
    assert diff and all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in diff)


def test_source_changes_nothing(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    create_method("source", m)(x)
    assert not changed(before, m.state_dict())


def test_bpa_with_a_flat_prior_is_tent(x):
    a, b = model(), model()
    create_method("tent", a, lr=0.05)(x)
    create_method("bpa", b, lr=0.05, num_classes=10, sigma0=1e6)(x)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(va, vb, atol=1e-6), k


def test_bpa_prior_pulls_towards_the_global_model(x):
    def drift(sigma0):
        m = model()
        anchor = [p.detach().clone() for p in collect_norm_params(m)[0]]
        method = create_method("bpa", m, lr=0.05, num_classes=10, sigma0=sigma0)
        for _ in range(20):
            method(x)
        return sum(float(((p.detach() - a) ** 2).sum()) for p, a in zip(collect_norm_params(m)[0], anchor))

    assert drift(0.05) < 0.5 * drift(100.0)


def test_precision_modes_are_mirror_images():
    lnC = math.log(10)
    assert prior_precision(0.0, num_classes=10, sigma0=1.0, mode="confidence") == pytest.approx(lnC)
    assert prior_precision(0.0, num_classes=10, sigma0=1.0, mode="literal") == 0.0
    hi = prior_precision(2.0, num_classes=10, sigma0=0.5, mode="confidence")
    lo = prior_precision(0.2, num_classes=10, sigma0=0.5, mode="confidence")
    assert lo > hi, "confident (low entropy) means a tighter prior"
    assert prior_precision(2.0, num_classes=10, sigma0=0.5, mode="literal") > prior_precision(
        0.2, num_classes=10, sigma0=0.5, mode="literal"
    )


def test_bad_method_input():
    with pytest.raises(ValueError, match="valid names are: bn, bpa, come, deyo, eata, sar, source, tent"):
        create_method("cotta", model())
    with pytest.raises(ValueError, match="learning rate must be > 0"):
        create_method("tent", model(), lr=-0.1)
    with pytest.raises(ValueError, match="valid names are: confidence, literal"):
        create_method("bpa", model(), lr=0.1, num_classes=10, precision_mode="inverse")


def test_bpa_prior_precision_scores_the_global_model_as_the_client_predicts(x):
    # Arrange: a shifted batch, on which the source BatchNorm statistics and the batch's differ
    from fedcore.adapt import softmax_entropy
    from fedcore.evaluate import batch_statistics

    shifted = 4.0 * x + 2.0
    m = model()
    reference = copy.deepcopy(m)
    with torch.no_grad(), batch_statistics(reference):
        e_batch = float(softmax_entropy(reference(shifted)).mean())
    with torch.no_grad():
        e_eval = float(softmax_entropy(reference.eval()(shifted)).mean())
    assert abs(e_batch - e_eval) > 0.01, "the fixture must separate the two normalisations"

    # Act
    method = create_method("bpa", m, lr=0.05, num_classes=10, sigma0=1.0)
    method(shifted)

    # Assert: λ from Ē under batch statistics (the client's prediction), not eval mode
    assert method.last_precision == pytest.approx(
        prior_precision(e_batch, num_classes=10, sigma0=1.0, mode="confidence"), abs=1e-6
    )
