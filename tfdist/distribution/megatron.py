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

__all__ = ["Plan", "plan", "call"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a layer computes with its kernel's tensor block.

    Attributes:
        kind: ``"column"`` or ``"row"``.
        kernel: The kernel variable.
        axis: column: the output's axis of the split letter; row: the
            input's.
        equation: The einsum equation (Dense: ``"...a,ab->...b"``).
    """

    kind: str
    kernel: Any
    axis: int
    equation: str

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


def plan(layer: Any) -> Plan | None:
    """The layer's Megatron plan, or None (its weights are gathered)."""
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
        return (Plan("column", kernel, -1, equation) if letter == "b"
                else Plan("row", kernel, -1, equation))
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


def call(layer: Any, the_plan: Plan, inputs: tf.Tensor, kernel: tf.Tensor,
         p: collectives.Placement) -> tf.Tensor:
    """What ``layer`` (Dense or EinsumDense) returns for ``inputs``, computed
    with ``kernel``, its block over the tensor group (gathered over the batch
    axis)."""
    from keras import ops
    rows = tf.shape(inputs)[0]
    if the_plan.kind == "column":
        y = _product(the_plan.equation, collectives.gather_rows(inputs), kernel)
        y = collectives.tp_all_gather(y, axis=the_plan.axis % y.shape.rank)
        y = y[p.t * rows:(p.t + 1) * rows]
    else:
        # The group's rows first, then this member's features of all of them.
        x = tf.split(collectives.gather_rows(inputs), p.tp, axis=the_plan.axis)[p.t]
        y = collectives.scatter_rows(_product(the_plan.equation, x, kernel))
    if layer.bias is not None:
        y = ops.add(y, layer.bias)
    if layer.activation is not None:
        y = layer.activation(y)
    return y
