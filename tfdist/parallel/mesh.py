"""The (data, tensor) mesh of a strategy's replicas.

``strategy_from_config(model_parallel=T)`` arranges the N replicas of a
Mirrored or MultiWorkerMirrored strategy as a DP x T mesh, DP = N / T, with
the tensor groups innermost: replica ``r`` is at data index ``r // T`` and
tensor index ``r % T``. Replicas are numbered host by host, so a tensor group
sits on one host's devices whenever T divides a host's replica count, and the
activations' collectives stay off the network; only the data-parallel
gradient sums cross it.

:func:`attach` also builds the collectives of each local replica (one
TensorFlow ``CollectiveReplicaLauncher`` per group and device, see
:mod:`tfdist.parallel.collectives`), before any ``tf.function`` traces them.
This module imports no TensorFlow at import time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfdist.errors import ConfigError
from tfdist.record import record_of

__all__ = ["Mesh", "attach", "mesh_of", "describe_line"]

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


def _model_parallel(value: Any) -> int:
    if isinstance(value, bool) or value is None:
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE)
    try:
        number = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE) from None
    if (number != value and not isinstance(value, str)) or number < 1:
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE)
    return number


def attach(strategy: Any, model_parallel: Any, always: bool = False) -> Mesh | None:
    """Arranges ``strategy``'s replicas as a (data, tensor) mesh.

    Args:
        strategy: A tfdist Mirrored or MultiWorkerMirrored strategy, just
            built (outside its scope).
        model_parallel: T, the tensor-parallel group size.
        always: Attach a mesh for T = 1 too (a keras.distribution layout may
            split weights over the data-parallel group alone).

    Returns:
        The mesh, or None for T = 1 without ``always`` (nothing is attached).

    Raises:
        ConfigError: T is not a positive integer dividing the replicas, or
            the strategy is not Mirrored or MultiWorkerMirrored.
    """
    tp = _model_parallel(model_parallel)
    kind = getattr(strategy, "kind", type(strategy).__name__)
    if tp == 1 and not always:
        record_of(strategy).mesh = None
        return None
    if kind not in ("mirrored", "multi_worker_mirrored"):
        raise ConfigError(
            "model_parallel",
            tp if tp > 1 else "a layout",
            f"1 under the {kind} strategy",
            source=_SOURCE,
            hint="Tensor parallelism runs under 'mirrored' and 'multi_worker_mirrored'.",
        )
    mesh = Mesh(strategy.num_replicas_in_sync, tp)
    from tfdist.parallel import collectives, grads, saving

    grads.install()
    saving.install()
    record_of(strategy).mesh = collectives.Runtime(strategy, mesh)
    return mesh
