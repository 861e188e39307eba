"""Metrics: accuracy, the continual accuracy matrix, forgetting, weight drift."""

from fedcore.evaluate.metrics import accuracy, batch_statistics, forgetting, predict

__all__ = ["accuracy", "batch_statistics", "forgetting", "predict"]
