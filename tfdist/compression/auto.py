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

import copy
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Sequence

import tensorflow as tf

from tfdist.compression.aggregate import Aggregator
from tfdist.errors import ConfigError

__all__ = ["AutoCompression", "LinkEstimate", "Decision", "CANDIDATES", "COMPUTE_S_PER_ENTRY",
           "STEP_FACTOR", "MIN_GAIN", "choose", "predict_costs", "measure_link",
           "reference_pass", "warmup_dtype"]

log = logging.getLogger("tfdist.compression")

#: What ``"auto"`` chooses from: no compression, a lossless-in-practice cast
#: (bf16 keeps float32's range, so it cannot overflow like fp16), and
#: PowerSGD with error feedback, the strongest compressor of the compression
#: benchmark for matrices. Top-k is not a default: its sort costs about eight
#: times PowerSGD's compute on CPUs (see :data:`COMPUTE_S_PER_ENTRY`), and
#: it only wins for large gradients PowerSGD cannot compress (vectors,
#: embeddings); pass ``AutoCompression(candidates=(..., "topk:0.01"))`` for
#: those.
CANDIDATES: tuple[str, ...] = ("none", "bf16", "powersgd:4")

#: Extra compute seconds per float32 gradient entry over an uncompressed
#: step, by compressor name, on the calibration machine. Measured with
#: ``benchmarks/compute_cost.py`` (2-core x86, one intra-op thread, the
#: gradients of a 5.8M-parameter MLP) as multiples of the reference pass
#: timed beside them: bf16/fp16 about 1.5x, PowerSGD 1.6x (rank 1) to 2.6x
#: (rank 4 and 8), top-k 1% about 20x (its sort); then times
#: :data:`REFERENCE_PASS_S_PER_ENTRY`. PowerSGD adds
#: :data:`POWERSGD_S_PER_ENTRY_RANK` per unit of rank to its base. Random-k,
#: sign and QSGD (not default candidates) are rough estimates.
COMPUTE_S_PER_ENTRY: dict[str, float] = {
    "none": 0.0, "bf16": 2.0e-9, "fp16": 2.0e-9, "topk": 2.6e-8, "randomk": 2.6e-8,
    "sign": 1.5e-8, "qsgd": 2.0e-8, "powersgd": 1.75e-9,
}
#: PowerSGD's extra compute per entry and per unit of rank (see above).
POWERSGD_S_PER_ENTRY_RANK = 0.4e-9

#: Seconds per entry of :func:`reference_pass` on the calibration machine
#: (printed by ``benchmarks/compute_cost.py``). At run time the same pass is
#: timed on every replica, all at once, and the compute costs are scaled by
#: the ratio: a slower or oversubscribed machine (4 workers on 2 cores)
#: pays more to compress, a faster one less.
REFERENCE_PASS_S_PER_ENTRY = 1.3e-9

#: How many more steps a compressor tends to need for the same accuracy
#: (its predicted cost is multiplied by this). The lossless or nearly
#: lossless ones get 1; PowerSGD and top-k with error feedback lost about a
#: point of accuracy at equal epochs in ``benchmarks/compression.py`` and
#: need some 10-20% more steps to catch up in ``benchmarks/slow_network.py``.
STEP_FACTOR: dict[str, float] = {
    "none": 1.0, "bf16": 1.0, "fp16": 1.0, "powersgd": 1.15, "topk": 1.15,
    "randomk": 1.5, "sign": 1.3, "qsgd": 1.05,
}

#: A compressor is chosen only if its predicted cost is at most this fraction
#: of no compression's: below a 10% gain the difference is within what the
#: constants can predict, and Keras's own all-reduce is the safe default.
MIN_GAIN = 0.9

#: float32 entries of the probes: 1 KiB (latency) and 2 MiB (bandwidth).
SMALL_PROBE = 256
LARGE_PROBE = 1 << 19


@dataclasses.dataclass(frozen=True)
class LinkEstimate:
    """What a collective costs between the replicas.

    Attributes:
        bandwidth: Bytes one replica sends per second inside a collective
            (ring all-reduce of S bytes among N: it sends 2 (N-1)/N S).
        latency: Seconds of a collective call that sends (almost) nothing.
        num_replicas: N, the replicas in sync when measured.
        compute_scale: How much slower than the calibration machine this one
            computes (the compute costs are multiplied by it); 1 when not
            measured.
    """

    bandwidth: float
    latency: float
    num_replicas: int
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if (not self.bandwidth > 0 or not math.isfinite(self.latency) or self.latency < 0
                or not 0 < self.compute_scale < math.inf):
            raise ConfigError("link", self, "a bandwidth > 0 bytes/s, a latency >= 0 s and "
                              "a finite compute_scale > 0")

    def __str__(self) -> str:
        return (f"{self.bandwidth * 8 / 1e6:,.1f} Mbit/s sent per replica, "
                f"{self.latency * 1e3:.2f} ms per collective, {self.num_replicas} replicas, "
                f"compute {self.compute_scale:.2g}x the calibration machine")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``"auto"`` chose, and from what.

    Attributes:
        choice: The label of the chosen candidate, e.g. ``"powersgd:4"`` or
            ``"none"``.
        costs: Predicted seconds per step (communication plus compression
            compute, times the step factor) of every candidate, by label.
        link: The link measured; None when not measured (one replica).
        entries: Gradient entries per step (the model's trainable size).
        candidate: The chosen candidate as given (a setting or an object).
    """

    choice: str
    costs: dict[str, float]
    link: LinkEstimate | None
    entries: int
    candidate: Any = None

    def explain(self) -> str:
        """Why: the link measured and each candidate's predicted cost."""
        if self.link is None:
            return "one replica: nothing to send"
        costs = ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in
                          sorted(self.costs.items(), key=lambda kv: kv[1]))
        return (f"{self.entries:,} gradient entries over {self.link}; "
                f"predicted per step: {costs}")

    def __str__(self) -> str:
        return f"{self.choice} ({self.explain()})"


def label(candidate: Any) -> str:
    """A short name for a candidate: the setting string, or ``"powersgd:4"``
    for a PowerSGD object, ``repr`` otherwise."""
    if isinstance(candidate, str):
        return candidate.strip().lower()
    rank = getattr(candidate, "rank", None)
    if getattr(candidate, "name", None) == "powersgd" and rank is not None:
        return f"powersgd:{rank}"
    return repr(candidate)


def _kind(candidate: Any) -> str:
    from tfdist.compression.setting import parse_compression
    return parse_compression(candidate).name


def _dense_entries(shapes) -> int:
    """Floating-point entries of the dense gradients: what compression
    computes on (sparse gradients pass through)."""
    from tfdist.compression.sparse import split_sparse
    dense, _ = split_sparse(shapes)
    return sum(math.prod(s) for s, d in dense if d.startswith(("float", "bfloat")))


def compute_cost(candidate: Any, entries: int,
                 per_entry: dict[str, float] | None = None) -> float:
    """Predicted compute seconds a candidate adds per step for ``entries`` gradient entries."""
    per_entry = COMPUTE_S_PER_ENTRY if per_entry is None else per_entry
    kind = _kind(candidate)
    cost = per_entry.get(kind, max(per_entry.values()))
    if kind == "powersgd":
        from tfdist.compression.factory import fixed_aggregator as make_aggregator
        cost += POWERSGD_S_PER_ENTRY_RANK * make_aggregator(candidate).rank
    return cost * entries


def predict_costs(
    link: LinkEstimate,
    shapes: Sequence[tuple[tuple[int, ...], str]],
    candidates: Sequence[Any] = CANDIDATES,
    *,
    compute_per_entry: dict[str, float] | None = None,
    step_factor: dict[str, float] | None = None,
) -> dict[str, float]:
    """Predicted seconds per step that each candidate spends on gradients.

    Args:
        link: The measured link.
        shapes: ``(shape, dtype name)`` of every trainable variable.
        candidates: Settings (``"bf16"``, ``"powersgd:4"``) or objects.
        compute_per_entry: Overrides :data:`COMPUTE_S_PER_ENTRY`.
        step_factor: Overrides :data:`STEP_FACTOR`.

    Returns:
        ``{label: seconds}``: ``(collectives * latency + bytes sent /
        bandwidth + compute * link.compute_scale) * step factor``, bytes from
        the candidate's traffic formula after any warm-up.
    """
    from tfdist.compression.factory import fixed_aggregator as make_aggregator

    factors = STEP_FACTOR if step_factor is None else step_factor
    entries = _dense_entries(shapes)
    costs = {}
    for candidate in candidates:
        traffic = make_aggregator(candidate).traffic(list(shapes), link.num_replicas)
        comm = traffic.collectives * link.latency + traffic.sent / link.bandwidth
        compute = compute_cost(candidate, entries, compute_per_entry) * link.compute_scale
        costs[label(candidate)] = (comm + compute) * factors.get(_kind(candidate), 1.0)
    return costs


def choose(
    link: LinkEstimate | None,
    shapes: Sequence[tuple[tuple[int, ...], str]],
    candidates: Sequence[Any] = CANDIDATES,
    **overrides: Any,
) -> Decision:
    """The candidate with the lowest predicted cost per step (pure: no TensorFlow op).

    Args:
        link: The measured link, or None for one replica.
        shapes: ``(shape, dtype name)`` of every trainable variable.
        candidates: What to choose from; ``"none"`` is always added.
        **overrides: ``compute_per_entry`` and ``step_factor``, passed to
            :func:`predict_costs`.

    Returns:
        The :class:`Decision`. One replica, or a model without gradients,
        gives ``"none"``; so does a best candidate that is not predicted to
        save at least ``1 - MIN_GAIN`` of no compression's cost. Ties go to
        the earlier candidate.
    """
    candidates = list(candidates)
    if not any(label(c) == "none" for c in candidates):
        candidates.insert(0, "none")
    entries = _dense_entries(shapes)
    if link is None or link.num_replicas < 2 or entries == 0:
        return Decision("none", {}, None, entries, "none")
    costs = predict_costs(link, shapes, candidates, **overrides)
    best = min(candidates, key=lambda c: costs[label(c)])
    if costs[label(best)] > MIN_GAIN * costs["none"]:
        best = "none"
    if _kind(best) == "powersgd":
        from tfdist.compression.factory import fixed_aggregator as make_aggregator
        chosen = make_aggregator(best)
        if not chosen.warmup_dtype_given:
            chosen = copy.copy(chosen)  # The caller's object stays as it was.
            chosen.warmup_dtype = warmup_dtype(link, shapes, **overrides)
        best = chosen
    return Decision(label(best), costs, link, entries, best)


def warmup_dtype(link: LinkEstimate, shapes: Sequence[tuple[tuple[int, ...], str]],
                 **overrides: Any) -> str:
    """``"bfloat16"`` when bf16 is predicted at least 10% cheaper per step than
    float32 on this link (see :data:`MIN_GAIN`), else ``"float32"``: what
    PowerSGD's dense warm-up steps send when ``"auto"`` chose PowerSGD."""
    costs = predict_costs(link, shapes, ("none", "bf16"), **overrides)
    return "bfloat16" if costs["bf16"] <= MIN_GAIN * costs["none"] else "float32"


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


def measure_link(strategy: tf.distribute.Strategy, *, large: int = LARGE_PROBE,
                 small: int = SMALL_PROBE, repeats: int = 3) -> LinkEstimate:
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
    from tfdist.compression.traffic import all_reduce_bytes

    if not tf.executing_eagerly() or not tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "tfdist: compression='auto' measures the link when the optimizer builds, which "
            "must happen eagerly in cross-replica context. Expected: model.fit(), or "
            "optimizer.build(model.trainable_variables) inside strategy.scope(). "
            "Received: a build inside a tf.function or a replica context")
    n = strategy.num_replicas_in_sync

    def probe(entries: int):
        @tf.function
        def once():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                return tf.reduce_sum(ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                                    tf.ones([entries], tf.float32)))
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
        float(v) for v in strategy.experimental_local_results(result)[0].numpy())
    sent = all_reduce_bytes(4 * large, n) - all_reduce_bytes(4 * small, n)
    # A link faster than the timer can tell is fast: cap at 1e12 bytes/s.
    bandwidth = sent / max(large_s - small_s, sent / 1e12)
    return LinkEstimate(bandwidth=bandwidth, latency=small_s, num_replicas=n,
                        compute_scale=min(max(scale, 0.1), 100.0))


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

    def __init__(self, candidates: Sequence[Any] = CANDIDATES, *,
                 link: LinkEstimate | None = None, probe_entries: int = LARGE_PROBE,
                 repeats: int = 3, compute_per_entry: dict[str, float] | None = None,
                 step_factor: dict[str, float] | None = None) -> None:
        from tfdist.compression.base import check_int
        from tfdist.compression.factory import fixed_aggregator as make_aggregator

        self.candidates = tuple(candidates)
        if not self.candidates:
            raise ConfigError("candidates", candidates, "at least one compression setting")
        for c in self.candidates:
            if _kind(c) == "auto":
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
            link = self.link if self.link is not None else measure_link(
                strategy, large=self.probe_entries, repeats=self.repeats)
            if link.num_replicas != n:
                link = dataclasses.replace(link, num_replicas=n)
        decision = choose(link, shapes, self.candidates,
                          **{k: v for k, v in self.overrides.items() if v is not None})
        self.decision = decision
        self.chosen = None if decision.choice == "none" else make_aggregator(decision.candidate)
        log.info("tfdist compression auto -> %s", decision)
        return decision

    def _require(self) -> Aggregator:
        if self.chosen is None:
            raise RuntimeError(
                "tfdist: compression='auto' has not chosen yet (it chooses when the optimizer "
                "builds, inside strategy.scope()), or chose none. Expected: the model "
                "compiled inside strategy.scope() before fit")
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
