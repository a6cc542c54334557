"""Timestamps inside the training step, where the work happens.

A step's phases are measured in the graph, not estimated: ``tf.timestamp()``
ops run when the tensors they are made to depend on are ready, and write
into a small float64 variable (the *marks*) that the host reads after the
step. The marks are taken at:

* ``input_ready``: the batch handed to ``train_step`` (Keras ``fit``, via
  :func:`wrap_step`; a custom loop may call :meth:`Profiler.mark_input`);
* ``grads_ready``: every gradient handed to the optimizer;
* ``peers_ready``, with ``barrier=True``: a scalar all-reduce, issued once
  the gradients are ready, returned. It returns when the slowest replica
  has issued its own, so the time before it is the wait for the slowest
  peer, and the gradients' collectives after it measure the transfer alone.
  Without the barrier (the default) the wait stays inside the first
  collective, and :func:`~tfdist.profiling.records.derive_waits` separates
  it once every worker's records are gathered;
* one span per collective (its input ready, its output ready, the bytes this
  replica sent through it), from :class:`ProfiledComm` or around Keras's own
  all-reduce;
* ``reduced``: the reduced (decompressed) gradients ready;
* ``end``: the step's outputs (the update and Keras's metrics) ready.

Only the first replica of each worker records. TensorFlow's automatic
control dependencies run all stateful ops that touch no resource, the
timestamps among them, in program order; under MirroredStrategy every
replica's ops are traced into one graph, so a second replica's marks would
wait for the first replica's. One replica per worker keeps them true.

The profiler adds no collective by default; the barrier adds one float per
step, about one latency of the link. Either way a span's start waits for
every gradient, so the gradients' transfer follows the backward pass, as
TensorFlow's default (one pack per step) does anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import record as kept
from tfdist.compat.tf_python import resource_variable_ops
from tfdist.compression import keras_hook
from tfdist.profiling.records import Span, StepRecord
from tfdist.transport.comm import ReplicaComm
from tfdist.transport.traffic import (
    all_gather_bytes,
    all_reduce_bytes,
    nbytes,
    slices_nbytes,
    wire_nbytes,
)

__all__ = [
    "Profiler",
    "ProfiledComm",
    "HEADER",
    "MAX_SPANS",
    "wrap_step",
    "profiler_of",
    "model_profiler",
    "wrap_make_function",
]

#: Slots of the marks vector before the spans.
HEADER = 8
_INPUT, _GRADS, _PEERS, _REDUCED, _END, _STEP = range(6)
#: Collectives recorded per step; more are left out of the record (and
#: counted in :attr:`Profiler.dropped_spans`).
MAX_SPANS = 32
_KINDS = {1.0: "all_reduce", 2.0: "all_gather"}
_KIND_CODES = {v: k for k, v in _KINDS.items()}


def worker_devices(strategy: Any) -> list[str]:
    """The devices of this worker's replicas; none for the default strategy."""
    try:
        return list(getattr(strategy.extended, "worker_devices", ()) or ())
    except RuntimeError:  # The default strategy has no worker devices.
        return []


def profiler_of(strategy: Any = None) -> Profiler | None:
    """The profiler active on ``strategy`` (default: the current one)."""
    strategy = strategy or tf.distribute.get_strategy()
    return kept.record_of(strategy).observer


def model_profiler(model: object) -> Profiler | None:
    """The profiler ``model``'s train function is built with, if any."""
    return kept.slot(model, Profiler)


def _flat_tensors(structure: Any) -> list[tf.Tensor]:
    out = []
    for t in tf.nest.flatten(structure, expand_composites=True):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype != tf.resource:
            out.append(t)
    return out


def _plain_variable(initial_value: Any, name: str) -> tf.Variable:
    """A variable of this host only, even inside a strategy's scope (a
    distributed one would be mirrored or synced, and its copies read through
    the strategy)."""

    def creator(next_creator, **kwargs):
        return resource_variable_ops.ResourceVariable(
            initial_value=kwargs["initial_value"], trainable=False, name=name
        )

    with tf.init_scope(), tf.variable_creator_scope(creator):
        return tf.Variable(initial_value, trainable=False, name=name)


class _Trace:
    """What one trace of a step has recorded so far (Python, trace time).

    ``owner`` is who ends it: ``"step"`` (Keras's train_step, wrapped) or
    ``"reduce"`` (the gradient reduction, in a custom loop).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.reset = False
        self.spans = 0


class Profiler:
    """Measures every step of the first replica of this worker.

    Attach it to a strategy with :meth:`attach` (the
    :class:`~tfdist.profiling.callback.StepProfile` callback does), trace a
    step, then call :meth:`record` after each step.

    Args:
        strategy: The strategy the steps run under.
        barrier: Measure the wait for the slowest peer with a scalar
            all-reduce before the gradients' collectives. Without it the
            wait is inside the first collective's span.
    """

    def __init__(self, strategy: tf.distribute.Strategy, barrier: bool = False) -> None:
        self.strategy = strategy
        self.barrier = barrier
        devices = worker_devices(strategy)
        self._primary = tf.DeviceSpec.from_string(devices[0]).to_string() if devices else None
        self._local_replicas = max(1, len(devices))
        with tf.device(devices[0] if devices else None):
            self.marks = _plain_variable(
                tf.zeros([HEADER + 4 * MAX_SPANS], tf.float64), name="tfdist_profile_marks"
            )
        self._trace: _Trace | None = None
        self.dropped_spans = 0

    # -- attaching ---------------------------------------------------------
    def attach(self) -> Profiler:
        """Makes the strategy's steps record into this profiler (replacing
        one a failed ``fit`` left attached)."""
        kept.record_of(self.strategy).observer = self
        return self

    def detach(self) -> None:
        if profiler_of(self.strategy) is self:
            kept.record_of(self.strategy).observer = None

    # -- trace time --------------------------------------------------------
    def _records_here(self) -> bool:
        """Whether the replica being traced is this worker's first."""
        if self._local_replicas == 1:
            return True
        ctx = tf.distribute.get_replica_context()
        devices = getattr(ctx, "devices", None) if ctx is not None else None
        first = devices[0] if devices else None
        while isinstance(first, (list, tuple)):  # MirroredStrategy: ([device],)
            first = first[0] if first else None
        if not first:
            return False
        return tf.DeviceSpec.from_string(first).to_string() == self._primary

    def _write(self, slots: Sequence[int], values: Sequence[Any]) -> None:
        trace = self._trace
        if trace is None:
            trace = self._trace = _Trace("reduce")
        if not trace.reset:
            # The first mark of a step clears the last step's, so a collective
            # in a branch not taken this step leaves no stale span.
            trace.reset = True
            self.marks.assign(tf.zeros_like(self.marks))
        self.marks.scatter_nd_update(
            tf.constant([[s] for s in slots], tf.int64),
            tf.stack([tf.cast(v, tf.float64) for v in values]),
        )

    @staticmethod
    def _stamp(after: Sequence[Any]) -> tf.Tensor:
        deps = _flat_tensors(after)
        with tf.control_dependencies(deps):
            return tf.timestamp()

    def mark(self, slot: int, after: Any) -> None:
        if self._records_here():
            self._write([slot], [self._stamp([after])])

    def mark_input(self, data: Any) -> Any:
        """Marks the batch ready; call it first in a custom loop's step
        function (``fit`` does it for you). Returns ``data``."""
        self.mark(_INPUT, data)
        return data

    def begin_trace(self) -> None:
        if self._records_here():
            self._trace = _Trace("step")

    def end_trace(self, outputs: Any) -> None:
        if self._records_here():
            self.mark(_END, outputs)
            self._trace = None

    def before_reduce(self, pairs: list, step: Any) -> list:
        """Marks the gradients ready and waits for the peers; returns the
        pairs with gradients that follow the wait."""
        grads = [g for g, _ in pairs if g is not None]
        here = self._records_here()
        if here:
            self._write([_GRADS, _STEP], [self._stamp(grads), step])
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return pairs  # No peer to wait for: peers_ready = grads_ready.
        if not self.barrier:
            if here:
                self.mark(_PEERS, grads)
            return pairs
        with tf.control_dependencies(_flat_tensors(grads)):
            token = tf.ones([], tf.float32)
        arrived = ctx.all_reduce(tf.distribute.ReduceOp.SUM, token)
        if here:
            self.mark(_PEERS, arrived)
        out = []
        for g, v in pairs:
            if g is not None:
                with tf.control_dependencies([arrived]):
                    g = tf.nest.map_structure(tf.identity, g, expand_composites=True)
            out.append((g, v))
        return out

    def after_reduce(self, grads: Any) -> None:
        if not self._records_here():
            return
        self.mark(_REDUCED, [g for g in tf.nest.flatten(grads) if g is not None])
        if self._trace is not None and self._trace.owner != "step":
            self._trace = None  # A custom loop's step ends with its update.

    def make_comm(self) -> ProfiledComm:
        """The collectives the aggregator of a compressed step uses."""
        return ProfiledComm(self)

    def keras_reduce(self, pairs: list, run: Callable[[], Any]) -> Any:
        """Keras's own all-reduce (no compression), recorded as one span."""
        ctx = tf.distribute.get_replica_context()
        grads = [g for g, _ in pairs if g is not None]
        n = ctx.num_replicas_in_sync if ctx is not None else 1
        if n == 1:
            return run()  # Nothing crosses a wire.
        return self.span("all_reduce", grads, run, sent_by_all_reduce(grads, n))

    def span(self, kind: str, inputs: Any, run: Callable[[], Any], sent: Any) -> Any:
        """Runs the collective ``run`` and records its span; ``sent`` is the
        bytes this replica sends through it (a number or a tensor)."""
        if not self._records_here():
            return run()
        start = self._stamp([inputs])
        with tf.control_dependencies([start]):
            outputs = run()
        end = self._stamp([outputs])
        trace = self._trace or _Trace("reduce")
        self._trace = trace
        if trace.spans >= MAX_SPANS:
            self.dropped_spans += 1
            return outputs
        base = HEADER + 4 * trace.spans
        trace.spans += 1
        self._write([base, base + 1, base + 2, base + 3], [start, end, sent, _KIND_CODES[kind]])
        return outputs

    # -- run time ----------------------------------------------------------
    def record(self, *, worker: int, epoch: int, host_begin: float, host_end: float) -> StepRecord:
        """The last step's record, read from the marks."""
        return decode(
            self.marks.numpy(), worker=worker, epoch=epoch, host_begin=host_begin, host_end=host_end
        )


def decode(
    marks: np.ndarray, *, worker: int, epoch: int, host_begin: float, host_end: float
) -> StepRecord:
    """A :class:`StepRecord` from one step's marks vector and host times.

    Instants not measured (0) repeat the one before, so their phase is 0.
    """
    marks = np.asarray(marks, dtype=np.float64)
    spans = []
    for base in range(HEADER, marks.shape[0] - 3, 4):
        start, end, sent, kind = marks[base : base + 4]
        if start > 0 and kind in _KINDS:
            spans.append(Span(_KINDS[kind], float(start), float(end), float(sent)))
    spans.sort(key=lambda s: s.start)
    instants = []
    last = host_begin
    for slot in (_INPUT, _GRADS, _PEERS, _REDUCED, _END):
        value = float(marks[slot])
        if slot == _REDUCED and value <= 0 and spans:
            value = max(s.end for s in spans)
        last = value if value > 0 else last
        instants.append(last)
    return StepRecord(
        worker=worker,
        step=int(marks[_STEP]),
        epoch=epoch,
        host_begin=host_begin,
        input_ready=instants[0],
        grads_ready=instants[1],
        peers_ready=instants[2],
        reduced=instants[3],
        end=instants[4],
        host_end=max(host_end, instants[4]),
        spans=spans,
    )


def _payload_bytes(tensors: Sequence[Any]) -> tuple[Any, Any]:
    """(all-reduce payload, sparse all-gather payload) of ``tensors``: the
    dense bytes statically, the slices' bytes from this replica's rows."""
    dense, sparse = 0, []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            row = int(np.prod(t.values.shape.as_list()[1:]))
            fixed = slices_nbytes(0, row, t.values.dtype.name, t.indices.dtype.name)
            per_row = slices_nbytes(1, row, t.values.dtype.name, t.indices.dtype.name) - fixed
            rows = tf.cast(tf.shape(t.indices)[0], tf.float64)
            sparse.append(fixed + per_row * rows)
        elif t is not None:
            dense += nbytes(t.shape.as_list(), t.dtype.name)
    return dense, (tf.add_n(sparse) if sparse else 0)


def sent_by_all_reduce(tensors: Sequence[Any], num_replicas: int) -> Any:
    """Bytes one replica sends when ``tensors`` are all-reduced (IndexedSlices
    all-gathered, as TensorFlow does)."""
    dense, sparse = _payload_bytes(tensors)
    out = all_reduce_bytes(dense, num_replicas)
    if not isinstance(sparse, int):
        out = out + sparse * float(num_replicas - 1)
    return out


class ProfiledComm(ReplicaComm):
    """:class:`ReplicaComm` whose collectives are recorded as spans."""

    def __init__(self, profiler: Profiler) -> None:
        super().__init__()
        self._profiler = profiler

    def send_all_reduce(self, tensors):
        return self._profiler.span(
            "all_reduce",
            tensors,
            lambda: super(ProfiledComm, self).send_all_reduce(tensors),
            sent_by_all_reduce(tensors, self.num_replicas),
        )

    def send_all_gather(self, tensors):
        payload = sum(wire_nbytes(t.shape.as_list(), t.dtype.name) for t in tensors)
        return self._profiler.span(
            "all_gather",
            tensors,
            lambda: super(ProfiledComm, self).send_all_gather(tensors),
            all_gather_bytes(payload, self.num_replicas),
        )


def wrap_step(step_function: Callable, profiler: Profiler) -> Callable:
    """``step_function`` (Keras's ``train_step``) with the input and end marks."""

    @functools.wraps(step_function)
    def profiled_step(data):
        profiler.begin_trace()
        profiler.mark_input(data)
        outputs = step_function(data)
        # The metrics do not wait for the update; reading the weights does
        # (each read follows the write to its variable).
        model = getattr(step_function, "__self__", None)
        weights = [tf.convert_to_tensor(v) for v in getattr(model, "trainable_variables", ())]
        profiler.end_trace([outputs, weights])
        return outputs

    return profiled_step


def wrap_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        profiler = model_profiler(self)
        if profiler is not None and getattr(step_function, "__name__", "") == "train_step":
            step_function = wrap_step(step_function, profiler)
        return original(self, step_function)

    return _make_function


def install() -> None:
    """Lets ``fit`` build its train function with the marks of the profiler
    set on the model (:func:`model_profiler`): the registry's ``profiling``;
    idempotent.

    Raises:
        tfdist.ConfigError: ``_make_function`` changed in this Keras and
            the profiler was switched off (with a warning).
    """
    from tfdist import compat

    keras_hook.install()
    compat.install("profiling")
    compat.require("profiling", "StepProfile")
