"""``ParameterServerStrategy`` with partitioners by name, and the server side of
a parameter-server job (:func:`serve`): ps and worker tasks serve the chief.
"""

from __future__ import annotations

import sys
from typing import Any

import tensorflow as tf
from absl import logging

from tfdist import plugins, spec as spec_lib
from tfdist.spec.detect import Choice
from tfdist.strategies.base import TfdistStrategy


def _partitioner(value: Any, num_ps: int):
    if not isinstance(value, str):
        return value
    kind, _, number = value.partition(":")
    parts = tf.distribute.experimental.partitioners
    if kind == "fixed":
        return parts.FixedShardsPartitioner(int(number))
    if kind == "min_size":
        # TF's default max_shards=1 would never shard: allow one per ps.
        return parts.MinSizePartitioner(min_shard_bytes=int(number), max_shards=max(1, num_ps))
    return parts.MaxSizePartitioner(max_shard_bytes=int(number))


class ParameterServerStrategy(TfdistStrategy, tf.distribute.experimental.ParameterServerStrategy):
    """``ParameterServerStrategy`` that Keras 3 can train under.

    Creating one installs :mod:`tfdist.training.ps.patches` (atomic increments on the
    ps, gradients of sharded variables). Train with :func:`tfdist.fit`.
    """

    kind = "parameter_server"

    def __init__(
        self,
        cluster_resolver,
        variable_partitioner=None,
        *,
        compression: Any = None,
        choice: Choice | None = None,
    ):
        num_ps = len(cluster_resolver.cluster_spec().as_dict().get("ps", ()))
        super().__init__(
            cluster_resolver, variable_partitioner=_partitioner(variable_partitioner, num_ps)
        )
        self._set_up(compression, choice)
        # Keras 3's fixes for this strategy (tfdist.training.ps.patches).
        plugins.run("parameter_server", self)


def resolver_of(cfg: spec_lib.TFConfig):
    """A SimpleClusterResolver of ``cfg``'s cluster and task."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in cfg.cluster.items()}),
        task_type=cfg.task_type,
        task_id=cfg.task_index,
        rpc_layer=cfg.rpc_layer or "grpc",
    )


def serve(cfg: spec_lib.TFConfig) -> None:
    """Runs this ps or worker task as a server of a parameter-server job.

    The chief drives training; ps and worker tasks only serve it. This never
    returns: the chief's side ends the job. On the preemption signal the
    server serves on until the coordinator has saved, then exits with code
    143 (:mod:`tfdist.training.ps.preemption`).
    """
    logging.info(
        "tfdist: %s serves the parameter-server cluster; the chief runs the training.", cfg.task_id
    )
    print(
        f"tfdist: {cfg.task_id} is serving the parameter-server cluster at {cfg.task_address}",
        file=sys.stderr,
        flush=True,
    )
    server = tf.distribute.Server(
        resolver_of(cfg).cluster_spec(),
        job_name=cfg.task_type,
        task_index=cfg.task_index,
        protocol=cfg.rpc_layer or "grpc",
        start=True,
    )
    # tfdist.training.plugin serves until preempted; server.join() would
    # never return, so no Python signal handler would run.
    if not plugins.run("serve", cfg.task_type, cfg.task_index, server):
        server.join()
