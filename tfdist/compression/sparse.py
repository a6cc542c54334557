"""Sparse gradients (``tf.IndexedSlices``): what they send and how many rows.

An Embedding layer's gradient is not its table's shape: it is one slice
(a row of the table) per id looked up, with the ids as indices, duplicates
included (TensorFlow's gradient of ``tf.gather`` does not merge them).
TensorFlow reduces it by all-gathering (``CollectiveReplicaLauncher.
all_reduce_indexed_slices``, under Mirrored and MultiWorkerMirrored alike):

1. each replica's number of rows, one int32 (4 bytes);
2. the values, ``rows x D`` entries, and
3. the indices, ``rows`` int32 or int64,

both padded to the largest replica's rows when the replicas hold different
numbers (a last, partial batch). Every replica then holds the concatenation,
duplicates and all; the optimizer applies it with scatter updates.

So the bytes depend on the batch, not on the table: ``rows`` is the number of
ids the replica with the most examples looked up in the step. Keras splits a
global batch of B examples as evenly as it can among N replicas, so that
replica holds ``ceil(B / N)`` examples, and an Embedding layer whose input
has shape ``(batch, L)`` looks up ``L`` ids per example.

What tfdist sends for them, by setting: ``fp16`` and ``bf16`` cast the
values to 16 bits (bfloat16 travels bit for bit as float16, which the
collectives gather); every other setting sends them as Keras does, since
top-k, random-k, sign, QSGD and PowerSGD work on dense tensors of a fixed
size, and error feedback on a dense residual. The indices always go as they
are.

:class:`SparseGradient` describes one such gradient for byte accounting;
:func:`model_gradients` finds a Keras model's Embedding tables;
:class:`StepGradients` follows each ``fit`` step's examples for
``CommunicationStats``. Where a model leaves an Embedding's input length
open (keras-hub's BERT takes ``(batch, None)`` token ids), the ids per
example come from the step the optimizer traced (:class:`TracedSlices`,
recorded by the Keras hook): the static shape of the ids its gather
flattened. This module runs no TensorFlow op of its own.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, NamedTuple

from tfdist.compat import keras_private
from tfdist.errors import ConfigError
from tfdist.transport.traffic import LENGTH_BYTES, slices_nbytes

__all__ = [
    "SparseGradient",
    "LENGTH_BYTES",
    "slices_nbytes",
    "split_sparse",
    "add_sparse",
    "model_gradients",
    "embedding_tables",
    "rows_per_replica",
    "StepGradients",
    "check_traced",
    "TracedSlices",
    "record_traced",
    "traced_slices",
]


_INDEX_DTYPES = ("int32", "int64")


@dataclasses.dataclass(frozen=True)
class SparseGradient:
    """A gradient reduced as ``tf.IndexedSlices`` (an Embedding table's).

    Attributes:
        shape: The variable's shape, e.g. ``(vocabulary, dim)``.
        dtype: The variable's (and the slices' values') dtype name.
        rows: Slices the replica with the most ids sends in one step (ids
            looked up, duplicates included; every replica pads to it).
        index_dtype: ``"int32"`` or ``"int64"``: the dtype of the ids the
            layer looked up (an Embedding casts any other input to int32).

    Raises:
        ConfigError: A field out of range; the message names it.
    """

    shape: tuple[int, ...]
    dtype: str
    rows: int
    index_dtype: str = "int32"

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if not shape or min(shape) < 0:
            raise ConfigError("shape", self.shape, "a variable shape of rank >= 1")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", getattr(self.dtype, "name", str(self.dtype)))
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 0:
            raise ConfigError("rows", self.rows, "an integer >= 0")
        name = getattr(self.index_dtype, "name", str(self.index_dtype))
        if name not in _INDEX_DTYPES:
            raise ConfigError("index_dtype", self.index_dtype, "'int32' or 'int64'")
        object.__setattr__(self, "index_dtype", name)

    @property
    def row_size(self) -> int:
        """Entries per slice: the product of the shape without its first axis."""
        return math.prod(self.shape[1:])


def split_sparse(shapes) -> tuple[list, list[SparseGradient]]:
    """Splits gradient specs into ``(shape, dtype)`` pairs and
    :class:`SparseGradient` entries, keeping each list's order."""
    dense, sparse = [], []
    for spec in shapes:
        (sparse if isinstance(spec, SparseGradient) else dense).append(spec)
    return dense, sparse


def rows_per_replica(batch_size: Any, num_replicas: int) -> int:
    """Examples the fullest replica holds: ``ceil(batch_size / num_replicas)``.

    Raises:
        ConfigError: ``batch_size`` is not an integer >= 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(
            "batch_size", batch_size, "the global batch size (an integer >= 1, as passed to fit)"
        )
    return -(-batch_size // num_replicas)


class TracedSlices(NamedTuple):
    """One IndexedSlices gradient as an optimizer's traced step aggregated it.

    Attributes:
        row_shape: The shape of one slice (the table's shape without its
            first axis).
        index_dtype: The indices' dtype name.
        ids_per_example: Ids each example looked up, from the static shape
            of the ids the gather flattened (a BERT fed batches of 16 token
            ids: 16), where the trace knew it; else None.
    """

    row_shape: tuple
    index_dtype: str
    ids_per_example: int | None = None


#: Optimizer -> the TracedSlices of its last traced step. Kept outside the
#: optimizer: Keras tracks the lists set on it.
_TRACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_traced(optimizer: Any, slices: list[TracedSlices]) -> None:
    """Records the IndexedSlices gradients ``optimizer``'s step traced."""
    _TRACED[optimizer] = list(slices)


def traced_slices(optimizer: Any) -> list[TracedSlices] | None:
    """The IndexedSlices gradients of ``optimizer``'s last traced step (a
    LossScaleOptimizer's: its inner optimizer's); None before its first."""
    for candidate in (getattr(optimizer, "inner_optimizer", None), optimizer):
        try:
            found = _TRACED.get(candidate) if candidate is not None else None
        except TypeError:  # Not weakly referenceable: never recorded.
            found = None
        if found is not None:
            return found
    return None


def embedding_tables(model: Any) -> dict[int, tuple[Any, int, str]]:
    """A Keras model's trainable Embedding tables whose gradients are
    IndexedSlices: a table tied to a ``reverse=True`` projection (GPT-2's
    logits) gets a dense gradient and is left out.

    Returns:
        ``{id(table variable): (layer, ids per example, index dtype)}``;
        ids per example is None where the layer's input length is not
        known from the model (keras-hub's BERT takes ``(batch, None)``
        token ids): :func:`model_gradients` then takes it from the traced
        step.
    """
    import keras

    tables = {}
    layers = (
        keras_private.flatten_layers(model, include_self=False)
        if hasattr(model, "_flatten_layers")
        else getattr(model, "layers", [])
    )
    for layer in layers:
        if not isinstance(layer, keras.layers.Embedding):
            continue
        table = getattr(layer, "embeddings", None)
        if table is None or not getattr(table, "trainable", False):
            continue
        nodes = [
            node
            for node in getattr(layer, "_inbound_nodes", [])
            if getattr(node, "input_tensors", None)
        ]
        # A ReversibleEmbedding called with reverse=True and tied weights
        # (GPT-2's logits) multiplies by its table: the gradient is dense.
        if getattr(layer, "tie_weights", True) and any(_reverse(node) for node in nodes):
            continue
        # A layer called on several inputs (a shared table) gets one gradient:
        # the slices of every call, concatenated.
        specs = [node.input_tensors[0] for node in nodes if not _reverse(node)]
        shapes = [tuple(spec.shape)[1:] for spec in specs]
        known = shapes and not any(d is None for shape in shapes for d in shape)
        # Each call's ids keep an int64 input's dtype, else become int32;
        # TensorFlow concatenates mixed ones as int64.
        index = "int64" if any(str(spec.dtype) == "int64" for spec in specs) else "int32"
        tables[id(table)] = (
            layer,
            sum(math.prod(shape) for shape in shapes) if known else None,
            index,
        )
    return tables


def _ids_of(traced: Any) -> int | None:
    """Ids per example of a TracedSlices (None for a bare (row shape, index dtype))."""
    return traced[2] if len(traced) > 2 else None


def _unknown_length(layer: Any, traced: list | None) -> ConfigError:
    specs = [
        node.input_tensors[0]
        for node in getattr(layer, "_inbound_nodes", [])
        if getattr(node, "input_tensors", None) and not _reverse(node)
    ]
    seen = (
        "no traced step yet"
        if traced is None
        else f"a traced step whose ids per example are {[_ids_of(t) for t in traced]}"
    )
    return ConfigError(
        "model",
        getattr(layer, "name", layer),
        "Embedding layers whose ids per example are known: a keras.Input of fixed "
        "length, or (once fit has traced a step) batches of fixed length",
        received=f"Embedding {layer.name!r} with input shapes "
        f"{[tuple(spec.shape) for spec in specs] or 'unknown'} and {seen}",
        hint="Pass the variables as a list of (shape, dtype) pairs and "
        "tfdist.compression.SparseGradient(shape, dtype, rows, index_dtype) "
        "entries instead.",
    )


def _reverse(node: Any) -> bool:
    """Whether a layer call was ``reverse=True`` (a ReversibleEmbedding's
    projection of hidden states onto the vocabulary, not a lookup)."""
    arguments = getattr(node, "arguments", None)
    args, kwargs = getattr(arguments, "args", ()), getattr(arguments, "kwargs", {}) or {}
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    return reverse is True


def model_gradients(model: Any, examples: int | None, traced: list | None = None) -> list:
    """Gradient specs of a Keras model's trainable variables, in order:
    ``(shape, dtype)`` for dense ones, :class:`SparseGradient` for
    Embedding tables looked up ``examples`` times ids per example.

    An Embedding whose input length the model leaves open (keras-hub's
    BERT) takes its ids per example from the traced step: the n-th
    IndexedSlices traced is the n-th table in variable order.

    Args:
        model: A built Keras model.
        examples: Examples the fullest replica holds in the step; may be
            None only for a model without Embedding tables.
        traced: The :class:`TracedSlices` of the step; None: those of the
            model's optimizer, if it has traced one.

    Raises:
        ConfigError: The model has Embedding tables and ``examples`` is
            None, or an Embedding's ids per example are known neither from
            the model nor from a traced step.
    """
    tables = embedding_tables(model)
    if tables and examples is None:
        names = ", ".join(repr(layer.name) for layer, _, _ in tables.values())
        raise ConfigError(
            "batch_size",
            None,
            "the global batch size (as passed to fit) for a model with Embedding layers",
            hint=f"The gradients of Embedding {names} are IndexedSlices: one row per id "
            "looked up, so what is sent depends on the batch, not on the table.",
        )
    if traced is None:
        traced = traced_slices(getattr(model, "optimizer", None))
    order = [id(v) for v in model.trainable_variables if id(v) in tables]
    out = []
    for v in model.trainable_variables:
        shape = tuple(int(d) for d in v.shape)
        dtype = getattr(v.dtype, "name", str(v.dtype))
        found = tables.get(id(v))
        if found is None:
            out.append((shape, dtype))
            continue
        layer, ids, index = found
        if ids is None:
            # Known once a step is traced: the ids the gather flattened.
            at = order.index(id(v))
            if traced is None or len(traced) != len(order) or _ids_of(traced[at]) is None:
                raise _unknown_length(layer, traced)
            ids = _ids_of(traced[at])
        out.append(SparseGradient(shape, dtype, examples * ids, index))
    return out


def add_sparse(traffic: Any, sparse: list[SparseGradient], value_dtype: str | None = None) -> Any:
    """Adds sparse gradients' all-gathers to a :class:`~tfdist.compression.traffic.Traffic`.

    Args:
        traffic: The Traffic of the step's dense gradients; changed in place.
        sparse: The step's sparse gradients.
        value_dtype: What the slices' values are sent as (``"float16"`` or
            ``"bfloat16"`` for a cast); None: their own dtype, as Keras
            sends them. The indices always go as they are.

    Returns:
        ``traffic``.
    """
    for s in sparse:
        traffic.dense_gather += slices_nbytes(s.rows, s.row_size, s.dtype, s.index_dtype)
        traffic.all_gather += slices_nbytes(
            s.rows, s.row_size, value_dtype or s.dtype, s.index_dtype
        )
        traffic.collectives += 3
    return traffic


class StepGradients:
    """The gradient specs of each ``fit`` step, for :class:`CommunicationStats`.

    A model without Embedding tables has the same specs every step. With
    tables, the rows follow the examples the fullest replica of this worker
    held in the step just taken: ``batch_size`` if given (the global batch,
    as :func:`predict_traffic` takes it), else the step's increase of Keras's
    loss tracker count on each local replica (Keras's ``train_step`` adds
    each replica's batch size to it), so a last, partial batch counts as it
    was sent. Under MultiWorkerMirrored each worker sees its own replicas:
    workers whose last batches differ each count their own. With
    ``steps_per_execution`` > 1 a call covers several steps; their examples
    are shared evenly among them.

    Args:
        model: The Keras model being trained.
        strategy: Its strategy.
        batch_size: The global batch size, or None to read the examples.
    """

    def __init__(self, model: Any, strategy: Any, batch_size: int | None = None) -> None:
        self.model, self.strategy = model, strategy
        self.sparse = bool(embedding_tables(model))
        self.examples = (
            None
            if batch_size is None
            else rows_per_replica(batch_size, strategy.num_replicas_in_sync)
        )
        self._counts: list[float] | None = None
        self._iterations: int | None = None
        self._static = None if self.sparse else model_gradients(model, None)

    def __call__(self, aggregator: Any = None) -> list:
        """The specs of the step just taken.

        The sparse gradients the step traced (the rows' shapes and index
        dtypes, from the model's optimizer or else ``aggregator``) must be
        those the model's Embedding tables predict; an Embedding of unknown
        input length takes its ids per example from them.

        Args:
            aggregator: The strategy's aggregator, if any.

        Raises:
            ConfigError: They are not (say, a layer of your own that gathers
                from a weight, or an Embedding also used as a dense matrix).
        """
        traced = traced_slices(getattr(self.model, "optimizer", None))
        if traced is None:
            traced = getattr(aggregator, "traced_slices", None)
        if self._static is not None:
            specs = self._static
        else:
            examples = self.examples if self.examples is not None else self._step_examples()
            specs = model_gradients(self.model, examples, traced)
        check_traced(specs, traced)
        return specs

    def _step_examples(self) -> int:
        tracker = getattr(self.model, "_loss_tracker", None)
        count = getattr(getattr(tracker, "count", None), "value", None)
        if count is None:
            raise ConfigError(
                "batch_size",
                None,
                "the global batch size for a model with "
                "Embedding layers trained without Keras's loss tracker",
                source="CommunicationStats",
            )
        counts = [float(c) for c in self.strategy.experimental_local_results(count)]
        previous = self._counts or [0.0] * len(counts)
        if any(c < p for c, p in zip(counts, previous)):  # Reset at an epoch's start.
            previous = [0.0] * len(counts)
        self._counts = counts
        # With steps_per_execution, one call covers several steps.
        iterations = int(self.model.optimizer.iterations.numpy())
        steps = (
            iterations - self._iterations
            if self._iterations is not None
            else int(getattr(self.model, "steps_per_execution", 1) or 1)
        )
        self._iterations = iterations
        examples = max(-(-int(round(c - p)) // max(steps, 1)) for c, p in zip(counts, previous))  # noqa: RUF046 - round() of a NumPy scalar is not an int on every NumPy
        if examples == 0:
            raise ConfigError(
                "batch_size",
                None,
                "the global batch size for a model with "
                "Embedding layers whose train_step does not update Keras's "
                "loss tracker",
                source="CommunicationStats",
            )
        return examples


def check_traced(specs: list, traced: list | None) -> None:
    """Raises unless the sparse gradients in ``specs`` are the ones traced.

    Args:
        specs: Gradient specs, :class:`SparseGradient` for the sparse ones.
        traced: :class:`TracedSlices` (or ``(row shape, index dtype)``
            pairs) of each IndexedSlices the aggregation sent, in order;
            None: not known (nothing checked).

    Raises:
        ConfigError: The counts, row shapes or index dtypes differ.
    """
    if traced is None:
        return
    _, sparse = split_sparse(specs)
    predicted = [(s.shape[1:], s.index_dtype) for s in sparse]
    sent = [(tuple(t[0]), t[1]) for t in traced]
    if predicted != sent:
        raise ConfigError(
            "model",
            predicted,
            "sparse gradients matching what the step sends",
            source="CommunicationStats",
            received=f"IndexedSlices sent with (row shape, index dtype) {sent}; the model's "
            f"Embedding tables predict {predicted}",
            hint="Byte accounting would be wrong. Count with predict_traffic() and a list of "
            "(shape, dtype) pairs and SparseGradient entries instead.",
        )
