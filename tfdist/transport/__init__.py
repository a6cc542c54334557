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

Between pipeline stages, :mod:`tfdist.transport.p2p` sends activations and
their gradients point to point over TCP (numpy only, no TensorFlow).

Importing this package imports no TensorFlow; its names load on first use.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes

_LAZY = {
    "Comm": "comm",
    "LocalComm": "comm",
    "ReplicaComm": "comm",
    "MpiComm": "mpi",
    "MpiTransport": "mpi",
    "TransportError": "mpi",
    "tf_config_from_mpi": "mpi",
    "Link": "p2p",
    "PeerError": "p2p",
    "connect_peers": "p2p",
    "connect_stages": "p2p",
    "RingGroup": "ring",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
