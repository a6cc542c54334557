"""A vocabulary-parallel embedding for Keras 3 (Megatron's layout).

The table ``(input_dim, output_dim)`` is split on the vocabulary: the member
at tensor index ``t`` holds rows ``[t*V/T, (t+1)*V/T)``. Under a mesh::

    ids [b, ...] --gather_rows--> [T*b, ...] --own rows of the table, zeros
      for ids outside them--> [T*b, ..., d] --scatter_rows--> [b, ..., d]

Every id is in exactly one member's range, so the group's sum is the lookup.
Outside a mesh (no strategy, T = 1) the layer is ``keras.layers.Embedding``.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from tfdist.errors import ConfigError
from tfdist.parallel import collectives, sharding

__all__ = ["VocabParallelEmbedding"]


@keras.saving.register_keras_serializable(package="tfdist")
class VocabParallelEmbedding(keras.layers.Embedding):
    """``keras.layers.Embedding`` whose vocabulary is split over the tensor group.

    Args:
        input_dim: The vocabulary size; model_parallel must divide it.
        output_dim: The embedding width (whole on every replica).
        **kwargs: ``keras.layers.Embedding``'s arguments (``mask_zero``
            works as there: the mask comes from the ids).

    Under a mesh, an id outside ``[0, input_dim)`` looks up zeros instead of
    raising, as no member's range holds it.
    """

    def __init__(self, input_dim: int, output_dim: int, **kwargs: Any):
        # Keras builds and sets `weights` in its constructor with full shapes;
        # done here after the build so a sharded table takes them too.
        weights = kwargs.pop("weights", None)
        super().__init__(input_dim, output_dim, **kwargs)
        if weights is not None:
            self.build()
            value = weights[0] if isinstance(weights, list) and len(weights) == 1 else weights
            sharding.assign_full(self._embeddings, value)

    def build(self, input_shape=None):
        if self.built:
            return
        if collectives.runtime_of() is None:
            return super().build(input_shape)
        if self.quantization_mode or self.lora_rank:
            what = (
                f"quantization_mode={self.quantization_mode!r}"
                if self.quantization_mode
                else f"lora_rank={self.lora_rank!r}"
            )
            raise ConfigError(
                self.name,
                what,
                "no quantization or LoRA on a sharded VocabParallelEmbedding (model_parallel > 1)",
                source="tfdist.parallel",
            )
        self._embeddings = sharding.add_sharded_weight(
            self,
            "embeddings",
            (self.input_dim, self.output_dim),
            axis=0,
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
        )
        self.built = True

    def call(self, inputs):
        if not sharding.is_sharded(self._embeddings):
            return super().call(inputs)
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = ops.cast(inputs, "int32")
        p = collectives.current()
        if p is None:  # Outside the replica context: the full table.
            table = sharding.local_full_tensor(self._embeddings)
            return ops.cast(ops.take(table, inputs, axis=0), self.compute_dtype)
        ids = collectives.gather_rows(inputs)
        rows = self.input_dim // p.tp
        local = ids - ops.cast(p.t * rows, ids.dtype)
        mine = ops.logical_and(ops.greater_equal(local, 0), ops.less(local, rows))
        # Ids of other members' rows read row 0 and are zeroed: never an
        # index outside this shard.
        found = ops.take(self._embeddings, ops.where(mine, local, ops.zeros_like(local)), axis=0)
        found = ops.where(ops.expand_dims(mine, -1), found, ops.zeros_like(found))
        return ops.cast(collectives.scatter_rows(found), self.compute_dtype)
