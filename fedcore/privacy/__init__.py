"""Differential privacy for test-time adaptation: the private gradient, the clip-only form, the gate
statistic's release and the μ-GDP ledger."""

from fedcore.privacy.accountant import (
    CALIBRATIONS,
    GDPAccountant,
    calibrate_sigma,
    check_clip_norm,
    check_delta,
    check_epsilon,
    check_gate_noise,
    check_sigma,
    gate_mu,
    gdp_delta,
    gdp_epsilon,
    mu_from_sigma,
)
from fedcore.privacy.ledger import Ledger, PrivacyConfig
from fedcore.privacy.gate import gate_noise_std, privatize_gate
from fedcore.privacy.dp import (
    BACKENDS,
    MODES,
    NOISE_SOURCES,
    ClippedGradient,
    PrivacySpec,
    PrivateGradient,
    check_private_model,
    flatten_per_sample,
    gaussian_noise,
    per_sample_grads_functorch,
    per_sample_grads_joint,
    per_sample_grads_opacus,
    privatize,
)

__all__ = ["CALIBRATIONS", "GDPAccountant", "calibrate_sigma", "check_clip_norm", "check_delta", "check_epsilon",
           "check_gate_noise", "check_sigma", "gate_mu", "gdp_delta", "gdp_epsilon", "mu_from_sigma", "BACKENDS",
           "MODES", "NOISE_SOURCES", "ClippedGradient", "PrivacySpec", "PrivateGradient", "check_private_model",
           "flatten_per_sample", "gaussian_noise", "per_sample_grads_functorch", "per_sample_grads_joint",
           "per_sample_grads_opacus", "privatize", "Ledger", "PrivacyConfig", "gate_noise_std", "privatize_gate"]
