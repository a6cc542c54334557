"""Tensor-parallel compute for a layer whose layout matches Megatron's.

A ``Dense`` or ``EinsumDense`` kernel split over the model axis along a
letter the input does not have (its output units, or heads) is a column
layer; along a letter the output does not have (its input features, or the
heads an output projection sums over) it is a row layer. Such a layer does
not gather its kernel over the model axis: each member of the tensor group
multiplies by its own block, as in :mod:`tfdist.parallel`, and the
activations move instead:

* column: the group's rows are gathered (``gather_rows``), multiplied by
  the block, the output's columns gathered back and this replica's rows
  kept;
* row: the group's rows gathered, this member's slice of their features
  multiplied by the block, and the partial sums added over the group with
  this replica's rows kept (``scatter_rows``).

An ``Embedding`` (or keras-hub's ``ReversibleEmbedding``) whose table is
split over the model axis along the vocabulary is vocabulary-parallel:

* lookup: the group's ids are gathered, each member looks up the ids in
  its range of the vocabulary (the others read nothing), and the rows are
  summed over the group with this replica's rows kept;
* reverse (tied logits): the group's rows are gathered, multiplied by the
  block's transpose (this member's range of the logits), and the logits'
  columns gathered back with this replica's rows kept;
* reverse of an untied table (keras-hub's ``reverse_embeddings``, split over
  the model axis along the vocabulary): the same, with that table's block.
  A call of an untied layer never gathers the table it does not read
  (:attr:`Plan.unused`): the logits table is as large as the embeddings.

Each layer is complete on its own (its output is what Keras's layer gives),
so any layer may follow it; a column layer followed by a row layer pays one
activation exchange more than Megatron's fused pair. A split over the batch
axis is still gathered (FSDP). Other layers, and these with quantization or
LoRA, run the plain gather of :mod:`~tfdist.distribution.regather`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfdist.parallel import collectives, sharding

__all__ = ["Plan", "plan", "call_plan", "uses_block", "call"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a layer computes with its kernel's tensor block.

    Attributes:
        kind: ``"column"``, ``"row"``, ``"vocabulary"`` or ``"logits"`` (an
            untied table's reverse call).
        kernel: The kernel variable (an embedding's table).
        axis: column: the output's axis of the split letter; row: the
            input's; vocabulary: 0; logits: -1.
        equation: The einsum equation (Dense: ``"...a,ab->...b"``; an
            embedding: ``""``).
        unused: The layer's other weights this call does not read (an
            untied embedding's other table): not gathered.
    """

    kind: str
    kernel: Any
    axis: int
    equation: str
    unused: tuple = ()

    @property
    def describe(self) -> str:
        return f"tensor-parallel ({self.kind})"


def _equation(layer: Any) -> str | None:
    import keras

    if type(layer).call is keras.layers.Dense.call:
        return "...a,ab->...b"
    if type(layer).call is keras.layers.EinsumDense.call:
        return layer.equation
    return None


def _embedding_plan(layer: Any) -> Plan | None:
    import keras

    if not isinstance(layer, keras.layers.Embedding):
        return None
    if type(layer).call not in (keras.layers.Embedding.call, _reversible_call()):
        return None
    table = getattr(layer, "_embeddings", None)
    if (
        table is None
        or getattr(layer, "quantization_mode", None)
        or getattr(layer, "lora_enabled", False)
    ):
        return None
    spec = sharding.spec_of(table)
    if spec is None or (0, sharding.TENSOR) not in spec.splits:
        return None
    return Plan("vocabulary", table, 0, "")


def call_plan(layer: Any, args: tuple, kwargs: dict) -> Plan | None:
    """The plan of this call of ``layer`` (:func:`plan`, refined for an
    untied ReversibleEmbedding: its reverse call computes with the logits
    table's block, and each call leaves the other table alone)."""
    found = plan(layer)
    if found is None or found.kind != "vocabulary" or getattr(layer, "tie_weights", True):
        return found
    logits_table = getattr(layer, "reverse_embeddings", None)
    if logits_table is None:
        return found
    reverse = dict(zip(("inputs", "reverse"), args), **kwargs).get("reverse", False)
    if not reverse:
        return dataclasses.replace(found, unused=(logits_table,))
    spec = sharding.spec_of(logits_table)
    if spec is None or (1, sharding.TENSOR) not in spec.splits:
        return None  # Gathered whole, as any other layout.
    return Plan("logits", logits_table, -1, "...a,ab->...b", unused=(found.kernel,))


def _reversible_call() -> Any:
    """keras-hub's ReversibleEmbedding.call, when keras-hub is imported."""
    import sys

    module = sys.modules.get("keras_hub.src.layers.modeling.reversible_embedding")
    return getattr(getattr(module, "ReversibleEmbedding", None), "call", None)


def plan(layer: Any) -> Plan | None:
    """The layer's Megatron plan, or None (its weights are gathered)."""
    vocabulary = _embedding_plan(layer)
    if vocabulary is not None:
        return vocabulary
    equation = _equation(layer)
    kernel = getattr(layer, "_kernel", None)
    if equation is None or kernel is None:
        return None
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return None
    spec = sharding.spec_of(kernel)
    if spec is None:
        return None
    tensor = [dim for dim, kind in spec.splits if kind == sharding.TENSOR]
    if not tensor:
        return None
    inputs, rest = equation.split(",")
    kernel_letters, output = rest.split("->")
    if "..." in kernel_letters:
        return None
    letter = kernel_letters[tensor[0]]
    if "..." in inputs or "..." in output:
        if equation != "...a,ab->...b":
            return None
        # Dense: the rows are the input's first axis; its features the last.
        return (
            Plan("column", kernel, -1, equation)
            if letter == "b"
            else Plan("row", kernel, -1, equation)
        )
    # The rows: the input's and the output's first letter, not the kernel's.
    if inputs[0] != output[0] or inputs[0] in kernel_letters:
        return None
    if letter in output and letter not in inputs:
        return Plan("column", kernel, output.index(letter), equation)
    if letter in inputs and letter not in output:
        return Plan("row", kernel, inputs.index(letter), equation)
    return None


def _product(equation: str, x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    from keras import ops

    if equation == "...a,ab->...b":
        return ops.matmul(x, kernel)
    return ops.einsum(equation, x, kernel)


def uses_block(layer: Any, the_plan: Plan, args: tuple, kwargs: dict) -> bool:
    """Whether this call computes with the plan's block (an untied
    ReversibleEmbedding's reverse call reads its own output table)."""
    if the_plan.kind != "vocabulary":
        return True
    reverse = dict(zip(("inputs", "reverse"), args), **kwargs).get("reverse", False)
    return not reverse or layer.tie_weights


def call(
    layer: Any,
    the_plan: Plan,
    args: tuple,
    kwargs: dict,
    kernel: tf.Tensor,
    p: collectives.Placement,
) -> Any:
    """What ``layer`` returns when called with ``args`` and ``kwargs``,
    computed with ``kernel``, its block over the tensor group (gathered over
    the batch axis)."""
    from keras import ops

    if the_plan.kind == "vocabulary":
        return _vocabulary_call(layer, args, kwargs, kernel, p)
    if the_plan.kind == "logits":
        return _logits(layer, args[0] if args else kwargs["inputs"], kernel, p)
    inputs = args[0] if args else kwargs["inputs"]
    rows = tf.shape(inputs)[0]
    if the_plan.kind == "column":
        y = _product(the_plan.equation, collectives.gather_rows(inputs), kernel)
        y = collectives.tp_all_gather(y, axis=the_plan.axis % y.shape.rank)
        y = y[p.t * rows : (p.t + 1) * rows]
    else:
        # The group's rows first, then this member's features of all of them.
        x = tf.split(collectives.gather_rows(inputs), p.tp, axis=the_plan.axis)[p.t]
        y = collectives.scatter_rows(_product(the_plan.equation, x, kernel))
    if layer.bias is not None:
        y = ops.add(y, layer.bias)
    if layer.activation is not None:
        y = layer.activation(y)
    return y


def _vocabulary_call(
    layer: Any, args: tuple, kwargs: dict, table: tf.Tensor, p: collectives.Placement
) -> Any:
    from keras import ops

    from tfdist.compat.keras_src import set_keras_mask

    named = dict(zip(("inputs", "reverse"), args))
    named.update(kwargs)
    inputs, reverse = named["inputs"], named.get("reverse", False)
    if reverse:
        return _logits(layer, inputs, ops.transpose(table), p)
    ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
    ids = collectives.gather_rows(_checked(layer, ids))
    width = tf.cast(tf.shape(table)[0], ids.dtype)
    local = ids - tf.cast(p.t, ids.dtype) * width
    mine = tf.logical_and(local >= 0, local < width)
    # Every id is looked up, another member's as row 0 with its value zeroed:
    # the table's gradient (sparse, as a lookup's is) then has one slice per
    # id on every member, the same count across the group, and never none
    # (its zero slices add nothing, to Adam's squares either). A select, not
    # a product: row 0 may hold inf or NaN, which a product would spread.
    rows = tf.gather(table, tf.where(mine, local, tf.zeros_like(local)))
    found = tf.where(mine[..., None], rows, tf.zeros_like(rows))
    out = ops.cast(collectives.scatter_rows(found), layer.compute_dtype)
    mask = layer.compute_mask(inputs)
    if mask is not None:
        set_keras_mask(out, mask)
    return out


def _logits(layer: Any, inputs: Any, kernel: tf.Tensor, p: collectives.Placement) -> Any:
    """A ReversibleEmbedding's reverse call with ``kernel`` (width x this
    member's range of the vocabulary): the group's rows times the block, the
    logits' columns gathered back, this replica's rows kept."""
    from keras import ops

    x = collectives.gather_rows(inputs)
    if layer.reverse_dtype is not None:
        x, kernel = ops.cast(x, layer.reverse_dtype), ops.cast(kernel, layer.reverse_dtype)
    logits = collectives.tp_all_gather(ops.matmul(x, kernel), axis=-1)
    rows = tf.shape(inputs)[0]
    logits = logits[p.t * rows : (p.t + 1) * rows]
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    return logits


def _checked(layer: Any, ids: tf.Tensor) -> tf.Tensor:
    """``ids``, failing as one device's lookup does on an id outside the
    vocabulary ("indices[i,j] = 64 is not in [0, 64)"): with the vocabulary
    split, such an id falls in no member's block and would read zeros.

    The ids are looked up in ``range(vocabulary)``, which gives them back:
    an assertion (stateful) would be ordered after the other replicas'
    collectives by TensorFlow's automatic control dependencies (the
    replicas then wait on each other forever), and a check whose value is
    unused is pruned by Grappler."""
    return tf.gather(tf.range(int(layer.input_dim), dtype=ids.dtype), ids)
