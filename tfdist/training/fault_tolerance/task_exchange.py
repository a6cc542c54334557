"""Every training task of a multi-worker job tells the others one small
record and gets all of theirs, through TensorFlow's coordination service.

A collective cannot carry a task's file names or a variable number of
backups, and every worker must know every other's answer to decide the
same thing (for example, which backup all of them resume from) before the
first training step. The key-value store of the coordination service
(which lives in the chief's process, for the life of the job) can: each task
sets ``tfdist/exchange/ATTEMPT/N-NAME/INDEX`` and reads the others' keys,
blocking until they are set. ``N`` counts this process's exchanges of that
name, which every task makes in the same order (at the same point of the
script), so a second ``fit`` in the same process uses fresh keys.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from tfdist.errors import TfdistError

__all__ = ["EXCHANGE_SECONDS", "ExchangeError", "exchange", "trainers"]

#: Seconds a task waits for the others' records: they may still be loading
#: data or building the model. A task that died makes the coordination
#: service fail the wait sooner.
EXCHANGE_SECONDS = 600.0

_COUNTS: dict[str, int] = {}
_LOCK = threading.Lock()


class ExchangeError(TfdistError, RuntimeError):
    """A task did not publish its record in time, or the job has no
    coordination service to exchange through."""


def trainers(strategy: Any) -> tuple[list[str], int]:
    """The names of the tasks that train in sync (``chief`` then ``worker``
    tasks, as ``"worker:1"``) and this task's index among them."""
    from tfdist.training.callbacks.workers import cluster

    spec, task_type, task_id = cluster(strategy)
    names = [f"{job}:{i}" for job in ("chief", "worker") for i in range(len(spec.get(job, ())))]
    mine = f"{task_type}:{task_id}"
    if mine not in names:
        return [mine], 0
    return names, names.index(mine)


def _next_prefix(name: str) -> str:
    with _LOCK:
        count = _COUNTS.get(name, 0) + 1
        _COUNTS[name] = count
    attempt = os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0")
    return f"tfdist/exchange/{attempt}/{count}-{name}"


def exchange(
    strategy: Any, name: str, record: dict, timeout: float = EXCHANGE_SECONDS
) -> list[dict]:
    """Publishes ``record`` (JSON-serializable) and returns every training
    task's record of the same exchange, in task order (this task's included).

    Call it on every training task at the same point of the script.

    Raises:
        ExchangeError: No coordination service, or a task's record did not
            come within ``timeout`` seconds (the message names the task).
    """
    import tensorflow as tf

    from tfdist.compat.tf_python import eager_context as context

    names, index = trainers(strategy)
    ctx = context.context()
    if ctx.coordination_service is None:
        raise ExchangeError(
            f"{names[index]}: expected TensorFlow's coordination service (it is set up "
            f"with the multi-worker strategy) to exchange '{name}' with {len(names) - 1} "
            "other task(s); received none in this process."
        )
    prefix = _next_prefix(name)
    ctx.set_config_key_value(f"{prefix}/{index}", json.dumps(record))
    records = []
    deadline = time.monotonic() + timeout
    for i, task in enumerate(names):
        left = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            records.append(json.loads(ctx.get_config_key_value(f"{prefix}/{i}", left)))
        except tf.errors.OpError as error:
            raise ExchangeError(
                f"{names[index]}: expected {task} to report '{name}' within {timeout:g} s "
                f"(every training task must run the same callbacks); received "
                f"{type(error).__name__}: {str(error).splitlines()[0]}"
            ) from error
    return records
