"""A multi-worker strategy created after TensorFlow's runtime has started.

TensorFlow sets up collective ops between workers when its eager runtime
starts. Any earlier TensorFlow work (a tensor, a ``tf.data`` dataset,
``tf.config.list_logical_devices``) starts it, and then
``MultiWorkerMirroredStrategy`` fails with "Collective ops must be configured
at program startup". The runtime can still enable them (TensorFlow's own
``enable_collective_ops`` does, with a warning); what breaks is every object
created before: its local device ``/job:localhost/...`` becomes
``/job:worker/task:N/...``, and using it fails with "unknown device".

:func:`after_start` makes that work for what scripts build before the
strategy, tf.data datasets: each live dataset is serialized while its device
still exists and rebuilt on the worker's device once collectives are enabled.
Variables and iterators hold state that cannot be carried over; for them it
raises :class:`StrategyOrderError`, which says what to move.
"""

from __future__ import annotations

import contextlib
import gc
import os
import traceback
from collections.abc import Iterator
from typing import Any

from absl import logging

from tfdist.compat import tf_private
from tfdist.compat.tf_python import (
    data_options,
    dataset_ops,
    eager_context as context,
    framework_ops as ops,
    gen_experimental_dataset_ops,
    graph_pb2,
    iterator_ops,
    multi_worker_util,
    resource_variable_ops,
)
from tfdist.errors import TfdistError

#: The device job of everything created before collectives are enabled.
_LOCAL_JOB = "/job:localhost/"

#: What TensorFlow raises, from ``Context.configure_collective_ops``.
TF_MESSAGE = "Collective ops must be configured at program startup"


class StrategyOrderError(TfdistError, RuntimeError):
    """The multi-worker strategy was created after state it cannot carry over."""


def _caller() -> str:
    """`` (at file:line)`` of the innermost frame outside tfdist, the
    standard library and installed packages, or ""."""
    skip = (
        os.path.dirname(os.path.abspath(__file__)) + os.sep,  # tfdist
        os.path.dirname(os.path.abspath(os.__file__)) + os.sep,
    )  # stdlib
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not (
            path.startswith(skip)
            or frame.filename.startswith("<")
            or f"{os.sep}site-packages{os.sep}" in path
        ):
            return f" (at {os.path.basename(path)}:{frame.lineno})"
    return ""


def order_error(call: str, what: str) -> StrategyOrderError:
    """The error for a strategy created after ``what``, naming ``call``."""
    return StrategyOrderError(
        f"{call}{_caller()} must create the multi-worker strategy before {what}. "
        "TensorFlow's runtime had already started in this process, and "
        "collective ops between workers can only be set up before it does; "
        "tf.data datasets built earlier are carried over, variables and "
        "iterators are not. Move the strategy line up, right after the "
        "imports, and build models and optimizers inside "
        f"`with strategy.scope():` after it. TensorFlow said: {TF_MESSAGE}"
    )


def _local(tensor: Any) -> bool:
    return isinstance(tensor, ops.EagerTensor) and tensor.device.startswith(_LOCAL_JOB)


def _describe_variables(variables: list) -> str:
    names = sorted({v.name.split(":")[0] for v in variables})
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(variables)} variable(s) ({shown}), e.g. a model built before it"


def _live_state() -> tuple[list, list, list, list]:
    """Live local datasets, variables, iterators and other tensors."""
    datasets, variables, iterators, tensors = [], [], [], []
    for obj in gc.get_objects():
        if isinstance(obj, dataset_ops.DatasetV2):
            if _local(getattr(obj, "_variant_tensor_attr", None)):
                datasets.append(obj)
        elif isinstance(obj, resource_variable_ops.BaseResourceVariable):
            if _local(getattr(obj, "_handle", None)):
                variables.append(obj)
        elif isinstance(obj, iterator_ops.OwnedIterator):
            if _local(getattr(obj, "_iterator_resource", None)):
                iterators.append(obj)
        elif _local(obj):
            tensors.append(obj)
    return datasets, variables, iterators, tensors


def _held_by(datasets: list) -> set[int]:
    """Ids of the tensors the datasets keep (inputs, seeds, their variant)."""
    held = set()
    for dataset in datasets:
        for value in vars(dataset).values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                held.add(id(item))
    return held


def _serialize(dataset, call: str) -> bytes:
    """The dataset's graph, read while its device still exists."""
    policies = data_options.ExternalStatePolicy
    try:
        graph = tf_private.serialized_graph(
            dataset, external_state_policy=policies.FAIL, strip_device_assignment=True
        )
    except Exception:  # noqa: BLE001 - external state: retried below
        # A Python generator (from_generator) is external state that stays
        # valid in this process: its function is registered by a token.
        try:
            graph = tf_private.serialized_graph(
                dataset, external_state_policy=policies.WARN, strip_device_assignment=True
            )
        except Exception as error:  # Reported with the cause.
            raise order_error(
                call,
                f"a tf.data dataset that cannot be carried over ({dataset.element_spec}: {error})",
            ) from error
    data = graph.numpy()
    if _LOCAL_JOB.encode() not in data:
        return data
    # Functions inside it (from_generator's PyFunc) keep their device, which
    # is about to disappear; strip_device_assignment does not reach them.
    graph_def = graph_pb2.GraphDef.FromString(data)
    for node in graph_def.node:
        node.device = ""
    for function in graph_def.library.function:
        for node in function.node_def:
            node.device = ""
    return graph_def.SerializeToString()


@contextlib.contextmanager
def after_start(cluster_spec, task_type: str, task_id: int, call: str) -> Iterator[None]:
    """Lets ``MultiWorkerMirroredStrategy.__init__`` run in a started runtime.

    Outside it, where the runtime has not started (or collectives are already
    set up), this does nothing. Inside, it checks what was built, serializes
    the live datasets, presets TensorFlow's collective settings to the values
    the strategy is about to set (so the strategy's own call is a no-op), and
    after the strategy enabled collectives rebuilds the datasets in place.

    Args:
        cluster_spec: The cluster's ``tf.train.ClusterSpec``.
        task_type: This task's job, ``"worker"`` or ``"chief"``.
        task_id: This task's index.
        call: The user's call, named in errors.

    Raises:
        StrategyOrderError: Variables or iterators exist, a dataset cannot be
            serialized, or this TensorFlow has none of the settings used.
    """
    ctx = context.context()
    if not tf_private.context_started(ctx) or tf_private.collectives_configured(ctx):
        yield
        return
    if not tf_private.can_preset_collectives(ctx):
        raise order_error(call, "any other TensorFlow work")
    gc.collect()  # An iterator in a dead cycle must not count as live.
    datasets, variables, iterators, tensors = _live_state()
    if variables:
        raise order_error(call, _describe_variables(variables))
    if iterators:
        raise order_error(call, f"{len(iterators)} dataset iterator(s) (iter(dataset))")
    held = _held_by(datasets)
    stale = [t for t in tensors if id(t) not in held]
    # Every live dataset, not only the outermost: a script may still use
    # the one it batched. Each graph holds its inputs' data, so over
    # in-memory arrays every rebuilt stage holds its own copy of them.
    graphs = [_serialize(dataset, call) for dataset in datasets]
    del tensors
    # The values MultiWorkerMirroredStrategy passes to configure_collective_ops,
    # which then returns at once instead of refusing a started runtime.
    tf_private.preset_collectives(
        ctx,
        leader=multi_worker_util.collective_leader(cluster_spec, task_type, task_id),
        device_filters=(f"/job:{task_type}/task:{task_id}",),
    )
    yield
    for dataset, graph in zip(datasets, graphs):
        tf_private.set_dataset_variant(
            dataset, gen_experimental_dataset_ops.dataset_from_graph(graph)
        )
    logging.warning(
        "tfdist: %s ran after TensorFlow's runtime had started; collective ops "
        "were enabled late and %d tf.data dataset(s) built before were rebuilt "
        "on this worker's device.%s",
        call,
        len(datasets),
        f" {len(stale)} other tensor(s) created before it (e.g. "
        f"{stale[0].dtype.name} {stale[0].shape}) cannot be used after it: "
        "create them after the strategy."
        if stale
        else "",
    )
