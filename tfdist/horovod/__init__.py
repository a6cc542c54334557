"""Horovod's API on tfdist: change the import, keep the script.

``import tfdist.horovod as hvd`` stands in for both ``horovod.tensorflow``
and ``horovod.tensorflow.keras``; ``import tfdist.horovod as horovod`` for
``horovod.run``. Each process is one rank, with no ``tf.distribute``
strategy, as in Horovod; the ranks come from the launcher's environment
(``tfdist launch``, ``tfdist horovodrun``, Slurm's ``srun``, or Horovod's
and Open MPI's variables) and the collectives are TensorFlow's own.

Differences from Horovod are listed in docs/guide/horovod.md.

It sits above the engines (``hvd.run`` starts ranks through ``tfdist launch``) and
below the CLI: it imports every part but the CLI.
"""

from tfdist.horovod import compat as _compat
from tfdist.horovod.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    join,
)
from tfdist.horovod.compression import Compression, Compressor
from tfdist.horovod.optimizer import DistributedOptimizer, load_model
from tfdist.horovod.run import RunError, run  # The function shadows the module.
from tfdist.horovod.runtime import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NotInitializedError,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tfdist.horovod.tape import DistributedGradientTape, tape_traffic

# Horovod-era Keras spellings (compile(experimental_run_tf_function=...),
# opt.variables(), opt.lr) are accepted while the shim is imported.
_compat.install()


def mpi_threads_supported() -> bool:
    """False: there is no MPI underneath."""
    return False


def mpi_enabled() -> bool:
    """False: ranks talk through TensorFlow's collectives, not MPI."""
    return False


#: False: tfdist.horovod is not built on MPI.
mpi_built = mpi_enabled
#: False: no Gloo underneath.
gloo_enabled = mpi_enabled
#: False: no Gloo underneath.
gloo_built = mpi_enabled
#: False: no IBM DDL underneath.
ddl_built = mpi_enabled
#: False: no oneCCL underneath.
ccl_built = mpi_enabled
#: False: no ROCm build of Horovod underneath.
rocm_built = mpi_enabled


def nccl_built() -> bool:
    """Whether TensorFlow can use NCCL here (a CUDA build)."""
    import tensorflow as tf

    return bool(tf.test.is_built_with_cuda())


#: Whether TensorFlow is a CUDA build (as ``nccl_built``).
cuda_built = nccl_built

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "join",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "ReduceOp",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "DistributedGradientTape",
    "tape_traffic",
    "load_model",
    "run",
    "RunError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "NotInitializedError",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "callbacks",
    "elastic",
]


def __getattr__(name: str):
    """``hvd.callbacks`` and ``hvd.elastic``, imported on first use: they import
    Keras, which ``import tfdist.horovod`` before ``hvd.init()`` should not."""
    if name in ("callbacks", "elastic"):
        import importlib

        return importlib.import_module(f"tfdist.horovod.{name}")
    raise AttributeError(f"module 'tfdist.horovod' has no attribute {name!r}")
