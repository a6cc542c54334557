"""What a ``keras.distribution`` layout did to each weight of a model.

:func:`report` lists every weight with its layout, its block's shape, how
it runs and the bytes one device holds for it, so that a user sees that the
layout map was honoured (and which weights it left whole) without reading
variables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tfdist.compat import keras_private
from tfdist.parallel import sharding

__all__ = ["WeightRow", "LayoutReport", "report"]

#: How a weight runs.
REPLICATED = "replicated"
#: Gathered for its (leaf) layer's call and again for the backward pass.
GATHERED = "gathered when used (FSDP)"
#: Gathered for its layer's call and kept for the backward pass (a layer
#: calling sublayers that have weights: its call is not recomputed).
GATHERED_KEPT = "gathered when used, kept for backward (FSDP)"
#: A shard of one of tfdist.parallel's layers (ColumnParallelDense, ...).
PARALLEL_LAYER = "tensor-parallel (tfdist.parallel layer)"


@dataclasses.dataclass(frozen=True)
class WeightRow:
    """One weight of a model under a layout.

    Attributes:
        path: The weight's path (what the layout map matched).
        shape: Its full shape.
        layout: The layout's axes; None where no rule matched.
        block: The shape each device holds.
        how: ``"replicated"``; ``"tensor-parallel (column)"``, ``"(row)"``
            or ``"(vocabulary)"`` (an embedding table;
            :mod:`~tfdist.distribution.megatron`: the block over the model
            axis is computed with, a batch-axis split still gathered);
            ``"gathered when used (FSDP)"`` (gathered again for the backward
            pass); ``"gathered when used, kept for backward (FSDP)"`` (its
            layer calls sublayers with weights); or ``"tensor-parallel
            (tfdist.parallel layer)"`` (a shard of ColumnParallelDense, ...).
        bytes_per_device: The bytes of the block one device holds.
        full_bytes: The bytes of the whole weight.
    """

    path: str
    shape: tuple[int, ...]
    layout: tuple | None
    block: tuple[int, ...]
    how: str
    bytes_per_device: int
    full_bytes: int


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """Every weight of a model, and the totals one device holds."""

    rows: tuple[WeightRow, ...]

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def full_bytes(self) -> int:
        return sum(r.full_bytes for r in self.rows)

    def row(self, path: str) -> WeightRow:
        """The row of the weight at ``path``.

        Raises:
            KeyError: No weight has that path.
        """
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"no weight at {path!r}; the paths are {[r.path for r in self.rows][:8]}...")

    def __str__(self) -> str:
        header = ("path", "shape", "layout", "block", "how", "bytes/device")
        lines = [header] + [
            (
                r.path,
                str(r.shape),
                str(r.layout) if r.layout else "-",
                str(r.block),
                r.how,
                f"{r.bytes_per_device:,}",
            )
            for r in self.rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines
        ]
        ratio = self.bytes_per_device / self.full_bytes if self.full_bytes else 1.0
        text.append(
            f"weights per device: {self.bytes_per_device:,} bytes of "
            f"{self.full_bytes:,} ({ratio:.2f}x); optimizer slots split like "
            "their weights"
        )
        return "\n".join(text)


def _layout_of(variable: Any, distribution: Any) -> tuple | None:
    spec = sharding.spec_of(variable)
    if spec is not None and spec.layout is not None:
        return tuple(spec.layout)
    if distribution is None:
        return None
    try:
        found = distribution.get_tensor_layout(variable.path)
    except (AttributeError, ValueError):
        return None
    axes = getattr(found, "axes", found)
    return tuple(axes) if axes is not None else None


def report(model: Any, distribution: Any = None) -> LayoutReport:
    """Each weight of ``model``: its layout, block and how it runs.

    Args:
        model: A Keras model (or layer) built under a ``ModelParallel``.
        distribution: The distribution whose layout map names the layouts of
            replicated weights too; default: the one set now.

    Returns:
        A :class:`LayoutReport`; ``str()`` gives a table.
    """
    if distribution is None:
        from tfdist.compat.keras_src import distribution_lib

        distribution = distribution_lib.distribution()
    from tfdist.distribution import megatron, regather

    kept, tensor_parallel = set(), {}
    for layer in keras_private.flatten_layers(model, include_self=True):
        split = regather.own_split(layer)
        if not regather.regathers(layer) or not regather.is_leaf(layer):
            # tfdist.parallel's own layers' shards (no layout) are theirs.
            kept.update(id(v) for v in split if sharding.spec_of(v).layout is not None)
        elif split and sharding.spec_of(split[0]).mesh.tp > 1:
            for found in (megatron.plan(layer), megatron.call_plan(layer, (), {"reverse": True})):
                if found is not None:
                    tensor_parallel.setdefault(id(found.kernel), found.describe)
    rows = []
    for v in model.weights:
        spec = sharding.spec_of(v)
        itemsize = np.dtype(v.dtype if isinstance(v.dtype, str) else v.dtype.name).itemsize
        shape = spec.full_shape if spec else tuple(int(s) for s in v.shape)
        block = spec.shard_shape if spec else shape
        rows.append(
            WeightRow(
                path=v.path,
                shape=shape,
                layout=_layout_of(v, distribution),
                block=block,
                how=(
                    REPLICATED
                    if spec is None
                    else PARALLEL_LAYER
                    if spec.layout is None
                    else GATHERED_KEPT
                    if id(v) in kept
                    else tensor_parallel.get(id(v), GATHERED)
                ),
                bytes_per_device=int(np.prod(block)) * itemsize,
                full_bytes=int(np.prod(shape)) * itemsize,
            )
        )
    return LayoutReport(tuple(rows))
