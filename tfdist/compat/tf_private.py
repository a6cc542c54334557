"""TensorFlow objects' private attributes that tfdist reads or sets, by name.

TensorFlow 2.19 to 2.21 keep these only under a private name (no public API
gives the same thing). Every such reach outside tfdist/compat goes through a
function here, so a renamed attribute fails in one place. The objects are
taken as arguments: importing this module imports no TensorFlow.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = [
    "can_preset_collectives",
    "collectives_configured",
    "context_started",
    "launcher_all_gather",
    "launcher_all_reduce",
    "manager_saving_to",
    "preset_collectives",
    "serialized_graph",
    "set_dataset_variant",
    "set_latest_checkpoint",
    "shared_name",
    "track_trackable",
]

#: The eager context's collective settings that MultiWorkerMirroredStrategy
#: passes to ``configure_collective_ops``.
_COLLECTIVE_FIELDS = (
    "_collective_leader",
    "_collective_scoped_allocator_enabled_ops",
    "_collective_use_nccl_communication",
    "_collective_device_filters",
)


# The eager context.


def context_started(ctx: Any) -> bool:
    """Whether TensorFlow's eager runtime (``context.context()``) has started."""
    # TF exposes no other test of a started runtime.
    return ctx._context_handle is not None


def collectives_configured(ctx: Any) -> bool:
    """Whether collective ops are set up in the eager context."""
    return getattr(ctx, "_collective_leader", None) is not None


def can_preset_collectives(ctx: Any) -> bool:
    """Whether this TensorFlow has every setting :func:`preset_collectives` sets."""
    return all(hasattr(ctx, field) for field in _COLLECTIVE_FIELDS)


def preset_collectives(ctx: Any, leader: str, device_filters: tuple[str, ...]) -> None:
    """Presets the values MultiWorkerMirrored gives ``configure_collective_ops``
    (which then returns at once instead of refusing a started runtime)."""
    # What MultiWorkerMirrored gives configure_collective_ops; no setter.
    ctx._collective_leader = leader
    # As above: the scoped-allocator ops, NCCL off, the device filters.
    ctx._collective_scoped_allocator_enabled_ops = ("CollectiveReduce",)
    ctx._collective_use_nccl_communication = False
    ctx._collective_device_filters = device_filters


# tf.data.


def serialized_graph(dataset: Any, **options: Any) -> Any:
    """The dataset's graph, serialized (a string tensor)."""
    # TF's only serialized form of a dataset, and its only way to carry a
    # dataset over a runtime restart.
    return dataset._as_serialized_graph(**options)


def set_dataset_variant(dataset: Any, variant: Any) -> None:
    """Points ``dataset`` at another variant tensor (its rebuilt graph)."""
    # Points the dataset at its rebuilt graph; no public API.
    dataset._variant_tensor_attr = variant


# Collective launchers (cross_device_utils.CollectiveReplicaLauncher).


def launcher_all_gather(launcher: Any, value: Any) -> Any:
    """Every member's ``value``, concatenated on axis 0 in member order."""
    # TF's collective launcher has no public all-gather.
    return launcher._all_gather(value, None)


def launcher_all_reduce(launcher: Any, value: Any, merge_op: str) -> Any:
    """``value`` reduced with ``merge_op`` (Min, Max, Mul...) over the
    launcher's group, keyed and ordered like its own all-reduces."""
    import tensorflow as tf

    from tfdist.compat.tf_python import collective_ops

    # TF's launcher has no Min/Max/Product: its device, group size, group
    # key, next instance key and ordering token (keeps the collectives in
    # order), as its all_reduce uses them.
    with tf.device(launcher._device):
        return collective_ops.all_reduce_v2(
            value,
            launcher._group_size,
            launcher._group_key,
            launcher._next_instance_key(),
            merge_op=merge_op,
            ordering_token=launcher._get_ordering_token(),
        )


# Tracking and checkpoints.


def track_trackable(owner: Any, trackable: Any, name: str, overwrite: bool = True) -> None:
    """Makes ``trackable`` a named checkpoint dependency of ``owner``."""
    # TF's tracking API: checkpoint dependencies outside Keras's variable list.
    owner._track_trackable(trackable, name=name, overwrite=overwrite)


def shared_name(variable: Any) -> str:
    """A variable's shared name, as TF's checkpointing reads it."""
    # TF's checkpointing reads _shared_name; a wrapper forwards its variable's.
    return variable._shared_name


@contextlib.contextmanager
def manager_saving_to(manager: Any, directory: str) -> Iterator[None]:
    """A ``tf.train.CheckpointManager`` saves into ``directory`` meanwhile,
    deleting none of its older checkpoints; its bookkeeping is put back after.
    """
    # CheckpointManager has no public way to save elsewhere: its directory,
    # its file prefix, its deletion queue and its latest path.
    saved = (
        manager._directory,
        manager._checkpoint_prefix,
        manager._maybe_delete,
        manager._latest_checkpoint,
    )
    manager._directory = directory
    manager._checkpoint_prefix = os.path.join(directory, os.path.basename(saved[1]))
    # Its sweep must not delete the older checkpoints of its own directory.
    manager._maybe_delete = collections.OrderedDict()
    try:
        yield
    finally:
        (
            manager._directory,
            manager._checkpoint_prefix,
            manager._maybe_delete,
            manager._latest_checkpoint,
        ) = saved


def set_latest_checkpoint(manager: Any, path: str) -> None:
    """Sets a ``tf.train.CheckpointManager``'s latest checkpoint."""
    # CheckpointManager's latest path has no setter.
    manager._latest_checkpoint = path
