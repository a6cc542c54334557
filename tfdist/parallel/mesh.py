"""The (data, tensor) mesh of a strategy's replicas.

``strategy_from_config(model_parallel=T)`` arranges the N replicas of a
Mirrored or MultiWorkerMirrored strategy as a DP x T mesh, DP = N / T, with
the tensor groups innermost: replica ``r`` is at data index ``r // T`` and
tensor index ``r % T``. Replicas are numbered host by host, so a tensor group
sits on one host's devices whenever T divides a host's replica count, and the
activations' collectives stay off the network; only the data-parallel
gradient sums cross it.

:func:`tfdist.parallel.attach.attach` puts a mesh on a strategy. This module
imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.errors import ConfigError
from tfdist.record import record_of

__all__ = ["Mesh", "mesh_of", "describe_line"]

_SOURCE = "strategy_from_config"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """``num_replicas`` replicas as ``dp`` data-parallel groups of ``tp``.

    Attributes:
        num_replicas: The replicas in sync (N).
        tp: The tensor-parallel group size (T).
    """

    num_replicas: int
    tp: int

    def __post_init__(self):
        if self.tp < 1 or self.num_replicas % self.tp:
            raise ConfigError(
                "model_parallel",
                self.tp,
                f"a divisor of the {self.num_replicas} replicas",
                source=_SOURCE,
            )

    @property
    def dp(self) -> int:
        """The data-parallel size: N / T."""
        return self.num_replicas // self.tp

    def coords(self, replica: int) -> tuple[int, int]:
        """(data index, tensor index) of a replica."""
        return divmod(int(replica), self.tp)

    def tp_group(self, d: int) -> list[int]:
        """The replicas of tensor group ``d``, in tensor-index order."""
        return list(range(d * self.tp, (d + 1) * self.tp))

    def dp_group(self, t: int) -> list[int]:
        """The replicas that hold the same shards (tensor index ``t``)."""
        return [d * self.tp + t for d in range(self.dp)]

    def describe(self) -> str:
        groups = " ".join(str(self.tp_group(d)) for d in range(self.dp))
        return f"data {self.dp} x tensor {self.tp}; tensor groups {groups}"


def mesh_of(strategy: Any) -> Mesh | None:
    """The mesh attached to ``strategy``; None without one (or with T = 1)."""
    runtime = record_of(strategy).mesh
    return runtime.mesh if runtime is not None else None


def describe_line(strategy: Any) -> str | None:
    """The ``describe()`` line of a strategy's mesh, or None."""
    mesh = mesh_of(strategy)
    return f"  mesh: {mesh.describe()}" if mesh is not None else None
