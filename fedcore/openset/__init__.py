"""Federated open-set recognition (FedPD++): unknown scores and their metrics, masks, alignment, evaluation.

* :mod:`~fedcore.openset.metrics`: AUROC, OSCR, MSP and PROSER scores; :mod:`~fedcore.openset.openmax`;
* :mod:`~fedcore.openset.masks`: importance to [0, 1], soft/hard masks, the close/open/shared parts;
* :mod:`~fedcore.openset.align`: layer-wise optimal-transport alignment and SBA's BatchNorm bank;
* :mod:`~fedcore.openset.gdca`: divide-and-conquer fusion of aligned parts;
* :mod:`~fedcore.openset.evaluate`: per-domain closed-set accuracy, AUROC and OSCR of a global model.

The PROSER trainer is :mod:`fedcore.train.proser`; FedPD++'s server is :mod:`fedcore.aggregate.fedpd`.
"""

from fedcore.openset.metrics import auroc, msp_score, open_set_metrics, oscr, proser_predict, proser_score
from fedcore.openset.openmax import OpenMax

__all__ = ["auroc", "oscr", "msp_score", "proser_score", "proser_predict", "open_set_metrics", "OpenMax"]
