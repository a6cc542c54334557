"""tfdist.parallel's part in a strategy's life (see :mod:`tfdist.plugins`).

``model_parallel=T`` arranges the replicas as a mesh
(:mod:`~tfdist.parallel.mesh`).
"""

from __future__ import annotations

from typing import Any

from tfdist.parallel import mesh as mesh_lib
from tfdist.parallel.attach import attach as attach_mesh


def attach(strategy: Any, model_parallel: Any) -> None:
    attach_mesh(strategy, model_parallel)


def describe(strategy: Any) -> str | None:
    return mesh_lib.describe_line(strategy)
