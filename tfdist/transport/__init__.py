"""What carries the gradient all-reduce between the processes of a job.

TensorFlow's collectives (RING over gRPC) are the default. On a fast link they
cost about twice PyTorch DDP's step time for fp32 gradients
(``benchmarks/results/allreduce.md``); ``transport="mpi"`` hands the
gradients' all-reduce to an MPI library instead (:mod:`tfdist.transport.mpi`).

A transport supplies the collectives of tfdist's gradient aggregation: a
:class:`~tfdist.transport.comm.Comm` (:mod:`tfdist.transport.comm`, with the
wire encoding in :mod:`tfdist.transport.wire` and the byte counts in
:mod:`tfdist.transport.traffic`). Every compression setting, and none, runs
over it, in Keras ``fit`` and in custom loops that call the optimizer: the
compressors are the maths on top (:mod:`tfdist.compression`, the layer above).
It writes no networking of its own.
"""

from __future__ import annotations

from tfdist.transport.comm import Comm, LocalComm, ReplicaComm
from tfdist.transport.mpi import MpiComm, MpiTransport, TransportError, tf_config_from_mpi

__all__ = [
    "Comm",
    "LocalComm",
    "ReplicaComm",
    "MpiComm",
    "MpiTransport",
    "TransportError",
    "tf_config_from_mpi",
]
