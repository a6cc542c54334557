"""tfdist.parallel's part in a strategy's life (see :mod:`tfdist.plugins`).

Keras distributions train unsharded beside a tf.distribute strategy on
TensorFlow, silently: :mod:`~tfdist.parallel.guard` refuses them in either
order. ``model_parallel=T`` arranges the replicas as a mesh
(:mod:`~tfdist.parallel.mesh`).
"""

from __future__ import annotations

from typing import Any

from tfdist.parallel import guard
from tfdist.parallel import mesh as mesh_lib


def refuse(kind: str) -> None:
    guard.check_no_distribution(kind)


def install(strategy: Any) -> None:
    guard.install()
    guard.check_no_distribution(strategy.kind)


def created(strategy: Any) -> None:
    guard.register_strategy(strategy)


def attach(strategy: Any, model_parallel: Any) -> None:
    mesh_lib.attach(strategy, model_parallel)


def describe(strategy: Any) -> str | None:
    return mesh_lib.describe_line(strategy)
