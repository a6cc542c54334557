"""All-reduce benchmark: where TensorFlow's cross-process all-reduce spends its time.

One command, as root::

    python benchmarks/allreduce.py                 # the recorded run (about 14 min)
    python benchmarks/allreduce.py --quick         # under a minute: small tensors, 2 workers
    python benchmarks/allreduce.py --mode=report   # the tables again from the JSON

Keras ``fit`` under MultiWorkerMirroredStrategy (2 workers, fp32 gradients of
the slow-network benchmark's 5.8M-parameter MLP) takes twice PyTorch DDP's
step on an unthrottled loopback, and the difference is TensorFlow's
collective all-reduce (RING over gRPC). This benchmark times that all-reduce
alone, pulls TensorFlow's own levers one at a time, and sets it beside MPI
(mpi4py over MPICH's libfabric TCP provider) and a plain TCP socket on the
same link.

Like ``benchmarks/slow_network.py`` it re-runs itself under ``unshare -n``:
a private network namespace whose only interface is a loopback. The
unthrottled rate (``none``) keeps the loopback's default MTU (65536); for a
limited rate the MTU is 1500 (like Ethernet) and ``tc ... tbf`` limits the
loopback, shared by all the workers' traffic like one medium. Needs root,
iproute2, tc, mpi4py and an MPI with ``mpiexec`` (the ``mpich`` wheel).

Every job is ``--workers`` processes on 127.0.0.1 (its own job per
configuration, in one invocation, at one rate). Unthrottled, every job runs in
``--rounds`` rounds (the second in reverse order, so that drift hits all
alike) and a configuration's timed calls are pooled; on a limited link, where
every configuration sits at the wire's floor, ``--configs_limited`` run once,
with ``tf/default`` again last. A worker builds the MLP's
gradient list (8 float32 tensors, 23,107,624 bytes; every value rank + 1),
warms up, then times ``--iters`` all-reduces (``--slow_iters`` on a limited
link, where one takes seconds), each one a call of a ``tf.function`` whose
``strategy.run`` calls ``tf.distribute.get_replica_context().all_reduce(SUM,
tensors, options=...)`` -- the path Keras's gradient all-reduce takes
(``merge_call`` into ``batch_reduce_to``). Every configuration's result is
checked against the expected sum, N(N+1)/2, and the check is recorded.

TensorFlow configurations (one lever each against ``tf/default``, one
intra-op and one inter-op thread per worker unless the lever says otherwise):

* ``default``: ``CommunicationOptions()`` (AUTO, which is RING on CPU; one
  pack); ``ring``: RING named; ``pack0`` (the same options as default: its
  difference from default is the noise), ``pack4m``, ``pack1m``:
  ``bytes_per_pack``;
* ``flat``: one ``tf.concat`` of the flattened tensors, one all-reduce of one
  tensor; ``chunks4``/``chunks8``: that buffer in K pieces in one call (with
  ``bytes_per_pack=1`` so that each piece is its own collective: with 0 they
  would be concatenated again); ``calls4``/``calls8``: K calls of one piece;
* ``inter2``/``inter4``: inter-op threads (intra 1); ``threads0``: both left
  at TensorFlow's default;
* ``timeout60``: ``timeout_seconds=60``;
* ``grpc_window``, ``grpc_frame``, ``grpc_maxmsg``: gRPC channel arguments in
  ``TF_GRPC_DEFAULT_OPTIONS``. TensorFlow reads that variable once per
  process, in ``CreateDefaultChannelArguments`` (tsl's grpc_channel.cc),
  as ``key=value`` pairs (integers, or quoted strings) for the channels it
  opens as a *client*; the RecvBuf caller is the client, and the tensor comes
  back in the response, so the receive-side HTTP/2 settings apply. It then
  sets ``grpc.max_receive_message_length`` to INT32_MAX itself (and the send
  limit is unlimited by default), so the max-message row is expected to be a
  no-op;
* ``no_token``: ``CollectiveReplicaLauncher._prefer_ordering_token = False``
  (a private class attribute of cross_device_utils, read when the strategy
  makes its launchers): collectives are then not chained through the ordering
  token resource;
* beyond the brief, two knobs the RecvBuf path reads: ``recv_chunk_whole`` and
  ``recv_chunk_1m``: ``ConfigProto.experimental.recv_buf_max_chunk`` (the
  sender copies each RecvBuf payload into strings of this size, 4096 bytes by
  default; -1 means one string), set through the strategy's
  ``_update_config_proto``; ``subdivs0``: ``max_subdivs_per_device=0`` on the
  CollectiveReduceV2 op (TensorFlow's ring then cuts the tensor into <= 4 MiB
  chunks, up to 2 subdivisions, and runs them concurrently; the Python API
  passes -1, one chunk per worker), by wrapping ``collective_ops.all_reduce_v2``.

MPI (``mpiexec -n N``, ``MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp`` so that MPICH does not use shared memory):
``comm.Allreduce`` of the flat buffer (``mpi/flat``) and of each tensor
(``mpi/tensors``). ``socket``: two processes exchanging the same bytes over
one TCP connection (both directions at once, which is the wire traffic of a
2-process all-reduce) and sending them one way: the link's ceiling.

Breakdown (unthrottled, 2 workers): time(bytes) = alpha + beta * bytes fitted to
one all-reduce of 64 KiB, 1 MiB, 4 MiB and the flat buffer, in TensorFlow
(default options) and in MPI; and one TensorFlow profiler trace of worker 0
doing the default all-reduce (after its timed calls), summarised from the
trace's XSpace by thread and by event.

Results: ``benchmarks/results/allreduce.{json,md}``. Ratios compare runs of
the same invocation; absolute times drift on shared machines, so the load is
recorded.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import app, flags

# The shared pieces sit beside this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import netns
from benchlib.machine import load_snapshot
from benchlib.mlp import mlp_shapes, param_count
from benchlib.netns import NO_LIMIT, parse_rate, tc_command

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
FLAGS = flags.FLAGS

LAYERS = ["256", "2048", "2048", "512", "10"]
QUICK_LAYERS = ["64", "256", "256", "10"]
#: The message sizes of the alpha/beta fit ("flat": the whole gradient buffer).
FIT_SIZES = ["65536", "1048576", "4194304", "flat"]
#: The environment that keeps MPICH off shared memory (ch4's ofi netmod, TCP).
MPI_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
_MIB = 1 << 20
#: gRPC channel arguments of the grpc_* configurations.
_WINDOW = f"grpc.http2.write_buffer_size={16 * _MIB},grpc.http2.lookahead_bytes={16 * _MIB}"

#: Each TensorFlow configuration: what it changes from ``default``.
#: layout: list (the 8 tensors), flat (one buffer), chunks (K pieces, one
#: call) or calls (K pieces, K calls). intra/inter: thread counts (0:
#: TensorFlow's default). grpc: TF_GRPC_DEFAULT_OPTIONS. token: the ordering
#: token. recv_chunk: recv_buf_max_chunk. subdivs: max_subdivs_per_device.
TF_CONFIGS: dict[str, dict[str, Any]] = {
    "tf/default": {"label": "default: CommunicationOptions() (AUTO → RING, one pack)"},
    "tf/ring": {"label": "implementation=RING", "implementation": "RING"},
    "tf/pack0": {"label": "bytes_per_pack=0 (= default)", "bytes_per_pack": 0},
    "tf/pack4m": {"label": "bytes_per_pack=4 MiB", "bytes_per_pack": 4 * _MIB},
    "tf/pack1m": {"label": "bytes_per_pack=1 MiB", "bytes_per_pack": _MIB},
    "tf/flat": {"label": "one flat buffer (tf.concat), one tensor", "layout": "flat"},
    "tf/chunks4": {"label": "flat buffer in 4 pieces, one call", "layout": "chunks", "k": 4},
    "tf/chunks8": {"label": "flat buffer in 8 pieces, one call", "layout": "chunks", "k": 8},
    "tf/calls4": {"label": "flat buffer in 4 pieces, 4 calls", "layout": "calls", "k": 4},
    "tf/calls8": {"label": "flat buffer in 8 pieces, 8 calls", "layout": "calls", "k": 8},
    "tf/inter2": {"label": "inter-op threads 2 (intra 1)", "inter": 2},
    "tf/inter4": {"label": "inter-op threads 4 (intra 1)", "inter": 4},
    "tf/threads0": {"label": "default threads (intra 0, inter 0)", "intra": 0, "inter": 0},
    "tf/timeout60": {"label": "timeout_seconds=60", "timeout": 60.0},
    "tf/grpc_window": {
        "label": "gRPC write buffer + lookahead 16 MiB",
        "grpc": _WINDOW,
    },
    "tf/grpc_frame": {
        "label": "gRPC as above + HTTP/2 max frame 16 MiB",
        "grpc": _WINDOW + ",grpc.http2.max_frame_size=16777215",
    },
    "tf/grpc_maxmsg": {
        "label": "gRPC max send/receive message -1 (unlimited)",
        "grpc": "grpc.max_send_message_length=-1,grpc.max_receive_message_length=-1",
    },
    "tf/no_token": {"label": "no ordering token", "token": False},
    "tf/recv_chunk_whole": {"label": "recv_buf_max_chunk=-1 (one string)", "recv_chunk": -1},
    "tf/recv_chunk_1m": {"label": "recv_buf_max_chunk=1 MiB", "recv_chunk": _MIB},
    "tf/subdivs0": {"label": "max_subdivs_per_device=0 (≤4 MiB ring chunks)", "subdivs": 0},
}
#: Not a lever: the fit's sizes; and worker 0's profiler trace.
TF_SWEEP = "tf/sweep"
OTHER_LABELS = {
    "mpi/flat": "MPI Allreduce, flat buffer",
    "mpi/tensors": "MPI Allreduce, each tensor",
    "socket/exchange": "TCP socket, the bytes both ways at once (2 processes)",
    "socket/oneway": "TCP socket, the bytes one way (2 processes)",
}
#: With 4 workers (each job takes longer to start): the levers that could
#: move the most.
CONFIGS_MORE = [
    "tf/default",
    "tf/flat",
    "tf/pack4m",
    "tf/calls8",
    "tf/inter4",
    "tf/grpc_frame",
    "tf/no_token",
    "tf/recv_chunk_whole",
    "tf/subdivs0",
]
#: On a limited link, where a 2-worker all-reduce takes 0.4 s and a 4-worker
#: one 1.2 s: the default, the other layouts and the transport knobs.
CONFIGS_LIMITED = ["tf/default", "tf/flat", "tf/calls8", "tf/subdivs0", "tf/recv_chunk_whole"]


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "inside", "report", "tf_worker", "mpi_worker", "socket_peer"],
        "all: run in a new namespace, then report. The others are internal "
        "(inside the namespace; one worker) or redo the report.",
    )
    flags.DEFINE_bool(
        "quick", False, "Small tensors, one rate, 2 workers, few iterations (under a minute)."
    )
    flags.DEFINE_list("rates", ["none", "1gbit"], "Link rates: none (unthrottled) or tc rates.")
    flags.DEFINE_list("workers", ["2", "4"], "Worker counts.")
    flags.DEFINE_list(
        "configs", list(TF_CONFIGS), "TensorFlow configurations with 2 workers, unthrottled."
    )
    flags.DEFINE_list(
        "configs_more", CONFIGS_MORE, "TensorFlow configurations with more workers, unthrottled."
    )
    flags.DEFINE_list(
        "configs_limited", CONFIGS_LIMITED, "TensorFlow configurations on a limited link."
    )
    flags.DEFINE_integer(
        "rounds",
        2,
        "Rounds of every unthrottled cell's jobs (the even ones in reverse order); a "
        "configuration's timed calls are pooled over its rounds.",
    )
    flags.DEFINE_list("layers", LAYERS, "MLP widths: the gradient list's shapes.")
    flags.DEFINE_integer("iters", 30, "Timed all-reduces per job, unthrottled.")
    flags.DEFINE_integer("slow_iters", 8, "Timed all-reduces per job on a limited link.")
    flags.DEFINE_integer(
        "warmup",
        15,
        "Untimed all-reduces first, unthrottled (tracing, group set-up, and gRPC's "
        "flow-control windows, which grow over the first calls).",
    )
    flags.DEFINE_integer("slow_warmup", 2, "Untimed all-reduces first on a limited link.")
    flags.DEFINE_list("fit_sizes", FIT_SIZES, "Bytes of the alpha/beta fit's messages.")
    flags.DEFINE_bool("profile", True, "Trace worker 0 of the unthrottled 2-worker default job.")
    flags.DEFINE_string("trace_dir", "", "Keep that trace here (default: a temporary directory).")
    flags.DEFINE_bool(
        "repeat_default", True, "Run tf/default again last in each one-round cell (drift)."
    )
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "allreduce", "Base name of the result files.")
    flags.DEFINE_string("note", "", "A line for the report (what else ran on the machine).")
    # One worker (internal).
    flags.DEFINE_string("config", None, "One configuration (worker modes).")
    flags.DEFINE_integer("world", 2, "Processes in the job (worker modes).")
    flags.DEFINE_integer("rank", 0, "This process (socket peer).")
    flags.DEFINE_integer("port", 0, "Port (socket peer).")
    flags.DEFINE_string("profile_dir", "", "Trace into this directory after timing (tf worker).")
    flags.DEFINE_string("out", None, "Write the worker's JSON here.")


# ---------------------------------------------------------------- workers


def _shapes() -> list[tuple[int, ...]]:
    return [s for s, _ in mlp_shapes([int(w) for w in FLAGS.layers])]


def _fit_bytes(total: int) -> list[int]:
    """The fit's message sizes in bytes (multiples of 4; "flat": ``total``)."""
    return [total if s == "flat" else int(s) // 4 * 4 for s in FLAGS.fit_sizes]


def _pieces(n: int, k: int) -> list[int]:
    """``n`` elements in ``k`` near-equal pieces."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _count_ops(graph, op_type: str) -> int:
    """``op_type`` nodes in a function graph, its library included."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for fn in graph_def.library.function:
        nodes += list(fn.node_def)
    return sum(n.op == op_type for n in nodes)


def _apply_process_levers(cfg: dict) -> None:
    """The levers that act before the strategy exists (private TF hooks)."""
    from tensorflow.python.distribute import (
        collective_all_reduce_strategy as cars,
        cross_device_utils,
    )
    from tensorflow.python.ops import collective_ops

    if cfg.get("token") is False:
        cross_device_utils.CollectiveReplicaLauncher._prefer_ordering_token = False
    if "recv_chunk" in cfg:
        update = cars.CollectiveAllReduceExtended._update_config_proto
        chunk = int(cfg["recv_chunk"])

        def with_chunk(self, config_proto):
            config = update(self, config_proto)
            config.experimental.recv_buf_max_chunk = chunk
            return config

        cars.CollectiveAllReduceExtended._update_config_proto = with_chunk
    if "subdivs" in cfg:
        reduce_v2 = collective_ops.all_reduce_v2
        subdivs = int(cfg["subdivs"])

        def with_subdivs(*args, **kwargs):
            kwargs["max_subdivs_per_device"] = subdivs
            return reduce_v2(*args, **kwargs)

        collective_ops.all_reduce_v2 = with_subdivs


def _options(cfg: dict, bytes_per_pack: int | None = None):
    import tensorflow as tf

    kwargs: dict[str, Any] = {}
    if "implementation" in cfg:
        kwargs["implementation"] = getattr(
            tf.distribute.experimental.CommunicationImplementation, cfg["implementation"]
        )
    if "timeout" in cfg:
        kwargs["timeout_seconds"] = cfg["timeout"]
    pack = cfg.get("bytes_per_pack", bytes_per_pack)
    if pack is not None:
        kwargs["bytes_per_pack"] = pack
    return tf.distribute.experimental.CommunicationOptions(**kwargs)


def _replica_fn(cfg: dict, shapes: Sequence[tuple[int, ...]]):
    """The all-reduce of one configuration, for ``strategy.run``."""
    import tensorflow as tf

    layout = cfg.get("layout", "list")
    sizes = [math.prod(s) for s in shapes]
    total = sum(sizes)
    k = int(cfg.get("k", 1))
    # chunks: each piece its own pack, so its own collective.
    options = _options(cfg, 1 if layout == "chunks" else None)
    sum_op = tf.distribute.ReduceOp.SUM

    def unflatten(flat):
        return [tf.reshape(p, s) for p, s in zip(tf.split(flat, sizes), shapes)]

    def fn(*tensors):
        ctx = tf.distribute.get_replica_context()
        if layout == "list":
            return ctx.all_reduce(sum_op, list(tensors), options=options)
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        if layout == "flat":
            return unflatten(ctx.all_reduce(sum_op, flat, options=options))
        pieces = tf.split(flat, _pieces(total, k))
        if layout == "chunks":
            reduced = ctx.all_reduce(sum_op, pieces, options=options)
        else:
            reduced = [ctx.all_reduce(sum_op, p, options=options) for p in pieces]
        return unflatten(tf.concat(reduced, axis=0))

    return fn


def _cpu() -> float:
    """This process's CPU seconds so far (user + system, all threads)."""
    return time.process_time()


def _time_calls(call, n: int, cpu: list[float] | None = None) -> list[float]:
    """Seconds of each of ``n`` calls; each waits for its last (small) output.

    Appends the process's CPU seconds per call to ``cpu`` if given.
    """
    times = []
    cpu_start = _cpu()
    for _ in range(n):
        start = time.perf_counter()
        out = call()
        out[-1].numpy()  # The eager call returns when done; this makes sure.
        times.append(time.perf_counter() - start)
    if cpu is not None:
        cpu.append((_cpu() - cpu_start) / n)
    return times


def _max_error(tf, outs, expected: float) -> float:
    return max(float(tf.reduce_max(tf.abs(o - expected))) for o in outs)


def tf_worker() -> None:
    """One TensorFlow worker (TF_CONFIG in the environment): times one configuration."""
    sweep = FLAGS.config == TF_SWEEP
    cfg = {} if sweep else TF_CONFIGS[FLAGS.config]
    import tensorflow as tf

    intra, inter = int(cfg.get("intra", 1)), int(cfg.get("inter", 1))
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    _apply_process_levers(cfg)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    world = strategy.num_replicas_in_sync
    expected = world * (world + 1) / 2
    shapes = _shapes()
    total_bytes = 4 * sum(math.prod(s) for s in shapes)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "threads": [intra, inter],
        "grpc_env": os.environ.get("TF_GRPC_DEFAULT_OPTIONS", ""),
    }

    def job(fn, tensors):
        @tf.function
        def step():
            return strategy.run(fn, args=tuple(tensors))

        return step

    if sweep:
        rows = []
        for nbytes in _fit_bytes(total_bytes):
            x = tf.fill([nbytes // 4], float(rank + 1))
            step = job(_replica_fn({}, [(nbytes // 4,)]), [x])
            _time_calls(step, FLAGS.warmup)
            cpu: list[float] = []
            times = _time_calls(step, FLAGS.iters, cpu)
            rows.append(
                {
                    "bytes": nbytes,
                    "times": times,
                    "median_s": statistics.median(times),
                    "cpu_s": cpu[0],
                    "max_error": _max_error(tf, step(), expected),
                }
            )
        result["sweep"] = rows
        result["verified"] = all(r["max_error"] == 0 for r in rows)
    else:
        tensors = [tf.fill(s, float(rank + 1)) for s in shapes]
        step = job(_replica_fn(cfg, shapes), tensors)
        _time_calls(step, FLAGS.warmup)
        cpu = []
        times = _time_calls(step, FLAGS.iters, cpu)
        error = _max_error(tf, step(), expected)
        graph = step.get_concrete_function().graph
        result.update(
            times=times,
            median_s=statistics.median(times),
            cpu_s=cpu[0],
            bytes=total_bytes,
            max_error=error,
            verified=error == 0,
            collectives=_count_ops(graph, "CollectiveReduceV2"),
        )
        if FLAGS.profile_dir and rank == 0:
            tf.profiler.experimental.start(FLAGS.profile_dir)
            traced = _time_calls(step, 5)
            tf.profiler.experimental.stop()
            result["profiled_times"] = traced
        elif FLAGS.profile_dir:
            _time_calls(step, 5)  # Worker 0's traced calls need their peers.
    _write(Path(FLAGS.out), result)


def mpi_worker() -> None:
    """One MPI rank (under mpiexec): times ``comm.Allreduce`` of one configuration."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    expected = world * (world + 1) / 2
    shapes = _shapes()
    total_bytes = 4 * sum(math.prod(s) for s in shapes)

    def measure(sends: list) -> tuple[list[float], float, float]:
        recvs = [np.empty_like(s) for s in sends]

        def once():
            for s, r in zip(sends, recvs):
                comm.Allreduce(s, r, op=MPI.SUM)

        for _ in range(FLAGS.warmup):
            once()
        times = []
        cpu_start = _cpu()
        for _ in range(FLAGS.iters):
            start = time.perf_counter()
            once()
            times.append(time.perf_counter() - start)
        cpu = (_cpu() - cpu_start) / FLAGS.iters
        error = max(float(np.max(np.abs(r - expected))) for r in recvs)
        return times, error, cpu

    result: dict[str, Any] = {"rank": rank, "world": world, "library": MPI.Get_library_version()}
    if FLAGS.config == "mpi/sweep":
        rows = []
        for nbytes in _fit_bytes(total_bytes):
            times, error, cpu = measure([np.full(nbytes // 4, rank + 1, np.float32)])
            rows.append(
                {
                    "bytes": nbytes,
                    "times": times,
                    "median_s": statistics.median(times),
                    "cpu_s": cpu,
                    "max_error": error,
                }
            )
        result["sweep"] = rows
        result["verified"] = all(r["max_error"] == 0 for r in rows)
    else:
        if FLAGS.config == "mpi/flat":
            sends = [np.full(total_bytes // 4, rank + 1, np.float32)]
        else:
            sends = [np.full(s, rank + 1, np.float32) for s in shapes]
        times, error, cpu = measure(sends)
        result.update(
            times=times,
            median_s=statistics.median(times),
            cpu_s=cpu,
            bytes=total_bytes,
            max_error=error,
            verified=error == 0,
            collectives=len(sends),
        )
    if rank == 0:
        _write(Path(FLAGS.out), result)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def socket_peer() -> None:
    """One of two processes moving the gradient bytes over one TCP connection.

    Per iteration, after a 1-byte go from rank 0: both ranks send the bytes
    and receive the peer's at once (exchange), then rank 0 sends them and
    rank 1 answers with one byte when it has all (one way). Rank 0 writes
    the times.
    """
    total = 4 * sum(math.prod(s) for s in _shapes())
    payload = bytes(total)
    inbox = memoryview(bytearray(total))
    one = memoryview(bytearray(1))
    if FLAGS.rank == 0:
        server = socket.create_server(("127.0.0.1", FLAGS.port))
        conn, _ = server.accept()
        server.close()
    else:
        deadline = time.time() + 60
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", FLAGS.port))
                break
            except ConnectionRefusedError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    exchange, oneway, cpu = [], [], []
    for _ in range(FLAGS.warmup + FLAGS.iters):
        cpu_start = _cpu()
        if FLAGS.rank == 0:
            conn.sendall(b"g")
        else:
            _recv_exact(conn, one)
        start = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        _recv_exact(conn, inbox)
        sender.join()
        exchange.append(time.perf_counter() - start)
        cpu.append(_cpu() - cpu_start)
        start = time.perf_counter()
        if FLAGS.rank == 0:
            conn.sendall(payload)
            _recv_exact(conn, one)
        else:
            _recv_exact(conn, inbox)
            conn.sendall(b"k")
        oneway.append(time.perf_counter() - start)
    conn.close()
    if FLAGS.rank == 0:
        skip = FLAGS.warmup
        _write(
            Path(FLAGS.out),
            {
                "bytes": total,
                "exchange": exchange[skip:],
                "oneway": oneway[skip:],
                "exchange_cpu_s": statistics.mean(cpu[skip:]),
            },
        )


# ---------------------------------------------------------------- orchestration


def _env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    env.pop("TF_CONFIG", None)
    env.pop("TF_GRPC_DEFAULT_OPTIONS", None)
    env.update(extra)
    return env


def _worker_args(config: str, iters: int, warmup: int) -> list[str]:
    return [
        f"--config={config}",
        f"--iters={iters}",
        f"--warmup={warmup}",
        f"--layers={','.join(FLAGS.layers)}",
        f"--fit_sizes={','.join(FLAGS.fit_sizes)}",
    ]


def _stop(proc: subprocess.Popen) -> None:
    """Stops one process this script started: SIGTERM (mpiexec passes it on to its
    ranks), then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(
    procs: list[subprocess.Popen], outs: Sequence[Path], timeout: float, exit_too: bool = False
) -> list[int | None]:
    """Waits until every file of ``outs`` exists (and, if ``exit_too``, every process
    has exited), one process fails, or time runs out; then stops the processes
    still running (only these). TensorFlow workers are stopped once their
    results are written: their exit (and a peer's last RecvBuf racing it) is
    not part of the benchmark.

    Returns:
        The exit codes (-15 or -9 for a process stopped here).
    """
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                break  # One failed: its peers would wait for it forever.
            if all(o.exists() for o in outs) and not (exit_too and None in codes):
                break
            if None not in codes:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            _stop(p)
    return [p.returncode for p in procs]


def _write(path: Path, result: dict) -> None:
    """Writes a worker's JSON whole (the orchestrator acts as soon as the file exists)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)


def _failure(name: str, codes: list, logs: list[Path]) -> RuntimeError:
    bad = next((i for i, c in enumerate(codes) if c not in (0, -9, -15, None)), 0)
    tail = logs[bad].read_text(errors="replace")[-3000:] if logs[bad].exists() else ""
    return RuntimeError(f"{name} failed: exit codes {codes}; log {bad} ends:\n{tail}")


def run_tf(
    config: str, world: int, iters: int, warmup: int, work: Path, profile_dir: str = ""
) -> dict:
    """Runs one TensorFlow job of ``world`` workers; returns worker 0's result."""
    from tfdist import spec
    from tfdist.engines.net import local_spec

    cfg = TF_CONFIGS.get(config, {})
    extra = {"TF_GRPC_DEFAULT_OPTIONS": cfg["grpc"]} if "grpc" in cfg else {}
    tag = f"{config.replace('/', '_')}_{world}w_{int(time.time() * 1e3)}"
    procs, outs, logs = [], [], []
    for rank, (_, _, task) in enumerate(spec.all_task_configs(local_spec(world))):
        out, log = work / f"{tag}_{rank}.json", work / f"{tag}_{rank}.log"
        outs.append(out)
        logs.append(log)
        args = [sys.executable, __file__, "--mode=tf_worker", *_worker_args(config, iters, warmup)]
        args += [f"--out={out}", f"--profile_dir={profile_dir}"]
        with open(log, "w") as stream:
            procs.append(
                subprocess.Popen(
                    args,
                    env=_env(TF_CONFIG=json.dumps(task), **extra),
                    stdout=stream,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = _wait(procs, outs, timeout=600)
    if not all(o.exists() for o in outs):
        raise _failure(f"{config} with {world} workers", codes, logs)
    results = [json.loads(o.read_text()) for o in outs]
    result = results[0]
    result["rank_medians"] = [r.get("median_s") for r in results]
    result["verified"] = all(r["verified"] for r in results)
    return result


def run_mpi(config: str, world: int, iters: int, warmup: int, work: Path) -> dict:
    """Runs ``mpiexec -n world`` of the MPI worker; returns rank 0's result."""
    tag = f"{config.replace('/', '_')}_{world}w_{int(time.time() * 1e3)}"
    out, log = work / f"{tag}.json", work / f"{tag}.log"
    args = ["mpiexec", "-n", str(world), sys.executable, __file__, "--mode=mpi_worker"]
    args += [*_worker_args(config, iters, warmup), f"--out={out}"]
    with open(log, "w") as stream:
        proc = subprocess.Popen(args, env=_env(**MPI_ENV), stdout=stream, stderr=subprocess.STDOUT)
    codes = _wait([proc], [out], timeout=600, exit_too=True)
    if codes[0] or not out.exists():
        raise _failure(f"{config} with {world} ranks", codes, [log])
    result = json.loads(out.read_text())
    result["env"] = dict(MPI_ENV)
    return result


def run_socket(iters: int, warmup: int, work: Path) -> dict:
    """Runs the two socket peers; returns rank 0's times."""
    from tfdist.engines.net import free_ports

    port = free_ports(1)[0]
    tag = f"socket_{int(time.time() * 1e3)}"
    out = work / f"{tag}.json"
    procs, logs = [], []
    for rank in (0, 1):
        log = work / f"{tag}_{rank}.log"
        logs.append(log)
        args = [sys.executable, __file__, "--mode=socket_peer"]
        args += _worker_args("socket", iters, warmup)
        args += [f"--rank={rank}", f"--port={port}", f"--out={out}"]
        with open(log, "w") as stream:
            procs.append(
                subprocess.Popen(args, env=_env(), stdout=stream, stderr=subprocess.STDOUT)
            )
        if rank == 0:
            time.sleep(0.3)  # Rank 1 also retries; this just saves it the retries.
    codes = _wait(procs, [out], timeout=600, exit_too=True)
    if any(codes) or not out.exists():
        raise _failure("socket", codes, logs)
    return json.loads(out.read_text())


def _meta() -> dict:
    versions = {}
    for dist in ("tensorflow", "keras", "mpi4py", "mpich", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    layers = [int(w) for w in FLAGS.layers]
    argv = [a for a in sys.argv[1:] if not a.startswith("--mode=")]
    return {
        "command": " ".join(["python benchmarks/allreduce.py", *argv]),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "rates": list(FLAGS.rates),
        "workers": [int(w) for w in FLAGS.workers],
        "layers": layers,
        "params": param_count(layers),
        "bytes": 4 * param_count(layers),
        "iters": FLAGS.iters,
        "slow_iters": FLAGS.slow_iters,
        "rounds": FLAGS.rounds,
        "warmup": FLAGS.warmup,
        "slow_warmup": FLAGS.slow_warmup,
        "mpi_env": MPI_ENV,
        "versions": versions,
        "note": FLAGS.note,
        "configs": {
            k: {kk: vv for kk, vv in v.items() if kk != "label"} for k, v in TF_CONFIGS.items()
        },
    }


def _self_times(events: list[tuple[int, int, str]]) -> dict[str, list[float]]:
    """Inclusive and self picoseconds, and counts, by name, of one thread's nested events.

    Args:
        events: (start, duration, name) of one trace line; an event inside
            another (by time) is its child, and its time is not the parent's own.
    """
    totals: dict[str, list[float]] = {}
    stack: list[list] = []  # [end, name, duration, children's time]

    def close(item: list) -> None:
        end, name, dur, children = item
        entry = totals.setdefault(name, [0.0, 0.0, 0])
        entry[0] += dur
        entry[1] += max(0, dur - children)
        entry[2] += 1

    for start, dur, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            close(stack.pop())
        if stack:
            stack[-1][3] += min(dur, stack[-1][0] - start)
        stack.append([start + dur, name, dur, 0])
    while stack:
        close(stack.pop())
    return totals


def _summarize_trace(profile_dir: str) -> dict:
    """Where worker 0's traced all-reduces spent their time, from the trace's XSpace.

    For each plane with events: the window the events span; per thread (trace
    line) its events' self time and its top events; over all threads, the
    events by self time (their time minus their nested events'), with their
    inclusive time and count.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": f"no .xplane.pb under {profile_dir}"}
    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(paths[0]).read_bytes())
    summary: dict[str, Any] = {"file_bytes": Path(paths[0]).stat().st_size, "planes": []}
    for plane in space.planes:
        names = {k: (m.display_name or m.name) for k, m in plane.event_metadata.items()}
        lo, hi = math.inf, -math.inf
        threads, overall = [], {}
        for line in plane.lines:
            if not line.events:
                continue
            base = line.timestamp_ns * 1000
            events = [
                (base + e.offset_ps, e.duration_ps, names.get(e.metadata_id, "?")[:100])
                for e in line.events
            ]
            lo = min(lo, min(e[0] for e in events))
            hi = max(hi, max(e[0] + e[1] for e in events))
            totals = _self_times(events)
            for name, (incl, own, count) in totals.items():
                entry = overall.setdefault(name, [0.0, 0.0, 0])
                entry[0] += incl
                entry[1] += own
                entry[2] += count
            top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:4]
            threads.append(
                {
                    "thread": line.display_name or line.name,
                    "events": len(events),
                    "self_ms": sum(v[1] for v in totals.values()) / 1e9,
                    "top": [[n, v[1] / 1e9] for n, v in top if v[1] > 0],
                }
            )
        if not overall:
            continue
        threads.sort(key=lambda t: -t["self_ms"])
        top = sorted(overall.items(), key=lambda kv: -kv[1][1])[:25]
        summary["planes"].append(
            {
                "plane": plane.name,
                "window_ms": (hi - lo) / 1e9,
                "threads": threads[:12],
                "events": [
                    {"name": n, "self_ms": own / 1e9, "total_ms": incl / 1e9, "count": c}
                    for n, (incl, own, c) in top
                ],
            }
        )
    return summary


def inside() -> None:
    """Runs every job inside the private network namespace; writes the raw JSON."""
    if netns.has_other_interfaces():
        raise SystemExit(
            "Refusing to throttle: this is not a private network namespace "
            "(run without --mode=inside)."
        )
    work = Path(tempfile.mkdtemp(prefix="tfdist_allreduce_"))
    meta = _meta()
    runs: list[dict] = []
    failures: list[dict] = []
    load = [load_snapshot()]
    started = time.time()
    profile: dict[str, Any] = {}
    throttled = False

    def record(config: str, world: int, rate: str, result: dict | None, **extra) -> None:
        if result is None:
            return
        result.update(config=config, workers=world, rate=rate, **extra)
        runs.append(result)
        med = result.get("median_s")
        print(
            f"[{time.time() - started:6.1f}s] {rate:>6} {world}w {config:<22} "
            + (f"{med:.4f} s" if med is not None else "")
            + f"  verified={result.get('verified')}",
            flush=True,
        )

    def attempt(config: str, world: int, rate: str, fn, *args) -> dict | None:
        """``fn(*args)``, once more after a failure; None (and a note) after two."""
        for n in (1, 2):
            try:
                return fn(*args)
            except RuntimeError as error:
                print(f"{rate} {world}w {config}: attempt {n} failed: {error}", flush=True)
                failures.append(
                    {
                        "config": config,
                        "workers": world,
                        "rate": rate,
                        "attempt": n,
                        "error": str(error)[-1500:],
                    }
                )
        return None

    try:
        for rate in FLAGS.rates:
            limited = parse_rate(rate) != math.inf
            netns.loopback_up(mtu=1500 if limited else 65536)
            if limited:
                subprocess.run(tc_command(rate), check=True)
            elif throttled:
                netns.unthrottle()
            throttled = limited
            iters = FLAGS.slow_iters if limited else FLAGS.iters
            warmup = FLAGS.slow_warmup if limited else FLAGS.warmup
            for world in [int(w) for w in FLAGS.workers]:
                if limited:
                    configs = FLAGS.configs_limited
                else:
                    configs = FLAGS.configs if world == 2 else FLAGS.configs_more
                order = ["mpi/flat", *configs, "mpi/tensors"]
                rounds = 1 if limited else FLAGS.rounds
                jobs = []
                for r in range(rounds):
                    jobs += [(r, c) for c in (order if r % 2 == 0 else order[::-1])]
                if rounds == 1 and FLAGS.repeat_default and "tf/default" in configs:
                    jobs.append((1, "tf/default"))
                for r, config in jobs:
                    if config.startswith("mpi/"):
                        res = attempt(
                            config, world, rate, run_mpi, config, world, iters, warmup, work
                        )
                        record(config, world, rate, res, round=r)
                        continue
                    trace = ""
                    if FLAGS.profile and world == 2 and not limited and config == "tf/default":
                        if r == 0:
                            trace = FLAGS.trace_dir or str(work / "trace")
                    res = attempt(
                        config, world, rate, run_tf, config, world, iters, warmup, work, trace
                    )
                    record(config, world, rate, res, round=r)
                    if trace and res is not None:
                        try:
                            profile = _summarize_trace(trace)
                        except Exception as error:  # noqa: BLE001 - any parse failure is reported, not fatal
                            profile = {"error": f"{type(error).__name__}: {error}"}
                if world == 2:
                    res = attempt("socket", 2, rate, run_socket, iters, warmup, work)
                    if res is not None:
                        for way in ("exchange", "oneway"):
                            record(
                                f"socket/{way}",
                                2,
                                rate,
                                {
                                    "times": res[way],
                                    "median_s": statistics.median(res[way]),
                                    "cpu_s": res["exchange_cpu_s"] if way == "exchange" else None,
                                    "bytes": res["bytes"],
                                    "verified": None,
                                },
                                round=0,
                            )
                    if not limited:
                        for config in ("mpi/sweep", TF_SWEEP):
                            run = run_mpi if config == "mpi/sweep" else run_tf
                            res = attempt(config, 2, rate, run, config, 2, iters, warmup, work)
                            record(config, 2, rate, res, round=0)
                load.append(load_snapshot())
        if throttled:
            netns.unthrottle()
    finally:
        meta.update(wall_s=time.time() - started, load=load, failures=failures)
        Path(FLAGS.results_dir).mkdir(parents=True, exist_ok=True)
        raw = {"meta": meta, "runs": runs, "profile": profile}
        _raw_path().write_text(json.dumps(raw, indent=1))
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- report


def _raw_path() -> Path:
    return Path(FLAGS.results_dir) / f"{FLAGS.name}.json"


def fit(points: Sequence[tuple[float, float]]) -> dict:
    """time = alpha + beta * bytes from (bytes, seconds) points, at least 2 sizes.

    beta is the slope between the two largest messages (the per-byte cost
    once latency no longer counts); alpha is the smallest message's time less
    beta times its bytes (the fixed cost per collective), floored at 0 (an MPI
    library moves small messages cheaper per byte than large ones). An MPI library
    changes protocol with size (eager, then rendezvous), so one straight line
    through all points would misstate both; the least-squares line by
    relative error is kept as ``least_squares`` for reference.
    """
    pts = sorted(points)
    (x1, y1), (x2, y2) = pts[-2], pts[-1]
    beta = (y2 - y1) / (x2 - x1)
    alpha = max(0.0, pts[0][1] - beta * pts[0][0])
    w = [1 / y**2 for _, y in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    ls_beta = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, pts)) / sxx
    return {
        "alpha_s": alpha,
        "beta_s_per_byte": beta,
        "gbyte_per_s": (1e-9 / beta) if beta > 0 else None,
        "points": [[x, y] for x, y in pts],
        "relative_residuals": [(y - alpha - beta * x) / y for x, y in pts],
        "least_squares": {"alpha_s": my - ls_beta * mx, "beta_s_per_byte": ls_beta},
    }


def _wire(nbytes: int, world: int, rate: str) -> dict | None:
    """Seconds on the wire of one all-reduce at ``rate``.

    ``per_worker_s``: one worker's 2(N-1)/N of the bytes; ``shared_medium_s``:
    all N workers' bytes, which share the one limited loopback.
    """
    bits = parse_rate(rate)
    if bits == math.inf:
        return None
    per_worker = 2 * (world - 1) / world * nbytes * 8 / bits
    return {"per_worker_s": per_worker, "shared_medium_s": per_worker * world}


#: Configurations that run the same thing as tf/default: their spread is the noise.
SAME_AS_DEFAULT = ("tf/default", "tf/ring", "tf/pack0")


def summarize(raw: dict) -> dict:
    """Rows per (workers, rate) with each configuration's runs pooled; ratios, fits, bounds."""
    runs = raw["runs"]
    cells: dict[tuple[int, str], dict[str, list[dict]]] = {}
    for r in runs:
        if r["config"].endswith("sweep"):
            continue
        cell = cells.setdefault((r["workers"], r["rate"]), {})
        cell.setdefault(r["config"], []).append(r)
    tables = []
    for (world, rate), by_config in cells.items():
        pooled = {}
        for config, group in by_config.items():
            times = [t for g in group for t in g["times"]]
            cpus = [g["cpu_s"] for g in group if g.get("cpu_s") is not None]
            pooled[config] = {
                "config": config,
                "median_s": statistics.median(times),
                "run_medians": [g["median_s"] for g in group],
                "cpu_s": statistics.mean(cpus) if cpus else None,
                "collectives": group[0].get("collectives"),
                "verified": (
                    None
                    if group[0].get("verified") is None
                    else all(g.get("verified") for g in group)
                ),
                "max_error": max((g.get("max_error") or 0.0) for g in group),
                "rank_medians": [g.get("rank_medians") for g in group],
            }
        mpi = pooled.get("mpi/flat", {}).get("median_s")
        default = pooled.get("tf/default", {}).get("median_s")
        for row in pooled.values():
            row["vs_mpi"] = row["median_s"] / mpi if mpi else None
            row["vs_default"] = row["median_s"] / default if default else None
        same = [
            m / default
            for c in SAME_AS_DEFAULT
            if c in pooled and default
            for m in [pooled[c]["median_s"], *pooled[c]["run_medians"]]
        ]
        band = max([0.05, *(abs(x - 1) for x in same)])
        some = next(iter(by_config.values()))[0]
        nbytes = some.get("bytes", raw["meta"]["bytes"])
        tables.append(
            {
                "workers": world,
                "rate": rate,
                "rows": list(pooled.values()),
                "wire": _wire(nbytes, world, rate),
                "noise_band": band,
            }
        )
    fits = {}
    for config in ("tf/sweep", "mpi/sweep"):
        sweep = next((r for r in runs if r["config"] == config), None)
        if sweep is not None:
            fits[config] = fit([(p["bytes"], p["median_s"]) for p in sweep["sweep"]])
            fits[config]["verified"] = sweep["verified"]
            fits[config]["cpu_s"] = sweep["sweep"][-1].get("cpu_s")
    sock = next(
        (r for r in runs if r["config"] == "socket/exchange" and r["rate"] == NO_LIMIT), None
    )
    if sock is not None:
        # One point: at 23 MB the per-message latency is negligible.
        fits["socket/exchange"] = {
            "beta_s_per_byte": sock["median_s"] / sock["bytes"],
            "gbyte_per_s": 1e-9 * sock["bytes"] / sock["median_s"],
            "cpu_s": sock.get("cpu_s"),
            "points": [[sock["bytes"], sock["median_s"]]],
        }
    return {"tables": tables, "fits": fits}


def _label(config: str) -> str:
    if config in TF_CONFIGS:
        return f"`{config}` {TF_CONFIGS[config]['label']}"
    return f"`{config}` {OTHER_LABELS.get(config, '')}"


def _f(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _rate_name(rate: str) -> str:
    if rate == NO_LIMIT:
        return "unthrottled loopback (MTU 65536)"
    bits = parse_rate(rate)
    unit = f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"
    return f"{unit} (tc tbf, MTU 1500)"


def _conclusions(summary: dict) -> list[str]:
    """Sentences computed from the numbers: which levers help, and by how much."""
    lines = []
    for table in summary["tables"]:
        rows = {r["config"]: r for r in table["rows"]}
        default, mpi = rows.get("tf/default"), rows.get("mpi/flat")
        if default is None:
            continue
        band = table["noise_band"]
        levers = [r for c, r in rows.items() if c.startswith("tf/") and c not in SAME_AS_DEFAULT]
        helped = sorted(
            (r for r in levers if r["vs_default"] < 1 - band), key=lambda r: r["vs_default"]
        )
        hurt = sorted(
            (r for r in levers if r["vs_default"] > 1 + band), key=lambda r: -r["vs_default"]
        )
        text = (
            f"**{table['workers']} workers, {_rate_name(table['rate'])}**: TF default "
            f"{default['median_s']:.4f} s"
        )
        if mpi is not None:
            text += f", MPI {mpi['median_s']:.4f} s (TF/MPI {default['vs_mpi']:.2f})"
        text += (
            f"; noise band ±{band:.0%} (how far the runs of configurations identical to "
            "default strayed from it). "
        )
        if helped:
            text += "Faster than default beyond it: " + ", ".join(
                f"`{r['config']}` ×{r['vs_default']:.2f}" for r in helped
            )
            if mpi is not None:
                text += f" (best {helped[0]['vs_mpi']:.2f}× MPI)"
            text += ". "
        else:
            text += "No lever beats default beyond it. "
        if hurt:
            text += (
                "Slower: "
                + ", ".join(f"`{r['config']}` ×{r['vs_default']:.2f}" for r in hurt)
                + ". "
            )
        wire = table["wire"]
        if wire is not None:
            text += (
                f"Wire floor (all workers' bytes through the one limited loopback) "
                f"{wire['shared_medium_s']:.3f} s: TF default at "
                f"{default['median_s'] / wire['shared_medium_s']:.2f}× it"
            )
            if mpi is not None:
                text += f", MPI at {mpi['median_s'] / wire['shared_medium_s']:.2f}×"
            text += "."
        lines.append(text.strip())
    fits = summary["fits"]
    if "tf/sweep" in fits and "mpi/sweep" in fits:
        tf_fit, mpi_fit = fits["tf/sweep"], fits["mpi/sweep"]
        text = (
            f"**α/β**: TF's fixed cost per collective is {tf_fit['alpha_s'] * 1e3:.2f} ms "
            f"(MPI's whole {int(mpi_fit['points'][0][0]):,}-byte all-reduce: "
            f"{mpi_fit['points'][0][1] * 1e3:.3f} ms) and its cost per byte "
            f"{tf_fit['beta_s_per_byte'] * 1e9:.2f} ns (MPI "
            f"{mpi_fit['beta_s_per_byte'] * 1e9:.2f} ns"
        )
        sock = fits.get("socket/exchange")
        if sock:
            text += (
                f"; the socket moving the same bytes both ways "
                f"{sock['beta_s_per_byte'] * 1e9:.2f} ns"
            )
        total = tf_fit["points"][-1][0]
        share = tf_fit["alpha_s"] / (tf_fit["alpha_s"] + tf_fit["beta_s_per_byte"] * total)
        text += f"): at {total:,} bytes α is {share:.0%} of TF's all-reduce, β the rest."
        lines.append(text)
    return lines


def markdown(raw: dict, summary: dict) -> str:
    """The report: conditions, a table per (workers, rate), the fit, the profile, conclusions."""
    meta = raw["meta"]
    v = meta["versions"]
    loads = [s["loadavg"][0] for s in meta["load"] if s.get("loadavg")]
    lines = [
        f"# TensorFlow's cross-process all-reduce vs MPI ({meta['params']:,} fp32 values, "
        f"{meta['bytes']:,} bytes)",
        "",
        f"`{meta['command']}` — {meta['when']}, wall time {meta['wall_s'] / 60:.1f} min.",
        "",
        f"Machine: {meta['cpus']} cores, no GPU; TensorFlow {v['tensorflow']}, Keras "
        f"{v['keras']}, mpi4py {v['mpi4py']}, MPICH {v['mpich']} (`mpiexec`, "
        + " ".join(f"{k}={val}" for k, val in meta["mpi_env"].items())
        + "). 1-minute load average before, after each cell and at the end: "
        + ", ".join(f"{x:.2f}" for x in loads)
        + " (the benchmark's own workers count in it: 2 or 4 busy processes)."
        + (f" {meta['note']}" if meta.get("note") else ""),
        "",
        f"Each job: its own processes on 127.0.0.1 in a private network namespace, "
        f"{meta['warmup']} untimed all-reduces, then {meta['iters']} timed "
        f"({meta['slow_warmup']} and {meta['slow_iters']} on a limited link). Unthrottled, "
        f"every job ran in {meta.get('rounds', 1)} rounds (the second in reverse order); a "
        "configuration's figure is the median of worker 0's seconds per all-reduce over "
        "all its timed calls, and *runs* lists each job's median. The message: the MLP's 8 "
        "gradient tensors (layers "
        + "-".join(map(str, meta["layers"]))
        + "). TensorFlow: `strategy.run` of `get_replica_context().all_reduce(SUM, tensors, "
        "options=...)` in a `tf.function` (the `merge_call` → `batch_reduce_to` path of Keras's "
        "gradients), one intra-op and one inter-op thread unless the row says otherwise. Every "
        "result was checked against the expected sum N(N+1)/2 (*sum ok*). *collectives*: "
        "CollectiveReduceV2 ops in the traced function (MPI: Allreduce calls). *CPU*: worker "
        "0's process CPU time (user + system, all threads) per all-reduce; MPICH polls while "
        "it waits, so its CPU time is its wall time.",
        "",
    ]
    for table in summary["tables"]:
        world, rate = table["workers"], table["rate"]
        lines += [f"## {world} workers, {_rate_name(rate)}", ""]
        if table["wire"] is not None:
            w = table["wire"]
            lines += [
                f"Wire time of one all-reduce: {w['per_worker_s']:.3f} s for one worker's "
                f"2(N−1)/N·bytes; {w['shared_medium_s']:.3f} s for all {world} workers' "
                "bytes, which share the one limited loopback (the floor here).",
                "",
            ]
        lines += [
            "| configuration | s per all-reduce | vs MPI flat | vs TF default | runs "
            "| collectives | CPU s | sum ok |",
            "|---|---:|---:|---:|---|---:|---:|---|",
        ]
        for r in table["rows"]:
            ok = {True: "yes", False: "**NO**", None: "—"}[r["verified"]]
            each = (
                ", ".join(f"{m:.4f}" for m in r["run_medians"]) if len(r["run_medians"]) > 1 else ""
            )
            lines.append(
                f"| {_label(r['config'])} | {_f(r['median_s'], 4)} | {_f(r['vs_mpi'], 2)} | "
                f"{_f(r['vs_default'], 2)} | {each} | "
                f"{r['collectives'] if r['collectives'] else '—'} | {_f(r['cpu_s'], 4)} | {ok} |"
            )
        lines.append("")
    fits = summary["fits"]
    if fits:
        lines += [
            "## Where the time goes: time = α + β·bytes (2 workers, unthrottled)",
            "",
            "One all-reduce of one float32 tensor per size (default options; one job per "
            "framework). β: the cost per byte of the all-reduced buffer, the slope between the "
            "two largest messages (1/β: its bytes per second); α: the fixed cost per collective, "
            "the smallest message's time less β times its bytes (0 if that is negative). The "
            "socket's "
            "β is its one 23 MB point: both processes sending the bytes and receiving the "
            "peer's at once, the traffic of a 2-process all-reduce.",
            "",
            "| | α | β | 1/β | worker 0 CPU s, largest | points (bytes: ms) |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, label in (
            ("tf/sweep", "TensorFlow default"),
            ("mpi/sweep", "MPI Allreduce"),
            ("socket/exchange", "TCP socket, both ways"),
        ):
            if name not in fits:
                continue
            f = fits[name]
            alpha = f"{f['alpha_s'] * 1e3:.3f} ms" if "alpha_s" in f else "—"
            pts = "; ".join(f"{int(x):,}: {y * 1e3:.3f}" for x, y in f.get("points", []))
            lines.append(
                f"| {label} | {alpha} | {f['beta_s_per_byte'] * 1e9:.3f} ns/B | "
                f"{_f(f['gbyte_per_s'], 2)} GB/s | {_f(f.get('cpu_s'), 4)} | {pts} |"
            )
        if "tf/sweep" in fits and "mpi/sweep" in fits:
            tf_fit, mpi_fit = fits["tf/sweep"], fits["mpi/sweep"]
            sock_beta = fits.get("socket/exchange", {}).get("beta_s_per_byte")
            lines += [
                "",
                f"TensorFlow's α over MPI's whole smallest all-reduce "
                f"({mpi_fit['points'][0][1] * 1e3:.3f} ms): "
                f"×{tf_fit['alpha_s'] / mpi_fit['points'][0][1]:.0f}; "
                f"β ×{tf_fit['beta_s_per_byte'] / mpi_fit['beta_s_per_byte']:.1f}."
                + (
                    f" β over the socket's: TF ×{tf_fit['beta_s_per_byte'] / sock_beta:.1f},"
                    f" MPI ×{mpi_fit['beta_s_per_byte'] / sock_beta:.1f}."
                    if sock_beta
                    else ""
                )
                + " Residuals of the line at each size (of the time): TF "
                + ", ".join(f"{x:+.0%}" for x in tf_fit["relative_residuals"])
                + "; MPI "
                + ", ".join(f"{x:+.0%}" for x in mpi_fit["relative_residuals"])
                + ".",
            ]
        lines.append("")
    lines += _profile_markdown(raw.get("profile") or {})
    lines += ["## Conclusion (computed from the tables)", ""]
    lines += [f"- {c}" for c in _conclusions(summary)]
    if meta.get("failures"):
        lines += ["", "## Failures", ""]
        lines += [
            f"- {f['rate']} {f['workers']}w {f['config']} (attempt {f['attempt']}): "
            + f["error"].strip().splitlines()[-1][:300]
            for f in meta["failures"]
        ]
    return "\n".join(lines) + "\n"


def _profile_markdown(profile: dict) -> list[str]:
    if not profile:
        return []
    lines = ["## Profile: worker 0, 5 default all-reduces (unthrottled, 2 workers)", ""]
    if "error" in profile:
        return [*lines, f"The trace could not be summarised: {profile['error']}", ""]
    for plane in profile.get("planes", []):
        lines += [
            f"Plane `{plane['plane']}`: the traced calls span {plane['window_ms']:.1f} ms. "
            "Threads by their events' self time (time not inside a nested event):",
            "",
            "| thread | events | self ms | its top events (self ms) |",
            "|---|---:|---:|---|",
        ]
        lines += [
            f"| {t['thread']} | {t['events']} | {t['self_ms']:.1f} | "
            + ", ".join(f"`{n}` {ms:.1f}" for n, ms in t["top"])
            + " |"
            for t in plane["threads"][:10]
        ]
        lines += [
            "",
            "Events by self time (inclusive: with their nested events):",
            "",
            "| event | count | self ms | inclusive ms |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{e['name']}` | {e['count']} | {e['self_ms']:.1f} | {e['total_ms']:.1f} |"
            for e in plane["events"][:15]
        ]
        lines.append("")
    return lines


def report() -> None:
    """Writes the markdown from the JSON of the last run (and the summary into the JSON)."""
    raw = json.loads(_raw_path().read_text())
    summary = summarize(raw)
    raw["summary"] = summary
    _raw_path().write_text(json.dumps(raw, indent=1))
    md = Path(FLAGS.results_dir) / f"{FLAGS.name}.md"
    md.write_text(markdown(raw, summary))
    print(md.read_text())


def _apply_quick() -> list[str]:
    """Flags --quick sets (unless given explicitly)."""
    quick = {
        "layers": ",".join(QUICK_LAYERS),
        "rates": "none",
        "workers": "2",
        "configs": "tf/default,tf/flat",
        "iters": "5",
        "warmup": "2",
        "fit_sizes": "65536,flat",
        "profile": "false",
        "repeat_default": "false",
        "rounds": "1",
        "name": "allreduce_quick",
    }
    given = {a.split("=", 1)[0].lstrip("-") for a in sys.argv[1:]}
    return [f"--{k}={v}" for k, v in quick.items() if k not in given]


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "tf_worker":
        tf_worker()
    elif FLAGS.mode == "mpi_worker":
        mpi_worker()
    elif FLAGS.mode == "socket_peer":
        socket_peer()
    elif FLAGS.mode == "inside":
        inside()
    elif FLAGS.mode == "report":
        report()
    else:
        netns.require("benchmarks/allreduce.py")
        if shutil.which("mpiexec") is None:
            raise SystemExit("benchmarks/allreduce.py needs mpiexec (pip install mpich mpi4py).")
        extra = _apply_quick() if FLAGS.quick else []
        netns.rerun_inside(__file__, sys.argv[1:] + extra)
        subprocess.run(
            [sys.executable, __file__] + sys.argv[1:] + extra + ["--mode=report"], check=True
        )


if __name__ == "__main__":
    define_flags()
    app.run(main)
