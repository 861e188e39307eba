"""Privacy accountants for PP-FCIL's local DP-SGD: Bayesian DP and classic (RDP) DP.

The mechanism
-------------
Each client clips every per-sample gradient to norm C, forms batches by Poisson sampling with
rate q, and adds N(0, σ²C²) to the sum of the clipped gradients (σ is the noise multiplier).
Neighbouring datasets differ by adding or removing one record x' (Opacus's relation), so the
two noised sums differ by clip(g(x')). Its realised size, in units of C, is

    d(x') = ‖clip(g(x'))‖ / C ∈ [0, 1].

Both accountants keep, for every integer order λ in ``orders``, the running privacy cost
C(λ) = Σ_t c_t(λ) over steps t, and convert it to ε for a given δ.

Classic DP (:class:`ClassicAccountant`)
    The worst case d = 1 for every step: c(λ) = λ · RDP_{λ+1}(q, σ), the Rényi DP of the
    subsampled Gaussian mechanism (Mironov, Talwar & Zhang 2019; computed by Opacus). With the
    default conversion ε equals what ``opacus.accountants.RDPAccountant`` reports for the same
    history and orders (Balle et al. 2020, Theorem 21).
    This is (ε, δ)-DP: it holds for every record x', however unusual.

Bayesian DP (:class:`BayesianAccountant`; Triastcyn & Faltings, ICML 2020)
    The same expansion, but with the realised d(x') instead of the worst case, averaged over
    x' drawn from the client's data:

        c(λ) = log E_{x'} E_{k∼Binomial(λ+1, q)} [ exp((k² − k) · d(x')² / (2σ²)) ],

    converted to ε(δ) as classic DP's cost is (see "Decisions" for the paper's looser Chernoff
    form). The expectation over x' is estimated from a sample of d values: the per-sample clipped
    norms of the batch.

What Bayesian DP guarantees, in plain words
-------------------------------------------
BDP's ε bounds the privacy loss for a neighbour record x' *drawn from the data
distribution*: the probability (over the noise and over the choice of x') that the loss
exceeds ε is at most δ. It says nothing about the worst-case record, which (ε, δ)-DP
protects. A record whose gradient is unusually large (an outlier, a mislabelled or rare
sample) can be protected far less than the reported ε suggests. So BDP is a *weaker*
guarantee than (ε, δ)-DP; when every gradient is clipped (all d = 1) the two costs coincide.

With ``estimator="mean"`` the expectation is the plain sample mean: the guarantee holds
insofar as the sample mean estimates the true expectation. With ``estimator="ucb"`` the
expectation is replaced by a one-sided Student-t upper confidence bound at level 1 − γ
(γ = ``confidence``); as in the BDP paper, the guarantee then holds with probability at least
1 − γ per step (at least 1 − Tγ over T steps, by a union bound: vacuous once Tγ ≥ 1, as it is
over a run of hundreds of steps; the paper folds this failure probability into δ, which is not
done here, and a t-bound on such skewed moments has no exact coverage either). Because every d ≤ 1, the true expectation can never exceed its
value at d = 1, so the bound is capped there: BDP's cost never exceeds the classic cost.

Decisions worth knowing
-----------------------
* The BDP paper writes the per-step cost as log max(M_L, M_R), where M_L is the expectation
  above and M_R = E_{k∼Binomial(λ, q)}[exp((k² + k) d² / (2σ²))] bounds the other direction of
  the divergence. That M_R is a loose (Jensen) bound: shifting k by one shows M_R ≥ M_L for
  every q < 1, and it grows linearly rather than quadratically in q, discarding the
  amplification by subsampling. The other direction is in fact dominated by M_L for the
  subsampled Gaussian (Mironov, Talwar & Zhang 2019, the fact Opacus's RDP rests on; the
  authors' own reference code also evaluates both directions with the M_L expansion). So
  c(λ) = log M_L here, which makes BDP with all d = 1 equal Opacus's RDP exactly.
* Costs of successive steps add, as in the paper's composition theorem. For one step the
  conversion above is a valid bound; over T steps a valid one needs log E_{x'} Π_t M_t(x'), and
  Σ_t log E_{x'} M_t(x') can fall below it when the same record is large in every step. The
  authors' later code adds a Hölder correction for that; it is not
  applied here.
* Both accountants convert C(λ) to ε the same way, chosen by ``conversion``. ``"balle"`` (the
  default) is the conversion of Balle et al. (2020, Theorem 21) that Opacus's RDP accountant uses.
  It bounds the hockey-stick divergence through a bound that is linear in the Rényi moment
  E[exp(λ·L)], so for Bayesian DP it bounds that divergence averaged over x' ∼ μ, which is what
  the BDP definition asks (Pr[A(D) ∈ S] ≤ e^ε Pr[A(D') ∈ S] + δ with the probability taken over
  the noise *and* x'); for one step exactly, over many steps as far as the composition above
  holds. ``"chernoff"`` is the BDP paper's ε = min_λ (C(λ) − log δ)/λ, a bound on
  the tail Pr[L ≥ ε], which is looser; valid for both. With every d = 1 the two accountants hold
  the same C(λ), so under one conversion they report the same ε for the same noise, and any
  difference between LBDP and classic DP comes from the data (d < 1), not from the arithmetic.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from fedcore.registry import Registry, check_choice

DEFAULT_ORDERS: Tuple[int, ...] = tuple(range(1, 65)) + (80, 96, 128, 256)
"""Integer orders λ (Rényi order α = λ + 1) over which ε is minimised."""

Orders = Union[Sequence[int], np.ndarray]
"""Integer orders λ >= 1 as a sequence or a 1-D array."""

ESTIMATORS = ("mean", "ucb")

CONVERSIONS = ("balle", "chernoff")
"""How C(λ) becomes ε: Balle et al. (2020, Theorem 21; Opacus's) or the BDP paper's Chernoff bound."""

SIGMA_MAX = 1e6
"""Calibration gives up beyond this noise multiplier."""

SIGMA_MIN = 1e-4
"""Calibration returns this noise multiplier when even it meets the target (e.g. every d = 0)."""

_SQ_NORM_SLACK = 1e-6
_CHUNK = 1 << 21  # float64 elements per block in the per-sample (UCB) computation


# ------------------------------------------------------------------------------------ checks
def _check_epsilon(epsilon: float) -> float:
    if not (isinstance(epsilon, (int, float, np.floating, np.integer)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(
            f"ε_total must be > 0 and finite, got {epsilon!r}; pass the client's privacy budget, e.g. epsilon=8.0"
        )
    return float(epsilon)


def _check_delta(delta: float) -> float:
    if not (isinstance(delta, (int, float, np.floating)) and 0 < delta < 1):
        raise ValueError(
            f"delta must lie strictly between 0 and 1, got {delta!r}; use well below 1/(records per client), e.g. 1e-5"
        )
    return float(delta)


def _check_q(q: float) -> float:
    if not (isinstance(q, (int, float, np.floating, np.integer)) and 0 < q <= 1):
        raise ValueError(f"sampling rate q must lie in (0, 1], got {q!r}; use batch size / records per client")
    return float(q)


def _check_sigma(sigma: float) -> float:
    if not (isinstance(sigma, (int, float, np.floating, np.integer)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(
            f"noise multiplier sigma must be a finite number > 0, got {sigma!r}; "
            "it is the noise std divided by the clip norm C"
        )
    return float(sigma)


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return int(steps)


def _check_confidence(confidence: float) -> float:
    if not (isinstance(confidence, (int, float, np.floating)) and 0 < confidence < 0.5):
        raise ValueError(
            f"confidence γ (the probability that the upper bound fails) must lie in (0, 0.5), "
            f"got {confidence!r}; e.g. 0.05 for a 95% upper bound"
        )
    return float(confidence)


def _check_orders(orders: Orders) -> np.ndarray:
    arr = np.asarray(list(orders) if not isinstance(orders, np.ndarray) else orders, dtype=float)
    if (
        arr.ndim != 1
        or arr.size == 0
        or not np.all(np.isfinite(arr))
        or np.any(arr < 1)
        or np.any(arr != np.round(arr))
    ):
        raise ValueError(
            f"orders must be a non-empty list of integers >= 1 (λ; Rényi order α = λ + 1), "
            f"got {orders!r}; e.g. DEFAULT_ORDERS"
        )
    return arr.astype(np.int64)


def _check_sq_norms(sq_norms: Any) -> np.ndarray:
    if hasattr(sq_norms, "detach"):  # a torch tensor; no torch import needed
        sq_norms = sq_norms.detach().cpu().double().numpy()
    arr = np.asarray(sq_norms, dtype=float).reshape(-1)
    if arr.size == 0:
        raise ValueError(
            "sq_norms is empty; pass ‖clip(g)‖²/C² of at least one per-sample gradient "
            "(two or more for estimator='ucb')"
        )
    finite = np.isfinite(arr)
    if not finite.all() or arr.min() < 0 or arr.max() > 1 + _SQ_NORM_SLACK:
        seen = f"values in [{arr[finite].min():.6g}, {arr[finite].max():.6g}]" if finite.any() else "no finite value"
        raise ValueError(
            f"sq_norms must lie in [0, 1] (got {seen}"
            f"{'' if finite.all() else ' and non-finite entries'}): clipped "
            "gradients have norm ≤ C; pass ‖clip(g)‖²/C²"
        )
    return np.clip(arr, 0.0, 1.0)


def _check_cost(cost: Any, n_orders: int, what: str = "cost") -> np.ndarray:
    arr = np.asarray(cost, dtype=float).reshape(-1)
    if arr.shape != (n_orders,) or np.any(np.isnan(arr)) or np.any(arr < 0):
        raise ValueError(
            f"{what} must hold one non-negative number per order ({n_orders}), got shape "
            f"{arr.shape}; pass what step_cost / bdp_step_cost returned for the same orders"
        )
    return arr


# ------------------------------------------------------------------------------------ the maths
def _log_binom_pmf(orders: np.ndarray, q: float) -> np.ndarray:
    """log P[k] for k ∼ Binomial(λ+1, q), one row per order, k = 0..max(λ)+1 (−inf past λ+1)."""
    from scipy.special import gammaln, xlog1py, xlogy

    n = (orders + 1).astype(float)[:, None]
    k = np.arange(int(orders.max()) + 2, dtype=float)[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = gammaln(n + 1) - gammaln(k + 1) - gammaln(np.maximum(n - k, 0) + 1) + xlogy(k, q) + xlog1py(n - k, -q)
    out[np.broadcast_to(k > n, out.shape)] = -np.inf
    return out


def _log_mgf_per_sample(sq_norms: np.ndarray, logpmf: np.ndarray, sigma: float) -> np.ndarray:
    """ℓ[i, j] = log E_{k∼Bin(λ_j+1, q)} exp((k² − k) d_i² / (2σ²)), shape (samples, orders)."""
    from scipy.special import logsumexp

    kmax = logpmf.shape[1]
    k = np.arange(kmax, dtype=float)
    half_kk = 0.5 * (k * k - k) / sigma**2  # (K,)
    rows = max(1, _CHUNK // (logpmf.size or 1))
    out = np.empty((sq_norms.size, logpmf.shape[0]))
    for start in range(0, sq_norms.size, rows):
        d2 = sq_norms[start : start + rows]
        terms = logpmf[None, :, :] + (d2[:, None] * half_kk[None, :])[:, None, :]  # (n, J, K)
        out[start : start + rows] = logsumexp(terms, axis=2)
    return out


def bdp_step_cost(
    *,
    sq_norms: Any,
    q: float,
    sigma: float,
    orders: Orders = DEFAULT_ORDERS,
    estimator: str = "mean",
    confidence: float = 0.05,
) -> np.ndarray:
    """Bayesian privacy cost c(λ) of one subsampled-Gaussian step, one value per order.

    Parameters
    ----------
    sq_norms:
        d(x')² = ‖clip(g(x'))‖² / C² for a sample of records x' (the batch's per-sample clipped
        gradients), each in [0, 1]. A numpy array, a sequence or a torch tensor.
    q:
        Poisson sampling rate, in (0, 1].
    sigma:
        Noise multiplier (noise std / C), > 0.
    orders:
        Integer orders λ ≥ 1 (Rényi order α = λ + 1).
    estimator:
        ``"mean"``: the sample mean of the per-record moment (log space, logsumexp).
        ``"ucb"``: a one-sided Student-t upper confidence bound on it at level 1 − ``confidence``,
        capped at the d = 1 value (which the true mean can never exceed); needs ≥ 2 samples.
    confidence:
        γ, the probability that the UCB fails, in (0, 0.5). Ignored by ``"mean"``.

    Returns
    -------
    numpy.ndarray
        c(λ) = log E_{x'} E_{k∼Binomial(λ+1, q)}[exp((k² − k) d(x')² / (2σ²))], ≥ 0, one per order.
    """
    from scipy.special import logsumexp

    d2 = _check_sq_norms(sq_norms)
    q, sigma, lam = _check_q(q), _check_sigma(sigma), _check_orders(orders)
    check_choice("estimator", estimator, ESTIMATORS)
    logpmf = _log_binom_pmf(lam, q)
    k = np.arange(logpmf.shape[1], dtype=float)
    half_kk = 0.5 * (k * k - k) / sigma**2
    n = d2.size
    if estimator == "mean":
        # E_{x'} E_k = E_k E_{x'} (Fubini): average exp(a_k d²) over the records first, per k.
        log_avg = logsumexp(d2[:, None] * half_kk[None, :], axis=0) - math.log(n)  # (K,)
        return np.maximum(logsumexp(logpmf + log_avg[None, :], axis=1), 0.0)

    gamma = _check_confidence(confidence)
    if n < 2:
        raise ValueError(
            "estimator='ucb' needs at least 2 values in sq_norms to estimate a spread; "
            "pass the whole batch's clipped norms or use estimator='mean'"
        )
    from scipy.stats import t as student_t

    ell = _log_mgf_per_sample(d2, logpmf, sigma)  # (n, J)
    log_mean = logsumexp(ell, axis=0) - math.log(n)
    top = ell.max(axis=0)
    dev = np.exp(ell - top[None, :]) - np.exp(log_mean - top)[None, :]
    var_scaled = (dev * dev).sum(axis=0) / (n - 1)  # sample variance / exp(2·top)
    with np.errstate(divide="ignore"):
        log_sd = top + 0.5 * np.log(var_scaled)
    log_margin = math.log(student_t.ppf(1.0 - gamma, df=n - 1)) + log_sd - 0.5 * math.log(n)
    log_ucb = np.logaddexp(log_mean, log_margin)
    worst = logsumexp(logpmf + half_kk[None, :], axis=1)  # every d = 1
    return np.maximum(np.minimum(log_ucb, worst), 0.0)


def chernoff_epsilon(*, total_cost: Any, orders: Orders = DEFAULT_ORDERS, delta: float) -> Tuple[float, int]:
    """ε by the Chernoff bound of the BDP paper: min_λ (C(λ) − log δ) / λ.

    Parameters
    ----------
    total_cost:
        C(λ) = Σ_t c_t(λ), one value per order.
    orders:
        The integer orders λ that ``total_cost`` belongs to.
    delta:
        δ, in (0, 1).

    Returns
    -------
    tuple of (float, int)
        ε and the order λ attaining it.
    """
    lam = _check_orders(orders)
    delta = _check_delta(delta)
    cost = _check_cost(total_cost, lam.size, "total_cost")
    eps = (cost - math.log(delta)) / lam
    best = int(np.argmin(eps))
    return float(eps[best]), int(lam[best])


def balle_epsilon(*, total_cost: Any, orders: Orders = DEFAULT_ORDERS, delta: float) -> Tuple[float, int]:
    """ε converted as ``opacus.accountants.RDPAccountant`` does (Balle et al. 2020, Theorem 21).

    With α = λ + 1 and RDP ρ(α) = C(λ)/λ, ε = min_α ρ(α) − (log δ + log α)/(α − 1) + log((α − 1)/α),
    floored at 0. Never larger than :func:`chernoff_epsilon` of the same cost.

    Returns
    -------
    tuple of (float, int)
        ε and the order λ attaining it.
    """
    lam = _check_orders(orders)
    delta = _check_delta(delta)
    cost = _check_cost(total_cost, lam.size, "total_cost")
    alpha = lam + 1.0
    eps = cost / lam - (math.log(delta) + np.log(alpha)) / lam + np.log(lam / alpha)
    best = int(np.argmin(eps))
    return max(float(eps[best]), 0.0), int(lam[best])


def cost_epsilon(
    *, total_cost: Any, orders: Orders = DEFAULT_ORDERS, delta: float, conversion: str = "balle"
) -> Tuple[float, int]:
    """ε of a privacy cost C(λ) under ``conversion`` (one of :data:`CONVERSIONS`), and the order attaining it."""
    check_choice("conversion", conversion, CONVERSIONS)
    convert = balle_epsilon if conversion == "balle" else chernoff_epsilon
    return convert(total_cost=total_cost, orders=orders, delta=delta)


def classic_step_cost(*, q: float, sigma: float, orders: Orders = DEFAULT_ORDERS) -> np.ndarray:
    """Worst-case (d = 1) cost of one step: λ · RDP_{λ+1}(q, σ), from Opacus's ``compute_rdp``."""
    from opacus.accountants.analysis.rdp import compute_rdp

    q, sigma, lam = _check_q(q), _check_sigma(sigma), _check_orders(orders)
    rdp = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=[float(a) for a in lam + 1]), dtype=float)
    return lam * rdp


# ------------------------------------------------------------------------------------ calibration
def calibrate_sigma_bdp(
    *,
    sq_norms: Any,
    q: float,
    steps: int,
    epsilon: float,
    delta: float,
    spent: Optional[Any] = None,
    orders: Orders = DEFAULT_ORDERS,
    estimator: str = "mean",
    confidence: float = 0.05,
    conversion: str = "balle",
) -> float:
    """The smallest noise multiplier σ with BDP ε(spent + steps · c_σ) ≤ ``epsilon``.

    Parameters
    ----------
    sq_norms:
        d² values (‖clip(g)‖²/C²) that represent the client's data, each in [0, 1]; or a list of such arrays,
        one per batch, when each future step is charged on its own batch: the planned cost of a step is then
        the mean of the batches' step costs, so the plan uses the estimator on samples of a batch's size.
    q:
        Poisson sampling rate, in (0, 1].
    steps:
        Number of future steps, all at this σ and with this distribution of d.
    epsilon, delta:
        The target (ε, δ) for the client's whole history.
    spent:
        C(λ) already spent (e.g. ``BayesianAccountant.total_cost``); ``None`` for nothing.
    orders, estimator, confidence:
        As in :func:`bdp_step_cost`.
    conversion:
        How the cost becomes ε (:data:`CONVERSIONS`), as in :func:`cost_epsilon`.

    Returns
    -------
    float
        σ, found by bisection to 1e-5 relative and rounded up (ε at σ never exceeds the target).
        :data:`SIGMA_MIN` when even that meets the target (e.g. every d = 0).

    Raises
    ------
    ValueError
        If ``spent`` alone already reaches ``epsilon`` (no σ can help), if ``epsilon`` is below
        −log δ / max λ (what the orders can certify at zero cost), or if σ > :data:`SIGMA_MAX`
        would be needed.
    """
    per_batch = isinstance(sq_norms, (list, tuple)) and len(sq_norms) > 0 and np.ndim(sq_norms[0]) == 1
    samples = [_check_sq_norms(b) for b in sq_norms] if per_batch else [_check_sq_norms(sq_norms)]
    q, steps, target, delta = _check_q(q), _check_steps(steps), _check_epsilon(epsilon), _check_delta(delta)
    lam = _check_orders(orders)
    check_choice("estimator", estimator, ESTIMATORS)
    check_choice("conversion", conversion, CONVERSIONS)
    base = np.zeros(lam.size) if spent is None else _check_cost(spent, lam.size, "spent")

    def eps_of(cost: np.ndarray) -> float:
        return cost_epsilon(total_cost=cost, orders=lam, delta=delta, conversion=conversion)[0]

    floor = eps_of(base)
    if floor >= target and spent is None:
        raise ValueError(
            f"ε_total={target:.4g} is below what these orders can certify at δ={delta:g} even with no "
            f"cost ({floor:.4g}); raise ε_total or add larger orders"
        )
    if floor >= target:
        raise ValueError(
            f"the budget is already spent: ε of `spent` alone is {floor:.4g} ≥ ε_total={target:.4g}, "
            "and no noise can lower it; stop training this client or raise ε_total"
        )

    def eps_at(sigma: float) -> float:
        cost = np.mean(
            [
                bdp_step_cost(sq_norms=d2, q=q, sigma=sigma, orders=lam, estimator=estimator, confidence=confidence)
                for d2 in samples
            ],
            axis=0,
        )
        return eps_of(base + steps * cost)

    return _bisect_sigma(eps_at, target)


def _bisect_sigma(eps_at, target: float) -> float:
    hi = 1.0
    while eps_at(hi) > target:
        hi *= 2.0
        if hi > SIGMA_MAX:
            raise ValueError(
                f"even sigma={SIGMA_MAX:g} does not meet ε_total={target:.4g}; raise ε_total or take fewer steps"
            )
    lo = hi / 2.0
    while eps_at(lo) <= target:
        hi, lo = lo, lo / 2.0
        if hi < SIGMA_MIN:
            return SIGMA_MIN
    while hi / lo - 1.0 > 1e-5:
        mid = math.sqrt(lo * hi)
        if eps_at(mid) <= target:
            hi = mid
        else:
            lo = mid
    return float(hi)


def calibrate_sigma_classic(
    *,
    q: float,
    steps: int,
    epsilon: float,
    delta: float,
    orders: Orders = DEFAULT_ORDERS,
    conversion: str = "balle",
) -> float:
    """The noise multiplier σ for (ε, δ)-DP over ``steps`` steps.

    With ``conversion="balle"`` this is what Opacus calibrates: ``get_noise_multiplier`` with the RDP
    accountant, on the same orders (α = λ + 1) as :class:`ClassicAccountant` and an ε tolerance of 0.1%
    of the target, so the accountant's ε at the returned σ is at most ``epsilon`` and within 0.1% of it.
    With ``"chernoff"`` it is the bisection of :func:`calibrate_sigma_bdp` on the d = 1 cost.
    """
    from opacus.accountants.utils import get_noise_multiplier

    q, steps, target, delta = _check_q(q), _check_steps(steps), _check_epsilon(epsilon), _check_delta(delta)
    lam = _check_orders(orders)
    if check_choice("conversion", conversion, CONVERSIONS) == "chernoff":
        return calibrate_sigma_bdp(
            sq_norms=np.ones(1), q=q, steps=steps, epsilon=target, delta=delta, orders=lam, conversion="chernoff"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")  # noisy during bisection
        try:
            sigma = get_noise_multiplier(
                target_epsilon=target,
                target_delta=delta,
                sample_rate=q,
                steps=steps,
                accountant="rdp",
                epsilon_tolerance=1e-3 * target,
                alphas=[float(a) for a in lam + 1],
            )
        except ValueError as err:
            raise ValueError(
                f"Opacus cannot calibrate sigma for ε_total={target:.4g}, δ={delta:g}, q={q:g}, "
                f"steps={steps}: {err}; raise ε_total or take fewer steps"
            ) from None
    return float(sigma)


# ------------------------------------------------------------------------------------ accountants
ACCOUNTANTS: Registry["_CostAccountant"] = Registry("privacy accountant")


class _CostAccountant:
    """Running cost C(λ) over integer orders λ, shared by both accountants; ``conversion`` turns it into ε."""

    name = ""

    def __init__(self, *, orders: Orders = DEFAULT_ORDERS, conversion: str = "balle") -> None:
        self.conversion = check_choice("conversion", conversion, CONVERSIONS)
        self.orders = _check_orders(orders)
        self.total_cost = np.zeros(self.orders.size)
        self._steps = 0

    # -- what subclasses define
    def step_cost(self, *, sq_norms: Any, q: float, sigma: float) -> np.ndarray:
        raise NotImplementedError

    def _convert(self, total_cost: np.ndarray, delta: float) -> Tuple[float, int]:
        return cost_epsilon(total_cost=total_cost, orders=self.orders, delta=delta, conversion=self.conversion)

    # -- shared
    @property
    def steps(self) -> int:
        """How many steps have been spent."""
        return self._steps

    def spend(self, cost: Any) -> None:
        """Add one step's ``cost`` (from :meth:`step_cost`) to the running total."""
        self.total_cost = self.total_cost + _check_cost(cost, self.orders.size)
        self._steps += 1

    def epsilon(self, delta: float) -> float:
        """ε spent so far at ``delta`` (0 before the first step)."""
        delta = _check_delta(delta)
        return 0.0 if self._steps == 0 else self._convert(self.total_cost, delta)[0]

    def epsilon_after(self, cost: Any, delta: float) -> float:
        """The ε that spending ``cost`` would bring; nothing is recorded."""
        delta = _check_delta(delta)
        return self._convert(self.total_cost + _check_cost(cost, self.orders.size), delta)[0]

    def state_dict(self) -> Dict[str, Any]:
        return {
            "accountant": self.name,
            "orders": [int(o) for o in self.orders],
            "total_cost": [float(c) for c in self.total_cost],
            "steps": int(self._steps),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("accountant") != self.name:
            raise ValueError(
                f"state of a {state.get('accountant')!r} accountant cannot be loaded into a "
                f"{self.name!r} one; create_accountant({state.get('accountant')!r}, ...) instead"
            )
        orders = _check_orders(state["orders"])
        if not np.array_equal(orders, self.orders):
            raise ValueError(
                f"the state was saved with different orders; create the accountant with orders={list(map(int, orders))}"
            )
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"steps in the state must be an integer >= 0, got {steps!r}")
        self.total_cost = _check_cost(state["total_cost"], self.orders.size, "total_cost").copy()
        self._steps = int(steps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self._steps}, orders={self.orders.size})"


@ACCOUNTANTS.register("bayesian")
class BayesianAccountant(_CostAccountant):
    """Bayesian DP ledger of one client (see the module docstring for what it guarantees).

    Parameters
    ----------
    orders:
        Integer orders λ ≥ 1.
    estimator:
        ``"ucb"`` (the default: the BDP paper's upper confidence bound) or ``"mean"`` (see
        :func:`bdp_step_cost`).
    confidence:
        γ for ``"ucb"``: its bound, hence the guarantee, holds with probability 1 − γ per step.
    conversion:
        How C(λ) becomes ε (:data:`CONVERSIONS`); the same default as :class:`ClassicAccountant`.
    """

    name = "bayesian"

    def __init__(
        self,
        *,
        orders: Orders = DEFAULT_ORDERS,
        estimator: str = "ucb",
        confidence: float = 0.05,
        conversion: str = "balle",
    ) -> None:
        super().__init__(orders=orders, conversion=conversion)
        self.estimator = check_choice("estimator", estimator, ESTIMATORS)
        self.confidence = _check_confidence(confidence)

    def step_cost(self, *, sq_norms: Any, q: float, sigma: float) -> np.ndarray:
        """c(λ) of one step whose batch has clipped norms² ``sq_norms`` (‖clip(g)‖²/C²)."""
        return bdp_step_cost(
            sq_norms=sq_norms,
            q=q,
            sigma=sigma,
            orders=self.orders,
            estimator=self.estimator,
            confidence=self.confidence,
        )


@ACCOUNTANTS.register("classic")
class ClassicAccountant(_CostAccountant):
    """(ε, δ)-DP ledger of one client: Opacus's RDP accounting, as C(λ) = λ · Σ_t RDP_t(λ + 1).

    ``step_cost`` ignores ``sq_norms`` (the worst case d = 1 holds for every record); with the default
    ``conversion="balle"``, ``epsilon`` equals ``opacus.accountants.RDPAccountant().get_epsilon(delta,
    alphas=[λ + 1 ...])`` for the same (σ, q) history.
    """

    name = "classic"

    def step_cost(self, *, sq_norms: Any = None, q: float, sigma: float) -> np.ndarray:
        """λ · RDP_{λ+1}(q, σ) for every order; ``sq_norms`` is not used."""
        return classic_step_cost(q=q, sigma=sigma, orders=self.orders)


def create_accountant(name: str, **settings: Any) -> _CostAccountant:
    """Build the accountant registered as ``name`` (``"bayesian"`` or ``"classic"``) with ``settings``."""
    return ACCOUNTANTS.create(name, **settings)


__all__ = [
    "ACCOUNTANTS",
    "BayesianAccountant",
    "ClassicAccountant",
    "DEFAULT_ORDERS",
    "ESTIMATORS",
    "SIGMA_MAX",
    "SIGMA_MIN",
    "CONVERSIONS",
    "balle_epsilon",
    "bdp_step_cost",
    "calibrate_sigma_bdp",
    "calibrate_sigma_classic",
    "classic_step_cost",
    "create_accountant",
    "chernoff_epsilon",
    "cost_epsilon",
]
