"""What carries the gradient all-reduce between the processes of a job.

TensorFlow's collectives (RING over gRPC) are the default. On a fast link they
cost about twice PyTorch DDP's step time for fp32 gradients
(``benchmarks/results/allreduce.md``); ``transport="mpi"`` hands the
gradients' all-reduce to an MPI library instead (:mod:`tfdist.transport.mpi`).

A transport only supplies the collectives of tfdist's gradient aggregation
(:class:`tfdist.compression.aggregate.Comm`): every compression setting, and
none, runs over it, in Keras ``fit`` and in custom loops that call the
optimizer. It writes no networking of its own.
"""

from __future__ import annotations

from tfdist.transport.mpi import MpiComm, MpiTransport, TransportError, tf_config_from_mpi

__all__ = ["MpiComm", "MpiTransport", "TransportError", "tf_config_from_mpi"]
