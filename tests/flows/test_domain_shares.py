"""Each domain's share of the global model: read from a round's merged clients and the server's weighting, and
reported beside each method's accuracy (FedPAD's grids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flows.reports.evaluations import domain_shares, domain_sizes
from flows.reports.tables import write_grid_report


class Part:
    """Two domains: a has clients 0 and 1 (10 and 30 examples), b has client 2 (60 examples)."""

    domains = ("a", "b")
    client_domain = [0, 0, 1]
    client_y = [np.zeros(10), np.zeros(30), np.zeros(60)]

    def domain_of(self, i: int) -> str:
        return self.domains[self.client_domain[i]]

    def clients_of(self, d: str):
        return [i for i, k in enumerate(self.client_domain) if self.domains[k] == d]


RECORDS = [
    {"round": 0, "clients": [0, 1, 2], "alpha.c0": 0.5, "alpha.c1": 0.3, "alpha.c2": 0.2},
    {"round": 1, "clients": [1, 2], "alpha.c1": 0.25, "alpha.c2": 0.75},
    {"round": 2, "clients": []},
]


def test_shares_follow_each_weighting_and_sum_to_one():
    part = Part()
    by_examples = domain_shares(RECORDS, part, "examples")
    assert by_examples[0] == pytest.approx({"a": 0.4, "b": 0.6})  # 40 of 100 examples
    assert by_examples[1] == pytest.approx({"a": 30 / 90, "b": 60 / 90})  # client 0 not merged
    assert by_examples[2] == {}  # nobody merged
    assert domain_shares(RECORDS, part, "clients")[:2] == [
        pytest.approx({"a": 2 / 3, "b": 1 / 3}),
        pytest.approx({"a": 0.5, "b": 0.5}),
    ]
    assert domain_shares(RECORDS, part, "alpha")[:2] == [
        pytest.approx({"a": 0.8, "b": 0.2}),
        pytest.approx({"a": 0.25, "b": 0.75}),
    ]
    assert domain_shares(RECORDS, part, None) == []
    assert domain_sizes(part) == {"a": (2, 40), "b": (1, 60)}


def _row(method: str, seed: int, weighting: str, acc_b: float) -> dict:
    summary = {
        "final_avg_acc": (0.9 + acc_b) / 2,
        "final_worst_acc": min(0.9, acc_b),
        "final_acc.a": 0.9,
        "final_acc.b": acc_b,
        "agg_seconds_mean": 0.01,
        "bytes_per_round": 2.0**20,
    }
    shares = domain_shares(RECORDS[:2], Part(), weighting)
    return {
        "method": method,
        "seed": seed,
        "summary": summary,
        "seconds": 1.0,
        "weights": {"examples": "n", "alpha": "α(θ)"}[weighting],
        "shares": shares,
    }


def test_the_report_names_the_weighting_the_worst_domain_and_each_domains_share(tmp_path: Path):
    rows = [_row("fedavg", s, "examples", 0.5) for s in (0, 1)] + [_row("fedpad", s, "alpha", 0.95) for s in (0, 1)]
    rows.append(_row("fedpad", 2, "alpha", 0.85))  # this seed's lowest domain is b, the other two seeds' a

    write_grid_report(rows, domains=["a", "b"], out=tmp_path, title="t", target="fedpad", sizes=domain_sizes(Part()))

    text = (tmp_path / "table.md").read_text()
    assert "Domains (clients / training examples): a 2 / 40, b 1 / 60" in text
    assert "| method | weights | avg acc | worst acc | worst domain | a | b | MiB/round |" in text
    assert "| fedavg | n | 0.700 ± 0.000 | 0.500 ± 0.000 | b | 0.900 | 0.500 | 1.00 |" in text
    assert "| fedpad | α(θ) | 0.908 ± 0.024 | 0.883 ± 0.024 | a (2/3) |" in text
    # shares: mean over the two rounds (last round in brackets)
    assert (
        f"| fedavg | n | {(0.4 + 30 / 90) / 2:.3f} ({30 / 90:.3f}) | {(0.6 + 60 / 90) / 2:.3f} ({60 / 90:.3f}) |"
        in text
    )
    assert "| fedpad | α(θ) | 0.525 (0.250) | 0.475 (0.750) |" in text
    assert (tmp_path / "weights.png").stat().st_size > 0


def test_a_grid_without_shares_writes_no_weights_column_or_plot(tmp_path: Path):
    rows = [{k: v for k, v in _row("fedavg", 0, "examples", 0.5).items() if k not in ("weights", "shares")}]

    write_grid_report(rows, domains=["a", "b"], out=tmp_path, title="t", target=None)

    assert "| method | avg acc | worst acc | worst domain | a | b | MiB/round |" in (tmp_path / "table.md").read_text()
    assert not (tmp_path / "weights.png").exists()
