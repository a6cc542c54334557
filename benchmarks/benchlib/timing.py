"""The step timer of the benchmarks' ``fit`` runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any


def step_timer(times: list[float]) -> Any:
    """A Keras callback that appends each training batch's wall time to ``times``.

    The time is the host's, from ``on_train_batch_begin`` to
    ``on_train_batch_end``: with ``steps_per_execution=1``, one step.
    """
    import keras  # Here: the scripts import Keras only in their worker processes.

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self._start)

    return StepTimer()


def median_step(times: Sequence[float], skip: int) -> float:
    """Median of the step times after the first ``skip`` (tracing, warm-up)."""
    kept = list(times[skip:])
    if not kept:
        raise ValueError(f"Expected more than {skip} step times. Received: {len(times)}")
    return statistics.median(kept)
