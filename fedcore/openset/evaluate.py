"""Open-set evaluation of a global model, per domain: closed-set accuracy, AUROC and OSCR for each unknown score.

Scores (higher = more likely unknown), by how the model was trained:

* ``msp``: −max softmax, for a model with one output per known class;
* ``openmax``: OpenMax's unknown probability, fitted on the clients' training logits (as if each
  client sent its per-class mean activation vectors and tail distances);
* ``proser``: the dummy logit over the best known logit, for a PROSER model (one extra output).

Keys: ``acc.<domain>``, ``auroc.<score>.<domain>``, ``oscr.<score>.<domain>``, their means over
domains (``avg_acc``, ``auroc.<score>``, ``oscr.<score>``), ``worst_acc``, and ``auroc`` / ``oscr``
for the first score listed (the method's headline). With ``unknown_sets`` (heterogeneous
unknowns), each scenario adds ``auroc_<scenario>.<score>.<domain>``, its mean over domains
``auroc_<scenario>.<score>``, and ``auroc_<scenario>`` for the headline score: every domain
scored against only the unknown rows its scenario mask keeps.
"""

from __future__ import annotations

import warnings
from typing import Dict, Mapping, Sequence, Tuple

import numpy as np
import torch

from fedcore.openset.metrics import auroc, msp_score, oscr, proser_predict, proser_score
from fedcore.openset.openmax import OpenMax
from fedcore.tensors import batches, resolve_device, to_tensor
from fedcore.types import ModelSpec

SCORES = ("msp", "openmax", "proser")


@torch.no_grad()
def logits_of(model: torch.nn.Module, x: np.ndarray, *, device="cpu", batch_size: int = 256) -> np.ndarray:
    model.eval()
    out = [model(to_tensor(x[sl], device=device)).float().cpu() for sl in batches(len(x), batch_size)]
    return torch.cat(out).numpy() if out else np.zeros((0, 0), np.float32)


def check_scores(scores: Sequence[str], *, dummy: bool) -> Tuple[str, ...]:
    """The score names, checked against the model: ``proser`` needs a dummy output, the others must not have one."""
    bad = [s for s in scores if s not in SCORES]
    if bad or not scores:
        raise ValueError(f"unknown open-set score(s) {bad or scores}; use some of {', '.join(SCORES)}")
    if dummy != all(s == "proser" for s in scores) or (dummy and len(scores) != 1):
        raise ValueError(
            f"scores {list(scores)} do not fit the model: a PROSER model (trainer proser, one dummy "
            "output) is scored with [proser]; a plain classifier with msp and/or openmax"
        )
    return tuple(scores)


def openset_evaluate(
    state: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    known: Mapping[str, Tuple[np.ndarray, np.ndarray]],
    unknown: Mapping[str, np.ndarray],
    *,
    scores: Sequence[str],
    fit: Tuple[np.ndarray, np.ndarray] | None = None,
    device: str = "cpu",
    unknown_sets: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    folded: bool = False,
) -> Dict[str, float]:
    """Open-set metrics of ``state`` on every domain (see the module docstring).

    ``folded`` adds ``auroc_max.<score>[.<domain>]``: max(AUROC, 1 − AUROC) per domain, then the mean over
    domains, which is what the FedPD++ authors' evaluation reports (a score ranked backwards counts as
    its mirror image). ``auroc`` stays the signed one.

    ``unknown_sets``: ``{scenario: {domain: bool mask over unknown[domain]}}``
    (:func:`fedcore.data.openset.unknown_masks`).

    ``fit`` is the (x, y) OpenMax is fitted on; it is needed only when ``openmax`` is listed. A
    model that gets a whole known class wrong cannot be fitted (OpenMax needs each class's mean
    activation vector): its OpenMax metrics are NaN in that round, with a warning, and the run goes on.
    """
    dev = resolve_device(device)
    model = spec.build().to(dev)
    model.load_state_dict(state)
    dummy = scores[0] == "proser"
    scorer = None
    if "openmax" in scores:
        if fit is None:
            raise ValueError("the openmax score needs training data to fit on (fit=(x, y))")
        try:
            scorer = OpenMax().fit(logits_of(model, fit[0], device=dev), np.asarray(fit[1]))
        except ValueError as e:  # an early round's model may get a whole class wrong: no score this round
            warnings.warn(
                f"OpenMax cannot be fitted to this model, its metrics are NaN for now: {e}",
                RuntimeWarning,
                stacklevel=2,
            )
    out: Dict[str, float] = {}
    for d, (x, y) in known.items():
        lk, lu = logits_of(model, x, device=dev), logits_of(model, unknown[d], device=dev)
        pred = proser_predict(lk) if dummy else lk.argmax(1)
        correct = pred == np.asarray(y)
        out[f"acc.{d}"] = float(correct.mean())
        for s in scores:
            if s == "proser":
                sk, su = proser_score(lk), proser_score(lu)
            elif s == "msp":
                sk, su = msp_score(lk), msp_score(lu)
            elif scorer is not None:
                sk, su = scorer.score(lk), scorer.score(lu)
            else:
                out[f"auroc.{s}.{d}"] = out[f"oscr.{s}.{d}"] = float("nan")
                if folded:
                    out[f"auroc_max.{s}.{d}"] = float("nan")
                for name in unknown_sets or {}:
                    out[f"auroc_{name}.{s}.{d}"] = float("nan")
                continue
            out[f"auroc.{s}.{d}"] = auroc(sk, su)
            if folded:
                out[f"auroc_max.{s}.{d}"] = max(out[f"auroc.{s}.{d}"], 1.0 - out[f"auroc.{s}.{d}"])
            out[f"oscr.{s}.{d}"] = oscr(sk, correct, su)
            for name, masks in (unknown_sets or {}).items():
                out[f"auroc_{name}.{s}.{d}"] = auroc(sk, su[masks[d]])
    domains = list(known)
    out["avg_acc"] = float(np.mean([out[f"acc.{d}"] for d in domains]))
    out["worst_acc"] = float(min(out[f"acc.{d}"] for d in domains))
    for s in scores:
        for m in ("auroc", "oscr", *(("auroc_max",) if folded else ())):
            out[f"{m}.{s}"] = float(np.mean([out[f"{m}.{s}.{d}"] for d in domains]))
    out["auroc"], out["oscr"] = out[f"auroc.{scores[0]}"], out[f"oscr.{scores[0]}"]
    if folded:
        out["auroc_max"] = out[f"auroc_max.{scores[0]}"]
    for name in unknown_sets or {}:
        for s in scores:
            out[f"auroc_{name}.{s}"] = float(np.mean([out[f"auroc_{name}.{s}.{d}"] for d in domains]))
        out[f"auroc_{name}"] = out[f"auroc_{name}.{scores[0]}"]
    return out
