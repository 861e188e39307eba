"""What a federation promises each client: the privacy settings, resolved, and a ledger per client."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

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
    gdp_epsilon,
    mu_from_sigma,
)
from fedcore.privacy.dp import BACKENDS, PrivacySpec, check_mode, check_noise_source


@dataclass(frozen=True)
class PrivacyConfig:
    """The privacy form of a run, as configured (``conf/privacy``).

    ``mode``: ``off`` | ``clip`` (the paper's clip-only form) | ``dp0`` (the private form at
    σ = 0) | ``dp``. Neither ``clip`` nor ``dp0`` has a guarantee. In ``dp`` mode σ is calibrated so that one
    arrival (every stream sample used ``uses`` times) costs ``epsilon`` at ``delta``, unless
    ``noise_multiplier`` gives σ directly. ``budget`` caps a client's cumulative ε over all its
    arrivals; a client that would exceed it is refused the update. ``gate_noise_multiplier`` (z):
    in ``dp`` mode the gate statistic σ_k is released with noise std z·ln C / n, which costs
    μ_g = 1/z of every arrival; σ is calibrated for what is left (see
    :func:`~fedcore.privacy.accountant.calibrate_sigma`). ``noise_source``: ``secure``
    (OS entropy, the default: the only source under which the guarantee holds against someone who
    can read the run's seed) or ``seeded`` (torch's generator, for reproducible research runs).
    """

    mode: str = "off"
    epsilon: Optional[float] = None
    delta: float = 1e-6
    clip_norm: float = 1.0
    noise_multiplier: Optional[float] = None
    calibration: str = "dp-tta"
    backend: str = "auto"
    budget: Optional[float] = None
    noise_source: str = "secure"
    gate_noise_multiplier: float = 10.0

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_noise_source(self.noise_source)
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {self.calibration!r}; valid names are: {', '.join(CALIBRATIONS)}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown per-sample gradient backend {self.backend!r}; valid names are: {', '.join(BACKENDS)}"
            )
        if self.mode == "off":
            return
        check_clip_norm(self.clip_norm)
        if self.mode in ("clip", "dp0"):
            if self.budget is not None or self.epsilon is not None:
                raise ValueError(
                    f"privacy mode {self.mode!r} adds no noise and gives no privacy guarantee, so "
                    "epsilon and budget do not apply; use privacy mode 'dp' for a guarantee"
                )
            return
        check_delta(self.delta)
        check_gate_noise(self.gate_noise_multiplier)
        if self.noise_multiplier is None:
            if self.epsilon is None:
                raise ValueError(
                    "privacy mode 'dp' needs a target epsilon per arrival (privacy.epsilon) "
                    "or an explicit privacy.noise_multiplier"
                )
            check_epsilon(self.epsilon)
        elif check_sigma(self.noise_multiplier) == 0:
            raise ValueError(
                "privacy mode 'dp' needs noise_multiplier > 0; for sigma = 0 use mode 'dp0' (the "
                "private form) or 'clip' (the paper's clip-only form)"
            )
        if self.budget is not None:
            try:
                check_epsilon(self.budget)
            except ValueError:
                raise ValueError(
                    f"privacy.budget must be a finite epsilon > 0 (each client's total), got "
                    f"{self.budget!r}; null sets no budget"
                ) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "PrivacyConfig":
        d = dict(d or {})
        d.pop("name", None)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown privacy setting(s) {sorted(unknown)}; valid names are: {', '.join(cls.__dataclass_fields__)}"
            )
        return cls(**d)

    def sigma(self, uses: int) -> float:
        if self.mode != "dp":
            return 0.0
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        return calibrate_sigma(self.epsilon, self.delta, uses=uses, method=self.calibration, reserved_mu=self.gate_mu)

    def spec(self, uses: int) -> PrivacySpec:
        return PrivacySpec(
            mode=self.mode,
            clip_norm=self.clip_norm,
            noise_multiplier=self.sigma(uses),
            backend=self.backend,
            noise_source=self.noise_source,
        )

    @property
    def name(self) -> str:
        """plain | clip | dp0 | dp-eps<ε> | dp-sigma<σ>, then ``-c<C>`` when C is not 1: the form's name.

        Runs, MLflow tags and tables carry it; two settings with one name would share a run folder, so a
        sweep refuses them (``flows.config.compose.check_forms``).
        """
        if self.mode == "off":
            return "plain"
        if self.mode in ("clip", "dp0"):
            name = self.mode
        else:
            name = f"dp-eps{self.epsilon:g}" if self.noise_multiplier is None else f"dp-sigma{self.noise_multiplier:g}"
        return name if self.clip_norm == 1.0 else f"{name}-c{self.clip_norm:g}"

    @property
    def accounted(self) -> bool:
        return self.mode == "dp"

    @property
    def gate(self) -> Optional[float]:
        """The gate statistic's noise multiplier z where it is privatised (``dp`` mode), else None."""
        return self.gate_noise_multiplier if self.accounted else None

    @property
    def gate_mu(self) -> float:
        """μ of one gate release (1/z in ``dp`` mode; 0 otherwise, where nothing is accounted)."""
        return gate_mu(self.gate)


class Ledger:
    """One :class:`GDPAccountant` per target client, keyed by client id."""

    def __init__(self, cfg: PrivacyConfig, *, uses: int):
        self.cfg, self.uses = cfg, uses
        self.sigma = cfg.sigma(uses)
        self.accountants: Dict[int, GDPAccountant] = {}

    def account(self, client: int) -> GDPAccountant:
        return self.accountants.setdefault(int(client), GDPAccountant())

    def epsilon(self, client: int) -> float:
        return self.account(client).get_epsilon(self.cfg.delta) if self.cfg.accounted else math.inf

    def arrival_epsilon(self) -> float:
        """ε of one arrival: the update and the gate release, composed."""
        if not self.cfg.accounted:
            return math.inf
        mu = math.sqrt(mu_from_sigma(self.sigma, self.uses) ** 2 + self.cfg.gate_mu**2)
        return gdp_epsilon(mu, self.cfg.delta)

    def would_exceed(self, client: int) -> bool:
        if not self.cfg.accounted or self.cfg.budget is None:
            return False
        after = self.account(client).epsilon_after(
            noise_multiplier=self.sigma, uses=self.uses, delta=self.cfg.delta, gate_noise_multiplier=self.cfg.gate
        )
        return after > self.cfg.budget * (1 + 1e-9)

    def charge(self, client: int) -> None:
        if self.cfg.accounted:
            self.account(client).step(noise_multiplier=self.sigma, uses=self.uses, gate_noise_multiplier=self.cfg.gate)

    def state_dict(self) -> Dict[int, Dict[str, Any]]:
        return {k: a.state_dict() for k, a in sorted(self.accountants.items())}

    def load_state_dict(self, state: Mapping[int, Mapping[str, Any]]) -> None:
        self.accountants = {}
        for k, s in state.items():
            self.account(int(k)).load_state_dict(dict(s))

    def record(self, client: int, *, refused: bool) -> Dict[str, float]:
        """The per-arrival ledger line for MLflow (finite numbers only)."""
        if not self.cfg.accounted:
            return {}
        return ledger_line(
            "arrival",
            sigma=self.sigma,
            spent=0.0 if refused else self.arrival_epsilon(),
            total=self.epsilon(client),
            budget=self.cfg.budget,
            refused=refused,
        )


# ---------------------------------------------------------------- one ledger format for every system
# Sequential arrivals keep the ledgers on the server (Ledger above); round-based clients keep their own account
# (fedcore.train.fcil: a Bayesian or RDP accountant, or NbAFL's upload count) and report ε and σ with each update.
# Both are written the same way: a ledger line per client and step in MLflow, privacy_ledger.json with every
# client's final account, and privacy_ledger.png (fedcore.evaluate.plots.plot_ledger).


def ledger_line(
    step: str, *, sigma: float, spent: float, total: float, budget: Optional[float], refused: bool
) -> Dict[str, float]:
    """One client's ledger line after one ``step`` (``"arrival"`` or ``"round"``), as MLflow metrics.

    ``spent``: the ε this step cost (``eps_<step>``; 0 when refused); ``total``: the client's cumulative ε;
    ``refused``: the client sent nothing because its budget is spent.
    """
    out = {
        "privacy_sigma": float(sigma),
        "privacy_refused": float(refused),
        f"eps_{step}": float(spent),
        "eps_client_total": float(total),
    }
    if budget is not None:
        out["eps_budget_remaining"] = max(0.0, float(budget) - out["eps_client_total"])
    return out


_ROUND_EPSILON = re.compile(r"^epsilon\.c(\d+)$")


def round_ledger_lines(
    records: Sequence[Mapping[str, Any]], *, budget: Optional[float]
) -> List[Tuple[int, int, Dict[str, float]]]:
    """(round, client, ledger line) for every client that reported a ledger in a round's record
    (``epsilon.c<k>``, ``sigma.c<k>`` and ``budget_spent.c<k>``, as the ``ppfcil`` strategy writes them)."""
    lines: List[Tuple[int, int, Dict[str, float]]] = []
    last: Dict[int, float] = {}
    sigmas: Dict[int, float] = {}
    for rec in records:
        for key in sorted(rec, key=lambda k: (len(k), k)):
            m = _ROUND_EPSILON.match(key)
            if m is None:
                continue
            k, total = int(m.group(1)), float(rec[key])
            refused = bool(rec.get(f"budget_spent.c{k}", 0.0))
            sigma = float(rec.get(f"sigma.c{k}", math.nan))
            if math.isfinite(sigma) and not refused:
                sigmas[k] = sigma
            # as private TTA's: a refused line carries the client's σ (its last), and every number is finite
            lines.append(
                (
                    int(rec["round"]),
                    k,
                    ledger_line(
                        "round",
                        sigma=sigmas.get(k, 0.0) if refused or not math.isfinite(sigma) else sigma,
                        spent=0.0 if refused else total - last.get(k, 0.0),
                        total=total,
                        budget=budget,
                        refused=refused,
                    ),
                )
            )
            last[k] = total
    return lines


def ledger_document(*, delta: float, clients: Mapping[int, Any], **about: Any) -> Dict[str, Any]:
    """privacy_ledger.json: δ, anything ``about`` the account (its kind, the budget), and every client's final
    ledger keyed by client id."""
    return {"delta": float(delta), **about, "clients": {str(k): v for k, v in sorted(clients.items())}}
