"""Pipeline schedules: the order in which each stage runs its micro-batches'
forward (``F``) and backward (``B``) passes in one training step.

- ``gpipe``: every forward, then every backward (GPipe). Each stage keeps
  all ``m`` micro-batches' activations until their backward.
- ``1f1b``: after ``p - s - 1`` warm-up forwards, stage ``s`` alternates one
  forward and one backward (PipeDream-Flush, Megatron's 1F1B). The same
  bubble as GPipe, but stage ``s`` keeps at most ``p - s`` micro-batches'
  activations at a time.

Both have the bubble ``(p - 1) / (m + p - 1)`` of ``p`` stages and ``m``
micro-batches when a forward and a backward take the same time on every
stage. :func:`simulate` replays a schedule with given pass times and
reports each stage's idle fraction and peak activations in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfdist.errors import ConfigError

__all__ = ["Action", "SCHEDULES", "actions", "bubble", "simulate", "Timeline"]

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one micro-batch: ``kind`` is ``"F"`` or ``"B"``."""

    kind: str
    microbatch: int


def actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The passes stage ``stage`` of ``stages`` runs in one step, in order.

    Raises:
        ConfigError: An unknown schedule, or counts out of range.
    """
    _check(schedule, stage, stages, microbatches)
    m = microbatches
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]
    return order


def _check(schedule: str, stage: int, stages: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError("schedule", schedule, f"one of {SCHEDULES}", source="tfdist.pipeline")
    for field, value, low in (("stages", stages, 1), ("microbatches", microbatches, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(field, value, f"an integer >= {low}", source="tfdist.pipeline")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ConfigError(
            "stage", stage, f"an integer in [0, {stages - 1}]", source="tfdist.pipeline"
        )


def bubble(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's idle fraction in theory: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found.

    Attributes:
        step: The step's length, first start to last end.
        idle: Per stage, the fraction of ``step`` it was not computing.
        peak_in_flight: Per stage, the most micro-batches whose forward had
            run and whose backward had not (activations kept).
        spans: Per stage, ``(kind, microbatch, start, end)`` of each pass.
    """

    step: float
    idle: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    spans: tuple[tuple[tuple[str, int, float, float], ...], ...]


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 1.0,
) -> Timeline:
    """Runs the schedule on paper: each pass starts when its stage is free
    and its input is there (a forward needs the previous stage's forward of
    the micro-batch, a backward the next stage's backward and its own
    forward). Sending takes no time.

    Raises:
        ConfigError: As :func:`actions`; a schedule that could never finish
            (a bug) raises RuntimeError.
    """
    p, m = stages, microbatches
    f = _per_stage(forward, p, "forward")
    b = _per_stage(backward, p, "backward")
    queues = [actions(schedule, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    spans: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    while any(queues):
        progressed = False
        for s in range(p):
            while queues[s]:
                a = queues[s][0]
                ready = _ready(a, s, p, done)
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + (f[s] if a.kind == "F" else b[s])
                done[(a.kind, a.microbatch, s)] = end
                spans[s].append((a.kind, a.microbatch, start, end))
                free[s] = end
                queues[s].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"schedule {schedule!r} deadlocks with {p} stages, {m} micro-batches"
            )
    return _timeline(spans)


def _per_stage(value: float | Sequence[float], stages: int, field: str) -> list[float]:
    values = [float(value)] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages or any(v <= 0 for v in values):
        raise ConfigError(
            field, value, f"a positive time, or one per stage ({stages})", source="simulate"
        )
    return values


def _ready(a: Action, s: int, p: int, done: dict) -> float | None:
    """When pass ``a`` of stage ``s`` has its inputs, or None if not yet."""
    if a.kind == "F":
        needs = [("F", a.microbatch, s - 1)] if s > 0 else []
    else:
        needs = [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < p - 1 else [])
    if any(n not in done for n in needs):
        return None
    return max((done[n] for n in needs), default=0.0)


def _timeline(spans: list[list[tuple[str, int, float, float]]]) -> Timeline:
    start = min(sp[0][2] for sp in spans)
    end = max(sp[-1][3] for sp in spans)
    step = end - start
    idle = tuple(1 - sum(e - b for _, _, b, e in sp) / step for sp in spans)
    peaks = []
    for sp in spans:
        live = peak = 0
        for kind, _, _, _ in sp:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(step, idle, tuple(peaks), tuple(tuple(sp) for sp in spans))
