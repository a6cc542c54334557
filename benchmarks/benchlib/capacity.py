"""Capacity ladders: the largest size each arm trains under a memory limit.

Each arm of a benchmark climbs a ladder of sizes (smallest first) until a
job fails; the next arm starts at the largest size the one before trained,
so that the arms' largest sizes can be compared at one size they share.
A failed job must be an OOM kill: any other failure is a bug, not a result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["climb", "outcome"]


def outcome(outcomes: list[dict], what: str) -> tuple[bool, int]:
    """``(trained, OOM kills)`` of a job's workers (:func:`jobs.outcome_job`
    under a limit).

    Raises:
        RuntimeError: The job failed without an OOM kill; the workers'
            stderr's ends.
    """
    trained = all(o["returncode"] == 0 and o["result"] for o in outcomes)
    killed = sum(o["memory"]["oom_kills"] for o in outcomes)
    if not trained and not killed:
        tails = "\n---\n".join(o["stderr_tail"][-1500:] for o in outcomes)
        raise RuntimeError(f"{what} failed without an OOM kill:\n{tails}")
    return trained, killed


def climb(
    arms: Sequence[str],
    sizes: Sequence[int],
    run: Callable[[str, int], dict],
    describe: Callable[[dict], str],
) -> list[dict]:
    """Runs ``run(arm, size)`` up the ladder for each arm, until one's record
    says ``trained`` is false; prints ``describe(record)`` for each.

    Returns:
        Every record, in the order run.
    """
    records: list[dict] = []
    start = 0
    for arm in arms:
        trained = []
        for size in sizes[start:]:
            record = run(arm, size)
            records.append(record)
            print(f"{arm} {size}: {describe(record)}", flush=True)
            if not record["trained"]:
                break
            trained.append(size)
        start = list(sizes).index(trained[-1]) if trained else 0
    return records
