"""Pipeline schedules: the order in which each stage runs its micro-batches'
forward (``F``) and backward (``B``) passes in one training step.

- ``gpipe``: every forward, then every backward (GPipe). Each stage keeps
  all ``m`` micro-batches' activations until their backward.
- ``1f1b``: after ``p - s - 1`` warm-up forwards, stage ``s`` alternates one
  forward and one backward (PipeDream-Flush, Megatron's 1F1B). The same
  bubble as GPipe, but stage ``s`` keeps at most ``p - s`` micro-batches'
  activations at a time.

- ``interleaved``: Megatron's interleaved 1F1B. Each of the ``p`` processes
  runs ``v`` model chunks (``chunks``) of a model cut in ``p * v`` stages:
  process ``k`` holds stages ``k, k + p, ...``. A process's passes are
  ``v`` times shorter, and the bubble ``v`` times smaller:
  ``(p - 1) / (v m + p - 1)``, for more messages and more activations in
  flight during the warm-up. ``m`` must be a multiple of ``p``.

GPipe and 1F1B have the bubble ``(p - 1) / (m + p - 1)`` of ``p`` stages
and ``m`` micro-batches when a forward and a backward take the same time on
every stage. :func:`simulate` replays a schedule with given pass times and
reports each process's idle fraction and peak activations in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tfdist.errors import ConfigError

__all__ = ["Action", "SCHEDULES", "actions", "bubble", "simulate", "Timeline"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one micro-batch: ``kind`` is ``"F"`` or ``"B"``;
    ``chunk`` is which of the process's model chunks runs it (0 but with
    the interleaved schedule)."""

    kind: str
    microbatch: int
    chunk: int = 0


def actions(
    schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1
) -> list[Action]:
    """The passes process ``stage`` of ``stages`` runs in one step, in order.

    Args:
        schedule: One of :data:`SCHEDULES`.
        stage: The process's place in the pipeline.
        stages: The pipeline's processes (``p``).
        microbatches: Micro-batches per step (``m``).
        chunks: Model chunks per process (``v``; only ``interleaved``
            takes more than 1).

    Raises:
        ConfigError: An unknown schedule, counts out of range, ``chunks``
            other than 1 but with ``interleaved``, or ``m`` not a multiple
            of ``p`` with it.
    """
    _check(schedule, stage, stages, microbatches, chunks)
    m = microbatches
    if schedule == "interleaved" and chunks > 1:  # One chunk a process: 1F1B.
        return _interleaved(stage, stages, m, chunks)
    if schedule == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]
    return order


def _interleaved(k: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron's order: forwards go through the chunks in groups of ``p``
    micro-batches, backwards through them in reverse; process ``k`` warms
    up with ``2 (p - k - 1) + (v - 1) p`` forwards, then alternates."""
    total = m * v

    def action(kind: str, n: int) -> Action:
        chunk = (n % (p * v)) // p
        return Action(kind, (n // (p * v)) * p + n % p, chunk if kind == "F" else v - 1 - chunk)

    warmup = min(2 * (p - k - 1) + (v - 1) * p, total)
    order = [action("F", n) for n in range(warmup)]
    for n in range(total - warmup):
        order += [action("F", warmup + n), action("B", n)]
    return order + [action("B", n) for n in range(total - warmup, total)]


def _check(schedule: str, stage: int, stages: int, microbatches: int, chunks: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError("schedule", schedule, f"one of {SCHEDULES}", source="tfdist.pipeline")
    for field, value, low in (
        ("stages", stages, 1),
        ("microbatches", microbatches, 1),
        ("chunks", chunks, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(field, value, f"an integer >= {low}", source="tfdist.pipeline")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ConfigError(
            "stage", stage, f"an integer in [0, {stages - 1}]", source="tfdist.pipeline"
        )
    if chunks > 1 and schedule != "interleaved":
        raise ConfigError(
            "chunks",
            chunks,
            f"1 with schedule {schedule!r} (only 'interleaved' runs several chunks a process)",
            source="tfdist.pipeline",
        )
    if schedule == "interleaved" and microbatches % stages:
        raise ConfigError(
            "microbatches",
            microbatches,
            f"a multiple of the {stages} pipeline processes with the interleaved schedule "
            "(its micro-batches go through the chunks in groups of that many)",
            source="tfdist.pipeline",
        )


def bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction in theory: ``(p - 1) / (v m + p - 1)`` (``v = 1``:
    GPipe's and 1F1B's)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


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
    chunks: int = 1,
    transfer: float = 0.0,
    durations: Mapping[tuple[int, Action], float] | None = None,
) -> Timeline:
    """Runs the schedule on paper: each pass starts when its process is
    free and its input is there (a forward needs the previous stage's
    forward of the micro-batch, a backward the next stage's backward and its
    own forward). ``forward`` and ``backward`` are a process's times for one
    micro-batch over all its chunks (each chunk's pass takes ``1 / chunks``
    of it), one number or one per process. ``transfer``: the time from a
    pass's end until another process can use what it sent (0: sending
    takes no time, as the bubble formula assumes). ``durations``: each
    pass's own time instead, by ``(process, action)`` (a measured step's).

    Raises:
        ConfigError: As :func:`actions`; ``durations`` without a pass of the
            schedule. A schedule that could never finish (a bug) raises
            RuntimeError.
    """
    p, m, v = stages, microbatches, chunks
    f = [t / v for t in _per_stage(forward, p, "forward")]
    b = [t / v for t in _per_stage(backward, p, "backward")]
    if durations is not None:
        missing = [
            (s, a)
            for s in range(p)
            for a in actions(schedule, s, p, m, v)
            if (s, a) not in durations
        ]
        if missing:
            raise ConfigError(
                "durations",
                f"{len(durations)} passes",
                f"a time for every pass of the schedule (none for process {missing[0][0]}'s "
                f"{missing[0][1]})",
                source="simulate",
            )
    if isinstance(transfer, bool) or not isinstance(transfer, (int, float)) or transfer < 0:
        raise ConfigError("transfer", transfer, "a time >= 0", source="simulate")
    queues = [actions(schedule, s, p, m, v) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    spans: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    while any(queues):
        progressed = False
        for s in range(p):
            while queues[s]:
                a = queues[s][0]
                ready = _ready(a, a.chunk * p + s, p * v, done, transfer if p > 1 else 0.0)
                if ready is None:
                    break
                start = max(free[s], ready)
                if durations is not None:
                    end = start + durations[s, a]
                else:
                    end = start + (f[s] if a.kind == "F" else b[s])
                done[(a.kind, a.microbatch, a.chunk * p + s)] = end
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


def _ready(a: Action, g: int, total: int, done: dict, transfer: float) -> float | None:
    """When pass ``a`` of stage ``g`` (of ``total``) has its inputs, or None
    if not yet; what another stage sent arrives ``transfer`` after its pass
    (neighbouring stages are on other processes)."""
    if a.kind == "F":
        needs = [(("F", a.microbatch, g - 1), transfer)] if g > 0 else []
    else:
        later = [(("B", a.microbatch, g + 1), transfer)] if g < total - 1 else []
        needs = [(("F", a.microbatch, g), 0.0), *later]
    if any(n not in done for n, _ in needs):
        return None
    return max((done[n] + delay for n, delay in needs), default=0.0)


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
