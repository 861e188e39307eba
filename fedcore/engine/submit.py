"""The seam between the plain driver and the flow.

A driver takes a ``submit(fn, **kwargs)`` callable that returns something with ``.result()``.
The plain driver runs the step at once (:func:`run_now`); the Prefect flow submits it as a
task on Ray. Both drivers therefore run the same step functions in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence


class Done:
    """A result that is already there: the plain driver's stand-in for a future."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        return self._value


def run_now(fn: Callable, **kwargs) -> Done:
    return Done(fn(**kwargs))


Submit = Callable[..., Any]
# submit_round(fn, calls, take): a driver that runs a whole round of client steps as one unit. It calls
# take(j, fn(**calls[j])) once per call, in call order, as soon as that result and every one before it
# are ready (the engine folds each into the round's aggregate), and returns when all are taken. A result
# taken is final: a retry reruns only the calls not yet taken.
# calls[j] builds call j when asked for (read each once, in order)
SubmitRound = Callable[[Callable, Sequence[Dict[str, Any]], Callable[[int, Any], None]], None]
