"""The rule by which the workers of a job pick the one backup they all resume from.

Each training task reports the points its backups hold: ``(epoch, batch)``,
the epoch to resume at and the batches of it already trained, for every
backup it can restore (its latest, and with ``double_checkpoint`` its
previous one; a damaged one does not count). Synchronous workers must all
resume at the same point, or the one that is behind waits in a collective
that the others never join. The rule:

* No task holds a backup: everybody starts fresh.
* Otherwise, the newest point that **every** task holds: with backups in one
  directory per task, a kill between two tasks' saves leaves one a step
  ahead; its previous backup is the point the others hold.
* If no point is held by every task (a task's backup was lost, or the
  directories belong to different jobs), nothing is loaded and every task
  fails at once with :class:`BackupDisagreementError`, naming each task and
  what it holds. Starting fresh silently would throw away the backups that
  do exist; resuming from one that some task lacks cannot be done.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tfdist.training.callbacks.files import BackupError

__all__ = ["BackupDisagreementError", "Point", "agree", "describe"]

#: (epoch to resume at, batches of it already trained).
Point = tuple[int, int]


class BackupDisagreementError(BackupError):
    """The tasks' backups hold no point in common: the job cannot resume."""


def describe(point: Point) -> str:
    """``(2, 0)`` -> ``"epoch 2"``; ``(1, 5)`` -> ``"epoch 1, batch 5"``."""
    epoch, batch = point
    return f"epoch {epoch}" + (f", batch {batch}" if batch else "")


def agree(
    held: Mapping[str, Iterable[Point]], where: Mapping[str, str] | None = None
) -> Point | None:
    """The point every task resumes at.

    Args:
        held: Task name -> the points of the backups it can restore.
        where: Task name -> where its backups are (for the message).

    Returns:
        The newest point every task holds; None if no task holds any (a
        fresh start).

    Raises:
        BackupDisagreementError: Some task holds a backup, but no point is
            held by every task.
    """
    sets = {task: {(int(e), int(b)) for e, b in points} for task, points in held.items()}
    if not any(sets.values()):
        return None
    common = set.intersection(*sets.values())
    if common:
        return max(common)
    where = where or {}

    def holding(task: str) -> str:
        points = sorted(sets[task], reverse=True)
        what = " and ".join(describe(p) for p in points) if points else "no backup"
        return f"{task} holds {what}" + (f" in {where[task]}" if task in where else "")

    raise BackupDisagreementError(
        "The workers cannot resume at the same point: expected every training task to "
        "hold a backup of one common point (epoch, batch); received: "
        + "; ".join(holding(task) for task in sets)
        + ". Nothing was loaded. Restore the missing backup, or remove every task's "
        "backup directory to start over."
    )
