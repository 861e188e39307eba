"""Metrics: accuracy, the continual accuracy matrix, forgetting, weight drift."""

from fedcore.evaluate.metrics import accuracy, forgetting, predict

__all__ = ["accuracy", "forgetting", "predict"]
