"""One process's work in a training step: its micro-batches' forward and
backward passes in the schedule's order (over its stages, with the
interleaved schedule's chunks), the activations and their gradients sent to
the processes of the neighbouring stages, tagged with the stage they go to,
and the optimizer applied to the process's own variables.

The loss is the model's: the last stage computes it on each micro-batch and
scales it by ``1 / m``, so that the gradients summed over the micro-batches
are those of the whole batch's mean loss (Keras's default reduction). The
step's loss travels back from the last stage to every stage, so that each
process's ``fit`` logs the same number.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.pipeline.laid_out import MeshPasses, apply_on, sum_gradients
from tfdist.pipeline.schedule import actions
from tfdist.pipeline.split import Stage
from tfdist.transport.p2p import ALIGN_BYTES

__all__ = ["Link", "StageRunner", "microbatches"]


class Link(Protocol):
    """A connection to a neighbouring stage (tfdist.transport.p2p.Link)."""

    def send(self, tag: tuple, arrays: Sequence[np.ndarray]) -> None: ...

    def post(self, tag: tuple, arrays: Sequence[np.ndarray]) -> None: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def recv(self, tag: tuple, timeout: float | None = None) -> list[np.ndarray]: ...

    def close(self) -> None: ...


#: Dtypes whose arrays :func:`as_tensor` shares with TensorFlow through DLPack.
SHARED_DTYPES = frozenset(
    np.dtype(t) for t in ("float16", "float32", "float64", "int8", "int32", "int64", "uint8")
)


def as_tensor(array: np.ndarray) -> tf.Tensor:
    """A received array as a tensor, sharing its memory where TensorFlow can
    read it in place (C-contiguous, 64-byte aligned, a DLPack dtype, not
    empty: tfdist.transport.p2p receives arrays so), else a copy. A copy of
    a micro-batch's activations costs about 0.1 ms a megabyte, on the
    critical path of the stage that waited for them. The array must not
    change afterwards: a received one is the tensor's alone."""
    if (
        array.size
        and array.dtype in SHARED_DTYPES
        and array.flags.c_contiguous
        and array.ctypes.data % ALIGN_BYTES == 0
    ):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def microbatches(values: Sequence[Any], count: int, field: str = "batch") -> list[list[Any]]:
    """Cuts each tensor of ``values`` into ``count`` equal parts along its
    first axis: ``result[i]`` is micro-batch ``i``'s list.

    Raises:
        ConfigError: A batch size that ``count`` does not divide, naming both.
    """
    sizes = {int(v.shape[0]) for v in values if v is not None}
    for size in sizes:
        if size % count:
            raise ConfigError(
                field,
                size,
                f"a batch size that the {count} micro-batches divide evenly (a multiple of "
                f"{count}; drop or pad the last batch, e.g. dataset.batch(..., "
                "drop_remainder=True))",
                source="tfdist.pipeline",
            )
    cut = [None if v is None else tf.split(v, count, axis=0) for v in values]
    return [[None if c is None else c[i] for c in cut] for i in range(count)]


@dataclasses.dataclass
class _Chunk:
    """One stage a process runs (several with the interleaved schedule)."""

    stage: Stage
    #: The stage that comes first or last in the whole pipeline.
    first: bool
    last: bool
    #: Where its trainable variables begin in the runner's list.
    offset: int
    variables: list
    #: What a tape watches: the tf.Variables under the Keras variables.
    watched: list
    #: The links to the processes of the previous and next stages.
    prev: Any
    next: Any
    passes: dict = dataclasses.field(default_factory=dict)
    #: Its passes on a distribution's devices (None: on the default device).
    mesh: MeshPasses | None = None


@dataclasses.dataclass
class _Kept:
    """What a micro-batch's forward keeps for its backward."""

    #: The tape around the pass (None on a mesh: its backward recomputes).
    tape: Any
    received: list
    #: The pass's outputs; on the last stage, its loss.
    result: Any
    #: On a mesh: the stage's own inputs, and on the last stage the loss's
    #: gradient with respect to the outputs.
    given: list = dataclasses.field(default_factory=list)
    upstream: list | None = None
    #: On a mesh: the stage's state before the forward (MeshPasses.state).
    state: list = dataclasses.field(default_factory=list)


class StageRunner:
    """Runs one process's stage of a pipeline (or its stages, with the
    interleaved schedule), one training step at a time.

    Args:
        stage: The stage (from :func:`~tfdist.pipeline.split_model`); with
            the interleaved schedule, the process's stages ``k, k + p, ...``
            of the ``stages`` the model was cut into (``p`` processes).
        stages: How many stages the model was cut into.
        links: The links to the processes of the previous and next stages,
            by process (a process's place in the pipeline: its first stage's
            index).
        schedule: One of :data:`~tfdist.pipeline.schedule.SCHEDULES`.
        microbatches: Micro-batches per step.
        loss: The loss (a Keras loss object), called on the last stage as
            ``loss(y, y_pred, sample_weight)``.
        optimizer: A Keras optimizer for the stage's variables.
        replicas: With data parallelism across pipeline replicas, this
            stage's replicas (:class:`~tfdist.pipeline.replicas.StageReplicas`):
            each replica trains on its share of the batch, and the stage's
            gradients (and the logged loss) are averaged over them.
        strategy: The strategy of the ``keras.distribution`` the stages'
            weights were made under (:mod:`~tfdist.pipeline.laid_out`): the
            passes and the update run on its replicas. The optimizer must
            have been made in its scope.
    """

    def __init__(
        self,
        stage: Stage | Sequence[Stage],
        stages: int,
        links: Mapping[int, Link],
        schedule: str,
        microbatches: int,
        loss: Callable[..., Any] | None,
        optimizer: Any,
        replicas: Any = None,
        strategy: Any = None,
    ) -> None:
        own = [stage] if isinstance(stage, Stage) else list(stage)
        self.replicas = replicas
        self.strategy = strategy
        self.stages = stages
        self.links = links
        self.schedule = schedule
        self.count = microbatches
        self.loss = loss
        self.optimizer = optimizer
        #: The pipeline's processes, and this one's place among them.
        self.processes = stages // len(own)
        self.process = own[0].index
        _check_chunks(own, stages, self.processes)
        self.first = self.process == 0
        self.last = self.process == self.processes - 1
        self.chunks: list[_Chunk] = []
        for s in own:
            self.chunks.append(self._chunk(s, sum(len(c.variables) for c in self.chunks)))
        self.variables = [v for c in self.chunks for v in c.variables]
        # The optimizer's update as one graph: eagerly, each variable's
        # update is several ops from Python (SGD on 4 Dense(1024) layers:
        # 9.9 ms eagerly, 3.4 ms as a graph; Adam 89 and 54 ms).
        self._apply = tf.function(self._apply_eagerly, reduce_retracing=True)
        self.order = actions(schedule, self.process, self.processes, microbatches, len(own))
        #: Whether the last stage keeps each step's outputs (for metrics):
        #: then ``last_batch`` is ``(y, y_pred, sample_weight)`` of the step,
        #: this replica's share of the batch.
        self.keep_outputs = False
        self.last_batch: tuple | None = None
        self._outputs: dict[int, list] = {}
        #: The most micro-batches' activations kept at once (with several
        #: chunks, each chunk's counts: a chunk is 1/v of the process's layers).
        self.peak_in_flight = 0
        #: A :class:`~tfdist.pipeline.trace.Trace` to record each step's
        #: passes, receives, sends and update in (None: nothing is timed).
        self.trace: Any = None

    def _chunk(self, stage: Stage, offset: int) -> _Chunk:
        p, g = self.processes, stage.index
        variables = [v for v in stage.variables if v.trainable]
        chunk = _Chunk(
            stage=stage,
            first=g == 0,
            last=g == self.stages - 1,
            offset=offset,
            variables=variables,
            watched=[v.value for v in variables],
            prev=self.links.get((g - 1) % p) if g > 0 else None,
            next=self.links.get((g + 1) % p) if g < self.stages - 1 else None,
        )
        if self.strategy is not None:  # On the distribution's devices.
            head = self._head if chunk.last else None
            chunk.mesh = MeshPasses(stage.model, self.strategy, variables, head)
            chunk.passes[False] = chunk.mesh.inference
            return chunk
        # The stage's forward pass (and the last stage's loss) as one graph
        # each for training and inference: a GradientTape around the call
        # keeps the graph's intermediates and runs its backward graph, so a
        # micro-batch costs two function calls rather than an eager op each.
        for training in (True, False):
            fn = functools.partial(self._pass, chunk, training=training)
            chunk.passes[training] = tf.function(fn, reduce_retracing=True)
        return chunk

    def _pass(self, chunk: _Chunk, inputs: list, targets: list | None, training: bool) -> list:
        """The stage's outputs; on the last stage with targets, its loss
        over this micro-batch, scaled by ``1 / m``, and its outputs."""
        out = chunk.stage.model(inputs, training=training)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if not chunk.last or targets is None:
            return outs
        return [self._head(out, targets), *outs]

    def _head(self, out: Any, targets: list) -> Any:
        """The micro-batch's loss, scaled by ``1 / m``."""
        y, weight = targets
        return self.loss(y, out, sample_weight=weight) / self.count

    # One step.

    def train_step(self, step: int, x: Sequence[Any], y: Any, sample_weight: Any = None) -> float:
        """Trains on one batch; returns the batch's loss (on every stage).

        Args:
            step: The step's number (tags the messages of this step).
            x: The model's inputs, flat (``keras.tree.flatten``); a stage
                uses those its ``model_inputs`` name.
            y: The targets (used on the last stage).
            sample_weight: Optional per-example weights (last stage).
        """
        try:
            return self._train_step(step, x, y, sample_weight)
        except BaseException:
            # The pipeline cannot go on without this stage: closing its links
            # makes the neighbours fail at once, naming it, not at a timeout.
            self.close()
            raise

    def close(self) -> None:
        """Closes the links to the neighbouring stages (and replicas)."""
        for link in self.links.values():
            link.close()
        if self.replicas is not None:
            self.replicas.close()

    def _train_step(self, step: int, x: Sequence[Any], y: Any, sample_weight: Any) -> float:
        x, y, sample_weight = self._share(x, y, sample_weight)
        given = [
            microbatches([x[i] for i in c.stage.model_inputs], self.count) for c in self.chunks
        ]
        targets = microbatches([y, sample_weight], self.count) if self.last else None
        kept: dict[tuple[int, int], tuple] = {}
        grads: list[Any] = [None] * len(self.variables)
        total = 0.0
        for action in self.order:
            chunk, i = self.chunks[action.chunk], action.microbatch
            if action.kind == "F":
                kept[action.chunk, i] = self._forward(step, chunk, i, given[action.chunk], targets)
                self.peak_in_flight = max(self.peak_in_flight, len(kept))
            else:
                done = kept.pop((action.chunk, i))
                if chunk.last:
                    total += float(done.result)
                self._backward(step, chunk, i, done, grads)
        if self.keep_outputs and self.last:
            self.last_batch = (y, self._joined_outputs(), sample_weight)
        self._flush()
        started = time.perf_counter()
        if self.replicas is not None:
            grads = self._replica_mean(grads, step)
        if any(g is not None for g in grads):
            self._apply(grads)
        self._span("update", step, started)
        loss = self._share_loss(step, total)
        return loss if self.replicas is None else self.replicas.mean_of(loss)

    def _replica_mean(self, grads: list, step: int) -> list:
        """The gradients averaged over the pipeline's replicas. On a mesh,
        each device's own: replica ``R``'s device ``d`` holds the same block
        (or share of the rows) as every other replica's device ``d``."""
        if self.strategy is None:
            return self.replicas.mean(grads, step)
        n = self.strategy.num_replicas_in_sync
        flat = self.replicas.mean([c for g in grads for c in g], step)
        return [flat[k * n : (k + 1) * n] for k in range(len(grads))]

    def _apply_eagerly(self, grads: list) -> None:
        """Applies the gradients that are not None to their variables."""
        if self.strategy is not None:  # Per-device gradients, every one made.
            apply_on(self.strategy, self.optimizer, grads, self.variables)
            return
        pairs = [(g, v) for g, v in zip(grads, self.variables) if g is not None]
        self.optimizer.apply([g for g, _ in pairs], [v for _, v in pairs])

    def _joined_outputs(self) -> Any:
        """The step's outputs, joined over the micro-batches in order."""
        parts = [self._outputs.pop(i) for i in range(self.count)]
        joined = [tf.concat([p[k] for p in parts], 0) for k in range(len(parts[0]))]
        return joined[0] if len(joined) == 1 else joined

    def _share(self, x: Sequence[Any], y: Any, sample_weight: Any) -> tuple:
        """This replica's share of the batch: its ``1 / R`` of the rows."""
        if self.replicas is None:
            return x, y, sample_weight
        count, index = self.replicas.replicas, self.replicas.group.rank
        size = int(x[0].shape[0])
        if size % (count * self.count):
            raise ConfigError(
                "batch",
                size,
                f"a multiple of replicas x microbatches = {count} x {self.count} (each replica "
                f"takes 1/{count} of the batch and cuts it in {self.count} micro-batches)",
                source="tfdist.pipeline",
            )
        mine = microbatches([*x, y, sample_weight], count)[index]
        return mine[: len(x)], mine[len(x)], mine[len(x) + 1]

    def _forward(
        self, step: int, chunk: _Chunk, i: int, given: list, targets: list | None
    ) -> _Kept:
        # Messages are tagged with the stage they go to: with interleaved
        # chunks one link carries several stages' messages.
        g = chunk.stage.index
        received = [] if chunk.first else self._receive(chunk.prev, step, ("F", g, i))
        started = time.perf_counter()
        wanted = list(targets[i]) if chunk.last else None
        if chunk.mesh is not None:
            state = chunk.mesh.state()  # What the backward's recompute starts from.
            outs, loss, upstream = chunk.mesh.forward(list(given[i]) + received, wanted, True)
            done = _Kept(None, received, outs, list(given[i]), upstream, state)
            if chunk.last:
                done.result, outs = loss, [loss, *outs]
        else:
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(chunk.watched)
                tape.watch(received)
                outs = chunk.passes[True](list(given[i]) + received, wanted)
            done = _Kept(tape, received, outs[0] if chunk.last else outs)
        started = self._span("F", step, started)
        if chunk.last:
            if self.keep_outputs:
                self._outputs[i] = outs[1:]
            return done
        chunk.next.post(("F", step, g + 1, i), [o.numpy() for o in outs])
        self._span("send", step, started, ("F", g + 1, i))
        return done

    def _backward(self, step: int, chunk: _Chunk, i: int, done: _Kept, grads: list) -> None:
        g = chunk.stage.index
        received = done.received
        upstream = None if chunk.last else self._receive(chunk.next, step, ("B", g, i))
        started = time.perf_counter()
        if chunk.mesh is not None:
            back, got = chunk.mesh.backward(
                done.given, received, upstream or done.upstream, done.state
            )
            add: Callable = chunk.mesh.add
        else:
            got = done.tape.gradient(done.result, chunk.watched + received, upstream)
            n = len(chunk.variables)
            got, back, add = got[:n], got[n:], sum_gradients
        for k, grad in enumerate(got, chunk.offset):
            if grad is not None:
                grads[k] = grad if grads[k] is None else add(grads[k], grad)
        started = self._span("B", step, started)
        if not chunk.first:
            back = [
                np.zeros(r.shape, r.dtype.as_numpy_dtype) if d is None else d.numpy()
                for d, r in zip(back, received)
            ]
            chunk.prev.post(("B", step, g - 1, i), back)
            self._span("send", step, started, ("B", g - 1, i))

    def _receive(self, link: Link, step: int, message: tuple) -> list:
        """The tensors of ``message`` (the pass it feeds, the stage it goes
        to, the micro-batch) from ``link``; the wait is a ``recv`` span."""
        started = time.perf_counter()
        kind, stage, i = message
        arrays = link.recv((kind, step, stage, i))
        tensors = [as_tensor(a) for a in arrays]
        self._span("recv", step, started, message)
        return tensors

    def _flush(self) -> None:
        """Waits for the step's posted activations and gradients to be sent."""
        for link in self.links.values():
            link.flush()

    def _span(self, kind: str, step: int, started: float, message: tuple = ()) -> float:
        """Records a span from ``started`` to now, if tracing; returns now."""
        if self.trace is None:
            return time.perf_counter()
        return self.trace.add(kind, step, started, message)

    def forward_step(
        self, kind: str, step: int, x: Sequence[Any], y: Any = None, sample_weight: Any = None
    ) -> tuple[float | None, list[np.ndarray]]:
        """One batch forward only (``evaluate``, ``predict``), micro-batch by
        micro-batch. Returns, on every stage, the batch's loss (when ``y`` is
        given) and the model's outputs (as arrays, joined over the
        micro-batches), both passed back from the last stage.

        Args:
            kind: Tags this step's messages apart from training's (``"E"``,
                ``"P"``).
            step: The step's number within ``kind``.
        """
        try:
            return self._forward_step(kind, step, x, y, sample_weight)
        except BaseException:
            self.close()
            raise

    def _forward_step(
        self, kind: str, step: int, x: Sequence[Any], y: Any, sample_weight: Any
    ) -> tuple[float | None, list[np.ndarray]]:
        given = [
            microbatches([x[i] for i in c.stage.model_inputs], self.count) for c in self.chunks
        ]
        targets = microbatches([y, sample_weight], self.count) if self.last else None
        outputs: list[list[Any]] = []
        total = 0.0
        # Micro-batch by micro-batch, each through this process's chunks in
        # order: what a pass waits for always comes earlier in that order.
        for i in range(self.count):
            for chunk, inputs in zip(self.chunks, given):
                g = chunk.stage.index
                received = []
                if not chunk.first:
                    arrays = chunk.prev.recv((kind, step, g, i))
                    received = [as_tensor(a) for a in arrays]
                wanted = list(targets[i]) if chunk.last and y is not None else None
                outs = chunk.passes[False](list(inputs[i]) + received, wanted)
                if not chunk.last:
                    chunk.next.post((kind, step, g + 1, i), [o.numpy() for o in outs])
                    continue
                if wanted is not None:
                    total += float(outs.pop(0))
                outputs.append(outs)
        self._flush()
        joined = (
            [np.concatenate([o[k] for o in outputs]) for k in range(len(outputs[0]))]
            if outputs
            else []
        )
        return self._share_back((kind + "-out", step), total if y is not None else None, joined)

    def _share_back(
        self, tag: tuple, loss: float | None, outputs: list[np.ndarray]
    ) -> tuple[float | None, list[np.ndarray]]:
        """The last stage's loss and outputs, passed back stage by stage."""
        if not self.last:
            arrays = self.links[self.process + 1].recv(tag)
            loss = None if arrays[0].size == 0 else float(arrays[0][0])
            outputs = arrays[1:]
        if not self.first:
            head = np.array([] if loss is None else [loss], np.float64)
            self.links[self.process - 1].send(tag, [head, *outputs])
        return loss, outputs

    def _share_loss(self, step: int, total: float) -> float:
        """The last stage's loss, passed back stage by stage."""
        if not self.last:
            (value,) = self.links[self.process + 1].recv(("L", step))
            total = float(value)
        if not self.first:
            self.links[self.process - 1].send(("L", step), [np.float64(total)])
        return total


def _check_chunks(own: list[Stage], stages: int, processes: int) -> None:
    """A process's stages are ``k, k + p, ...``, one per chunk."""
    k = own[0].index
    expected = [k + c * processes for c in range(len(own))]
    if stages % len(own) or [s.index for s in own] != expected:
        raise ConfigError(
            "stage",
            [s.index for s in own],
            f"stages k, k + p, ... of the {stages} (p = {stages} / chunks processes): "
            f"here {expected}",
            source="tfdist.pipeline",
        )
