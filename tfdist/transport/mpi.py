"""Gradient all-reduce through MPI (mpi4py), for jobs an MPI launcher starts.

``strategy_from_config(transport="mpi")`` (or ``TFDIST_TRANSPORT=mpi``) in a
script that ``mpiexec -n N``, ``mpirun`` or ``srun --mpi=pmi2`` started gives
a MultiWorkerMirroredStrategy whose gradient aggregation (Keras ``fit``, and
custom loops through ``optimizer.apply_gradients``) runs over MPI: one
``MPI_Allreduce`` per gradient, all in one call into Python per step,
instead of TensorFlow's RING over gRPC. Every compression setting runs over it too.
Without a ``TF_CONFIG`` the ranks agree on one through MPI
(:func:`tf_config_from_mpi`): TensorFlow's own runtime still joins the
processes for variable creation, metrics and checkpoints.

Install: ``pip install 'tfdist[mpi]'`` (mpi4py and MPICH's wheel, whose
``mpiexec`` lands beside Python), or mpi4py built against the cluster's MPI.

How it runs, and why:

* The MPI calls happen on one thread of their own, in the order the step
  issues them (each depends on the previous one in the graph), so every rank
  calls the same collectives in the same order whatever TensorFlow's
  executor schedules. mpi4py releases the GIL inside MPI.
* ``float32``/``float64``/``int32``/``int64`` buffers are summed by
  ``MPI_Allreduce``. MPI has no 16-bit float sum, so ``float16`` and
  ``bfloat16`` payloads (``compression="bf16"``) are gathered with
  ``MPI_Allgather`` and summed in float32 locally (the same bytes on 2
  ranks; ``N - 1`` copies instead of ``2 (N - 1) / N`` on N).
* Sparse gradients (``IndexedSlices``) are gathered with ``MPI_Allgatherv``,
  as TensorFlow gathers them.
* A collective that does not finish within ``timeout`` seconds (the
  strategy's ``collective_timeout``) fails the step with a
  :class:`TransportError` naming the call and the rank; an MPI error (a peer
  gone) fails it at once. After either, or after any uncaught error, MPI
  cannot be trusted: at exit the process calls ``MPI_Abort``, so that the
  launcher stops every rank rather than leaving one waiting in
  ``MPI_Finalize``. (A hung peer usually shows first in TensorFlow's own
  collectives of the step, Keras's reduction of the logs, which the
  strategy's peer watchdog fails after the same timeout.)
* One replica per process (one CPU or one GPU, as Horovod): the collectives
  are per process.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError, TfdistError
from tfdist.transport.host import HostComm

__all__ = ["MpiComm", "MpiTransport", "TransportError", "import_mpi", "tf_config_from_mpi"]

_INSTALL_HINT = (
    "Install the mpi extra (pip install 'tfdist[mpi]': mpi4py and MPICH's wheel) and start "
    "the script with an MPI launcher: mpiexec -n N python train.py"
)


class TransportError(TfdistError, RuntimeError):
    """An MPI collective failed or did not finish within the timeout."""


def import_mpi() -> Any:
    """The ``mpi4py.MPI`` module (which initialises MPI on first import).

    Raises:
        ConfigError: mpi4py is not installed, or no MPI library loads. Field
            ``'transport'``.
    """
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise ConfigError(
            "transport", "mpi", "mpi4py and an MPI library", received=str(error), hint=_INSTALL_HINT
        ) from None
    except RuntimeError as error:  # mpi4py found no libmpi.
        raise ConfigError(
            "transport",
            "mpi",
            "an MPI library mpi4py can load",
            received=str(error),
            hint=_INSTALL_HINT,
        ) from None
    return MPI


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tf_config_from_mpi(comm: Any = None, *, host: str | None = None) -> dict:
    """A TF_CONFIG for this rank of the MPI job, every rank a worker.

    Each rank picks a free port and the addresses are gathered over MPI, so
    that rank r is ``worker:r``. ``host`` defaults to ``TFDIST_MPI_HOST``,
    then to 127.0.0.1 when all ranks share this host's name, else to the
    host name.

    Raises:
        ConfigError: The MPI world has a single rank (the script was not
            started by an MPI launcher). Field ``'transport'``.
    """
    mpi = import_mpi()
    comm = comm or mpi.COMM_WORLD
    if comm.Get_size() < 2:
        raise ConfigError(
            "transport",
            "mpi",
            "a job of 2 or more MPI ranks, or a TF_CONFIG",
            received="an MPI world of 1 rank and no TF_CONFIG",
            hint="Start the script with mpiexec -n N (or mpirun, srun --mpi=pmi2), or give "
            "each process its TF_CONFIG (tfdist launch).",
        )
    name = socket.gethostname()
    names = comm.allgather(name)
    if host is None:
        host = os.environ.get("TFDIST_MPI_HOST") or ("127.0.0.1" if len(set(names)) == 1 else name)
    address = f"{host}:{_free_port('' if host != '127.0.0.1' else host)}"
    addresses = comm.allgather(address)
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": comm.Get_rank()}}


class _Caller:
    """Runs MPI calls on one thread of its own, each within a timeout."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.broken: str | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="tfdist-mpi", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as error:  # noqa: BLE001 - handed to the calling thread, which raises it
                box.append((False, error))
            done.set()

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        if self.broken is not None:
            raise TransportError(
                f"tfdist transport 'mpi': {what} was not started: an earlier collective "
                f"failed ({self.broken}); the job must restart"
            )
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(self.timeout):
            self.broken = f"{what} did not finish within {self.timeout:g} s"
            raise TransportError(
                f"tfdist transport 'mpi': {what} did not finish within collective_timeout="
                f"{self.timeout:g} s: a peer rank is gone, stopped or stuck before this step. "
                "This rank stops; its launcher then stops the others"
            )
        ok, value = box[0]
        if not ok:
            self.broken = f"{what}: {value}"
            raise TransportError(f"tfdist transport 'mpi': {what} failed: {value}") from value
        return value


#: The "poll" wait: Testall without pause for this long, then between naps of
#: ``_NAP`` seconds. Measured with 4 ranks on 2 cores (the fast-links
#: benchmark's MLP, unthrottled): 0.113 s per step, against 0.156-0.180 s
#: spinning in MPI_Allreduce and 0.124-0.127 s with other pairs tried
#: (0/0.5 ms, 2/1 ms).
_SPIN, _NAP = 0.0005, 0.0001
WAITS = ("auto", "spin", "poll")


def _wait_all(mpi: Any, requests: list) -> None:
    start = time.perf_counter()
    while not mpi.Request.Testall(requests):
        if time.perf_counter() - start > _SPIN:
            time.sleep(_NAP)


class MpiTransport:
    """The MPI side of a strategy: its communicator and its calling thread.

    Args:
        timeout: Seconds one collective may take; None waits forever.
        comm: The communicator (default ``MPI.COMM_WORLD``, duplicated so
            that tfdist's calls never match a user's).
        wait: How a rank waits for its peers inside a collective. ``"spin"``:
            in ``MPI_Allreduce``, which polls the network without pause
            (MPI's way; right when every rank has its own cores). ``"poll"``:
            ``MPI_Iallreduce``, then ``MPI_Testall`` for half a millisecond
            and between naps of 0.1 ms, which leaves the cores to the ranks
            still computing when there are more ranks on a host than cores
            (4 ranks on 2 cores: 0.113 against 0.156-0.180 s per step).
            ``"auto"`` (default; ``TFDIST_MPI_WAIT``): "poll" when this
            host has more ranks than cores, else "spin".

    Raises:
        ConfigError: mpi4py or MPI is missing, or ``wait`` is not one of
            ``WAITS``.
    """

    name = "mpi"

    def __init__(
        self, timeout: float | None = 600.0, comm: Any = None, wait: str | None = None
    ) -> None:
        wait = wait or os.environ.get("TFDIST_MPI_WAIT", "").strip().lower() or "auto"
        if wait not in WAITS:
            raise ConfigError(
                "wait", wait, "one of " + ", ".join(map(repr, WAITS)), source="MpiTransport"
            )
        self.mpi = import_mpi()
        self.comm = (comm or self.mpi.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        hosts = self.comm.allgather(socket.gethostname())
        #: Ranks of this job on this host.
        self.local_ranks = hosts.count(hosts[self.rank])
        if wait == "auto":
            wait = "poll" if self.local_ranks > (os.cpu_count() or 1) else "spin"
        #: "spin" or "poll": how this rank waits inside a collective.
        self.wait = wait
        self._caller = _Caller(timeout)
        #: Collectives run and bytes this rank handed to them, by MPI call.
        self.calls: dict[str, int] = {"allreduce": 0, "allgather": 0, "allgatherv": 0}
        self.sent: dict[str, int] = {"allreduce": 0, "allgather": 0, "allgatherv": 0}
        self._finalize_timeout = timeout or 600.0
        atexit.register(self._at_exit)

    @property
    def broken(self) -> str | None:
        """Why MPI cannot be used any more (a failed or timed-out call), or None."""
        return self._caller.broken

    def _at_exit(self) -> None:
        # MPI_Finalize waits for every rank: beside a peer that is stuck, or
        # after this rank failed (a collective, or any uncaught error), it
        # would never return. MPI_Abort ends the job instead, and the launcher
        # says which rank did; a finalize that still hangs is aborted after
        # the collective timeout. mpi4py's own finalize then finds MPI done.
        mpi = self.mpi
        if mpi.Is_finalized():
            return
        if self._caller.broken is not None or getattr(sys, "last_value", None) is not None:
            mpi.COMM_WORLD.Abort(1)
        timer = threading.Timer(self._finalize_timeout, self._finalize_stuck)
        timer.daemon = True
        timer.start()
        mpi.Finalize()
        timer.cancel()

    def _finalize_stuck(self) -> None:
        print(
            f"tfdist transport 'mpi': rank {self.rank} waited {self._finalize_timeout:g} s in "
            "MPI_Finalize for a peer rank; aborting the job",
            file=sys.stderr,
            flush=True,
        )
        self.mpi.COMM_WORLD.Abort(1)

    def make_comm(self) -> MpiComm:
        """The :class:`~tfdist.transport.comm.Comm` of one aggregation."""
        return MpiComm(self)

    def describe(self) -> str:
        version = " ".join(self.mpi.Get_library_version().splitlines()[0].split())
        return (
            f"mpi ({version}; rank {self.rank} of {self.size}; {self.local_ranks} on this "
            f"host; waits by {self.wait})"
        )

    # Host-side collectives, run on the MPI thread. Inputs are numpy arrays.

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.sent[kind] += int(nbytes)

    def allreduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The sum over ranks of each array: one MPI_Allreduce each, in order.

        One call per tensor rather than one on a concatenated buffer: MPI is
        as fast either way on a step's gradients (``allreduce.md``), and the
        concatenation and the split back cost two copies of every byte.
        """
        outs = [np.empty_like(a) for a in arrays]
        nbytes = sum(a.nbytes for a in arrays)
        for a in arrays:
            self._count("allreduce", a.nbytes)

        def run():
            if self.wait == "poll":
                requests = [
                    self.comm.Iallreduce(np.ascontiguousarray(a), out)
                    for a, out in zip(arrays, outs)
                ]
                _wait_all(self.mpi, requests)
                return
            for a, out in zip(arrays, outs):
                self.comm.Allreduce(np.ascontiguousarray(a), out)

        self._caller.call(
            run,
            f"MPI_Allreduce of {len(arrays)} buffer(s), {nbytes} bytes "
            f"({arrays[0].dtype}), on rank {self.rank}",
        )
        return outs

    def allgather(self, flat: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(flat).view(np.uint8)
        out = np.empty((self.size, raw.size), np.uint8)
        self._count("allgather", raw.size)
        self._caller.call(
            lambda: self.comm.Allgather(raw, out),
            f"MPI_Allgather of {raw.size} bytes on rank {self.rank}",
        )
        return out.view(flat.dtype).reshape(self.size, *flat.shape)

    def allgatherv(self, rows: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
        row_bytes = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.dtype.itemsize
        self._count("allgatherv", raw.size)

        def gather():
            counts = np.array(self.comm.allgather(raw.size), np.int64)
            out = np.empty(int(counts.sum()), np.uint8)
            self.comm.Allgatherv(raw, [out, counts])
            return out

        out = self._caller.call(gather, f"MPI_Allgatherv of {raw.size} bytes on rank {self.rank}")
        rows_out = out.size // row_bytes if row_bytes else 0
        return out.view(rows.dtype).reshape(rows_out, *rows.shape[1:])


class MpiComm(HostComm):
    """Collectives of one gradient aggregation over MPI.

    A :class:`~tfdist.transport.host.HostComm` over :class:`MpiTransport`:
    its primitives are ``tf.numpy_function`` calls into the transport,
    chained by control dependencies in the order they are made.
    """

    def __init__(self, transport: MpiTransport) -> None:
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        if replicas != transport.size:
            raise ConfigError(
                "transport",
                "mpi",
                f"one replica per MPI rank ({transport.size} ranks)",
                received=f"{replicas} replicas in sync",
                hint="Give each process one device (no cpu_replicas, one GPU per rank).",
            )
        super().__init__(transport, replicas)
