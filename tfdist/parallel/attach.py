"""Arranging a strategy's replicas as a (data, tensor) mesh: :func:`attach`.

Besides the mesh (:class:`~tfdist.parallel.mesh.Mesh`), it builds the
collectives of each local replica (one TensorFlow ``CollectiveReplicaLauncher``
per group and device, see :mod:`tfdist.parallel.collectives`) before any
``tf.function`` traces them, and installs the gradient and saving hooks of
sharded weights (:mod:`~tfdist.parallel.grads`, :mod:`~tfdist.parallel.saving`).
"""

from __future__ import annotations

from typing import Any

from tfdist.errors import ConfigError
from tfdist.parallel import collectives, grads, saving
from tfdist.parallel.mesh import Mesh
from tfdist.record import record_of

__all__ = ["attach"]

_SOURCE = "strategy_from_config"


def _model_parallel(value: object) -> int:
    if isinstance(value, bool) or value is None:
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE)
    try:
        number = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE) from None
    if (number != value and not isinstance(value, str)) or number < 1:
        raise ConfigError("model_parallel", value, "an integer >= 1", source=_SOURCE)
    return number


def attach(strategy: Any, model_parallel: object, always: bool = False) -> Mesh | None:
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
    grads.install()
    saving.install()
    record_of(strategy).mesh = collectives.Runtime(strategy, mesh)
    return mesh
