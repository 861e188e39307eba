"""Client-side supervised local training (the labelled source clients)."""

from fedcore.train.sgd import LocalResult, train_client

__all__ = ["LocalResult", "train_client"]
