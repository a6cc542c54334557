"""Every process of a pipeline runs the same plan, or none starts.

Each process cuts the model itself, from its own arguments. Processes given
different split points would still exchange tensors of the same shapes
between layers of the same width, and train a wrong model without a word;
different schedules or micro-batch counts would wait for messages that never
come. That happens to a script that picks its split points on each worker:
:func:`~tfdist.pipeline.balancing.balance` with ``by="time"`` measures
slightly different costs on each. So before the first step, each process
sends its neighbours what it was given, and a difference is a
``ConfigError`` naming the field, both values and the other process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tfdist.errors import ConfigError

if TYPE_CHECKING:
    from tfdist.pipeline.split import Stage
    from tfdist.transport.p2p import Link

__all__ = ["TAG", "plan_of", "check_agreement"]

#: The tag of the message that carries a process's plan.
TAG = ("plan",)


def plan_of(
    stages: Sequence[Stage], split_points: Sequence[str], **settings: object
) -> dict[str, object]:
    """What every process must have been given alike.

    Args:
        stages: The :class:`~tfdist.pipeline.split.Stage` list the process cut.
        split_points: The split points it was given.
        **settings: Other arguments every process must share (schedule,
            micro-batches, chunks, replicas, compression), as JSON values.

    Returns:
        The plan: the split points, the settings, and ``model``, a digest of
        every stage's layer names and weight shapes (a process that built
        another model, or another size of it, differs there).
    """
    shapes = [[list(stage.layers), [list(v.shape) for v in stage.variables]] for stage in stages]
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    return {"split_points": list(split_points), **settings, "model": digest}


def check_agreement(
    plan: Mapping[str, object],
    links: Mapping[int, Link],
    names: Sequence[str],
    source: str,
    timeout: float | None = None,
) -> None:
    """Sends ``plan`` to every linked process and compares theirs with it.

    Args:
        plan: This process's :func:`plan_of`.
        links: By rank, the links to the processes to agree with.
        names: How errors name each rank (e.g. ``"stage 1"``).
        source: What the error names as its source.
        timeout: Seconds to wait for each plan (None: the links' own).

    Raises:
        ConfigError: A linked process was given another value: the field is
            the argument, the value this process's, the message names the
            other process and its value.
        PeerError: A linked process died or sent nothing in time.
    """
    text = np.frombuffer(json.dumps(plan, sort_keys=True).encode(), np.uint8)
    for link in links.values():
        link.send(TAG, [text])
    for rank in sorted(links):
        (got,) = links[rank].recv(TAG, timeout=timeout)
        theirs = json.loads(got.tobytes().decode())
        for field, ours in plan.items():
            if theirs.get(field) != ours:
                what = (
                    "another model (its stages' layers or weight shapes differ)"
                    if field == "model"
                    else repr(theirs.get(field))
                )
                raise ConfigError(
                    field,
                    ours,
                    f"the same on every process of the pipeline ({names[rank]} was given {what})",
                    source=source,
                )
