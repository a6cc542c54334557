"""How a weight is split over the mesh: :class:`ShardSpec`, kept on the
variable (a :mod:`tfdist.record` slot) and found with :func:`spec_of`.

Below the collectives and the sharded weights (:mod:`tfdist.parallel.sharding`),
which both read it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from tfdist.parallel.mesh import Mesh
from tfdist.record import attach, slot

__all__ = ["ShardSpec", "TENSOR", "DATA", "spec_of", "is_sharded", "mark", "inner_variable"]


#: The mesh axis a weight dimension is split over.
TENSOR, DATA = "tensor", "data"


@dataclasses.dataclass(frozen=True, eq=False)
class ShardSpec:
    """How a weight is split over the mesh.

    Each split names a weight dimension and the mesh axis it is divided
    over: the tensor group (``"tensor"``, T parts, by tensor index) or the
    data-parallel group (``"data"``, DP parts, by data index). The replica
    at mesh coordinates (d, t) holds the block of every split dimension at
    its index. tfdist.parallel's layers split one dimension over the tensor
    group; a keras.distribution layout may split one over each axis.

    Attributes:
        full_shape: The full weight's shape.
        runtime: The strategy's mesh runtime.
        strategy: The strategy the weight lives under.
        splits: ``(dimension, axis)`` pairs, at most one per axis.
        path: The weight's path, for messages (None: the layer names it).
        layout: The layout it came from, for messages and reports.
    """

    full_shape: tuple[int, ...]
    runtime: Any
    strategy: Any
    splits: tuple[tuple[int, str], ...]
    path: str | None = None
    layout: tuple | None = None

    @classmethod
    def on_tensor_axis(
        cls, axis: int, full_shape: tuple[int, ...], runtime: Any, strategy: Any
    ) -> ShardSpec:
        """Split on ``axis`` over the tensor group (tfdist.parallel's layers)."""
        return cls(tuple(full_shape), runtime, strategy, ((axis, TENSOR),))

    @property
    def mesh(self) -> Mesh:
        return self.runtime.mesh

    @property
    def axis(self) -> int:
        """The first split dimension."""
        return self.splits[0][0]

    @property
    def tp(self) -> int:
        """The number of parts of the first split dimension."""
        return self.parts(self.splits[0][1])

    def parts(self, kind: str) -> int:
        """How many parts a split over mesh axis ``kind`` has."""
        return self.mesh.tp if kind == TENSOR else self.mesh.dp

    @property
    def over_data(self) -> bool:
        """Whether the data-parallel group holds different blocks: then each
        block's gradient is summed over every replica as the full weight is
        gathered back (FSDP), not by the optimizer's data-parallel sum."""
        return any(kind == DATA for _, kind in self.splits)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for dim, kind in self.splits:
            shape[dim] //= self.parts(kind)
        return tuple(shape)

    def index(self, replica: int) -> tuple[int, ...]:
        """The block a global replica holds: its index along each split."""
        d, t = self.mesh.coords(replica)
        return tuple(t if kind == TENSOR else d for _, kind in self.splits)

    def blocks(self) -> list[tuple[int, ...]]:
        """Every block's index."""
        return list(itertools.product(*(range(self.parts(k)) for _, k in self.splits)))

    def slices(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        """Where the block of index ``index`` lies in the full value."""
        where = [slice(None)] * len(self.full_shape)
        for (dim, kind), i in zip(self.splits, index):
            width = self.full_shape[dim] // self.parts(kind)
            where[dim] = slice(i * width, (i + 1) * width)
        return tuple(where)

    def owner(self, index: tuple[int, ...]) -> int:
        """The first global replica holding the block of index ``index``."""
        return next(r for r in range(self.mesh.num_replicas) if self.index(r) == index)

    def block(self, value: Any, replica: int) -> Any:
        """The block of a full value (numpy array or tensor) ``replica`` holds."""
        return value[self.slices(self.index(replica))]

    def assemble(self, parts: dict, concat: Any) -> Any:
        """The full value from one block per index (``concat(list, axis)``)."""

        def join(prefix: tuple[int, ...]) -> Any:
            if len(prefix) == len(self.splits):
                return parts[prefix]
            dim, kind = self.splits[len(prefix)]
            return concat([join(prefix + (i,)) for i in range(self.parts(kind))], dim)

        return join(())

    def local_cover(self, first: int, local: int) -> dict | None:
        """Local component positions holding every block once, by block
        index, when this process's ``local`` replicas (the first global one
        ``first``) hold them all; else None. Processes may differ: see
        :meth:`every_process_covers`."""
        found: dict = {}
        for i in range(local):
            found.setdefault(self.index(first + i), i)
        return found if len(found) == len(self.blocks()) else None

    def every_process_covers(self, local: int) -> bool:
        """Whether every process (each with ``local`` replicas, as under
        MultiWorkerMirrored) holds every block. Full values are read locally
        only then: if some processes read locally while the others join a
        gather, the gather hangs."""
        processes = self.mesh.num_replicas // local
        return all(self.local_cover(w * local, local) is not None for w in range(processes))

    def describe_weight(self) -> str:
        """The weight as messages name it: path, full shape and split."""
        where = ", ".join(
            f"dim {dim} over the {kind} axis ({self.parts(kind)})" for dim, kind in self.splits
        )
        name = f"{self.path} " if self.path else ""
        return f"{name}(full shape {self.full_shape}, split: {where})"


def inner_variable(variable: Any) -> Any:
    """The tf.Variable behind a Keras variable (a MirroredVariable here)."""
    inner = getattr(variable, "_value", None)
    return inner if inner is not None else variable


def spec_of(variable: Any) -> ShardSpec | None:
    """The ShardSpec of a Keras variable (or of its tf value), or None."""
    spec = slot(variable, ShardSpec)
    if spec is None:
        # A Keras variable's backing tf.Variable may hold the mark.
        spec = slot(getattr(variable, "_value", None), ShardSpec)
    return spec


def is_sharded(variable: Any) -> bool:
    return spec_of(variable) is not None


def mark(variable: Any, spec: ShardSpec) -> None:
    attach(variable, spec)
    inner = getattr(variable, "_value", None)
    if inner is not None and hasattr(inner, "__dict__"):
        attach(inner, spec)
