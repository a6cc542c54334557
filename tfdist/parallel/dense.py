"""Megatron's column- and row-parallel Dense layers for Keras 3.

``ColumnParallelDense`` holds ``W[:, shard]`` (and its bias shard);
``RowParallelDense`` holds ``W[shard, :]`` and a whole bias. A column layer
followed by a row layer, with only elementwise work between them, computes
an MLP whose hidden width is split over the tensor group::

    x [b, d] --gather_rows--> [T*b, d] --W1[:, t]--> [T*b, h/T]
      --act--> --W2[t, :]--> partial [T*b, d] --scatter_rows--> [b, d] + bias

Keras splits the batch over replicas and scales each replica's loss by
1/replicas; gathering the group's rows and scattering them back keeps both
valid, so ``fit`` needs no change. Outside a mesh (no strategy, T = 1) each
layer is exactly ``keras.layers.Dense``; with sharded weights called outside
the replica context (a direct ``model(x)`` in the scope) it computes with the
full weights.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from tfdist.errors import ConfigError
from tfdist.parallel import collectives, sharding

__all__ = ["ColumnParallelDense", "RowParallelDense"]


def _refuse_quantization(layer: keras.layers.Dense) -> None:
    if layer.quantization_mode or getattr(layer, "lora_rank", None):
        what = (
            f"quantization_mode={layer.quantization_mode!r}"
            if layer.quantization_mode
            else f"lora_rank={layer.lora_rank!r}"
        )
        raise ConfigError(
            f"{layer.name}",
            what,
            f"no quantization or LoRA on a sharded {type(layer).__name__} (model_parallel > 1)",
            source="tfdist.parallel",
        )


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(keras.layers.Dense):
    """``keras.layers.Dense`` whose output units are split over the tensor group.

    Args:
        units: The full number of output units; model_parallel must divide it.
        gather_output: False (the default): the output stays split, in the
            parallel layout ``[T*b, ..., units/T]`` that a following
            :class:`RowParallelDense` (or an elementwise op) takes. True: every
            replica gets its own rows with all the units, like ``Dense``.
        **kwargs: ``keras.layers.Dense``'s arguments.
    """

    def __init__(self, units: int, gather_output: bool = False, **kwargs: Any):
        super().__init__(units, **kwargs)
        self.gather_output = bool(gather_output)

    def build(self, input_shape):
        if collectives.runtime_of() is None:
            return super().build(input_shape)
        _refuse_quantization(self)
        in_dim = int(input_shape[-1])
        self._kernel = sharding.add_sharded_weight(
            self,
            "kernel",
            (in_dim, self.units),
            axis=1,
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = (
            sharding.add_sharded_weight(
                self,
                "bias",
                (self.units,),
                axis=0,
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
            if self.use_bias
            else None
        )
        self.input_spec = keras.InputSpec(min_ndim=2, axes={-1: in_dim})
        self.built = True

    def call(self, inputs, training=None):
        if not sharding.is_sharded(self._kernel):
            return super().call(inputs, training=training)
        p = collectives.current()
        if p is None:
            return _dense(
                inputs,
                sharding.local_full_tensor(self._kernel),
                self.bias if self.bias is None else sharding.local_full_tensor(self.bias),
                self.activation,
            )
        x = collectives.gather_rows(inputs)
        y = _dense(x, self._kernel, self.bias, self.activation)
        if not self.gather_output:
            return y
        full = collectives.tp_all_gather(y, axis=-1)
        rows = ops.shape(inputs)[0]
        return full[p.t * rows : (p.t + 1) * rows]

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(keras.layers.Dense):
    """``keras.layers.Dense`` whose input features are split over the tensor group.

    Args:
        units: The number of output units (whole on every replica).
        input_is_parallel: True (the default): the input is in the parallel
            layout a :class:`ColumnParallelDense` gives, ``[T*b, ...,
            features/T]``. False: an ordinary input ``[b, ..., features]``.
        **kwargs: ``keras.layers.Dense``'s arguments. The bias is whole and
            added once, after the group's sum.
    """

    def __init__(self, units: int, input_is_parallel: bool = True, **kwargs: Any):
        super().__init__(units, **kwargs)
        self.input_is_parallel = bool(input_is_parallel)

    def build(self, input_shape):
        runtime = collectives.runtime_of()
        if runtime is None:
            return super().build(input_shape)
        _refuse_quantization(self)
        in_dim = int(input_shape[-1])
        if self.input_is_parallel and collectives.current() is not None:
            # Built lazily on the first real batch: the input is a shard.
            in_dim *= runtime.mesh.tp
        self._kernel = sharding.add_sharded_weight(
            self,
            "kernel",
            (in_dim, self.units),
            axis=0,
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = (
            self.add_weight(
                name="bias",
                shape=(self.units,),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
            if self.use_bias
            else None
        )
        self.input_spec = keras.InputSpec(min_ndim=2)
        self.built = True

    def call(self, inputs, training=None):
        if not sharding.is_sharded(self._kernel):
            return super().call(inputs, training=training)
        p = collectives.current()
        if p is None:
            return _dense(
                inputs, sharding.local_full_tensor(self._kernel), self.bias, self.activation
            )
        x = inputs
        if not self.input_is_parallel:
            width = int(inputs.shape[-1]) // p.tp
            x = collectives.gather_rows(inputs)[..., p.t * width : (p.t + 1) * width]
        y = collectives.scatter_rows(ops.matmul(x, self._kernel))
        if self.bias is not None:
            y = ops.add(y, self.bias)
        return self.activation(y) if self.activation is not None else y

    def get_config(self):
        return {**super().get_config(), "input_is_parallel": self.input_is_parallel}


def _dense(x, kernel, bias, activation):
    # Full weights read from the components are not autocast (mixed precision).
    y = ops.matmul(x, ops.cast(kernel, x.dtype))
    if bias is not None:
        y = ops.add(y, ops.cast(bias, y.dtype))
    return activation(y) if activation is not None else y
