"""Horovod's collectives on TensorFlow's: allreduce, allgather, broadcast, objects.

Every function works eagerly and inside a ``tf.function``, with no strategy:
one process per rank, each calling the same collectives in the same order.
Outside a ``tf.function`` each call first checks that all ranks issued the
same kind of collective on the same dtype and shape (and name, when given),
and fails with :class:`~tfdist.horovod.runtime.CollectiveMismatchError`
otherwise (see :mod:`tfdist.horovod.runtime`).

Differences from Horovod, all documented in docs/guide/horovod.md:

* ``broadcast`` is an all-reduce in which only the root contributes, which
  sends about twice the bytes of a tree broadcast; it is exact (x + 0 = x).
* ``op`` may be Average, Sum, Min, Max or Product; Adasum raises.
* ``join()`` is a barrier: a rank that joined does not stand in with zeros
  for the all-reduces of ranks that still train, as Horovod's does.
"""

from __future__ import annotations

import contextlib
import enum
import pickle
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat import tf_private
from tfdist.errors import ConfigError
from tfdist.horovod import runtime
from tfdist.horovod.runtime import CollectiveMismatchError

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "join",
    "sum_dense",
    "gather_rows",
    "gather_varying",
]


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (``hvd.Average``...)."""

    #: The mean over ranks (Horovod's default).
    Average = 0
    #: The sum over ranks.
    Sum = 1
    #: Horovod's Adasum; tfdist refuses it (no Adasum reduction in TensorFlow).
    Adasum = 2
    #: The element-wise minimum over ranks.
    Min = 3
    #: The element-wise maximum over ranks.
    Max = 4
    #: The element-wise product over ranks.
    Product = 5


Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product

_MERGE = {
    ReduceOp.Sum: "Add",
    ReduceOp.Average: "Add",
    ReduceOp.Min: "Min",
    ReduceOp.Max: "Max",
    ReduceOp.Product: "Mul",
}

#: dtypes TensorFlow's CPU collectives reduce; others travel as int32.
_REDUCIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
_SIGNATURE_BYTES = 120


def resolve_op(
    op: Any,
    average: Any = None,
    source: str = "hvd.allreduce",
    allowed: Sequence[ReduceOp] = tuple(_MERGE),
) -> ReduceOp:
    """``op``/``average`` as Horovod takes them -> a :class:`ReduceOp`.

    Raises:
        ConfigError: Both given, an unknown op, or Adasum.
    """
    if average is not None:
        if op is not None:
            raise ConfigError(
                "op",
                op,
                "op or the deprecated average, not both",
                source=source,
                received=f"op={op!r}, average={average!r}",
            )
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return ReduceOp.Average
    try:
        resolved = ReduceOp(op)
    except ValueError:
        raise ConfigError("op", op, "hvd.Average or hvd.Sum", source=source) from None
    if resolved == ReduceOp.Adasum:
        raise ConfigError(
            "op",
            "hvd.Adasum",
            "hvd.Average or hvd.Sum",
            source=source,
            hint="Adasum is Horovod's own MPI reduction; TensorFlow's collectives, which "
            "tfdist.horovod runs on, have no such reduction. hvd.Average trains the "
            "same model as Horovod's default.",
        )
    if resolved not in allowed:
        raise ConfigError(
            "op", resolved.name, " or ".join(f"hvd.{a.name}" for a in allowed), source=source
        )
    return resolved


def _eager() -> bool:
    return tf.executing_eagerly()


def _describe(kind: str, name: str | None, tensor: Any, varying_first: bool = False) -> str:
    shape = list(tensor.shape) if tensor.shape.rank is not None else ["?"]
    if varying_first and shape:
        shape[0] = "*"
    dims = ",".join(str(d) for d in shape)
    label = f" {name!r}" if name else ""
    return f"{kind}{label} {tensor.dtype.name}[{dims}]"


def _check_same(what: str) -> None:
    """All ranks issued ``what``? Raises CollectiveMismatchError naming each
    rank's collective when not."""
    raw = what.encode()[:_SIGNATURE_BYTES].ljust(_SIGNATURE_BYTES, b"\0")
    words = tf.bitcast(tf.reshape(tf.constant(np.frombuffer(raw, np.uint8)), [-1, 4]), tf.int32)
    rows = gather_rows(tf.reshape(words, [1, -1])).numpy()
    seen = [bytes(r.astype("<i4").tobytes()).rstrip(b"\0").decode(errors="replace") for r in rows]
    if len(set(seen)) > 1:
        issued = "; ".join(f"rank {r} issued {s}" for r, s in enumerate(seen))
        raise CollectiveMismatchError(
            f"tfdist.horovod: the ranks issued different collectives at the same point: "
            f"{issued}. Expected: every rank issues the same collectives in the same order "
            "(TensorFlow matches them by order; Horovod matched them by name). Keep "
            "collectives out of rank-specific code such as `if hvd.rank() == 0:`."
        )


@contextlib.contextmanager
def _Guard(what: str) -> Iterator[None]:  # noqa: N802 - used like a class.
    """Outside tf.function: signature check and stall watch around a collective."""
    if not (_eager() and runtime.size() > 1):
        yield
        return
    with runtime.inflight(f"hvd {what}"):
        _check_same(what)
        yield


# --- the primitives ---------------------------------------------------------


def _wire(t: tf.Tensor) -> tf.Tensor:
    return t if t.dtype in _REDUCIBLE else tf.cast(t, tf.int32)


def sum_dense(tensors: Sequence[tf.Tensor], merge: str = "Add") -> list[tf.Tensor]:
    """Reduces dense tensors across ranks: one collective per dtype."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if runtime.size() == 1 or not tensors:
        return [tf.identity(t) for t in tensors]
    launcher = runtime.launcher()
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_wire(t).dtype, []).append(i)
    out: list[Any] = [None] * len(tensors)
    for members in groups.values():
        flat = [tf.reshape(_wire(tensors[i]), [-1]) for i in members]
        packed = flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)
        if merge == "Add":
            reduced = runtime.watched(lambda: launcher.all_reduce(packed))  # noqa: B023 - watched() calls it at once
        else:
            reduced = runtime.watched(lambda: _reduce_other(launcher, packed, merge))  # noqa: B023 - watched() calls it at once
        parts = tf.split(reduced, [int(f.shape[0]) for f in flat]) if len(flat) > 1 else [reduced]
        for i, part in zip(members, parts):
            out[i] = tf.cast(tf.reshape(part, tf.shape(tensors[i])), tensors[i].dtype)
    return out


def _reduce_other(launcher, packed: tf.Tensor, merge: str) -> tf.Tensor:
    """Min/Max/Product: TensorFlow's all_reduce_v2 with another merge op, keyed
    and ordered like the launcher's own all-reduces."""
    return tf_private.launcher_all_reduce(launcher, packed, merge)


def gather_rows(rows: tf.Tensor) -> tf.Tensor:
    """Every rank's equally shaped ``rows``, concatenated on axis 0 in rank order."""
    if runtime.size() == 1:
        return tf.identity(rows)
    launcher = runtime.launcher()
    return runtime.watched(lambda: tf_private.launcher_all_gather(launcher, rows))


def gather_varying(tensor: tf.Tensor) -> tf.Tensor:
    """All ranks' ``tensor`` concatenated on axis 0; first dimensions may differ."""
    tensor = tf.convert_to_tensor(tensor)
    if runtime.size() == 1:
        return tf.identity(tensor)
    wire = _wire(tensor)
    n = runtime.size()
    counts = gather_rows(tf.reshape(tf.shape(wire, out_type=tf.int64)[0], [1]))
    most = tf.reduce_max(counts)
    pad = [[0, most - tf.shape(wire, out_type=tf.int64)[0]]] + [[0, 0]] * (wire.shape.rank - 1)
    padded = tf.pad(wire, tf.cast(pad, tf.int64))
    gathered = gather_rows(padded)
    parts = [gathered[r * most : r * most + counts[r]] for r in range(n)]
    return tf.cast(tf.concat(parts, axis=0), tensor.dtype)


# --- Horovod's API ----------------------------------------------------------


def _as_tensor(value: Any) -> Any:
    if isinstance(value, tf.IndexedSlices):
        return value
    return tf.convert_to_tensor(
        getattr(value, "value", value) if not isinstance(value, tf.Tensor) else value
    )


def _check_process_set(process_set: Any, source: str) -> None:
    if process_set is not None:
        raise ConfigError(
            "process_set",
            process_set,
            "None (every rank): process sets are not supported",
            source=source,
        )


def allreduce(
    tensor: Any,
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: Any = None,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduces ``tensor`` over all ranks (default: the average), as ``hvd.allreduce``.

    Args:
        tensor: A tensor, variable or ``tf.IndexedSlices`` (gathered, as
            Horovod does).
        average: Deprecated Horovod spelling of ``op``.
        device_dense: Ignored (TensorFlow places collectives).
        device_sparse: Ignored (TensorFlow places collectives).
        compression: ``hvd.Compression.none``/``fp16``, a Horovod-style
            compressor class, or a stateless tfdist compression setting.
        op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``,
            ``hvd.Max`` or ``hvd.Product``.
        prescale_factor: Multiplies the tensor before the sum.
        postscale_factor: Multiplies the result after the sum.
        name: Checked against the other ranks' outside a ``tf.function``.
        process_set: Only None is supported.
        ignore_name_scope: Ignored.

    Returns:
        The reduced tensor (IndexedSlices for IndexedSlices).
    """
    from tfdist.horovod.compression import as_horovod_compressor

    _check_process_set(process_set, "hvd.allreduce")
    op = resolve_op(op, average)
    tensor = _as_tensor(tensor)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (ReduceOp.Average, ReduceOp.Sum):
            raise ConfigError(
                "op", op.name, "hvd.Average or hvd.Sum for IndexedSlices", source="hvd.allreduce"
            )
        with _Guard(_describe("allreduce(slices)", name, tensor.values, True)):
            values = gather_varying(
                tensor.values * prescale_factor if prescale_factor != 1.0 else tensor.values
            )
            indices = gather_varying(tensor.indices)
        scale = postscale_factor / (runtime.size() if op == ReduceOp.Average else 1)
        if scale != 1.0:
            values = values * tf.cast(scale, values.dtype)
        return tf.IndexedSlices(values, indices, tensor.dense_shape)
    compressor = as_horovod_compressor(compression, "hvd.allreduce")
    with _Guard(_describe("allreduce", name, tensor)):
        x = tensor
        if prescale_factor != 1.0:
            x = x * tf.cast(prescale_factor, x.dtype)
        sent, ctx = compressor.compress(x)
        reduced = sum_dense([sent], _MERGE[op])[0]
        out = compressor.decompress(reduced, ctx)
    return _postscale(out, op, postscale_factor)


def _postscale(out: tf.Tensor, op: ReduceOp, postscale_factor: float) -> tf.Tensor:
    if op == ReduceOp.Average:
        n = runtime.size()
        if out.dtype.is_floating:
            out = out / tf.cast(n, out.dtype)
        else:
            out = out // n
    if postscale_factor != 1.0:
        out = out * tf.cast(postscale_factor, out.dtype)
    return out


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list:
    """Reduces several tensors in one collective per dtype (``hvd.grouped_allreduce``)."""
    from tfdist.horovod.compression import as_horovod_compressor

    _check_process_set(process_set, "hvd.grouped_allreduce")
    op = resolve_op(op, average, "hvd.grouped_allreduce")
    tensors = [_as_tensor(t) for t in tensors]
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [
            allreduce(t, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            for t in tensors
        ]
    compressor = as_horovod_compressor(compression, "hvd.grouped_allreduce")
    what = "grouped_allreduce " + " ".join(_describe("", None, t).strip() for t in tensors)
    with _Guard(what):
        pairs = [
            compressor.compress(
                t * tf.cast(prescale_factor, t.dtype) if prescale_factor != 1.0 else t
            )
            for t in tensors
        ]
        reduced = sum_dense([p for p, _ in pairs], _MERGE[op])
        outs = [compressor.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]
    return [_postscale(o, op, postscale_factor) for o in outs]


def allgather(
    tensor: Any, name: str | None = None, ignore_name_scope: bool = False, process_set: Any = None
) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` on axis 0, in rank order; the
    first dimension may differ between ranks (``hvd.allgather``). A scalar
    counts as shape [1]."""
    _check_process_set(process_set, "hvd.allgather")
    tensor = _as_tensor(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    with _Guard(_describe("allgather", name, tensor, varying_first=True)):
        return gather_varying(tensor)


def _check_root(root_rank: Any, source: str) -> int:
    n = runtime.size()
    if (
        isinstance(root_rank, bool)
        or not isinstance(root_rank, (int, np.integer))
        or not 0 <= int(root_rank) < n
    ):
        raise ConfigError("root_rank", root_rank, f"a rank in [0, {n - 1}]", source=source)
    return int(root_rank)


def _broadcast_many(tensors: Sequence[tf.Tensor], root: int) -> list[tf.Tensor]:
    """Root's values for each tensor: an all-reduce in which only root adds."""
    if runtime.rank() == root:
        sent = list(tensors)
    else:
        sent = [tf.zeros_like(t) for t in tensors]
    bad = [
        t.dtype.name
        for t in tensors
        if not (t.dtype.is_floating or t.dtype.is_integer or t.dtype == tf.bool)
    ]
    if bad:
        raise ConfigError(
            "tensor.dtype",
            bad[0],
            "a numeric or bool tensor",
            source="hvd.broadcast",
            hint="Use hvd.broadcast_object for others.",
        )
    return sum_dense(sent)


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: Any = None,
) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank (``hvd.broadcast``)."""
    _check_process_set(process_set, "hvd.broadcast")
    root = _check_root(root_rank, "hvd.broadcast")
    tensor = _as_tensor(tensor)
    with _Guard(_describe(f"broadcast(root={root})", name, tensor)):
        return _broadcast_many([tensor], root)[0]


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, process_set: Any = None, inplace: bool = False
) -> Any:
    """Assigns ``root_rank``'s values to ``variables`` on every rank.

    One collective per dtype whatever the number of variables. Works with
    Keras 3 variables (which have no ``.ref()``) and ``tf.Variable``.

    Returns:
        None eagerly; inside a ``tf.function`` the grouped assignments.
    """
    _check_process_set(process_set, "hvd.broadcast_variables")
    root = _check_root(root_rank, "hvd.broadcast_variables")
    variables = list(variables)
    if not variables:
        return None
    values = [tf.convert_to_tensor(getattr(v, "value", v)) for v in variables]
    what = f"broadcast_variables(root={root}) {len(values)} variables " + ",".join(
        sorted({v.dtype.name for v in values})
    )
    with _Guard(what):
        out = _broadcast_many(values, root)
    ops = [v.assign(o) for v, o in zip(variables, out)]
    return None if _eager() else tf.group(*[o for o in ops if o is not None])


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle

        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj)


def _bytes_tensor(data: bytes) -> tf.Tensor:
    raw = np.frombuffer(data + b"\0" * (-len(data) % 4), np.uint8)
    return tf.bitcast(tf.reshape(tf.constant(raw), [-1, 4]), tf.int32)


def _tensor_bytes(words: Any, length: int) -> bytes:
    return np.asarray(words, dtype="<i4").tobytes()[:length]


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: Any = None,
) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank (``hvd.broadcast_object``).

    Outside a ``tf.function`` only, as in Horovod.
    """
    _check_process_set(process_set, "hvd.broadcast_object")
    root = _check_root(root_rank, "hvd.broadcast_object")
    if runtime.size() == 1:
        return obj
    data = _dumps(obj) if runtime.rank() == root else b""
    with _Guard(f"broadcast_object(root={root})" + (f" {name!r}" if name else "")):
        length = int(_broadcast_many([tf.constant(len(data), tf.int64)], root)[0].numpy())
        words = (
            _bytes_tensor(data)
            if runtime.rank() == root
            else tf.zeros([(length + 3) // 4], tf.int32)
        )
        got = _broadcast_many([words], root)[0].numpy()
    return pickle.loads(_tensor_bytes(got, length))


def allgather_object(
    obj: Any, session: Any = None, name: str | None = None, process_set: Any = None
) -> list:
    """Every rank's ``obj``, in rank order (``hvd.allgather_object``)."""
    _check_process_set(process_set, "hvd.allgather_object")
    if runtime.size() == 1:
        return [obj]
    data = _dumps(obj)
    with _Guard("allgather_object" + (f" {name!r}" if name else "")):
        lengths = gather_rows(tf.constant([len(data)], tf.int64)).numpy()
        words = gather_varying(_bytes_tensor(data)).numpy()
    out, at = [], 0
    for length in lengths:
        n = (int(length) + 3) // 4
        out.append(pickle.loads(_tensor_bytes(words[at : at + n], int(length))))
        at += n
    return out


def barrier(process_set: Any = None) -> None:
    """Returns once every rank has called it (``hvd.barrier``)."""
    _check_process_set(process_set, "hvd.barrier")
    if runtime.size() == 1:
        return
    with _Guard("barrier"):
        sum_dense([tf.constant(1, tf.int32)])


def join(device: str = "") -> int:
    """Waits for every rank (``hvd.join``) and returns the rank that arrived last.

    Unlike Horovod's, a rank waiting here does not stand in with zeros for
    the all-reduces of ranks that still train: give every rank the same
    number of steps.
    """
    if runtime.size() == 1:
        return 0
    with _Guard("join"):
        arrived = gather_rows(tf.constant([time.time()], tf.float64)).numpy()
    return int(np.argmax(arrived))
