"""Which worker the others wait for.

In synchronous training every worker's step takes as long as the slowest
one's: the others wait for it in the first collective. A worker's *busy*
time (its step minus its wait for peers) is what it spent itself; the
straggler is the worker whose busy time exceeds the median over the workers
by a set factor. Pure Python.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping

from tfdist.errors import ConfigError

__all__ = ["Straggler", "find_stragglers", "check_factor"]


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A worker slower than the others.

    Attributes:
        worker: Its index.
        busy: Its mean seconds per step not spent waiting for a peer.
        median: The median of every worker's busy seconds.
        factor: ``busy / median``.
        threshold: The factor it exceeded.
        peers_wait: The mean seconds per step the other workers waited.
        step: Its mean step seconds (the job's pace).
        steps: Steps measured.
    """

    worker: int
    busy: float
    median: float
    factor: float
    threshold: float
    peers_wait: float
    step: float
    steps: int

    def __str__(self) -> str:
        return (
            f"worker {self.worker} is a straggler: busy {self.busy * 1e3:.1f} ms per step "
            f"against the workers' median {self.median * 1e3:.1f} ms "
            f"({self.factor:.2f}x > {self.threshold:g}x); the other workers waited "
            f"{self.peers_wait * 1e3:.1f} ms per step for it (step {self.step * 1e3:.1f} ms, "
            f"{self.steps} steps)"
        )


def check_factor(value: object) -> float:
    """Validates a straggler factor: a number above 1."""
    try:
        factor = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        factor = float("nan")
    if isinstance(value, bool) or not factor > 1.0 or factor == float("inf"):
        raise ConfigError(
            "straggler_factor",
            value,
            "a finite number above 1 (how many times the workers' median busy "
            "time a straggler exceeds)",
            source="tfdist.profiling",
        )
    return factor


def find_stragglers(summary: Mapping[int, Mapping[str, float]], factor: float) -> list[Straggler]:
    """The workers of ``summary`` (worker -> :func:`~tfdist.profiling.records.mean_phases`
    entry) whose busy time exceeds ``factor`` times the median, slowest first.
    One worker has no peers: no straggler."""
    if len(summary) < 2:
        return []
    busy = {w: s["busy"] for w, s in summary.items()}
    median = statistics.median(busy.values())
    if median <= 0:
        return []
    out = []
    for w, b in busy.items():
        if b > factor * median:
            others = [s["wait"] for v, s in summary.items() if v != w]
            out.append(
                Straggler(
                    worker=w,
                    busy=b,
                    median=median,
                    factor=b / median,
                    threshold=factor,
                    peers_wait=statistics.fmean(others),
                    step=summary[w]["step"],
                    steps=int(summary[w]["steps"]),
                )
            )
    return sorted(out, key=lambda s: -s.factor)
