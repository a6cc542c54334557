"""Multi-head attention with its heads split over the tensor group.

``ParallelMultiHeadAttention`` keeps ``keras.layers.MultiHeadAttention``'s
weights (the sub-layers ``query``, ``key``, ``value`` [, ``gate``] and
``attention_output``, in that order, with the same shapes). Under a mesh the
member at tensor index ``t`` holds heads ``[t*N/T, (t+1)*N/T)``: the q/k/v
kernels ``(d, N, key_dim)`` and biases ``(N, key_dim)`` are split on the heads
axis, as is the output kernel ``(N, value_dim, d)``; the output bias is whole::

    query/value/key [b, S, d] --gather_rows--> [T*b, S, d] --local heads-->
      attention [T*b, S, N/T, value_dim] --output kernel rows--> partial
      [T*b, S, d] --scatter_rows--> [b, S, d] + bias

Outside a mesh (no strategy, T = 1) the layer is Keras's.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from tfdist.compat import keras_private
from tfdist.compat.keras_src import (
    analyze_einsum_string as _analyze_einsum_string,
    mha_build_proj_equation as _build_proj_equation,
    mha_output_shape as _get_output_shape,
)
from tfdist.errors import ConfigError
from tfdist.parallel import collectives, sharding

__all__ = ["ParallelMultiHeadAttention"]


def _full(variable: Any) -> Any:
    return None if variable is None else sharding.local_full_tensor(variable)


class _HeadsEinsumDense(keras.layers.EinsumDense):
    """An attention projection whose kernel is split on its heads axis.

    Args:
        equation: The projection's einsum equation.
        kernel_axis: The kernel's heads axis.
        bias_axis: The bias's heads axis; None keeps the bias whole.
        partial: True for the output projection: the local heads give a
            partial sum, summed over the group (``scatter_rows``) before the
            whole bias is added.
        **kwargs: ``keras.layers.EinsumDense``'s arguments.
    """

    def __init__(
        self,
        equation: str,
        *,
        kernel_axis: int,
        bias_axis: int | None,
        partial: bool,
        **kwargs: Any,
    ):
        super().__init__(equation, **kwargs)
        self.kernel_axis = kernel_axis
        self.bias_axis = bias_axis
        self.partial = partial

    def build(self, input_shape):
        if collectives.runtime_of() is None:
            return super().build(input_shape)
        # Keras 3.15 also returns the kernel's input and output axes (for
        # VarianceScaling's fans); earlier versions return the shapes only.
        shapes = _analyze_einsum_string(
            self.equation, self.bias_axes, input_shape, self.partial_output_shape
        )
        kernel_shape, bias_shape = shapes[0], shapes[1]
        input_axes, output_axes = shapes[3:5] if len(shapes) >= 5 else (None, None)
        # Keras 3.10 to 3.14 answer compute_output_shape from it (build sets it).
        self.full_output_shape = tuple(shapes[2])
        self.input_spec = keras.InputSpec(ndim=len(input_shape))
        initializer = self.kernel_initializer
        if (
            isinstance(initializer, keras.initializers.VarianceScaling)
            and input_axes is not None
            and (initializer.input_axes is None or initializer.output_axes is None)
        ):
            # Keras's fans for the full kernel; the seed stays as configured
            # so that sharding can give every worker the same one.
            initializer = type(initializer).from_config(
                {**initializer.get_config(), "input_axes": input_axes, "output_axes": output_axes}
            )
        self._kernel = sharding.add_sharded_weight(
            self,
            "kernel",
            tuple(kernel_shape),
            axis=self.kernel_axis,
            initializer=initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
            dtype=self.dtype,
        )
        if bias_shape is None:
            self.bias = None
        elif self.bias_axis is None:
            self.bias = self.add_weight(
                name="bias",
                shape=tuple(bias_shape),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
                dtype=self.dtype,
            )
        else:
            self.bias = sharding.add_sharded_weight(
                self,
                "bias",
                tuple(bias_shape),
                axis=self.bias_axis,
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
                dtype=self.dtype,
            )
        self.built = True

    def call(self, inputs, training=None):
        if not sharding.is_sharded(self._kernel):
            return super().call(inputs, training=training)
        local = collectives.current() is not None
        kernel = self._kernel if local else _full(self._kernel)
        y = ops.einsum(self.equation, inputs, ops.cast(kernel, inputs.dtype))
        if self.partial and local:
            y = collectives.scatter_rows(y)
        if self.bias is not None:
            bias = self.bias if local or self.bias_axis is None else _full(self.bias)
            y = ops.add(y, ops.cast(bias, y.dtype))
        return self.activation(y) if self.activation is not None else y


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(keras.layers.MultiHeadAttention):
    """``keras.layers.MultiHeadAttention`` whose heads are split over the tensor group.

    Args:
        num_heads: The number of heads; model_parallel must divide it.
        key_dim: Size of each head for query and key.
        value_dim: Size of each head for value (default: key_dim).
        dropout: Dropout rate on the attention probabilities.
        use_bias: Whether the projections have biases.
        output_shape: The output's shape besides the batch and sequence axes
            (default: the query's last dimension).
        **kwargs: ``keras.layers.MultiHeadAttention``'s other arguments.

    Call arguments are Keras's. ``attention_mask``, ``use_causal_mask`` and the
    Keras masks of the inputs work as there. With
    ``return_attention_scores=True`` the scores of all heads are returned (the
    group all-gathers its heads' scores: ``T-1`` times their size on the wire).
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_shape: Any = None,
        **kwargs: Any,
    ):
        super().__init__(
            num_heads,
            key_dim,
            value_dim=value_dim,
            dropout=dropout,
            use_bias=use_bias,
            output_shape=output_shape,
            **kwargs,
        )
        runtime = collectives.runtime_of()
        if runtime is not None:
            self._check_heads(runtime.mesh.tp)

    def _check_heads(self, tp: int) -> None:
        if self._num_heads % tp:
            raise ConfigError(
                f"{self.name}.num_heads",
                self._num_heads,
                f"a number of heads that model_parallel={tp} divides (the "
                f"ParallelMultiHeadAttention '{self.name}' splits its heads "
                "over the tensor group)",
                source="tfdist.parallel",
            )

    def _projection(
        self, name: str, rank: int, heads_dim: int, output: bool = False, output_dims: Any = None
    ) -> _HeadsEinsumDense:
        common = self._get_common_kwargs_for_sublayer()
        if output:
            equation, bias_axes, out_rank = _build_proj_equation(
                rank - 1, bound_dims=2, output_dims=len(output_dims)
            )
            shape = _get_output_shape(out_rank - 1, output_dims)
            # Kernel (heads, value_dim, *out): heads on axis 0; bias whole.
            kernel_axis, bias_axis = 0, None
        else:
            equation, bias_axes, out_rank = _build_proj_equation(
                rank - 1, bound_dims=1, output_dims=2
            )
            shape = _get_output_shape(out_rank - 1, [self._num_heads, heads_dim])
            # Kernel (d, heads, size), bias (heads, size).
            kernel_axis, bias_axis = 1, 0
        return _HeadsEinsumDense(
            equation,
            output_shape=shape,
            bias_axes=bias_axes if self._use_bias else None,
            name=name,
            kernel_axis=kernel_axis,
            bias_axis=bias_axis,
            partial=output,
            activation="sigmoid" if name == "gate" else None,
            **common,
        )

    def build(self, query_shape, value_shape, key_shape=None):
        runtime = collectives.runtime_of()
        if runtime is None:
            return super().build(query_shape, value_shape, key_shape)
        self._check_heads(runtime.mesh.tp)
        key_shape = value_shape if key_shape is None else key_shape
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError(
                "All dimensions of `value` and `key`, except the last one, "
                f"must be equal. Received: value_shape={value_shape} and "
                f"key_shape={key_shape}"
            )
        # Keras's sub-layers, in Keras's order, with sharded weights.
        self._query_dense = self._projection("query", len(query_shape), self._key_dim)
        self._query_dense.build(query_shape)
        self._key_dense = self._projection("key", len(key_shape), self._key_dim)
        self._key_dense.build(key_shape)
        # MultiHeadAttention's gate (use_gate=True) is new in Keras 3.15.
        if getattr(self, "_use_gate", False):
            self._gate_dense = self._projection("gate", len(query_shape), self._value_dim)
            self._gate_dense.build(query_shape)
        self._value_dense = self._projection("value", len(value_shape), self._value_dim)
        self._value_dense.build(value_shape)
        self._build_attention(len(query_shape) + 1)
        out = self._output_shape if self._output_shape else [query_shape[-1]]
        self._output_dense = self._projection(
            "attention_output", len(query_shape), 0, output=True, output_dims=list(out)
        )
        heads_input = list(self._query_dense.compute_output_shape(query_shape))
        heads_input[-1] = self._value_dim
        self._output_dense.build(tuple(heads_input))
        self.built = True

    def _sharded(self) -> bool:
        dense = getattr(self, "_query_dense", None)
        # The variable itself: EinsumDense.kernel may be a LoRA sum.
        return dense is not None and sharding.is_sharded(keras_private.own_kernel(dense))

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
    ):
        if not self._sharded():
            return super().call(
                query,
                value,
                key=key,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                use_causal_mask=use_causal_mask,
            )
        p = collectives.current()
        if key is None:
            key = value
        # Here, not at module level: Keras < 3.6 has no mask helpers, and
        # tfdist.parallel must still import there.
        from tfdist.compat.keras_src import get_keras_mask, set_keras_mask

        query_mask = get_keras_mask(query)
        for x in (query, value, key):
            set_keras_mask(x, None)
        # The mask of this replica's rows (explicit, causal and the inputs'
        # Keras masks), then the group's rows like the inputs.
        attention_mask = self._compute_attention_mask(
            query,
            value,
            query_mask=query_mask,
            value_mask=value_mask,
            key_mask=key_mask,
            attention_mask=attention_mask,
            use_causal_mask=use_causal_mask,
        )
        rows = ops.shape(query)[0]
        if p is not None:
            gathered = {id(query): collectives.gather_rows(query)}
            for x in (value, key):
                if id(x) not in gathered:
                    gathered[id(x)] = collectives.gather_rows(x)
            query, value, key = (gathered[id(x)] for x in (query, value, key))
            attention_mask = _gather_mask(attention_mask, len(query.shape))
        gate = self._gate_dense(query) if getattr(self, "_use_gate", False) else None
        q = self._query_dense(query)
        k = self._key_dense(key)
        v = self._value_dense(value)
        output, scores = self._compute_attention(
            q, k, v, attention_mask, training, return_attention_scores
        )
        if gate is not None:
            output = ops.multiply(output, gate)
        output = self._output_dense(output)
        if query_mask is not None:
            set_keras_mask(output, query_mask)
        if not return_attention_scores:
            return output
        if p is not None:
            # Scores (batch dims with the heads last among them, then the
            # attention axes): all heads, this replica's rows.
            heads_axis = len(scores.shape) - 2 * len(self._attention_axes) - 1
            scores = collectives.tp_all_gather(scores, axis=heads_axis)
            scores = scores[p.t * rows : (p.t + 1) * rows]
        return output, scores


def _gather_mask(mask: Any, rank: int) -> Any:
    """The group's rows of an attention mask that has a batch axis (a rank
    of at least the query's, like Keras's ``(B, T, S)``)."""
    if mask is None or len(mask.shape) < rank or mask.shape[0] == 1:
        return mask  # No batch axis, or one broadcast over the batch.
    import tensorflow as tf

    gathered = collectives.gather_rows(tf.stop_gradient(ops.cast(mask, "int32")))
    return ops.cast(gathered, "bool")
