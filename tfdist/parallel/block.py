"""A tensor-parallel transformer block: attention and MLP split over the group.

The block of keras-io's "Text classification with Transformer" (post-norm)::

    x -> attention -> dropout -> LayerNorm(x + .) = y
      -> Dense(ff_dim, relu) -> Dense(d) -> dropout -> LayerNorm(y + .)

with :class:`~tfdist.parallel.ParallelMultiHeadAttention` (heads split) and
a :class:`~tfdist.parallel.ColumnParallelDense` /
:class:`~tfdist.parallel.RowParallelDense` pair (hidden units split). The
LayerNorms and dropouts are replicated and work on each replica's own rows.
Per block and step, the group exchanges the activations twice forward (a
gather and a scatter around attention and around the MLP) and twice
backward. Outside a mesh it is the same block built from Keras's
MultiHeadAttention and two Dense layers.
"""

from __future__ import annotations

from typing import Any

import keras

from tfdist.errors import ConfigError
from tfdist.parallel import collectives
from tfdist.parallel.attention import ParallelMultiHeadAttention
from tfdist.parallel.dense import ColumnParallelDense, RowParallelDense

__all__ = ["TransformerBlock"]


@keras.saving.register_keras_serializable(package="tfdist")
class TransformerBlock(keras.layers.Layer):
    """A post-norm transformer encoder block whose attention and MLP are
    tensor-parallel.

    Args:
        num_heads: Attention heads; model_parallel must divide it.
        key_dim: Size of each head (query, key and value).
        ff_dim: The MLP's hidden width; model_parallel must divide it.
        dropout: Dropout rate after the attention and after the MLP.
        epsilon: The LayerNorms' epsilon.
        use_causal_mask: Whether each position attends only to earlier ones.
        activation: The MLP's hidden activation.
        kernel_initializer: Initializer of every kernel.
        **kwargs: ``keras.layers.Layer``'s arguments (name, dtype...).

    Sub-layers (and so weights) in order: ``attention``, ``norm1``,
    ``ffn_in``, ``ffn_out``, ``norm2``. The model dimension is the input's
    last one. The input's Keras mask (e.g. from an embedding with
    ``mask_zero``) masks the attention, as Keras's MultiHeadAttention does,
    and is passed on.
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        ff_dim: int,
        dropout: float = 0.0,
        epsilon: float = 1e-6,
        use_causal_mask: bool = False,
        activation: Any = "relu",
        kernel_initializer: Any = "glorot_uniform",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.key_dim = int(key_dim)
        self.ff_dim = int(ff_dim)
        self.dropout = float(dropout)
        self.epsilon = float(epsilon)
        self.use_causal_mask = bool(use_causal_mask)
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_masking = True

    def _check(self) -> None:
        runtime = collectives.runtime_of()
        if runtime is None:
            return
        tp = runtime.mesh.tp
        for field, width in (("num_heads", self.num_heads), ("ff_dim", self.ff_dim)):
            if width % tp:
                raise ConfigError(
                    f"{self.name}.{field}",
                    width,
                    f"a width that model_parallel={tp} divides (the "
                    f"TransformerBlock '{self.name}' splits it over the "
                    "tensor group)",
                    source="tfdist.parallel",
                )

    def _initializer(self) -> Any:
        # A fresh instance per weight, as Keras's own layers clone theirs.
        init = self.kernel_initializer
        return type(init).from_config(init.get_config())

    def build(self, input_shape):
        self._check()
        d = int(input_shape[-1])
        self.attention = ParallelMultiHeadAttention(
            self.num_heads,
            self.key_dim,
            kernel_initializer=self._initializer(),
            dtype=self.dtype_policy,
            name="attention",
        )
        self.dropout1 = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)
        self.norm1 = keras.layers.LayerNormalization(
            epsilon=self.epsilon, dtype=self.dtype_policy, name="norm1"
        )
        self.ffn_in = ColumnParallelDense(
            self.ff_dim,
            activation=self.activation,
            kernel_initializer=self._initializer(),
            dtype=self.dtype_policy,
            name="ffn_in",
        )
        self.ffn_out = RowParallelDense(
            d, kernel_initializer=self._initializer(), dtype=self.dtype_policy, name="ffn_out"
        )
        self.dropout2 = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)
        self.norm2 = keras.layers.LayerNormalization(
            epsilon=self.epsilon, dtype=self.dtype_policy, name="norm2"
        )
        shape = tuple(input_shape)
        self.attention.build(shape, shape)
        self.norm1.build(shape)
        self.ffn_in.build(shape)
        # RowParallelDense reads a shape seen in the replica context (a lazy
        # build on the first batch) as the parallel layout's: give it that.
        p = collectives.current()
        hidden = self.ff_dim // p.tp if p is not None else self.ff_dim
        self.ffn_out.build(shape[:-1] + (hidden,))
        self.norm2.build(shape)
        self.built = True

    def call(self, inputs, training=None):
        attended = self.attention(
            inputs, inputs, training=training, use_causal_mask=self.use_causal_mask
        )
        x = self.norm1(inputs + self.dropout1(attended, training=training))
        y = self.ffn_out(self.ffn_in(x))
        return self.norm2(x + self.dropout2(y, training=training))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "ff_dim": self.ff_dim,
            "dropout": self.dropout,
            "epsilon": self.epsilon,
            "use_causal_mask": self.use_causal_mask,
            "activation": keras.activations.serialize(self.activation),
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }
