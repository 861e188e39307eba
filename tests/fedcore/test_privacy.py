import copy
import math

import numpy as np
import pytest
import torch

from fedcore.adapt import create_method, softmax_entropy
from fedcore.models import create_model
from fedcore.privacy import (
    GDPAccountant,
    Ledger,
    PrivacyConfig,
    PrivacySpec,
    calibrate_sigma,
    gate_mu,
    gate_noise_std,
    gaussian_noise,
    gdp_delta,
    gdp_epsilon,
    mu_from_sigma,
    per_sample_grads_functorch,
    per_sample_grads_opacus,
    privatize,
    privatize_gate,
)
from fedcore.privacy.audit import canary_audit, epsilon_lower_bound

# DP-TTA's table: sigma for each epsilon at delta = 1e-6.
PAPER = {1: 8.594, 5: 1.966, 10: 1.084, 15: 0.777, 20: 0.619}


@pytest.mark.parametrize("eps,sigma", sorted(PAPER.items()))
def test_calibrate_sigma_reproduces_the_paper_table(eps, sigma):
    assert calibrate_sigma(eps, 1e-6) == pytest.approx(sigma, abs=0.002)


@pytest.mark.parametrize("eps", sorted(PAPER))
def test_exact_calibration_inverts_the_conversion_and_the_paper_is_conservative(eps):
    exact = calibrate_sigma(eps, 1e-6, method="exact")
    assert gdp_epsilon(2 / exact, 1e-6) == pytest.approx(eps, rel=1e-6)
    assert gdp_delta(eps, 2 / exact) == pytest.approx(1e-6, rel=1e-4)
    # The paper's sigma is never smaller, so its epsilon is within budget.
    assert calibrate_sigma(eps, 1e-6) >= exact
    assert gdp_epsilon(2 / PAPER[eps], 1e-6) <= eps


def test_gdp_delta_at_zero_is_the_gaussian_tail_formula():
    mu = 1.3
    from scipy.stats import norm

    assert gdp_delta(0.0, mu) == pytest.approx(2 * norm.cdf(mu / 2) - 1, rel=1e-12)
    assert gdp_epsilon(mu, 0.9) == 0.0  # delta above delta(0): no epsilon needed


def test_reuse_composes_as_mu_sqrt_k():
    acc = GDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=2.0)
    assert acc.mu == pytest.approx(mu_from_sigma(2.0) * math.sqrt(3))
    assert acc.mu == pytest.approx(mu_from_sigma(2.0, uses=3))
    once = GDPAccountant()
    once.step(noise_multiplier=2.0)
    assert acc.get_epsilon(1e-6) > once.get_epsilon(1e-6)
    # calibrating for k uses scales sigma by sqrt(k), so one arrival still costs the target
    s1, s4 = calibrate_sigma(5, 1e-6, method="exact"), calibrate_sigma(5, 1e-6, uses=4, method="exact")
    assert s4 == pytest.approx(2 * s1, rel=1e-6)


def test_accountant_state_round_trip():
    a = GDPAccountant()
    a.step(noise_multiplier=1.5, uses=2)
    a.step(noise_multiplier=3.0)
    b = GDPAccountant()
    b.load_state_dict(a.state_dict())
    assert b.history == a.history and b.get_epsilon(1e-5) == a.get_epsilon(1e-5)
    with pytest.raises(ValueError, match="not a GDP accountant"):
        b.load_state_dict({"mechanism": "rdp", "history": []})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="dp", epsilon=0.0), "epsilon must be a finite number > 0"),
        (dict(mode="dp", epsilon=-1.0), "epsilon must be a finite number > 0"),
        (dict(mode="dp", epsilon=1.0, delta=0.0), "delta must lie strictly between 0 and 1"),
        (dict(mode="dp", epsilon=1.0, delta=1.0), "delta must lie strictly between 0 and 1"),
        (dict(mode="dp", epsilon=1.0, clip_norm=0.0), "clip norm C must be a finite number > 0"),
        (dict(mode="dp", epsilon=1.0, clip_norm=-2.0), "clip norm C must be a finite number > 0"),
        (dict(mode="dp", noise_multiplier=-0.5), "sigma must be >= 0"),
        (dict(mode="dp"), "needs a target epsilon"),
        (dict(mode="dp", noise_multiplier=0.0), "use mode 'dp0'"),
        (dict(mode="clip", budget=5.0), "no privacy guarantee"),
        (dict(mode="dp0", epsilon=1.0), "no privacy guarantee"),
        (dict(mode="secret"), "valid names are: off, clip, dp0, dp"),
        (dict(mode="dp", epsilon=1.0, calibration="rdp"), "valid names are: dp-tta, exact"),
    ],
)
def test_impossible_privacy_parameters_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyConfig(**kwargs)


def test_bad_values_rejected_by_the_functions_too():
    with pytest.raises(ValueError, match="epsilon"):
        calibrate_sigma(0, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        calibrate_sigma(1, 1.5)
    with pytest.raises(ValueError, match="sigma"):
        mu_from_sigma(-1)
    with pytest.raises(ValueError, match="clip norm"):
        PrivacySpec(mode="clip", clip_norm=0)


def test_ledger_refuses_once_the_budget_would_be_exceeded():
    cfg = PrivacyConfig(mode="dp", epsilon=5.0, budget=6.0)
    led = Ledger(cfg, uses=1)
    assert not led.would_exceed(0)
    led.charge(0)
    assert led.epsilon(0) == pytest.approx(5.0, abs=0.05)
    assert led.would_exceed(0)  # two arrivals compose to about 7.4 > 6
    assert not led.would_exceed(1)  # another client's ledger is its own
    rec = led.record(0, refused=True)
    assert rec["privacy_refused"] == 1.0 and rec["eps_arrival"] == 0.0
    assert rec["eps_budget_remaining"] == pytest.approx(6.0 - led.epsilon(0))


# ------------------------------------------------------------------------------------ the gate statistic
def test_the_released_gate_statistic_carries_noise_of_std_z_lnC_over_n():
    """σ_k + N(0, (z ln C / n)²): the Gaussian mechanism for a mean of values in [0, ln C]."""
    cfg = PrivacyConfig(mode="dp", epsilon=5.0, gate_noise_multiplier=4.0, noise_source="seeded")
    n, exact = 500, 1.2
    torch.manual_seed(0)
    draws = np.array([privatize_gate(exact, cfg, num_classes=10, n=n) for _ in range(20_000)])
    std = 4.0 * math.log(10) / n
    assert gate_noise_std(num_classes=10, n=n, noise_multiplier=4.0) == pytest.approx(std)
    assert draws.std() == pytest.approx(std, rel=0.03)
    assert abs(draws.mean() - exact) < 4 * std / math.sqrt(len(draws))
    # clamped to [0, ln C]: post-processing
    edge = [privatize_gate(0.0, cfg, num_classes=10, n=2) for _ in range(200)]
    assert min(edge) == 0.0 and max(edge) <= math.log(10) and len(set(edge)) > 1
    # no release to privatise outside dp mode
    for mode in ("off", "clip", "dp0"):
        assert privatize_gate(exact, PrivacyConfig(mode=mode), num_classes=10, n=n) == exact


def test_the_ledger_charges_the_gate_release_by_mu_gdp_composition():
    sigma, z, delta = 2.0, 3.0, 1e-6
    led = Ledger(PrivacyConfig(mode="dp", noise_multiplier=sigma, gate_noise_multiplier=z), uses=1)
    update_only = gdp_epsilon(mu_from_sigma(sigma), delta)
    assert led.arrival_epsilon() == pytest.approx(gdp_epsilon(math.sqrt((2 / sigma) ** 2 + (1 / z) ** 2), delta))
    assert led.arrival_epsilon() > update_only
    for _ in range(3):
        led.charge(0)
    assert led.epsilon(0) == pytest.approx(gdp_epsilon(math.sqrt(3 * ((2 / sigma) ** 2 + 1 / z**2)), delta))
    assert gate_mu(z) == pytest.approx(1 / z)
    # the state round-trips, and a state written before the gate was accounted reads as no gate release
    again = GDPAccountant()
    again.load_state_dict(led.state_dict()[0])
    assert again.mu == pytest.approx(led.account(0).mu)
    old = GDPAccountant()
    old.load_state_dict({"mechanism": "gdp", "history": [[sigma, 1]]})
    assert old.get_epsilon(delta) == pytest.approx(update_only)


def test_a_budget_refuses_one_arrival_earlier_once_the_gate_is_charged():
    sigma, z = 2.0, 3.0  # mu per arrival: 1 for the update, 1/3 for the gate
    budget = gdp_epsilon(math.sqrt(4.2), 1e-6)  # 4 updates alone fit (mu² = 4), 4 with the gate do not (4.44)
    led = Ledger(PrivacyConfig(mode="dp", noise_multiplier=sigma, gate_noise_multiplier=z, budget=budget), uses=1)
    granted = 0
    while not led.would_exceed(0):
        led.charge(0)
        granted += 1
    assert granted == 3
    alone = GDPAccountant()  # the same budget without the gate's charge
    updates = 0
    while alone.epsilon_after(noise_multiplier=sigma, uses=1, delta=1e-6) <= budget:
        alone.step(noise_multiplier=sigma)
        updates += 1
    assert updates == 4


@pytest.mark.parametrize("method", ["exact", "dp-tta"])
def test_sigma_calibration_leaves_room_for_the_gate(method):
    """σ is calibrated for what the gate leaves: the arrival (update + gate) costs what the target allots."""
    for eps in (1.0, 5.0, 20.0):
        whole = calibrate_sigma(eps, 1e-6, method=method)
        split = calibrate_sigma(eps, 1e-6, method=method, reserved_mu=0.1)
        assert split > whole
        total = math.sqrt(mu_from_sigma(split) ** 2 + 0.1**2)
        assert total == pytest.approx(mu_from_sigma(whole), rel=1e-9)
        if method == "exact":
            assert gdp_epsilon(total, 1e-6) == pytest.approx(eps, rel=1e-6)
    cfg = PrivacyConfig(mode="dp", epsilon=1.0, calibration=method)
    assert cfg.sigma(1) == pytest.approx(calibrate_sigma(1.0, 1e-6, method=method, reserved_mu=0.1))
    with pytest.raises(ValueError, match="raise privacy.gate_noise_multiplier above"):
        calibrate_sigma(1.0, 1e-6, method=method, reserved_mu=1.0)


@pytest.mark.parametrize("z", [0.0, -1.0, float("inf"), None])
def test_a_gate_without_noise_is_refused_in_dp_mode(z):
    with pytest.raises(ValueError, match="gate_noise_multiplier must be a finite number > 0"):
        PrivacyConfig(mode="dp", epsilon=1.0, gate_noise_multiplier=z)


# ------------------------------------------------------------------------------------ private gradients
def gn_model(seed=0):
    torch.manual_seed(seed)
    return create_model("cnn", in_channels=1, num_classes=10, norm="group")


@pytest.fixture
def x():
    torch.manual_seed(1)
    return torch.randn(24, 1, 16, 16)


def test_dp_on_batchnorm_fails_and_names_the_groupnorm_fix(x):
    bn = create_model("cnn", in_channels=1, num_classes=10, norm="batch")
    with pytest.raises(ValueError, match="model.norm=group"):
        create_method("tent", bn, lr=0.1, privacy=PrivacySpec(mode="dp", noise_multiplier=1.0))


@pytest.mark.parametrize("which", ["norm", "all"])
def test_functorch_and_opacus_per_sample_gradients_agree(x, which):
    m = gn_model()
    method = create_method("tent", m, lr=0.1, adapt_params=which)
    a = per_sample_grads_functorch(m, method.params, method.sample_loss, x, {})
    b = per_sample_grads_opacus(m, method.params, method.sample_loss, x, {})
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    # and they sum to the ordinary batch gradient
    loss = method.sample_loss(m(x), {}, method.params).sum()
    full = torch.autograd.grad(loss, list(method.params.values()))
    for k, g in zip(a, full):
        assert torch.allclose(a[k].sum(0), g, atol=1e-5), k


def test_privatize_clips_each_sample_and_scales_noise():
    per = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
    g, stats = privatize(per, clip_norm=1.0, noise_multiplier=0.0, batch_size=2)
    assert torch.allclose(g["w"], (torch.tensor([0.6, 0.8]) + torch.tensor([0.3, 0.4])) / 2)
    assert stats["clip_fraction"] == 0.5
    zeros = {"w": torch.zeros(10, 20000)}
    torch.manual_seed(0)
    g, _ = privatize(zeros, clip_norm=0.5, noise_multiplier=2.0, batch_size=10)
    assert float(g["w"].std()) == pytest.approx(2.0 * 0.5 / 10, rel=0.03)


def test_private_update_norm_is_bounded_by_the_clip_norm(x):
    """Without noise, one SGD step moves the parameters by at most lr * C (each sample clipped to C)."""
    m = gn_model()
    method = create_method("tent", m, lr=1.0, momentum=0.0, privacy=PrivacySpec(mode="dp0", clip_norm=1e-3))
    before = {k: p.detach().clone() for k, p in method.params.items()}
    method(x * 50)
    step = torch.sqrt(sum(((p.detach() - before[k]) ** 2).sum() for k, p in method.params.items()))
    assert 0 < float(step) <= 1e-3 * (1 + 1e-5)
    assert method.private.stats["clip_fraction"] == 1.0


# ------------------------------------------------------------------------------------ the paper's clip-only form
METHODS6 = ["tent", "eata", "sar", "deyo", "come", "bpa"]


def build(name, norm="group", privacy=None, seed=0, x=None, **kw):
    """A method on a fresh CNN; with ``x``, its entropy filter at the median entropy on ``x``, so the
    filters keep about half the batch."""
    torch.manual_seed(seed)
    m = create_model("cnn", in_channels=1, num_classes=10, norm=norm)
    extra = {}
    if name == "eata":
        extra.update(source_x=torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(5)), d_margin=0.4)
    if x is not None and name in ("eata", "sar", "deyo"):
        with torch.no_grad():
            coeff = float(softmax_entropy(copy.deepcopy(m).train()(x)).median()) / math.log(10)
        if name == "deyo":
            extra.update(deyo_margin_coeff=coeff, plpd_threshold=-1.0)
        else:
            extra.update(e_margin_coeff=coeff)
    return create_method(name, m, lr=0.1, num_classes=10, privacy=privacy, **{**extra, **kw})


def batches3(x):
    torch.manual_seed(2)
    return [x, torch.randn_like(x) * 2, x.flip(0) + 0.5]


@pytest.mark.parametrize("norm", ["group", "batch"])
@pytest.mark.parametrize("name", METHODS6)
def test_clip_only_with_a_huge_clip_norm_is_the_plain_form(x, name, norm):
    """DP-TTA's ablation keeps each method as published: with nothing clipped it is the plain form,
    filters, normaliser, SAR's SAM and recovery, EATA's Fisher term and BPA's running prior
    included, over several batches, on GroupNorm and on BatchNorm models alike."""
    plain, clip = build(name, norm, x=x), build(name, norm, x=x, privacy=PrivacySpec(mode="clip", clip_norm=1e6))
    assert clip.clip is not None and clip.private is None
    for xb in batches3(x):
        torch.manual_seed(7)  # DeYO's patch shuffle
        out_p = plain(xb)
        torch.manual_seed(7)
        out_c = clip(xb)
        assert torch.allclose(out_p, out_c, atol=1e-5)
    assert clip.kept == plain.kept
    for (k, va), vb in zip(plain.model.state_dict().items(), clip.model.state_dict().values()):
        assert torch.allclose(va.float(), vb.float(), atol=2e-5), k


def _reference_clipped_step(method, x, clip_norm):
    """Σ clip(∇ℓ_i) / plain normaliser + ∇penalty, per-sample gradients by one backward per sample."""
    logits = method.model(x)
    aux = method.aux(x, logits.detach())
    losses = method.sample_loss(logits, aux, method.params)
    names = list(method.params)
    total = {k: torch.zeros_like(p) for k, p in method.params.items()}
    for i in range(len(x)):
        gi = torch.autograd.grad(losses[i], [method.params[k] for k in names], retain_graph=True, allow_unused=True)
        gi = [torch.zeros_like(method.params[k]) if g is None else g for k, g in zip(names, gi)]
        norm = torch.sqrt(sum((g**2).sum() for g in gi))
        for k, g in zip(names, gi):
            total[k] += g * min(1.0, clip_norm / (float(norm) + 1e-12))
    denom = method.plain_normaliser(aux, len(x))
    pen = method.penalty(method.params)
    pg = torch.autograd.grad(pen, [method.params[k] for k in names]) if pen is not None else [0.0] * len(names)
    return {k: total[k] / denom + g for k, g in zip(names, pg)}, denom


@pytest.mark.parametrize("norm", ["group", "batch"])
@pytest.mark.parametrize("name", ["tent", "eata", "deyo", "come", "bpa"])
def test_clip_only_clips_each_sample_and_keeps_the_plain_normaliser(x, name, norm):
    """One step of the clip-only form is Σ_i clip_C(g_i) / (samples kept) plus the unclipped penalty
    gradient, with g_i from the joint forward. The private form at σ = 0 (dp0) is not: it drops
    EATA's filters, divides by |B| and folds BPA's prior into the clipped loss."""
    C = 0.02
    ref = build(name, norm, seed=3, x=x)
    torch.manual_seed(7)
    expected, denom = _reference_clipped_step(ref, x, C)
    before = {k: p.detach().clone() for k, p in ref.params.items()}
    method = build(name, norm, seed=3, x=x, privacy=PrivacySpec(mode="clip", clip_norm=C), momentum=0.0)
    # g_i from Opacus' hooks where no layer mixes samples and the loss has no parameter terms of its
    # own; else from the joint pass: the reference holds either way
    assert method.clip_by_hooks == (norm == "group" and name != "bpa")
    torch.manual_seed(7)
    method(x)
    assert 0 < denom and method.kept == int(denom)
    if name in ("eata", "deyo"):
        assert denom < len(x)  # the filters are on, as in the plain form
    for k, p in method.params.items():
        assert torch.allclose(p.detach(), before[k] - 0.1 * expected[k], atol=1e-6), k
    assert 0 < method.clip.stats["clip_fraction"] <= 1
    assert "clip_fraction" in method.diagnostics()


def test_clip_only_eata_keeps_the_fisher_term_outside_the_clip(x):
    """A parameter displaced from θ₀ feels the full Fisher pull, however small C is."""
    C, lr, alpha, shift = 1e-8, 0.1, 1e4, 0.1
    method = build("eata", x=x, privacy=PrivacySpec(mode="clip", clip_norm=C), fisher_alpha=alpha, momentum=0.0)
    with torch.no_grad():
        for p in method.params.values():
            p.add_(shift)
    before = {k: p.detach().clone() for k, p in method.params.items()}
    pull = {k: 2 * alpha * method.fisher[k] * shift for k in before}  # ∇ α Σ F (θ − θ₀)²
    method(x)
    assert method.kept > 0
    rest = torch.sqrt(sum(((p.detach() - before[k] + lr * pull[k]) ** 2).sum() for k, p in method.params.items()))
    assert float(rest) <= lr * C + 1e-5  # what is left: the clipped entropy part (≤ lr·C) and float32 rounding
    assert lr * float(torch.sqrt(sum((g**2).sum() for g in pull.values()))) > 1e-3  # while the pull is large


def test_clip_only_sar_clips_at_both_sam_evaluations_and_recovers(x):
    C, rho, lr = 0.02, 0.05, 0.1
    ref = build("sar", seed=3, x=x, rho=rho)
    names = list(ref.params)
    theta = {k: p.detach().clone() for k, p in ref.params.items()}
    # first evaluation at θ: clipped per-sample gradients of the kept samples' entropies
    logits = ref.model(x)
    mask = ref.aux(x, logits.detach())["mask"]
    kept = float(mask.sum())
    assert 0 < kept < len(x)

    def clipped(losses):
        total = {k: torch.zeros_like(p) for k, p in ref.params.items()}
        for i in range(len(losses)):
            gi = torch.autograd.grad(losses[i], [ref.params[k] for k in names], retain_graph=True)
            s = min(1.0, C / (float(torch.sqrt(sum((g**2).sum() for g in gi))) + 1e-12))
            for k, g in zip(names, gi):
                total[k] += g * s
        return total

    g1 = {k: v / kept for k, v in clipped(softmax_entropy(logits) * mask).items()}
    n1 = torch.sqrt(sum((g**2).sum() for g in g1.values()))
    with torch.no_grad():
        for k, p in ref.params.items():
            p.add_(rho * g1[k] / n1)
    h2 = softmax_entropy(ref.model(x))
    mask2 = mask * (h2.detach() < ref.e_margin).float()
    assert float(mask2.sum()) > 0
    g2 = {k: v / float(mask2.sum()) for k, v in clipped(h2 * mask2).items()}
    method = build(
        "sar", seed=3, x=x, rho=rho, momentum=0.0, reset_constant=0.0, privacy=PrivacySpec(mode="clip", clip_norm=C)
    )
    assert method.clip_by_hooks  # GroupNorm: both evaluations take g_i from hooks
    method(x)
    for k, p in method.params.items():
        assert torch.allclose(p.detach(), theta[k] - lr * g2[k], atol=1e-6), k
    # the recovery stays: a loss EMA below the constant resets the model, as in the plain form
    resetting = build("sar", x=x, rho=rho, reset_constant=100.0, privacy=PrivacySpec(mode="clip", clip_norm=C))
    resetting(x)
    assert resetting.resets == 1


def test_joint_per_sample_gradients_under_batchnorm_sum_to_the_batch_gradient(x):
    """On BatchNorm the clip-only form's g_i is ∂ℓ_i/∂θ through the joint batch forward, so the g_i sum
    to the plain gradient; a batch of one (what vmap over samples computes) is a different quantity."""
    from fedcore.privacy import per_sample_grads_joint

    method = build("tent", "batch")
    losses = method.sample_loss(method.model(x), {}, method.params)
    per = per_sample_grads_joint(losses, method.params)
    full = torch.autograd.grad(losses.sum(), list(method.params.values()))
    for (k, g), f in zip(per.items(), full):
        assert torch.allclose(g.sum(0), f, atol=1e-5), k
    alone = torch.autograd.grad(
        method.sample_loss(method.model(x[:1]), {}, method.params)[0], list(method.params.values())
    )
    assert any(not torch.allclose(per[k][0], a, atol=1e-4) for k, a in zip(per, alone))


def test_dp0_is_the_private_form_and_clip_is_not(x):
    dp0 = build("eata", x=x, privacy=PrivacySpec(mode="dp0"))
    clip = build("eata", x=x, privacy=PrivacySpec(mode="clip"))
    assert dp0.private is not None and dp0.clip is None and clip.private is None and clip.clip is not None
    dp0(x)
    assert dp0.kept == 0  # the private form has no filter to count
    with pytest.raises(ValueError, match="model.norm=group"):
        build("tent", "batch", privacy=PrivacySpec(mode="dp0"))
    build("tent", "batch", privacy=PrivacySpec(mode="clip"))(x)  # the clip-only form runs on BatchNorm


@pytest.mark.parametrize("name", ["tent", "eata", "sar", "deyo", "come", "bpa"])
def test_every_method_has_a_deterministic_private_form(x, name):
    def run():
        torch.manual_seed(3)
        m = gn_model()
        kw = {"source_x": x[:8]} if name == "eata" else {}
        method = create_method(
            name,
            m,
            lr=0.05,
            num_classes=10,
            **kw,
            privacy=PrivacySpec(mode="dp", noise_multiplier=1.0, noise_source="seeded"),
        )
        for _ in range(3):
            out = method(x)
        return out, m.state_dict()

    (o1, s1), (o2, s2) = run(), run()
    assert torch.equal(o1, o2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    base = gn_model().state_dict()
    assert any(not torch.equal(s1[k], base[k]) for k in s1)  # it did adapt


# ------------------------------------------------------------------------------------ the noise source
def test_secure_noise_is_standard_normal_and_never_repeats():
    a = gaussian_noise((400_000,), std=1.0, source="secure", dtype=torch.float64)
    b = gaussian_noise((400_000,), std=1.0, source="secure", dtype=torch.float64)
    assert not torch.equal(a, b)
    assert abs(float(a.mean())) < 0.01 and float(a.std()) == pytest.approx(1.0, abs=0.01)
    assert float(((a - a.mean()) ** 4).mean() / a.var() ** 2) == pytest.approx(3.0, abs=0.05)  # Gaussian tails
    from scipy.stats import kstest

    assert kstest(b[:20_000].numpy(), "norm").pvalue > 1e-4
    g = gaussian_noise((3, 4), std=2.5, source="secure")
    assert g.shape == (3, 4) and g.dtype == torch.float32


def test_seeded_noise_is_torchs_generator():
    torch.manual_seed(11)
    a = gaussian_noise((5,), std=2.0, source="seeded")
    torch.manual_seed(11)
    assert torch.equal(a, 2.0 * torch.randn(5))


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="dp", epsilon=1.0, noise_source="urandom"), dict(mode="dp", epsilon=1.0, noise_source="Secure")],
)
def test_an_unknown_noise_source_names_the_valid_ones(kwargs):
    with pytest.raises(ValueError, match="valid names are: secure, seeded"):
        PrivacyConfig(**kwargs)
    with pytest.raises(ValueError, match="valid names are: secure, seeded"):
        PrivacySpec(mode="dp", noise_multiplier=1.0, noise_source=kwargs["noise_source"])


def test_dp_noise_defaults_to_the_secure_source():
    assert PrivacySpec().noise_source == "secure"
    assert PrivacyConfig(mode="dp", epsilon=1.0).spec(1).noise_source == "secure"


@pytest.mark.parametrize("source", ["secure", "seeded"])
def test_two_runs_of_one_config_differ_only_with_the_secure_source(x, source):
    """The same seed, the same data: seeded noise repeats (anyone with the seed can subtract it), secure does not."""

    def run():
        torch.manual_seed(3)
        m = gn_model()
        method = create_method(
            "tent", m, lr=0.5, privacy=PrivacySpec(mode="dp", noise_multiplier=1.0, noise_source=source)
        )
        method(x)
        return m.state_dict()

    a, b = run(), run()
    same = all(torch.equal(a[k], b[k]) for k in a)
    assert same == (source == "seeded")


# ------------------------------------------------------------------------------------ audit
def test_epsilon_lower_bound_of_identical_scores_is_zero():
    s = np.zeros(100)
    assert epsilon_lower_bound(s, s, delta=1e-5) == 0.0
    sep = epsilon_lower_bound(np.ones(200), np.zeros(200), delta=1e-5)
    assert 3.5 < sep < math.log(200)  # perfect separation, limited by the number of trials


@pytest.mark.slow
def test_canary_audit_never_beats_the_accountant_and_catches_sigma_zero():
    from sklearn.datasets import load_digits

    d = load_digits()
    pool = torch.tensor(d.images[:400] / 8.0 - 1.0, dtype=torch.float32).unsqueeze(1)

    def build():
        return gn_model(seed=0)

    # C far below the per-sample gradient norms: every sample is clipped, the tight regime.
    clip = canary_audit(
        build,
        pool,
        spec=PrivacySpec(mode="dp0", clip_norm=1e-3),
        delta=1e-5,
        num_classes=10,
        trials=150,
        stream_size=4,
        seed=0,
    )
    assert clip.epsilon_lower > 2.0 and clip.auc > 0.9  # no noise: the attack sees the canary
    for sigma in (0.5, 2.0):
        res = canary_audit(
            build,
            pool,
            spec=PrivacySpec(mode="dp", clip_norm=1e-3, noise_multiplier=sigma),
            delta=1e-5,
            num_classes=10,
            trials=150,
            stream_size=4,
            seed=1,
        )
        assert res.epsilon_lower <= res.epsilon_accountant
        assert res.auc < clip.auc


@pytest.mark.parametrize("backend", ["functorch", "opacus"])
def test_private_prediction_comes_from_the_model_before_the_update(x, backend):
    m = gn_model()
    with torch.no_grad():
        expected = m(x)
    method = create_method("tent", m, lr=0.5, privacy=PrivacySpec(mode="dp", noise_multiplier=1.0, backend=backend))
    assert torch.allclose(method(x), expected, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(m(x), expected, atol=1e-5)  # and then it adapted


def test_auto_backend_follows_the_benchmark(x):
    dp = PrivacySpec(mode="dp", noise_multiplier=1.0)
    assert create_method("tent", gn_model(), lr=0.1, privacy=dp).private.spec.backend == "opacus"
    assert create_method("tent", gn_model(), lr=0.1, privacy=dp, adapt_params="all").private.spec.backend == "functorch"
    assert create_method("bpa", gn_model(), lr=0.1, num_classes=10, privacy=dp).private.spec.backend == "functorch"
    with pytest.raises(ValueError, match="use privacy.backend=functorch"):
        create_method(
            "bpa",
            gn_model(),
            lr=0.1,
            num_classes=10,
            privacy=PrivacySpec(mode="dp", noise_multiplier=1.0, backend="opacus"),
        )
