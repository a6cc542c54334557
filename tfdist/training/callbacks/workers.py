"""Which worker this is, and scratch directories for the workers that do not write.

Under multi-worker training every worker runs every callback; only the chief
writes where the user asked, the others write into a scratch directory that is
removed (at exit at the latest).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

import tensorflow as tf

from tfdist.compat.tf_python import multi_worker_util

# --------------------------------------------------------------------------
# Who is the chief.


def _resolver(strategy: Any):
    # ParameterServerStrategy keeps its resolver private.
    return (
        getattr(strategy, "cluster_resolver", None)
        or getattr(strategy, "_cluster_resolver", None)
        or getattr(getattr(strategy, "extended", None), "_cluster_resolver", None)
    )


def cluster(strategy: Any) -> tuple[dict, str | None, int | None]:
    """``(cluster spec dict, task type, task id)`` of ``strategy``, or ``({}, None, None)``."""
    resolver = _resolver(strategy)
    if resolver is None or not getattr(resolver, "task_type", None):
        return {}, None, None
    return (resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id)


def is_chief(strategy: Any = None) -> bool:
    """Whether this task writes checkpoints and logs for the job.

    tfdist strategies answer themselves (``strategy.is_chief``). For
    TensorFlow's own strategies the answer comes from the cluster resolver,
    as ``multi_worker_util.is_chief`` decides it (the ``chief`` task, else
    ``worker:0``); without a cluster (one process) it is True.

    Args:
        strategy: The strategy; default: the one in scope.
    """
    strategy = strategy or tf.distribute.get_strategy()
    own = getattr(strategy, "is_chief", None)
    if isinstance(own, bool):
        return own
    spec, task_type, task_id = cluster(strategy)
    if not spec or task_type is None:
        return True
    return multi_worker_util.is_chief(spec, task_type, task_id)


def num_workers(strategy: Any = None) -> int:
    """Worker processes that train in sync (``chief`` + ``worker`` tasks), >= 1."""
    strategy = strategy or tf.distribute.get_strategy()
    spec, _, _ = cluster(strategy)
    return max(1, len(spec.get("chief", ())) + len(spec.get("worker", ())))


def task_name(strategy: Any) -> str:
    """``"type:index"`` of this task, or ``"local"`` without a cluster."""
    _, task_type, task_id = cluster(strategy)
    return f"{task_type}:{task_id}" if task_type else "local"


def model_strategy(model: Any):
    """The strategy ``model`` was built under, or the current one."""
    return getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()


# --------------------------------------------------------------------------
# Scratch directories for non-chief writers.

_SCRATCH: set[str] = set()


def _remove_scratch() -> None:
    for path in list(_SCRATCH):
        shutil.rmtree(path, ignore_errors=True)
        _SCRATCH.discard(path)


atexit.register(_remove_scratch)


def make_scratch(prefix: str) -> str:
    """A temporary directory, removed at process exit if not before."""
    path = tempfile.mkdtemp(prefix=prefix)
    _SCRATCH.add(path)
    return path


def drop_scratch(path: str | None) -> None:
    """Removes a directory from :func:`make_scratch` (None: nothing)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
        _SCRATCH.discard(path)
