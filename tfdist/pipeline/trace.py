"""Where a pipeline step's time went: each process's spans, and the bubble.

A :class:`~tfdist.pipeline.runtime.StageRunner` given a :class:`Trace`
records, per step, when each of its passes ran (``F``, ``B``), when it waited
in a receive (``recv``), turned outputs into bytes and sent them (``send``),
and averaged and applied its gradients (``update``).

:func:`breakdown` reads the spans of every process of a pipeline (on one
clock: ``time.perf_counter`` is the host's monotonic clock, the same in every
process of a machine) and splits each process's share of the step into those
parts. Its window is the schedule's: from the first forward to the last
backward of the step, over every process, the span the bubble formula
``(p - 1) / (v m + p - 1)`` describes. The update comes after it.

:func:`replay` gives the bubble the schedule has with the measured pass times
and free transfers (:func:`~tfdist.pipeline.schedule.simulate`): stages of
unequal cost leave more idle than the formula, which assumes equal ones.
:func:`delivery` measures what a message costs the stage waiting for it,
and ``replay(..., transfer=...)`` adds that cost to every message.
:func:`replay_step` replays one step with each pass as long as it was.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Sequence

from tfdist.errors import ConfigError
from tfdist.pipeline.schedule import actions, simulate

__all__ = [
    "KINDS",
    "Span",
    "Trace",
    "Breakdown",
    "breakdown",
    "replay",
    "replay_step",
    "delivery",
]

#: What a span measures: a forward or backward pass, a receive (waiting for
#: the neighbour, and making tensors of its bytes), making bytes of outputs
#: and posting them to the link's sender thread (the writing overlaps the
#: next pass), the gradient averaging and optimizer step.
KINDS = ("F", "B", "recv", "send", "update")


@dataclasses.dataclass(frozen=True)
class Span:
    """One measured part of a step on one process (seconds, host clock).

    Attributes:
        message: For a ``send`` or ``recv``, the message: ``(kind, stage,
            microbatch)``, the pass it feeds (``"F"`` or ``"B"``), the
            stage it goes to, and its micro-batch; else ``()``.
    """

    kind: str
    step: int
    start: float
    end: float
    message: tuple = ()

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Trace:
    """The spans one process recorded, step after step.

    Args:
        keep: How many steps' spans to keep (the oldest go first).
    """

    def __init__(self, keep: int = 1000) -> None:
        if keep < 1:
            raise ConfigError("keep", keep, "at least 1 step", source="tfdist.pipeline.trace")
        self.keep = keep
        # By step, oldest first: dropping a step is one pop, not a scan of
        # every span kept (add runs inside the training step).
        self._by_step: collections.OrderedDict[int, list[Span]] = collections.OrderedDict()

    @property
    def spans(self) -> list[Span]:
        """Every span kept, in the order recorded."""
        return [s for spans in self._by_step.values() for s in spans]

    def add(self, kind: str, step: int, start: float, message: tuple = ()) -> float:
        """Records a span of ``kind`` from ``start`` to now; returns now."""
        now = time.perf_counter()
        if step not in self._by_step:
            self._by_step[step] = []
            if len(self._by_step) > self.keep:
                self._by_step.popitem(last=False)
        self._by_step[step].append(Span(kind, step, start, now, message))
        return now

    def steps(self) -> list[int]:
        """The steps recorded, in order."""
        return sorted(self._by_step)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """One step of a pipeline, per process, as fractions of its window.

    Attributes:
        window: Seconds from the step's first forward to its last backward,
            over every process.
        compute: Per process, the fraction spent in forward and backward passes.
        wait: Per process, the fraction spent in receives.
        send: Per process, the fraction spent making bytes of outputs and
            posting them (a sender thread writes them meanwhile).
        idle: Per process, ``1 - compute``: the measured bubble, transfers
            included (the formula counts them as idle too, at zero cost).
        forward: Per process, the mean seconds of one forward pass (over
            its chunks' passes of one micro-batch, summed).
        backward: As ``forward``, for a backward pass.
        update: Per process, the seconds of the update after the window.
    """

    window: float
    compute: tuple[float, ...]
    wait: tuple[float, ...]
    send: tuple[float, ...]
    idle: tuple[float, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]


def breakdown(spans: Sequence[Sequence[Span]], step: int, chunks: int = 1) -> Breakdown:
    """Splits one step of a pipeline into its parts, per process.

    Args:
        spans: Per process (in pipeline order), its recorded spans, on one clock.
        step: The step to read.
        chunks: Stages a process runs (the interleaved schedule's ``v``).

    Raises:
        ConfigError: A process that recorded no pass of ``step``.
    """
    own = [[s for s in process if s.step == step] for process in spans]
    for k, process in enumerate(own):
        if not any(s.kind in ("F", "B") for s in process):
            raise ConfigError(
                "spans",
                f"process {k}: {len(process)} spans of step {step}",
                "a forward or backward pass of the step on every process",
                source="tfdist.pipeline.trace",
            )
    passes = [s for process in own for s in process if s.kind in ("F", "B")]
    start, end = min(s.start for s in passes), max(s.end for s in passes)
    window = end - start

    def share(process: list[Span], kinds: tuple[str, ...]) -> float:
        inside = (min(s.end, end) - max(s.start, start) for s in process if s.kind in kinds)
        return sum(max(0.0, t) for t in inside) / window

    def per_pass(process: list[Span], kind: str) -> float:
        times = [s.seconds for s in process if s.kind == kind]
        return chunks * sum(times) / len(times) if times else 0.0

    compute = tuple(share(p, ("F", "B")) for p in own)
    return Breakdown(
        window=window,
        compute=compute,
        wait=tuple(share(p, ("recv",)) for p in own),
        send=tuple(share(p, ("send",)) for p in own),
        idle=tuple(1 - c for c in compute),
        forward=tuple(per_pass(p, "F") for p in own),
        backward=tuple(per_pass(p, "B") for p in own),
        update=tuple(sum(s.seconds for s in p if s.kind == "update") for p in own),
    )


def replay(
    schedule: str,
    microbatches: int,
    steps: Sequence[Breakdown],
    chunks: int = 1,
    transfer: float = 0.0,
):
    """The schedule's idle per process with the steps' median pass times and
    free transfers: the bubble these stages have, which the formula gives
    only for stages of equal cost. With ``transfer`` (e.g. the measured
    :func:`delivery`), each message also takes that long to arrive.

    Returns:
        A :class:`~tfdist.pipeline.schedule.Timeline`.
    """
    forward = [statistics.median(b.forward[k] for b in steps) for k in range(len(steps[0].forward))]
    backward = [statistics.median(b.backward[k] for b in steps) for k in range(len(forward))]
    return simulate(schedule, len(forward), microbatches, forward, backward, chunks, transfer)


def replay_step(
    schedule: str,
    microbatches: int,
    spans: Sequence[Sequence[Span]],
    step: int,
    chunks: int = 1,
    transfer: float = 0.0,
):
    """The schedule replayed with one measured step's own pass times, each
    pass as long as it was: what is left between this and the measured idle
    is neither the stages' costs nor their passes' jitter (a pass slower
    than its median holds up the stage waiting for it), but the runtime's
    own time between passes, and each message's delivery beyond
    ``transfer``.

    Args:
        spans: Per process (in pipeline order), its recorded spans.
        step: The step to replay.

    Returns:
        A :class:`~tfdist.pipeline.schedule.Timeline`.

    Raises:
        ConfigError: A process whose passes of ``step`` are not the
            schedule's, in its order.
    """
    p = len(spans)
    durations = {}
    for s, process in enumerate(spans):
        passes = sorted(
            (x for x in process if x.step == step and x.kind in ("F", "B")), key=lambda x: x.start
        )
        planned = actions(schedule, s, p, microbatches, chunks)
        if [x.kind for x in passes] != [a.kind for a in planned]:
            raise ConfigError(
                "spans",
                f"process {s}: {''.join(x.kind for x in passes)} in step {step}",
                f"the schedule's passes in its order, {''.join(a.kind for a in planned)}",
                source="tfdist.pipeline.trace",
            )
        durations.update({(s, a): x.seconds for a, x in zip(planned, passes)})
    return simulate(
        schedule, p, microbatches, chunks=chunks, transfer=transfer, durations=durations
    )


def delivery(spans: Sequence[Sequence[Span]], steps: Sequence[int]) -> float | None:
    """The median time a message took to reach a stage that was waiting for
    it: from the end of its ``send`` span (the sender's pass is done and the
    bytes posted) to the end of the matching ``recv`` (the tensors made),
    over the receives of ``steps`` that began before their message was
    sent. None if no receive waited so. What each message adds to a
    pipeline's critical path: the writing, the reading, the threads' wake-ups
    and the conversions.

    Args:
        spans: Per process, its recorded spans, on one clock.
        steps: The steps to read.
    """
    wanted = set(steps)
    sent = {
        (s.step, s.message): s.end
        for process in spans
        for s in process
        if s.kind == "send" and s.message and s.step in wanted
    }
    waits = [
        s.end - sent[s.step, s.message]
        for process in spans
        for s in process
        if s.kind == "recv" and (s.step, s.message) in sent and s.start < sent[s.step, s.message]
    ]
    return statistics.median(waits) if waits else None
