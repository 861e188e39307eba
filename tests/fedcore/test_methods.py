"""EATA, SAR, DeYO and COME: the parts that make each one itself."""

import copy
import math

import pytest
import torch

from fedcore.adapt import create_method, opinion_entropy, shuffle_patches, softmax_entropy
from fedcore.models import create_model


def model(norm="batch", seed=0):
    torch.manual_seed(seed)
    return create_model("cnn", in_channels=1, num_classes=10, norm=norm)


@pytest.fixture
def x():
    torch.manual_seed(1)
    return torch.randn(32, 1, 16, 16)


def test_opinion_entropy_is_the_entropy_of_belief_and_uncertainty_masses():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 0.0, 0.0]])
    w = 3.0
    e = logits.exp()
    s = e.sum(1, keepdim=True) + w
    q = torch.cat([e / s, w / s], 1)
    assert torch.allclose(q.sum(1), torch.ones(2))
    assert torch.allclose(opinion_entropy(logits, w), -(q * q.log()).sum(1), atol=1e-6)
    # the uncertainty mass keeps the entropy above the softmax entropy's floor of 0
    sharp = torch.tensor([[30.0, 0.0, 0.0]])
    assert float(opinion_entropy(sharp, w)) < float(opinion_entropy(logits[:1], w))


def test_come_gradient_cannot_lengthen_the_logits():
    logits = torch.tensor([[2.0, 0.5, -1.0]], requires_grad=True)
    opinion_entropy(logits, 3.0).sum().backward()
    # the gradient is orthogonal to the logit vector: only its direction is learnt
    assert abs(float((logits.grad * logits.detach()).sum())) < 1e-6


def test_shuffle_patches_permutes_a_grid_of_patches():
    x = torch.arange(2 * 16 * 16, dtype=torch.float32).reshape(2, 1, 16, 16)
    torch.manual_seed(0)
    y = shuffle_patches(x, 4)
    assert y.shape == x.shape and not torch.equal(x, y)
    for i in range(2):
        assert torch.equal(y[i].flatten().sort().values, x[i].flatten().sort().values)
    # each 4x4 block of the output is some block of the input
    blocks = {tuple(x[0, 0, r : r + 4, c : c + 4].flatten().tolist()) for r in range(0, 16, 4) for c in range(0, 16, 4)}
    out = {tuple(y[0, 0, r : r + 4, c : c + 4].flatten().tolist()) for r in range(0, 16, 4) for c in range(0, 16, 4)}
    assert out == blocks
    assert shuffle_patches(torch.randn(3, 1, 28, 28), 4).shape == (3, 1, 28, 28)


def test_eata_filters_unreliable_and_redundant_samples(x):
    m = model()
    method = create_method("eata", m, lr=0.01, num_classes=10, fisher_alpha=0.0, d_margin=0.4)
    logits = m(x).detach()
    aux = method.aux(x, logits)
    h = softmax_entropy(logits)
    assert torch.equal(aux["mask"].bool(), h < 0.4 * math.log(10))  # no EMA yet: entropy filter only
    assert torch.allclose(aux["weight"], torch.exp(-(h - 0.4 * math.log(10))))
    # with an EMA equal to a sample's own probabilities, that sample is redundant (|cos| = 1)
    method.mean_probs = logits.softmax(1)[0]
    assert float(method.aux(x, logits)["mask"][0]) == 0.0


def test_eata_fisher_needs_source_samples_and_pulls_back(x):
    with pytest.raises(ValueError, match="fisher_alpha: 0"):
        create_method("eata", model(), lr=0.01, num_classes=10)

    def drift(alpha):
        m = model()
        before = copy.deepcopy(m.state_dict())
        method = create_method(
            "eata", m, lr=0.5, num_classes=10, fisher_alpha=alpha, source_x=x, d_margin=1.0, e_margin_coeff=1.0
        )
        for _ in range(5):
            method(x)
        return sum(
            float((m.state_dict()[k] - before[k]).norm())
            for k in before
            if "running" not in k and "num_batches" not in k
        )

    assert drift(20.0) < drift(0.0)


def test_eata_fisher_leaves_batchnorm_statistics_alone(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    create_method("eata", m, lr=0.01, num_classes=10, source_x=x * 5 + 2)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sar_recovers_when_the_loss_ema_falls_below_the_constant(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    method = create_method("sar", m, lr=0.05, num_classes=10, e_margin_coeff=1.0, reset_constant=100.0)
    method(x)
    assert method.resets == 1
    assert all(torch.equal(before[k], m.state_dict()[k]) for k in before)
    never = create_method("sar", model(), lr=0.05, num_classes=10, e_margin_coeff=1.0, reset_constant=0.0)
    never(x)
    assert never.resets == 0


def test_sar_sharpness_step_differs_from_plain_entropy_step(x):
    a, b = model(), model()
    create_method("sar", a, lr=0.05, num_classes=10, e_margin_coeff=1.0, rho=0.5, reset_constant=0.0)(x)
    create_method("sar", b, lr=0.05, num_classes=10, e_margin_coeff=1.0, rho=0.0, reset_constant=0.0)(x)
    c = model()
    create_method("tent", c, lr=0.05)(x)
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))  # SAR's second pass also moves BN statistics
    # rho = 0 is a plain step on the reliable entropy (all samples kept here), which is Tent's
    assert all(torch.allclose(sb[k], sc[k], atol=1e-6) for k in sb)
    assert any(not torch.allclose(sa[k], sb[k]) for k in sa)


def test_deyo_weights_and_filters(x):
    m = model()
    method = create_method("deyo", m, lr=0.01, num_classes=10)
    logits = m(x).detach()
    aux = method.aux(x, logits)
    h = softmax_entropy(logits)
    keep = (h < 0.5 * math.log(10)) & (aux["plpd"] > 0.2)
    assert torch.equal(aux["mask"].bool(), keep)
    assert torch.allclose(aux["weight"], torch.exp(-(h - 0.4 * math.log(10))) + torch.exp(aux["plpd"]))
    # the x' pass must not move the BatchNorm running statistics
    before = copy.deepcopy(m.state_dict())
    method.aux(x, logits)
    assert all(torch.equal(before[k], m.state_dict()[k]) for k in before)


def test_deyo_adapts_a_batchnorm_model_and_its_shuffled_pass_leaves_the_statistics(x):
    """The x' pass once restored the running statistics in place, which broke the backward of the
    first forward (whose graph saved them) whenever a sample passed the filters."""
    m, ref = model(), model()
    method = create_method("deyo", m, lr=0.1, num_classes=10, deyo_margin_coeff=1.0, plpd_threshold=-1.0)
    method(x)
    assert method.kept == len(x)
    ref.train()(x)  # one batch-statistics pass: what the running statistics should have seen
    for k, b in ref.named_buffers():
        assert torch.equal(b, dict(m.named_buffers())[k]), k
    assert any(not torch.equal(p, dict(ref.named_parameters())[k]) for k, p in m.named_parameters())


def test_methods_skip_the_update_when_every_sample_is_filtered(x):
    m = model()
    before = copy.deepcopy(m.state_dict())
    method = create_method("deyo", m, lr=0.5, num_classes=10, plpd_threshold=2.0)  # PLPD <= 1 always
    method(x)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "running" not in k and "num_batches" not in k)
    assert method.kept == 0


def test_a_misspelt_setting_names_the_valid_ones():
    with pytest.raises(ValueError, match="EATA has no setting fishr_alpha; valid settings are: .*fisher_alpha"):
        create_method("eata", model(), lr=0.01, num_classes=10, fishr_alpha=1.0)
    with pytest.raises(ValueError, match="Tent has no setting rho"):
        create_method("tent", model(), lr=0.01, rho=0.05)
