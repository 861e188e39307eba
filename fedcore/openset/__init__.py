"""Open-set recognition: unknown scores (MSP, PROSER, OpenMax) and their metrics (AUROC, OSCR)."""

from fedcore.openset.metrics import auroc, msp_score, open_set_metrics, oscr, proser_predict, proser_score
from fedcore.openset.openmax import OpenMax

__all__ = ["auroc", "oscr", "msp_score", "proser_score", "proser_predict", "open_set_metrics", "OpenMax"]
