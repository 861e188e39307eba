"""μ-GDP accounting for streaming test-time adaptation (DP-TTA).

A private step adds N(0, σ²C²) to the sum of per-sample gradients clipped to norm C. Under
change-one neighbouring one sample moves that sum by at most 2C, so a step is μ-GDP with
μ = 2/σ (Dong, Roth & Su, Gaussian differential privacy). In the streaming protocol each
sample is used once, so a client's stream costs one step's μ, with no composition over steps.
A sample used k times (several steps per batch, several passes over the stream) composes to
μ·√k; different noise levels compose as μ = sqrt(Σ μ_i²).

The gate statistic. Each arrival the client also reports σ_k, the adapted model's mean prediction
entropy over its n stream samples, which steers the server's UGSA gate. In ``dp`` mode it is
released with Gaussian noise of std z·ln C / n (z = ``gate_noise_multiplier``): each sample's
entropy lies in [0, ln C], so changing one sample moves the mean by at most ln C / n, and the
release is μ-GDP with μ_g = 1/z (:func:`gate_mu`). It reads the same samples as the update, so it
composes with it: an arrival costs sqrt(μ_update² + μ_g²).

The budget split: z is set, so the gate takes a fixed μ_g of each arrival, and
:func:`calibrate_sigma` (``reserved_mu=μ_g``) gives the gradient the rest of what the
calibration allots to the target ε, μ_update = sqrt(μ_budget² − μ_g²).

The conversion to (ε, δ) is exact:

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2)

:func:`calibrate_sigma` picks σ for a target (ε, δ). ``method="dp-tta"`` (the default) is the
calibration behind the DP-TTA paper's table: Opacus' PRV accountant with its bisection
tolerance of 0.01 in ε, and σ doubled for change-one sensitivity. It is slightly conservative:
at δ = 1e-6 it gives σ = 8.594 for ε = 1, where the exact inverse (``method="exact"``) gives
8.449. The ε that the ledger reports is always the exact one for the σ actually used.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

CALIBRATIONS = ("dp-tta", "exact")


# ------------------------------------------------------------------------------------ checks
def check_epsilon(epsilon: float) -> float:
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(
            f"epsilon must be a finite number > 0, got {epsilon!r}; "
            "for no noise at all use the clip-only form (sigma = 0)"
        )
    return float(epsilon)


def check_delta(delta: float) -> float:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(
            f"delta must lie strictly between 0 and 1, got {delta!r} (commonly well below 1/stream size, e.g. 1e-6)"
        )
    return float(delta)


def check_sigma(sigma: float) -> float:
    if not (isinstance(sigma, (int, float)) and sigma >= 0 and not math.isnan(sigma)):
        raise ValueError(f"noise multiplier sigma must be >= 0, got {sigma!r} (0 = clip-only, no privacy)")
    return float(sigma)


def check_clip_norm(clip_norm: float) -> float:
    if not (isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip norm C must be a finite number > 0, got {clip_norm!r}")
    return float(clip_norm)


def check_gate_noise(noise_multiplier: float) -> float:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(
            f"gate_noise_multiplier must be a finite number > 0, got {noise_multiplier!r}: the client "
            "reports its gate statistic sigma_k every arrival, and without noise that release has no "
            "finite epsilon (10 costs mu = 0.1 of each arrival's budget)"
        )
    return float(noise_multiplier)


def check_uses(uses: int) -> int:
    if int(uses) != uses or uses < 1:
        raise ValueError(f"uses (times each sample enters a gradient) must be an integer >= 1, got {uses!r}")
    return int(uses)


# ------------------------------------------------------------------------------------ conversions
def mu_from_sigma(sigma: float, uses: int = 1) -> float:
    """μ of a sample that entered ``uses`` private steps with noise multiplier ``sigma`` (inf if σ = 0)."""
    sigma, uses = check_sigma(sigma), check_uses(uses)
    return math.inf if sigma == 0 else 2.0 * math.sqrt(uses) / sigma


def gate_mu(noise_multiplier: float | None) -> float:
    """μ of one gate release with noise std z·Δ for sensitivity Δ (z = ``noise_multiplier``): 1/z; 0 for none."""
    return 0.0 if noise_multiplier is None else 1.0 / check_gate_noise(noise_multiplier)


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    from scipy.special import log_ndtr, ndtr  # here, not at import: scipy costs workers ~1 s to load

    # e^ε Φ(b) computed in log space: e^ε overflows long before the product does.
    a, b = -epsilon / mu + mu / 2, -epsilon / mu - mu / 2
    return float(ndtr(a) - math.exp(epsilon + log_ndtr(b)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for a μ-GDP mechanism (inf when μ is inf)."""
    delta = check_delta(delta)
    if math.isinf(mu):
        return math.inf
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    from scipy.optimize import brentq

    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


@functools.lru_cache(maxsize=256)
def calibrate_sigma(
    epsilon: float, delta: float, *, uses: int = 1, method: str = "dp-tta", reserved_mu: float = 0.0
) -> float:
    """Noise multiplier σ so that a sample used ``uses`` times costs at most (ε, δ).

    ``method="exact"`` inverts :func:`gdp_epsilon` (bisection to 1e-10). ``method="dp-tta"``
    reproduces the paper's table (see the module docstring); it never gives a smaller σ than
    the exact inverse, so the guarantee holds either way.

    ``reserved_mu``: a release that composes with these steps and takes this fixed μ of the
    budget (the gate statistic, μ_g = 1/z). The calibration's μ for the whole budget, μ_b =
    2√uses/σ_b, is split as μ_b² = μ_update² + reserved_mu², and σ = 2√uses/μ_update. With
    ``reserved_mu=0`` this is σ_b itself.
    """
    base = _calibrate_whole(epsilon, delta, uses=uses, method=method)
    if reserved_mu == 0:
        return base
    if not (math.isfinite(reserved_mu) and reserved_mu > 0):
        raise ValueError(f"reserved_mu must be a finite number >= 0, got {reserved_mu!r}")
    budget = mu_from_sigma(base, uses)
    if reserved_mu >= budget:
        raise ValueError(
            f"the gate release alone (mu = {reserved_mu:.3g}) spends the whole budget of epsilon = "
            f"{epsilon:g} (mu = {budget:.3g}); raise privacy.gate_noise_multiplier above "
            f"{1 / budget:.3g}, or the target epsilon"
        )
    return 2.0 * math.sqrt(uses) / math.sqrt(budget**2 - reserved_mu**2)


def _calibrate_whole(epsilon: float, delta: float, *, uses: int, method: str) -> float:
    epsilon, delta, uses = check_epsilon(epsilon), check_delta(delta), check_uses(uses)
    if method == "exact":
        from scipy.optimize import brentq

        f = lambda s: gdp_epsilon(mu_from_sigma(s, uses), delta) - epsilon  # noqa: E731 - decreasing in s
        lo, hi = 1e-3, 1.0
        while f(hi) > 0:
            hi *= 2.0
        return float(brentq(f, lo, hi, xtol=1e-10))
    if method == "dp-tta":
        return _opacus_prv_sigma(epsilon, delta, uses)
    raise ValueError(f"unknown calibration {method!r}; valid names are: {', '.join(CALIBRATIONS)}")


def _opacus_prv_sigma(epsilon: float, delta: float, uses: int) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PRV's log(0) warnings at sample_rate = 1 are harmless
        z = get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=1.0,
            steps=uses,
            accountant="prv",
            epsilon_tolerance=0.01,
        )
    return 2.0 * float(z)  # Opacus' noise multiplier is per add/remove sensitivity C; change-one is 2C


# ------------------------------------------------------------------------------------ accountant
class GDPAccountant:
    """One client's privacy ledger: every private pass over its stream, composed.

    ``history`` holds ``(sigma, uses, gate)`` entries, one per arrival that adapted privately:
    every sample of the stream entered ``uses`` steps with noise multiplier ``sigma``, and the
    gate statistic was released with noise multiplier ``gate`` (None: not released). Entries
    compose as μ = sqrt(Σ uses·(2/σ)² + (1/gate)²), since each pass reuses the same samples.
    """

    def __init__(self) -> None:
        self.history: List[Tuple[float, int, Optional[float]]] = []

    def __len__(self) -> int:
        return len(self.history)

    @staticmethod
    def _mu2(sigma: float, uses: int, gate: Optional[float] = None) -> float:
        return mu_from_sigma(sigma, uses) ** 2 + gate_mu(gate) ** 2

    def step(self, *, noise_multiplier: float, uses: int = 1, gate_noise_multiplier: Optional[float] = None) -> None:
        gate = None if gate_noise_multiplier is None else check_gate_noise(gate_noise_multiplier)
        self.history.append((check_sigma(noise_multiplier), check_uses(uses), gate))

    @property
    def mu(self) -> float:
        return math.sqrt(sum(self._mu2(*h) for h in self.history))

    def get_epsilon(self, delta: float) -> float:
        return gdp_epsilon(self.mu, delta)

    def epsilon_after(
        self, *, noise_multiplier: float, uses: int, delta: float, gate_noise_multiplier: Optional[float] = None
    ) -> float:
        """The cumulative ε if one more pass were spent (nothing is recorded)."""
        mu2 = self.mu**2 + self._mu2(noise_multiplier, uses, gate_noise_multiplier)
        return gdp_epsilon(math.sqrt(mu2), delta)

    def state_dict(self) -> Dict[str, Any]:
        return {"mechanism": "gdp", "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("mechanism") != "gdp":
            raise ValueError(f"not a GDP accountant state: mechanism={state.get('mechanism')!r}")
        # entries written before the gate was accounted have two fields: no gate release
        self.history = [
            (float(h[0]), int(h[1]), None if len(h) < 3 or h[2] is None else float(h[2])) for h in state["history"]
        ]

    def __repr__(self) -> str:
        return f"GDPAccountant(steps={len(self.history)}, mu={self.mu:.4g})"
