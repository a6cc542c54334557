"""Step records as a Chrome trace: one track per worker, opened in Perfetto.

The Chrome trace event format (``chrome://tracing``, https://ui.perfetto.dev)
takes a JSON object whose ``traceEvents`` are complete events (``"ph": "X"``,
a start ``ts`` and a duration ``dur`` in microseconds) on a process
(``pid``) and thread (``tid``). Each worker is a process named
``worker <i>``; each step is a ``step N`` event, and inside it, on the same
thread, its phases (:data:`~tfdist.profiling.records.PHASES`): one
``communicate`` event per collective, with the bytes it sent in ``args``.

Workers on different hosts have different clocks. Every worker leaves a
step's first collective at the same instant (give or take one latency), so
:func:`align` takes each worker's median offset from worker 0 at that
instant and the merged trace shifts the workers by it. Pure Python.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from tfdist.profiling.records import StepRecord

__all__ = ["worker_path", "align", "chrome_trace", "write", "read"]


def worker_path(path: str | os.PathLike, worker: int) -> str:
    """Where worker ``worker`` writes its own track: ``trace.json`` ->
    ``trace.worker-1.json``."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.worker-{worker}{ext or '.json'}"


def align(records: Iterable[StepRecord]) -> dict[int, float]:
    """Seconds to subtract from each worker's instants to put them on worker
    0's clock: the median, over the steps both measured, of the difference
    of the instants they left the step's first collective, which every
    worker leaves together. A worker with no step in common with worker 0
    gets 0."""
    by_worker: dict[int, dict[int, float]] = {}
    for r in records:
        if r.spans:
            first = min(r.spans, key=lambda s: s.start)
            by_worker.setdefault(r.worker, {})[r.step] = first.end
    reference = by_worker.get(0, {})
    offsets = {}
    for worker, steps in by_worker.items():
        common = [steps[s] - reference[s] for s in steps if s in reference]
        offsets[worker] = statistics.median(common) if common and worker != 0 else 0.0
    for r in records:
        offsets.setdefault(r.worker, 0.0)
    return offsets


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _event(name: str, start: float, end: float, worker: int, args: dict) -> dict:
    return {
        "name": name,
        "ph": "X",
        "ts": _us(start),
        "dur": _us(max(0.0, end - start)),
        "pid": worker,
        "tid": 0,
        "cat": "tfdist",
        "args": args,
    }


def _step_events(r: StepRecord, shift: float) -> list[dict]:
    """The envelope and the phases of one step, in time order."""

    def at(t: float) -> float:
        return t - shift

    args = {"step": r.step, "epoch": r.epoch}
    events = [
        _event(
            f"step {r.step}", at(r.host_begin), at(r.host_end), r.worker, {**args, "bytes": r.bytes}
        )
    ]
    phases: list[tuple[str, float, float, dict]] = [
        ("input", r.host_begin, r.input_ready, {}),
        ("compute", r.input_ready, r.grads_ready, {}),
        ("wait", r.grads_ready, r.peers_ready, {}),
    ]
    cursor = r.peers_ready
    for span in sorted(r.spans, key=lambda s: s.start):
        start = max(span.start, cursor)
        if start > cursor:
            phases.append(("compress", cursor, start, {}))
        phases.append(
            ("communicate", start, max(start, span.end), {"kind": span.kind, "bytes": span.bytes})
        )
        cursor = max(cursor, span.end)
    phases.append(("decompress", cursor, max(cursor, r.reduced), {}))
    phases.append(("update", max(cursor, r.reduced), max(cursor, r.end), {}))
    for name, start, end, extra in phases:
        if end > start or name == "communicate":
            events.append(_event(name, at(start), at(end), r.worker, {**args, **extra}))
    return events


def chrome_trace(
    records: Iterable[StepRecord], offsets: Mapping[int, float] | None = None
) -> dict[str, Any]:
    """The Chrome-trace JSON object of ``records`` (see the module doc).

    Args:
        records: Steps of one or more workers.
        offsets: Seconds subtracted from each worker's instants
            (:func:`align`); default: none.
    """
    records = sorted(records, key=lambda r: (r.worker, r.host_begin))
    offsets = dict(offsets or {})
    events: list[dict] = []
    for worker in sorted({r.worker for r in records}):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": worker,
                "tid": 0,
                "args": {"name": f"worker {worker}"},
            }
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": worker,
                "tid": 0,
                "args": {"sort_index": worker},
            }
        )
    for r in records:
        events.extend(_step_events(r, offsets.get(r.worker, 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "tfdist.profiling",
            "clock_offsets_s": {str(w): o for w, o in sorted(offsets.items())},
        },
    }


def write(
    path: str | os.PathLike,
    records: Iterable[StepRecord],
    offsets: Mapping[int, float] | None = None,
) -> str:
    """Writes :func:`chrome_trace` to ``path`` atomically (a temporary file
    in the same directory, renamed): a reader never sees half a trace."""
    path = os.fspath(path)
    text = json.dumps(chrome_trace(records, offsets))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Loads a trace written by :func:`write`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
