"""Tensor parallelism for Keras 3 on TensorFlow.

``tfdist.strategy_from_config(model_parallel=T)`` arranges the replicas as
a (data, tensor) mesh (:mod:`tfdist.parallel.mesh`); the layers here split
their weights over each tensor group, Megatron-style, and run under plain
``model.fit``. With T = 1, or outside any strategy, each layer is its Keras
counterpart, so one model definition runs anywhere.

It sits above the strategies and below the Keras integration: it imports the
strategies, compression and the spec layer, never training, profiling, horovod,
the engines or the CLI. A strategy reaches it through :mod:`tfdist.plugins`
(:mod:`~tfdist.parallel.plugin`).
"""

from tfdist.parallel.attach import attach
from tfdist.parallel.attention import ParallelMultiHeadAttention
from tfdist.parallel.block import TransformerBlock
from tfdist.parallel.collectives import reset_traffic, traffic
from tfdist.parallel.dense import ColumnParallelDense, RowParallelDense
from tfdist.parallel.embedding import VocabParallelEmbedding
from tfdist.parallel.mesh import Mesh, mesh_of
from tfdist.parallel.sharding import assign_full, full_value, spec_of

__all__ = [
    "ColumnParallelDense",
    "RowParallelDense",
    "VocabParallelEmbedding",
    "ParallelMultiHeadAttention",
    "TransformerBlock",
    "Mesh",
    "attach",
    "mesh_of",
    "traffic",
    "reset_traffic",
    "full_value",
    "assign_full",
    "spec_of",
]
