"""The collectives tfdist's gradient aggregation runs over: :class:`Comm`.

An aggregator (:mod:`tfdist.compression`) is the maths: it hands tensors to a
:class:`Comm` and gets their sum, or every replica's copy, back. A Comm
records what it was handed, so that the bytes sent can be checked against the
aggregator's prediction (:meth:`Comm.traffic`), and sends it.

What sends is the transport's part. Two kinds of override point, public:

* :meth:`ReplicaComm.reduce_sum` and :meth:`ReplicaComm.gather_rows`: the two
  primitives every reduction is built of, with the wire encoding
  (:mod:`tfdist.transport.wire`) done around them. MPI
  (:class:`tfdist.transport.MpiComm`), Horovod's ranks
  (``tfdist.horovod.optimizer.HorovodComm``) and a tensor-parallel mesh's
  data-parallel group (``tfdist.parallel.grads.GroupComm``) override these.
* :meth:`Comm.send_all_reduce` and :meth:`Comm.send_all_gather`: a whole call,
  encoding included. The profiler (``tfdist.profiling.instrument.ProfiledComm``)
  wraps these to time each collective; :class:`LocalComm` answers for one
  replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError
from tfdist.transport.traffic import Traffic, nbytes, slices_nbytes, wire_nbytes
from tfdist.transport.wire import from_words, slices_from_wire, slices_to_wire, to_words

__all__ = ["Comm", "LocalComm", "ReplicaComm"]


class Comm:
    """The collectives an aggregator may use, recording what it sends.

    ``reduced`` and ``gathered`` list the (shape, dtype name) of every
    tensor handed to an all-reduce / all-gather, so tests can compare what
    was really sent with :meth:`Aggregator.traffic`. ``sliced`` lists every
    IndexedSlices handed to :meth:`all_reduce`, which TensorFlow all-gathers
    (see :mod:`tfdist.compression.sparse`): ``(row shape, values dtype,
    indices dtype, rows)``, ``rows`` being this replica's number of slices
    as a tensor (dynamic inside ``fit``).
    """

    num_replicas: int

    def __init__(self) -> None:
        self.reduced: list[tuple[tuple[int, ...], str]] = []
        self.gathered: list[tuple[tuple[int, ...], str]] = []
        self.sliced: list[tuple[tuple[int, ...], str, str, tf.Tensor]] = []

    def all_reduce(self, tensors: Sequence[Any]) -> list[Any]:
        """SUM over replicas of each tensor; IndexedSlices are all-gathered
        (their slices concatenated, as TensorFlow reduces them)."""
        tensors = list(tensors)
        for t in tensors:
            if isinstance(t, tf.IndexedSlices):
                self.sliced.append(
                    (
                        tuple(t.values.shape.as_list()[1:]),
                        t.values.dtype.name,
                        t.indices.dtype.name,
                        tf.shape(t.indices)[0],
                    )
                )
            elif isinstance(t, tf.Tensor):
                self.reduced.append(_spec(t))
        return self.send_all_reduce(tensors) if tensors else []

    def all_gather(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Every replica's copy of each tensor, stacked on a new axis 0."""
        tensors = list(tensors)
        self.gathered.extend(_spec(t) for t in tensors)
        return self.send_all_gather(tensors) if tensors else []

    def cond(self, pred: tf.Tensor, true_fn: Callable, false_fn: Callable, args: tuple) -> Any:
        """``tf.cond`` whose branches may use the collectives.

        ``pred`` must be the same on every replica.
        """
        return tf.cond(pred, lambda: true_fn(*args), lambda: false_fn(*args))

    def traffic(
        self, dense: int, dense_gather: int = 0, rows: Sequence[int] | None = None
    ) -> Traffic:
        """The recorded payloads as a :class:`Traffic`.

        Args:
            dense: The reference all-reduce payload (see :class:`Traffic`).
            dense_gather: The reference all-gather payload of sparse gradients.
            rows: The slices every replica sent for each entry of ``sliced``:
                the largest number any replica held (TensorFlow pads to it).
                None: the static row counts recorded (eager, one replica).
        """
        if rows is None:
            rows = []
            for _shape, _, _, count in self.sliced:
                value = tf.get_static_value(count)
                if value is None:
                    raise ConfigError(
                        "rows",
                        None,
                        "the rows each IndexedSlices sent (the "
                        "largest over replicas): inside a tf.function they are "
                        "dynamic",
                        source="Comm.traffic",
                    )
                rows.append(int(value))
        if len(rows) != len(self.sliced):
            raise ConfigError(
                "rows",
                rows,
                f"{len(self.sliced)} counts, one per IndexedSlices sent",
                source="Comm.traffic",
            )
        sparse = sum(
            slices_nbytes(int(r), math.prod(shape), values, indices)
            for (shape, values, indices, _), r in zip(self.sliced, rows)
        )
        return Traffic(
            self.num_replicas,
            dense=dense,
            dense_gather=dense_gather,
            all_reduce=sum(nbytes(s, d) for s, d in self.reduced),
            all_gather=sum(wire_nbytes(s, d) for s, d in self.gathered) + sparse,
        )

    def send_all_reduce(self, tensors: list) -> list:
        """Sends one :meth:`all_reduce` call (override point)."""
        raise NotImplementedError

    def send_all_gather(self, tensors: list) -> list:
        """Sends one :meth:`all_gather` call (override point)."""
        raise NotImplementedError


def _spec(t: tf.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape.as_list()), t.dtype.name


class LocalComm(Comm):
    """Collectives of a single replica: the sum of one is itself.

    Runs an aggregator's full math (and its byte recording) in one process.
    """

    num_replicas = 1

    def send_all_reduce(self, tensors):
        return [t if isinstance(t, tf.IndexedSlices) else tf.identity(t) for t in tensors]

    def send_all_gather(self, tensors):
        return [tf.expand_dims(t, 0) for t in tensors]


class ReplicaComm(Comm):
    """Collectives through the current replica context.

    Works under MirroredStrategy and MultiWorkerMirroredStrategy alike. The
    tensors of one call go in one collective per dtype (an all-gather: one
    for float16, one for everything else, packed as int32 words).
    """

    def __init__(self, num_replicas: int | None = None) -> None:
        """Args:
        num_replicas: The replicas the collectives span; default: the
            current replica context's (a subclass that runs outside one,
            such as Horovod's ranks, says how many).
        """
        super().__init__()
        if num_replicas is None:
            num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        self.num_replicas = num_replicas

    # The context is looked up per call: a branch of cond() may run in a
    # fresh replica context (MirroredStrategy's call_for_each_replica).
    def send_all_reduce(self, tensors):
        sent = [slices_to_wire(t) for t in tensors]
        # One call per dtype: inside a tf.function TensorFlow packs a call's
        # dense tensors into one concat, which fails on mixed dtypes (a
        # cast's 16-bit payloads beside a float32 or integer gradient sent
        # as it is). IndexedSlices, gathered apart anyway, go in one call.
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(sent):
            key = "slices" if isinstance(t, tf.IndexedSlices) else t.dtype.name
            groups.setdefault(key, []).append(i)
        out: list[Any] = [None] * len(sent)
        for members in groups.values():
            for i, o in zip(members, self.reduce_sum([sent[i] for i in members])):
                out[i] = o
        return [slices_from_wire(o, t) for o, t in zip(out, tensors)]

    def reduce_sum(self, tensors: list) -> list:
        """SUM over replicas of each tensor, all of one wire dtype
        (IndexedSlices: gathered). Override point."""
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tensors)

    def gather_rows(self, rows: tf.Tensor) -> tf.Tensor:
        """Every replica's [1, n] row, stacked in replica order: [N, n].
        Override point."""
        return tf.distribute.get_replica_context().all_gather(rows, axis=0)

    def send_all_gather(self, tensors):
        # One collective per wire dtype, whatever the number of tensors:
        # every payload is flattened into int32 words (float16 stays float16,
        # which needs no padding) and concatenated; all_gather stacks each
        # replica's buffer as a row. Handing all_gather a list instead makes
        # one collective per tensor: one more round trip each, between
        # processes.
        words = [to_words(t) for t in tensors]
        groups: dict[str, list[int]] = {}
        for i, w in enumerate(words):
            groups.setdefault(w.dtype.name, []).append(i)
        out: list[Any] = [None] * len(tensors)
        for members in groups.values():
            packed = tf.concat([words[i] for i in members], axis=0)
            rows = self.gather_rows(tf.expand_dims(packed, 0))
            offset = 0
            for i in members:
                size = int(words[i].shape[0])
                out[i] = from_words(rows[:, offset : offset + size], tensors[i])
                offset += size
        return out

    def cond(self, pred, true_fn, false_fn, args):
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            return super().cond(pred, true_fn, false_fn, args)

        # MirroredStrategy on CPU all-reduces through merge_call, which a
        # tf.cond in replica context cannot contain: branch in cross-replica
        # context and run each branch on every replica (as Keras's
        # LossScaleOptimizer does).
        def merged(distribution, pred, *args):
            pred = distribution.experimental_local_results(pred)[0]
            run = distribution.extended.call_for_each_replica
            return tf.cond(pred, lambda: run(true_fn, args), lambda: run(false_fn, args))

        return tf.distribute.get_replica_context().merge_call(merged, args=(pred, *args))
