"""Every worker's rows on every worker, through the strategy's collectives.

The chief needs the other workers' step records (for the straggler report,
TensorBoard and the merged timeline). They travel through an all-gather of
float64 rows, the job's own link: workers on different hosts need no shared
disk, and a dead peer fails the gather with the strategy's own timeout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat.tf_python import multi_worker_util

__all__ = ["worker_index", "local_replicas", "gather_rows"]


def local_replicas(strategy: Any) -> int:
    """Replicas this worker runs (its devices), >= 1."""
    from tfdist.profiling.instrument import worker_devices

    return max(1, len(worker_devices(strategy)))


def worker_index(strategy: Any) -> int:
    """This worker's rank among the workers that train in sync (the chief,
    then the workers in order), as MultiWorkerMirrored numbers them; 0
    without a cluster."""
    from tfdist.training.callbacks.workers import cluster

    spec, task_type, task_id = cluster(strategy)
    if not spec or task_type not in ("chief", "worker"):
        return 0
    return multi_worker_util.id_in_cluster(spec, task_type, task_id)


def gather_rows(strategy: Any, rows: np.ndarray) -> list[np.ndarray]:
    """Each worker's ``rows`` (an ``[n, width]`` float64 array; ``n`` may
    differ between workers), indexed by worker.

    Every worker of the job must call it at the same point.
    """
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, rows.shape[-1] if rows.ndim else 1)
    workers = strategy.num_replicas_in_sync // local_replicas(strategy)
    if workers <= 1:
        return [rows]
    per_worker = local_replicas(strategy)
    counts = _all_gather(strategy, np.array([[rows.shape[0]]], np.float64), per_worker)
    counts = [int(c) for c in counts[::per_worker, 0]]
    width = rows.shape[1]
    padded = np.zeros((max(counts), width), np.float64)
    padded[: rows.shape[0]] = rows
    out = _all_gather(strategy, padded, per_worker).reshape(-1, max(counts), width)
    return [out[w * per_worker][: counts[w]] for w in range(workers)]


def _all_gather(strategy: Any, value: np.ndarray, per_worker: int) -> np.ndarray:
    """All-gather of ``value`` from each worker's first replica (the others
    send zeros of the same shape), stacked on axis 0 in replica order."""
    local = tf.constant(value)

    @tf.function  # MultiWorkerMirrored runs collectives eagerly only with a warning.
    def gather():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            first = tf.equal(ctx.replica_id_in_sync_group % per_worker, 0)
            return tf.where(first, local, tf.zeros_like(local))

        return strategy.gather(strategy.run(replica_fn), axis=0)

    return gather().numpy()
