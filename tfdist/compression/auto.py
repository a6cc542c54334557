"""``compression="auto"``: pick a compressor, or none, for the link measured.

Compression only pays when the time it saves on the wire exceeds what it
costs to compute (Agarwal et al., MLSys 2022): on a fast link the answer is
usually none, on a slow one a strong compressor. ``"auto"`` decides per job,
when the optimizer builds (``model.fit`` builds it before the first step):

1. **Measure the link** (:func:`measure_link`): every replica times
   all-reduces of a small (1 KiB) and a large (2 MiB by default) float32
   tensor through the strategy, the same collectives training uses. The
   small one gives the latency of a collective call, the difference the
   bandwidth, as bytes *one replica sends* per second (the ring formulas of
   :mod:`tfdist.compression.traffic`), so the same number predicts any
   payload whether the link is shared (one loopback) or per pair. The
   replicas then all-gather their measurements and keep the slowest, so every
   worker holds the same figures and makes the same choice.
2. **Predict each candidate's cost per step** (:func:`predict_costs`):
   ``collectives * latency + bytes sent / bandwidth`` from the candidate's
   own traffic formula (:meth:`Aggregator.traffic`, exact bytes for the
   model's gradient shapes), plus its compute, ``entries *``
   :data:`COMPUTE_S_PER_ENTRY` (a constant per compressor calibrated with
   ``benchmarks/compute_cost.py``: compression is a few memory passes, and
   top-k a sort, per gradient entry), scaled by how fast this machine runs
   a reference pass compared with the calibration machine (timed on every
   replica at once, so 4 workers sharing 2 cores see their contention).
   Lossy compressors' costs are multiplied by :data:`STEP_FACTOR`, the
   extra steps they tend to need to reach the same accuracy, so that a lossy
   choice must win clearly.
3. **Pick the cheapest** (:func:`choose`) and log it, unless it saves less
   than 10% over no compression (:data:`MIN_GAIN`). One replica sends
   nothing: the choice is ``"none"`` without measuring.
4. **Pick PowerSGD's warm-up precision** (:func:`warmup_dtype`): its dense
   warm-up steps go as bfloat16 when bf16 is predicted cheaper than no
   compression on this link. At 100 Mbit/s a float32 warm-up step of a
   5.8M-parameter model costs 60 compressed steps; halving it halves the
   largest cost of reaching an accuracy early (``benchmarks/slow_network.py``).
   A PowerSGD candidate given with its own ``warmup_dtype`` keeps it.

The measurement takes a few all-reduces of 2 MiB: about 1.5 s at 100
Mbit/s between 2 workers, milliseconds on a fast link.

The choice sees the optimizer's variables only, before any batch: an
Embedding table counts there as a dense matrix, although its gradient is
sent as slices whatever is chosen (see :mod:`tfdist.compression.sparse`).
:func:`choose` and :func:`predict_costs` given
:class:`~tfdist.compression.sparse.SparseGradient` entries leave them out of
the compute. Once chosen, the bytes reported are exact.

The choice is visible as ``strategy.compression`` (``auto -> powersgd:4``)
and in ``strategy.describe()``, with the measured link and every
candidate's predicted cost. It is made once per strategy, at the first
optimizer build under it; later models under the same strategy reuse it.

Example::

    strategy = tfdist.strategy_from_config(compression="auto")
    with strategy.scope():
        model = build_model(); model.compile(optimizer="adam", loss=...)
    model.fit(data)
    print(strategy.compression)     # auto -> powersgd:4
    print(strategy.describe())      # ... and why

:class:`AutoCompression` takes other candidates (settings or objects, e.g.
``PowerSGD(rank=2, warmup_steps=100)``), a known link instead of measuring,
and other calibration constants.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfdist.compression.aggregate import Aggregator
from tfdist.compression.auto_model import (
    CANDIDATES,
    COMPUTE_S_PER_ENTRY,
    LARGE_PROBE,
    MIN_GAIN,
    REFERENCE_PASS_S_PER_ENTRY,
    SMALL_PROBE,
    STEP_FACTOR,
    Decision,
    LinkEstimate,
    choose,
    kind_of,
    label,
    predict_costs,
    warmup_dtype,
)
from tfdist.errors import ConfigError

__all__ = [
    "AutoCompression",
    "LinkEstimate",
    "Decision",
    "CANDIDATES",
    "COMPUTE_S_PER_ENTRY",
    "STEP_FACTOR",
    "MIN_GAIN",
    "choose",
    "predict_costs",
    "measure_link",
    "reference_pass",
    "warmup_dtype",
]

log = logging.getLogger("tfdist.compression")


def reference_pass(entries: int = 1 << 20, repeats: int = 5) -> float:
    """Seconds per entry of a memory-bound pass like compression's (a scale, a
    bfloat16 round trip and a sum), median of ``repeats`` timed calls."""
    x = tf.random.stateless_normal([entries], seed=[1, 2])

    @tf.function
    def once(x):
        return tf.reduce_sum(tf.cast(tf.cast(x * 1.0001, tf.bfloat16), tf.float32))

    once(x).numpy()  # Trace.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once(x).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / entries


def measure_link(
    strategy: tf.distribute.Strategy,
    *,
    large: int = LARGE_PROBE,
    small: int = SMALL_PROBE,
    repeats: int = 3,
) -> LinkEstimate:
    """Times all-reduces between the strategy's replicas; the same on every worker.

    Must be called in cross-replica context, eagerly, with every worker
    calling it at the same point (as ``model.fit`` builds the optimizer).

    Args:
        strategy: A strategy with two or more replicas.
        large: float32 entries of the bandwidth probe.
        small: float32 entries of the latency probe.
        repeats: Timed calls per probe (the median is taken), after one
            untimed call that sets the collectives up.

    Returns:
        The slowest replica's :class:`LinkEstimate`, with the compute scale
        of the slowest replica (:func:`reference_pass`, run by all at once).
    """
    from tfdist.transport.traffic import all_reduce_bytes

    if not tf.executing_eagerly() or not tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "tfdist: compression='auto' measures the link when the optimizer builds, which "
            "must happen eagerly in cross-replica context. Expected: model.fit(), or "
            "optimizer.build(model.trainable_variables) inside strategy.scope(). "
            "Received: a build inside a tf.function or a replica context"
        )
    n = strategy.num_replicas_in_sync

    def probe(entries: int):
        @tf.function
        def once():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                return tf.reduce_sum(
                    ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.ones([entries], tf.float32))
                )

            return strategy.run(replica_fn)

        return once

    def seconds(fn) -> float:
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            for value in strategy.experimental_local_results(fn()):
                value.numpy()
            if i:  # The first call traces and sets the group up.
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    small_s = seconds(probe(small))
    large_s = seconds(probe(large))
    seconds(probe(small))  # Line the replicas up again before timing compute.
    scale = reference_pass() / REFERENCE_PASS_S_PER_ENTRY

    @tf.function
    def slowest(measured):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            return tf.reduce_max(ctx.all_gather(measured[None], axis=0), axis=0)

        return strategy.run(replica_fn)

    result = slowest(tf.constant([small_s, large_s, scale], tf.float64))
    small_s, large_s, scale = (
        float(v) for v in strategy.experimental_local_results(result)[0].numpy()
    )
    sent = all_reduce_bytes(4 * large, n) - all_reduce_bytes(4 * small, n)
    # A link faster than the timer can tell is fast: cap at 1e12 bytes/s.
    bandwidth = sent / max(large_s - small_s, sent / 1e12)
    return LinkEstimate(
        bandwidth=bandwidth,
        latency=small_s,
        num_replicas=n,
        compute_scale=min(max(scale, 0.1), 100.0),
    )


class AutoCompression(Aggregator):
    """The ``"auto"`` setting: resolves to another aggregator when the optimizer builds.

    Args:
        candidates: What to choose from (settings or objects); ``"none"`` is
            always a candidate.
        link: A known :class:`LinkEstimate` to use instead of measuring.
        probe_entries: float32 entries of the bandwidth probe (2 MiB).
        repeats: Timed probe calls (median).
        compute_per_entry: Overrides :data:`COMPUTE_S_PER_ENTRY`.
        step_factor: Overrides :data:`STEP_FACTOR`.

    Raises:
        ConfigError: A candidate is not a valid setting, or is ``"auto"``.
    """

    name = "auto"

    def __init__(
        self,
        candidates: Sequence[Any] = CANDIDATES,
        *,
        link: LinkEstimate | None = None,
        probe_entries: int = LARGE_PROBE,
        repeats: int = 3,
        compute_per_entry: dict[str, float] | None = None,
        step_factor: dict[str, float] | None = None,
    ) -> None:
        from tfdist.compression.base import check_int
        from tfdist.compression.factory import fixed_aggregator as make_aggregator

        self.candidates = tuple(candidates)
        if not self.candidates:
            raise ConfigError("candidates", candidates, "at least one compression setting")
        for c in self.candidates:
            if kind_of(c) == "auto":
                raise ConfigError("candidates", c, "settings other than 'auto'")
            make_aggregator(c)  # Fails now on a bad candidate.
        self.link = link
        self.probe_entries = check_int("probe_entries", probe_entries, SMALL_PROBE + 1, 2**28)
        self.repeats = check_int("repeats", repeats, 1, 100)
        self.overrides = {"compute_per_entry": compute_per_entry, "step_factor": step_factor}
        self.decision: Decision | None = None
        self.chosen: Aggregator | None = None

    def __repr__(self) -> str:
        return f"AutoCompression(candidates={list(map(label, self.candidates))})"

    @property
    def resolved(self) -> bool:
        """Whether the choice has been made."""
        return self.decision is not None

    @property
    def passthrough(self) -> bool:
        """Whether the choice was no compression (Keras's own all-reduce runs)."""
        return self.decision is not None and self.chosen is None

    def resolve(self, strategy: tf.distribute.Strategy, variables: Sequence[Any]) -> Decision:
        """Measures the link (unless given) and chooses; idempotent.

        Args:
            strategy: The strategy training runs under.
            variables: The trainable variables whose gradients are reduced.

        Returns:
            The :class:`Decision`, also kept as ``self.decision``.
        """
        from tfdist.compression.factory import fixed_aggregator as make_aggregator

        if self.decision is not None:
            return self.decision
        shapes = [(tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name) for v in variables]
        n = strategy.num_replicas_in_sync
        link = None
        if n > 1:
            link = (
                self.link
                if self.link is not None
                else measure_link(strategy, large=self.probe_entries, repeats=self.repeats)
            )
            if link.num_replicas != n:
                link = dataclasses.replace(link, num_replicas=n)
        decision = choose(
            link,
            shapes,
            self.candidates,
            **{k: v for k, v in self.overrides.items() if v is not None},
        )
        self.decision = decision
        self.chosen = None if decision.choice == "none" else make_aggregator(decision.candidate)
        log.info("tfdist compression auto -> %s", decision)
        return decision

    def _require(self) -> Aggregator:
        if self.chosen is None:
            raise RuntimeError(
                "tfdist: compression='auto' has not chosen yet (it chooses when the optimizer "
                "builds, inside strategy.scope()), or chose none. Expected: the model "
                "compiled inside strategy.scope() before fit"
            )
        return self.chosen

    def state_specs(self, shape, dtype, key):
        return self._require().state_specs(shape, dtype, key)

    def aggregate(self, items, step, comm):
        return self._require().aggregate(items, step, comm)

    def traffic(self, shapes, num_replicas, step=None):
        if self.passthrough:
            from tfdist.compression.factory import fixed_aggregator as make_aggregator

            return make_aggregator("none").traffic(shapes, num_replicas, step=step)
        return self._require().traffic(shapes, num_replicas, step=step)

    def describe(self) -> str:
        if self.decision is None:
            return f"{self!r}: chooses when the optimizer builds"
        chosen = "Keras's all-reduce" if self.chosen is None else self.chosen.describe()
        return f"runs {chosen}; chosen from {self.decision.explain()}"
