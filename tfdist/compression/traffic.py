"""Byte accounting, at its public path: the counts live in
:mod:`tfdist.transport.traffic`, beside the :class:`~tfdist.transport.comm.Comm`
that counts what it sends, below the compressors that predict it."""

from __future__ import annotations

from tfdist.transport.traffic import (
    GATHER_DTYPES,
    LENGTH_BYTES,
    Traffic,
    all_gather_bytes,
    all_reduce_bytes,
    dtype_name,
    itemsize,
    nbytes,
    slices_nbytes,
    wire_nbytes,
)

__all__ = [
    "GATHER_DTYPES",
    "LENGTH_BYTES",
    "Traffic",
    "all_gather_bytes",
    "all_reduce_bytes",
    "dtype_name",
    "itemsize",
    "nbytes",
    "slices_nbytes",
    "wire_nbytes",
]
