"""What a resume carries over beyond the weights: per-worker compression
state, and the policy when the job comes back at another size.

**Compression state.** A backup's weights file holds each error-feedback
residual as its mean over replicas (:mod:`tfdist.compression.keras_hook`),
which keeps their sum, the gradient still owed. Restoring the mean to every
replica is exact for the sum but not for each replica: a nonlinear
compressor (top-k, sign, fp16 rounding, even PowerSGD's float sums) then
compresses slightly different tensors, and a resumed run drifts from an
uninterrupted one (2e-6 here after 48 PowerSGD steps). So every worker also
writes its own replicas' state next to the backup
(``ckpt-NNNNNN.state-worker-1.npz``), and a resume at the same size loads
it back exactly.

**Another size** (an elastic job shrank or grew), the policy:

* *Residuals* are carried, not dropped: each new replica gets the saved mean
  times ``old_replicas / new_replicas``, so that their sum, the gradient
  still owed, is unchanged. State that is the same on every replica
  (PowerSGD's Q) is loaded as it is.
* *Global batch.* tfdist keeps what the script computes. A script that keeps
  the global batch (``dataset.batch(GLOBAL_BATCH)``, the recommended way,
  rather than ``distribute_dataset(per_replica_batch=...)``) gets a larger
  per-replica batch and the same steps per epoch: the resume is at the same
  batch, and exact in data. A script whose global batch follows the number
  of workers gets another number of steps per epoch: the resume keeps the
  fraction of the epoch done (``floor(step * new_steps / old_steps)``
  batches, exact when the sizes divide), and the restored learning rate is
  scaled by the ratio of global batches (``old_steps / new_steps``), the
  linear scaling rule of Goyal et al. (2017); a learning-rate schedule is
  left as it is, with a warning.
* *Data.* The backup's position is a number of global batches into a
  deterministic epoch order; every worker skips that many global batches
  (reading, not training), so no example of the epoch is trained twice or
  skipped, whatever the new sharding.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import numpy as np
from absl import logging

from tfdist.training.atomic import replacing

__all__ = ["state_file", "save_replica_state", "load_replica_state", "resize"]


def state_file(checkpoint: str, task: str) -> str:
    """``ckpt-000003.weights.h5`` and ``worker:1`` -> ``ckpt-000003.state-worker-1.npz``."""
    stem = checkpoint.split(".", 1)[0]
    return f"{stem}.state-{task.replace(':', '-')}.npz"


def _state(optimizer: Any) -> list:
    from tfdist.compression.keras_hook import state_variables

    inner = getattr(optimizer, "inner_optimizer", None)
    return state_variables(inner if inner is not None else optimizer)


def _local(strategy: Any, variable: Any) -> tuple:
    return tuple(strategy.experimental_local_results(getattr(variable, "value", variable)))


def save_replica_state(
    optimizer: Any, strategy: Any, directory: str, checkpoint: str, task: str
) -> str | None:
    """Writes this worker's replicas' compression state, atomically.

    Returns:
        The file's path, or None when there is no compression state.
    """
    variables = _state(optimizer)
    if not variables:
        return None
    arrays = {
        f"v{i}_r{r}": copy.numpy()
        for i, v in enumerate(variables)
        for r, copy in enumerate(_local(strategy, v))
    }
    arrays["replicas"] = np.array(strategy.num_replicas_in_sync)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, state_file(checkpoint, task))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
    with replacing(path, tmp, os.fdopen(fd, "wb")) as f:
        np.savez(f, **arrays)
    return path


def load_replica_state(
    optimizer: Any, strategy: Any, directory: str, checkpoint: str, task: str, saved_replicas: int
) -> str:
    """After the weights were loaded: makes the compression state exact (same
    size) or carries the residuals' sum over (another size).

    Returns:
        What was done: ``"none"`` (no state), ``"exact"``, ``"mean"`` (same
        size, but this worker's file is missing: the saved mean stays), or
        ``"rescaled"``.
    """
    variables = _state(optimizer)
    if not variables:
        return "none"
    replicas = strategy.num_replicas_in_sync
    if saved_replicas != replicas:
        ratio = saved_replicas / replicas
        for v in variables:
            if "MEAN" in str(getattr(v.value, "aggregation", "")).upper():
                for copy in _local(strategy, v):
                    copy.assign(copy * ratio)
        logging.warning(
            "tfdist: compression residuals saved by %d replicas are carried over "
            "to %d: each gets the saved mean times %d/%d, so their sum (the "
            "gradient still owed) is kept.",
            saved_replicas,
            replicas,
            saved_replicas,
            replicas,
        )
        return "rescaled"
    path = os.path.join(directory, state_file(checkpoint, task))
    if not os.path.exists(path):
        logging.warning(
            "tfdist: %s is missing; the compression state resumes from the "
            "replicas' mean (their sum is kept, each replica's share is not).",
            path,
        )
        return "mean"
    with np.load(path) as saved:
        for i, v in enumerate(variables):
            for r, copy in enumerate(_local(strategy, v)):
                copy.assign(saved[f"v{i}_r{r}"])
    return "exact"


def resize(meta: dict, replicas: int, steps_per_epoch: int | None, optimizer: Any) -> int:
    """The batch to resume at when the size or the steps per epoch changed;
    applies the learning-rate part of the policy and logs it.

    Args:
        meta: The backup pointer (``replicas``, ``step``, ``steps_per_epoch``).
        replicas: Replicas of this run.
        steps_per_epoch: Steps per epoch of this run, if known.
        optimizer: The model's optimizer (its learning rate may be scaled).

    Returns:
        The number of batches of the saved epoch to skip.
    """
    step = int(meta["step"])
    old_replicas = int(meta.get("replicas") or replicas)
    old_steps = meta.get("steps_per_epoch")
    if old_replicas == replicas and (
        not old_steps or not steps_per_epoch or old_steps == steps_per_epoch
    ):
        return step
    if not old_steps or not steps_per_epoch or old_steps == steps_per_epoch:
        logging.warning(
            "tfdist: the job resumes at another size: %d -> %d replicas. Policy: global "
            "batch kept (%s steps per epoch), so the per-replica batch changes; it resumes "
            "at batch %d of epoch %s; compression residuals keep their sum.",
            old_replicas,
            replicas,
            steps_per_epoch or "same",
            step,
            meta.get("epoch"),
        )
        return step
    new_step = math.floor(step * steps_per_epoch / old_steps)
    message = (
        f"tfdist: the job resumes at another size: {old_replicas} -> {replicas} "
        f"replicas, {old_steps} -> {steps_per_epoch} steps per epoch (the global batch "
        f"follows the workers). Policy: the fraction of the epoch done is kept "
        f"(batch {step} -> {new_step})"
    )
    rate = getattr(optimizer, "_learning_rate", None)
    from keras.optimizers.schedules import LearningRateSchedule

    if optimizer is None or rate is None or isinstance(rate, LearningRateSchedule):
        logging.warning(
            "%s; the learning-rate schedule is left as it is: scale it with "
            "the global batch in the script if you need to.",
            message,
        )
        return new_step
    factor = old_steps / steps_per_epoch
    old = float(np.asarray(optimizer.learning_rate))
    optimizer.learning_rate = old * factor
    logging.warning(
        "%s; learning rate %.6g -> %.6g (linear scaling with the global batch, Goyal et al. 2017).",
        message,
        old,
        old * factor,
    )
    return new_step
