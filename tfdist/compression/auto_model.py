"""The cost model behind ``compression="auto"``: what each candidate costs per step
(compute to compress, wire time of what it sends, extra steps it needs), and the
choice among the candidates. Pure Python: the link and the machine's speed come
in as numbers, measured by :mod:`tfdist.compression.auto`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from tfdist.errors import ConfigError

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
    "none": 0.0,
    "bf16": 2.0e-9,
    "fp16": 2.0e-9,
    "topk": 2.6e-8,
    "randomk": 2.6e-8,
    "sign": 1.5e-8,
    "qsgd": 2.0e-8,
    "powersgd": 1.75e-9,
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
    "none": 1.0,
    "bf16": 1.0,
    "fp16": 1.0,
    "powersgd": 1.15,
    "topk": 1.15,
    "randomk": 1.5,
    "sign": 1.3,
    "qsgd": 1.05,
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
        if (
            not self.bandwidth > 0
            or not math.isfinite(self.latency)
            or self.latency < 0
            or not 0 < self.compute_scale < math.inf
        ):
            raise ConfigError(
                "link",
                self,
                "a bandwidth > 0 bytes/s, a latency >= 0 s and a finite compute_scale > 0",
            )

    def __str__(self) -> str:
        return (
            f"{self.bandwidth * 8 / 1e6:,.1f} Mbit/s sent per replica, "
            f"{self.latency * 1e3:.2f} ms per collective, {self.num_replicas} replicas, "
            f"compute {self.compute_scale:.2g}x the calibration machine"
        )


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
        costs = ", ".join(
            f"{k} {v * 1e3:,.1f} ms" for k, v in sorted(self.costs.items(), key=lambda kv: kv[1])
        )
        return f"{self.entries:,} gradient entries over {self.link}; predicted per step: {costs}"

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


def kind_of(candidate: Any) -> str:
    """The compression kind of ``candidate`` (e.g. ``"powersgd"``)."""
    from tfdist.spec.compression import parse_compression

    return parse_compression(candidate).name


def _dense_entries(shapes) -> int:
    """Floating-point entries of the dense gradients: what compression
    computes on (sparse gradients pass through)."""
    from tfdist.compression.sparse import split_sparse

    dense, _ = split_sparse(shapes)
    return sum(math.prod(s) for s, d in dense if d.startswith(("float", "bfloat")))


def compute_cost(candidate: Any, entries: int, per_entry: dict[str, float] | None = None) -> float:
    """Predicted compute seconds a candidate adds per step for ``entries`` gradient entries."""
    per_entry = COMPUTE_S_PER_ENTRY if per_entry is None else per_entry
    kind = kind_of(candidate)
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
        costs[label(candidate)] = (comm + compute) * factors.get(kind_of(candidate), 1.0)
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
    if kind_of(best) == "powersgd":
        from tfdist.compression.factory import fixed_aggregator as make_aggregator

        chosen = make_aggregator(best)
        if not chosen.warmup_dtype_given:
            chosen = copy.copy(chosen)  # The caller's object stays as it was.
            chosen.warmup_dtype = warmup_dtype(link, shapes, **overrides)
        best = chosen
    return Decision(label(best), costs, link, entries, best)


def warmup_dtype(
    link: LinkEstimate, shapes: Sequence[tuple[tuple[int, ...], str]], **overrides: Any
) -> str:
    """``"bfloat16"`` when bf16 is predicted at least 10% cheaper per step than
    float32 on this link (see :data:`MIN_GAIN`), else ``"float32"``: what
    PowerSGD's dense warm-up steps send when ``"auto"`` chose PowerSGD."""
    costs = predict_costs(link, shapes, ("none", "bf16"), **overrides)
    return "bfloat16" if costs["bf16"] <= MIN_GAIN * costs["none"] else "float32"
