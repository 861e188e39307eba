"""The federation loops, each written once, and what they share.

* :mod:`~fedcore.engine.submit`: the seam between the plain driver and the Prefect flow;
* :mod:`~fedcore.engine.checkpoint`: atomic, sha256-checked server state for every loop;
* :mod:`~fedcore.engine.spec`: how to rebuild a network, and a network saved as data only;
* :mod:`~fedcore.engine.arrivals`: sequential arrival (BPFedCTTA, DP-TTA);
* :mod:`~fedcore.engine.rounds`: synchronous rounds (source pretraining, FedPAD and its baselines).
"""

from fedcore.engine.arrivals import (
    AdaptResult,
    ArrivalConfig,
    ArrivalsResult,
    ServerState,
    adapt_client,
    arrivals_result,
    evaluate_global,
    initial_state,
    iter_arrivals,
    run_arrivals,
    source_pool,
    summarise,
)
from fedcore.engine.checkpoint import CheckpointError, RunInterrupted, load_state, save_state
from fedcore.engine.rounds import (
    RoundConfig,
    RoundData,
    RoundsResult,
    evaluate_sets,
    load_client_states,
    run_rounds,
    source_round_data,
    train_step,
)
from fedcore.engine.spec import ModelSpec, init_state, load_network, save_network
from fedcore.engine.submit import Done, Submit, SubmitRound, run_now

__all__ = [
    "AdaptResult",
    "ArrivalConfig",
    "ArrivalsResult",
    "ServerState",
    "adapt_client",
    "arrivals_result",
    "evaluate_global",
    "initial_state",
    "iter_arrivals",
    "run_arrivals",
    "source_pool",
    "summarise",
    "CheckpointError",
    "RunInterrupted",
    "load_state",
    "save_state",
    "RoundConfig",
    "RoundData",
    "RoundsResult",
    "evaluate_sets",
    "load_client_states",
    "run_rounds",
    "source_round_data",
    "train_step",
    "ModelSpec",
    "init_state",
    "load_network",
    "save_network",
    "Done",
    "Submit",
    "SubmitRound",
    "run_now",
]
