"""Every TensorFlow internal (``tensorflow.python``, ``tensorflow.core``,
``tensorflow.compiler``, ``tensorflow.tsl``) tfdist uses, by one name each.

tf.distribute's public API does not reach the coordination service, the
collective launcher or dataset graphs that tfdist needs; the private modules
that do move between TF versions. This table is the only place that knows
where they are: tfdist code imports by table name,

    from tfdist.compat.tf_python import eager_context as context

and the name resolves on first use (PEP 562 ``__getattr__``) to the first
candidate location that exists, then stays cached. Importing this module
imports no TensorFlow; importing a name imports only that name's module.

A location is ``"module.path:attr"`` (``attr`` may be dotted) or
``"module.path"`` for a whole module. Version notes below were checked
against TF 2.16.2, 2.17.1, 2.18.1, 2.19.1, 2.20.0 and 2.21.0. A name that
resolves nowhere raises :class:`InternalNotFound` naming the name, every
location tried and the installed versions; :func:`unresolved` lists such
names without raising.
"""

from __future__ import annotations

from typing import Any

from tfdist.compat._locate import InternalNotFound, Table

__all__ = ["InternalNotFound", "LOCATIONS", "unresolved"]

# Entries: tfdist name -> candidates, tried in order. Keep each comment: what
# tfdist uses it for.
LOCATIONS: dict[str, tuple[str, ...]] = {
    # --- tensorflow.python.eager ----------------------------------------------
    # The eager context: coordination-service key/values (preemption,
    # chief_save), collective health checks and aborts (watchdog, Horovod),
    # enabling collectives late (late_start, multi_worker), barriers (rejoin,
    # exit_barrier).
    "eager_context": ("tensorflow.python.eager.context",),
    # GradientTape's defining module: ps_patches wraps GradientTape.gradient.
    "backprop": ("tensorflow.python.eager.backprop",),
    # --- tensorflow.python.distribute ----------------------------------------
    # is_chief, id_in_cluster, coordination_leader, collective_leader.
    "multi_worker_util": ("tensorflow.python.distribute.multi_worker_util",),
    # check_destinations/get_devices_from: compression's CrossDeviceOps picks
    # its reduce device as ReductionToOneDevice does.
    "cross_device_ops": ("tensorflow.python.distribute.cross_device_ops",),
    # CollectiveReplicaLauncher and CollectiveKeys (parallel, Horovod).
    "cross_device_utils": ("tensorflow.python.distribute.cross_device_utils",),
    # collective_util.Options for the launchers above.
    "collective_util": ("tensorflow.python.distribute.collective_util",),
    # Parameter-server sharded variables (ps_patches differentiates per shard).
    "ShardedVariable": ("tensorflow.python.distribute.sharded_variable:ShardedVariable",),
    # tfdist's SlurmClusterResolver subclasses TF's.
    "slurm_cluster_resolver": (
        "tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver",
    ),
    # PreemptionCheckpointHandler, patched by training.tf_handler.
    "failure_handling": ("tensorflow.python.distribute.failure_handling.failure_handling",),
    # --- tensorflow.python.ops / framework / data / trackable / training -------
    # ResourceVariable without tf.Variable's distribution hooks (counters,
    # collective buffers), and BaseResourceVariable for isinstance checks.
    "resource_variable_ops": ("tensorflow.python.ops.resource_variable_ops",),
    # all_reduce_v2 with a min/max/product merge op (Horovod's collectives).
    "collective_ops": ("tensorflow.python.ops.collective_ops",),
    # variable_creator_scope: Horovod creates variables eagerly on a retrace
    # (with resource_variable_ops.default_variable_creator_v2).
    "variable_scope": ("tensorflow.python.ops.variable_scope",),
    # dataset_from_graph: late_start rebuilds datasets on the collective job.
    "gen_experimental_dataset_ops": ("tensorflow.python.ops.gen_experimental_dataset_ops",),
    # DatasetV2 / OwnedIterator / ExternalStatePolicy, for late_start's checks.
    "dataset_ops": ("tensorflow.python.data.ops.dataset_ops",),
    "iterator_ops": ("tensorflow.python.data.ops.iterator_ops",),
    "data_options": ("tensorflow.python.data.ops.options",),
    # EagerTensor for late_start's device checks.
    "framework_ops": ("tensorflow.python.framework.ops",),
    # Error codes (UNAVAILABLE, DEADLINE_EXCEEDED) for abort_collective_ops.
    "framework_errors": ("tensorflow.python.framework.errors",),
    # Trackable: the resumable iterator saves its position in checkpoints.
    "trackable_base": ("tensorflow.python.trackable.base",),
    # TF's ClusterSpec class (Slurm, Horovod); the public name is the same class.
    "ClusterSpec": (
        "tensorflow.python.training.server_lib:ClusterSpec",
        "tensorflow:train.ClusterSpec",
    ),
    # --- protobufs --------------------------------------------------------------
    # GraphDef, to inspect and rebuild a dataset's graph (data, late_start).
    "graph_pb2": ("tensorflow.core.framework.graph_pb2",),
    # ServerDef for Horovod's in-process server.
    "tensorflow_server_pb2": ("tensorflow.core.protobuf.tensorflow_server_pb2",),
    # CoordinationServiceConfig for multi-worker. TF 2.19-2.21: under XLA's
    # tsl; TF 2.16-2.18: tensorflow/tsl (2.18 already has the XLA package,
    # without this module).
    "coordination_config_pb2": (
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
        "tensorflow.tsl.protobuf.coordination_config_pb2",
    ),
}

_table = Table(__name__, LOCATIONS)


def __getattr__(name: str) -> Any:
    """Resolves a table name on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not in :data:`LOCATIONS`.
        InternalNotFound: No candidate location exists on this TensorFlow.
    """
    return _table.resolve(name)


def __dir__() -> list[str]:
    return _table.dir(globals())


def unresolved() -> dict[str, str]:
    """Table names that resolve nowhere on the installed TensorFlow, with why.

    Imports TensorFlow. Empty when tfdist supports this TensorFlow.
    """
    return _table.unresolved()
