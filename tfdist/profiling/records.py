"""One measured training step of one worker, and where its time went.

A :class:`StepRecord` holds the instants a step passed through, as seconds
since the epoch on the worker's own clock: when the host called the step,
when its batch was ready, when the gradients were ready, when every peer had
arrived, when the reduced gradients were ready, when the update ended and
when the host got control back. Between the last two are the collectives
(:class:`Span`: an all-reduce or all-gather, with the bytes this replica sent
through it by the ring formulas of :mod:`tfdist.compression.traffic`).

:func:`phases` turns the instants into durations; nothing here imports
TensorFlow, so the timeline, the plot and ``tfdist profile`` read records
without it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "Span",
    "StepRecord",
    "PHASES",
    "phases",
    "busy",
    "union_length",
    "mean_phases",
    "to_row",
    "from_row",
    "row_width",
    "derive_waits",
]

#: The phases of a step, in the order they happen.
PHASES = ("input", "compute", "wait", "compress", "communicate", "decompress", "update", "other")


@dataclasses.dataclass(frozen=True)
class Span:
    """One collective call of a step.

    Attributes:
        kind: ``"all_reduce"`` or ``"all_gather"``.
        start: When its input was ready (seconds, worker clock).
        end: When its output was ready.
        bytes: Bytes this replica sent through it.
    """

    kind: str
    start: float
    end: float
    bytes: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclasses.dataclass
class StepRecord:
    """The instants one step of one worker passed through.

    Every instant is in seconds since the epoch on the worker's clock.
    Instants the step did not measure repeat the one before them, so each
    phase of :func:`phases` is then 0 (one replica has no peers to wait for).

    Attributes:
        worker: The worker's index (its rank among the workers).
        step: The optimizer's step counter before the step.
        epoch: The Keras epoch (0 in a custom loop).
        host_begin: The host called the step function.
        input_ready: The step's batch was ready (forward and backward begin).
        grads_ready: The gradients were ready.
        peers_ready: Every peer had its gradients ready (a scalar all-reduce
            returned): the wait for the slowest peer ends here.
        reduced: The reduced gradients were ready (decompressed).
        end: The optimizer update (and Keras's metrics) ended.
        host_end: The step function returned to the host.
        spans: The collectives that carried the gradients.
        clock_offset: Seconds to subtract from this worker's instants to put
            them on the chief's clock (see :mod:`tfdist.profiling.timeline`).
    """

    worker: int
    step: int
    epoch: int
    host_begin: float
    input_ready: float
    grads_ready: float
    peers_ready: float
    reduced: float
    end: float
    host_end: float
    spans: list[Span] = dataclasses.field(default_factory=list)
    clock_offset: float = 0.0

    @property
    def bytes(self) -> float:
        """Bytes this worker's replica sent for the step's gradients."""
        return float(sum(s.bytes for s in self.spans))

    @property
    def seconds(self) -> float:
        """The step's wall time seen by the host."""
        return self.host_end - self.host_begin

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["spans"] = [[s.kind, s.start, s.end, s.bytes] for s in self.spans]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(
                f"a step record has unknown fields {sorted(unknown)}; "
                f"expected only {sorted(fields)}"
            )
        values = dict(data)
        values["spans"] = [
            Span(str(k), float(a), float(b), float(n)) for k, a, b, n in values.get("spans", [])
        ]
        return cls(**values)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def phases(record: StepRecord) -> dict[str, float]:
    """Seconds of ``record`` spent in each of :data:`PHASES`, plus ``step``.

    * ``input``: host call to batch ready (the input pipeline, when it is
      slower than the step);
    * ``compute``: forward and backward;
    * ``wait``: gradients ready until every peer's were (the slowest peer);
    * ``communicate``: time inside collectives (overlapping calls counted
      once);
    * ``compress`` / ``decompress``: the rest of the reduction, before and
      after the last collective returned;
    * ``update``: the optimizer's update and Keras's metrics;
    * ``other``: the rest of the host's step (function call, callbacks'
      reads).

    The phases add up to ``step``, the host's wall time.
    """
    r = record
    reducing = max(0.0, r.reduced - r.peers_ready)
    comm = min(reducing, union_length((s.start, s.end) for s in r.spans))
    last_out = max((s.end for s in r.spans), default=r.reduced)
    decompress = min(max(0.0, r.reduced - last_out), reducing - comm)
    out = {
        "input": max(0.0, r.input_ready - r.host_begin),
        "compute": max(0.0, r.grads_ready - r.input_ready),
        "wait": max(0.0, r.peers_ready - r.grads_ready),
        "compress": max(0.0, reducing - comm - decompress),
        "communicate": comm,
        "decompress": decompress,
        "update": max(0.0, r.end - r.reduced),
    }
    step = r.seconds
    out["other"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    return out


def busy(record: StepRecord) -> float:
    """Seconds of the step this worker was not waiting for a peer: what a
    straggler has more of."""
    p = phases(record)
    return p["step"] - p["wait"]


def mean_phases(records: Iterable[StepRecord]) -> dict[int, dict[str, float]]:
    """Per worker: the mean seconds per step of each phase (and ``step``,
    ``busy``), the mean ``bytes`` and the number of ``steps``."""
    sums: dict[int, dict[str, float]] = {}
    for r in records:
        acc = sums.setdefault(
            r.worker, {k: 0.0 for k in (*PHASES, "step", "busy", "bytes", "steps")}
        )
        p = phases(r)
        for k in (*PHASES, "step"):
            acc[k] += p[k]
        acc["busy"] += p["step"] - p["wait"]
        acc["bytes"] += r.bytes
        acc["steps"] += 1
    for acc in sums.values():
        n = acc["steps"]
        for k in acc:
            if k != "steps":
                acc[k] /= n
    return dict(sorted(sums.items()))


_INSTANTS = (
    "host_begin",
    "input_ready",
    "grads_ready",
    "peers_ready",
    "reduced",
    "end",
    "host_end",
)
_KIND_CODES = {"all_reduce": 1.0, "all_gather": 2.0}
_KINDS = {v: k for k, v in _KIND_CODES.items()}


def row_width(max_spans: int) -> int:
    """Floats in a record's row (see :func:`to_row`)."""
    return 4 + len(_INSTANTS) + 4 * max_spans


def to_row(record: StepRecord, max_spans: int) -> list[float]:
    """``record`` as a fixed-width row of floats, to send between workers:
    worker, step, epoch, the instants, the span count, then each span's
    kind code, start, end and bytes (zeros past the last)."""
    spans = record.spans[:max_spans]
    row = [float(record.worker), float(record.step), float(record.epoch)]
    row += [float(getattr(record, name)) for name in _INSTANTS]
    row.append(float(len(spans)))
    for s in spans:
        row += [_KIND_CODES[s.kind], s.start, s.end, s.bytes]
    row += [0.0] * (row_width(max_spans) - len(row))
    return row


def from_row(row: Iterable[float]) -> StepRecord:
    """Inverse of :func:`to_row`."""
    row = [float(v) for v in row]
    head = 3 + len(_INSTANTS)
    count = int(row[head])
    spans = [
        Span(_KINDS[row[i]], row[i + 1], row[i + 2], row[i + 3])
        for i in range(head + 1, head + 1 + 4 * count, 4)
    ]
    return StepRecord(
        int(row[0]), int(row[1]), int(row[2]), **dict(zip(_INSTANTS, row[3:head])), spans=spans
    )


def derive_waits(records: Iterable[StepRecord]) -> list[StepRecord]:
    """Separates the wait for the slowest peer from the first collective, for
    steps measured without a barrier.

    A collective returns on every worker once the last one has joined it, so
    the worker that joined last spent only the transfer in it and every
    other worker the transfer plus its wait. Per step, each worker's wait is
    its first collective's duration minus the shortest one's (clock-free:
    durations only). The first span then starts after the wait, and
    ``peers_ready`` moves there. Steps that only one worker measured are
    left as they are. Returns the records (changed in place) in their order.
    """
    records = list(records)
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        if r.spans:
            by_step.setdefault(r.step, []).append(r)
    for group in by_step.values():
        if len({r.worker for r in group}) < 2:
            continue
        firsts = [min(r.spans, key=lambda s: s.start) for r in group]
        shortest = min(s.seconds for s in firsts)
        for r, first in zip(group, firsts):
            wait = first.seconds - shortest
            start = first.start + wait
            r.spans[r.spans.index(first)] = Span(first.kind, start, first.end, first.bytes)
            r.peers_ready = max(r.peers_ready, start)
    return records
