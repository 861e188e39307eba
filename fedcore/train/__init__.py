"""Client-side supervised local training, chosen by name: sgd, prox, scaffold, feddyn, proto, proser, fcil.

Importing this package registers every trainer in :data:`TRAINERS`.
"""

from fedcore.train import fcil, feddyn, proser, proto, prox, scaffold, sgd  # noqa: F401 - registers the trainers
from fedcore.train.base import TRAINERS, ClientUpdate, LocalTrainer, augment_batch, create_trainer
from fedcore.train.proto import class_prototypes

__all__ = ["TRAINERS", "ClientUpdate", "LocalTrainer", "create_trainer", "augment_batch", "class_prototypes"]
