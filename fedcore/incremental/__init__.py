"""Class-incremental building blocks for PP-FCIL: exemplar herding and memory, and incremental metrics.

* :mod:`~fedcore.incremental.exemplars`: iCaRL's herding and a fixed-size per-client exemplar memory;
* :mod:`~fedcore.incremental.metrics`: average incremental accuracy, forgetting and final accuracy.
"""

from fedcore.incremental.exemplars import ExemplarMemory, herding
from fedcore.incremental.metrics import average_incremental_accuracy, final_accuracy, forgetting, seen_accuracy

__all__ = ["herding", "ExemplarMemory", "seen_accuracy", "average_incremental_accuracy", "forgetting", "final_accuracy"]
