"""fedcore.evaluate.plots.save: the bytes of tight_layout + savefig, without savefig's second layout pass."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedcore.evaluate import plots as P


def text_and_legend(plt):
    fig, ax = plt.subplots(figsize=(8.4, 3.6))
    a = np.arange(1, 31)
    ax.plot(a, np.linspace(0.2, 0.9, 30), "o-", label="online (stream)")
    ax.plot(a, np.linspace(0.9, 0.3, 30), "s--", label=r"$\|\theta_G^{(k)}-\theta_G^{(0)}\|$")
    ax.set_xticks(a, [f"{k}:corruption{k % 10}" for k in a], rotation=90, fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_title("bpa+ugsa (plain) accuracy per arrival")
    ax.legend(fontsize=7)
    return fig


def colorbar(plt):
    fig, ax = plt.subplots(figsize=(6, 6))
    im = ax.imshow(np.random.default_rng(0).random((30, 10)), vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(30), [f"{k}:domain" for k in range(30)], fontsize=6)
    fig.colorbar(im, ax=ax, label="accuracy")
    return fig


def twin_and_grid(plt):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for k, ax in enumerate(axes.flat):
        ax.bar(range(5), np.arange(5) * (k + 1), alpha=0.6)
        ax.twinx().plot(range(5), np.arange(5) ** 0.5, "o-", color="tab:red")
        ax.set_title(f"panel {k}")
    fig.suptitle("a 2 x 2 figure")
    return fig


@pytest.mark.parametrize("build", [text_and_legend, colorbar, twin_and_grid])
def test_save_writes_the_same_bytes_as_tight_layout_and_savefig(tmp_path, build):
    plt = P.pyplot()
    fig = build(plt)
    fig.tight_layout()
    fig.savefig(tmp_path / "reference.png", dpi=110)
    plt.close(fig)
    P.save(build(plt), tmp_path / "saved.png")
    digest = [hashlib.md5((tmp_path / f).read_bytes()).hexdigest() for f in ("reference.png", "saved.png")]
    assert digest[0] == digest[1]
    assert plt.get_fignums() == []  # save closes its figure


@pytest.mark.parametrize("rc", [{}, {"figure.autolayout": True}, {"figure.constrained_layout.use": True}])
@pytest.mark.filterwarnings("ignore:The figure layout has changed to tight:UserWarning")  # the constrained case
def test_save_does_not_lay_the_figure_out_twice(tmp_path, monkeypatch, rc):
    """savefig draws once more with rendering disabled when a figure has a layout engine: save leaves none,
    also where a matplotlibrc asks every figure for one."""
    import matplotlib
    from matplotlib.figure import Figure

    plt = P.pyplot()
    draws = []
    real = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: draws.append(1) or real(self, renderer))
    with matplotlib.rc_context(rc):
        P.save(text_and_legend(plt), tmp_path / "saved.png")
    assert len(draws) == 1
