"""The library's torch-only tiny federation is the one the stage code builds."""

import numpy as np
import torch

from flows.config import compose as C
from tests.fedcore.tiny import PRETRAIN, build_tiny


def test_the_torch_only_tiny_federation_equals_the_stage_codes(tiny):
    # Execute
    built = build_tiny()

    # Assert: the same settings, arrays and source weights as Hydra + the prepare/partition steps give
    assert C.pretrain_config(tiny["cfg"]) == PRETRAIN and C.model_spec(tiny["cfg"]) == built["spec"]
    a, b = tiny["partition"], built["partition"]
    assert all(np.array_equal(x, y) for x, y in zip(a.source_x, b.source_x))
    assert all(
        np.array_equal(x.stream_x, y.stream_x) and np.array_equal(x.holdout_y, y.holdout_y)
        for x, y in zip(a.targets, b.targets)
    )
    assert all(torch.equal(tiny["source"][k], built["source"][k]) for k in tiny["source"])
