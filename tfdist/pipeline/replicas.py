"""Data parallelism across pipeline replicas: ``R`` copies of a ``P``-stage
pipeline on ``R x P`` processes.

Process ``rank = replica * P + stage`` runs one stage of one replica
(consecutive ranks form a pipeline, as Megatron's and PyTorch's meshes order
pipeline ranks). Each replica takes its ``1 / R`` of every global batch; at
the end of a step, each stage's gradients are averaged over the ``R``
replicas of that stage, through tfdist's aggregators (so any compression
setting applies to this all-reduce, with its error feedback), over a ring of
p2p links (:class:`tfdist.transport.ring.RingGroup`) between those
processes. The pipelines' activations never cross replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat.keras_src import standardize_dtype
from tfdist.compression.aggregate import Aggregator, Item, scale_gradient
from tfdist.errors import ConfigError
from tfdist.transport.host import HostComm

__all__ = ["Grid", "StageReplicas", "aggregator_for"]

SOURCE = "tfdist.pipeline"


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where each process of a ``replicas x stages`` job sits.

    Attributes:
        stages: Processes per pipeline (``P``): each runs one stage, or
            ``chunks`` of them with the interleaved schedule.
        replicas: Pipeline replicas (``R``), the data-parallel degree.
        chunks: Stages per process (``v``): process ``k`` runs stages ``k,
            k + P, ...``, so the last process sends to the first.
    """

    stages: int
    replicas: int = 1
    chunks: int = 1

    @property
    def size(self) -> int:
        """Processes in the job."""
        return self.stages * self.replicas

    def rank(self, replica: int, stage: int) -> int:
        """The process that runs ``stage`` of ``replica``."""
        return replica * self.stages + stage

    def place(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of process ``rank``."""
        return divmod(rank, self.stages)

    def name(self, rank: int) -> str:
        """How messages name process ``rank``."""
        replica, stage = self.place(rank)
        return f"stage {stage}" if self.replicas == 1 else f"stage {stage} of replica {replica}"

    def names(self) -> list[str]:
        """Every process's name, by rank."""
        return [self.name(rank) for rank in range(self.size)]

    def pipeline_peers(self, rank: int) -> dict[int, int]:
        """The neighbouring processes' ranks in the pipeline, by their place
        in it (with several chunks a process, a ring: the last process's
        stages send to the first's)."""
        replica, stage = self.place(rank)
        near = {stage - 1, stage + 1}
        if self.chunks > 1:
            near = {(stage - 1) % self.stages, (stage + 1) % self.stages}
        return {s: self.rank(replica, s) for s in near if 0 <= s < self.stages and s != stage}

    def ring_peers(self, rank: int) -> dict[int, int]:
        """The ring neighbours among this stage's replicas: rank by replica."""
        replica, stage = self.place(rank)
        if self.replicas == 1:
            return {}
        near = {(replica - 1) % self.replicas, (replica + 1) % self.replicas}
        return {r: self.rank(r, stage) for r in near}

    def peers(self, rank: int) -> set[int]:
        """Every process ``rank`` links with."""
        return set(self.pipeline_peers(rank).values()) | set(self.ring_peers(rank).values())


def aggregator_for(compression: Any, error_feedback: bool | None = None) -> Aggregator | None:
    """The aggregator of a compression setting (None: plain float32 sums).

    Raises:
        ConfigError: As :func:`tfdist.compression.factory.fixed_aggregator`
            (``"auto"`` too: a pipeline's replicas take a fixed setting).
    """
    if compression is None or compression == "none":
        return None
    from tfdist.compression.factory import fixed_aggregator

    return fixed_aggregator(compression, error_feedback)


class StageReplicas:
    """The mean of one stage's gradients over its replicas.

    Args:
        group: The ring of this stage's replicas (``allreduce``,
            ``allgather``, ``allgatherv``, ``size``, ``rank``).
        variables: The stage's trainable variables, in the order of the
            gradients :meth:`mean` gets.
        aggregator: A tfdist aggregator (a compression setting), or None to
            send float32 sums.
    """

    def __init__(self, group: Any, variables: Sequence[Any], aggregator: Aggregator | None) -> None:
        self.group = group
        self.replicas = int(group.size)
        self.aggregator = aggregator
        self.variables = list(variables)
        #: The aggregator's state (error-feedback residuals, PowerSGD's Q),
        #: per variable index: this replica's own, as on a strategy's replica.
        self.state: dict[int, dict[str, Any]] = {}
        if aggregator is not None:
            for index, v in enumerate(self.variables):
                specs = aggregator.state_specs(tuple(v.shape), standardize_dtype(v.dtype), index)
                for spec in specs:
                    self.state.setdefault(index, {})[spec.name] = tf.Variable(
                        _initial(spec), trainable=False, name=f"{spec.name}_{index}"
                    )

    def mean(self, grads: Sequence[Any], step: int) -> list[Any]:
        """Each gradient averaged over the replicas (None stays None)."""
        comm = HostComm(self.group)
        at = [i for i, g in enumerate(grads) if g is not None]
        if self.aggregator is None:
            summed = comm.all_reduce([grads[i] for i in at])
        else:
            items = [Item(grads[i], i, self.state.get(i, {})) for i in at]
            summed = self.aggregator.aggregate(items, tf.constant(step, tf.int64), comm)
        out: list[Any] = [None] * len(grads)
        for i, g in zip(at, summed):
            out[i] = scale_gradient(g, 1.0 / self.replicas)
        return out

    def mean_of(self, value: float) -> float:
        """A number (the step's loss) averaged over the replicas."""
        (total,) = self.group.allreduce(np.array([value], np.float64))
        return float(total[0]) / self.replicas

    def close(self) -> None:
        """Closes the links to this stage's other replicas."""
        self.group.close()


def _initial(spec: Any) -> Any:
    if spec.initializer == "zeros":
        return tf.zeros(spec.shape, spec.dtype)
    return spec.initializer(spec.shape, spec.dtype)


def check_replicas(replicas: Any) -> int:
    """``replicas`` as given, if it is an integer >= 1.

    Raises:
        ConfigError: Naming the value.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError("replicas", replicas, "an integer >= 1", source=SOURCE)
    return replicas
