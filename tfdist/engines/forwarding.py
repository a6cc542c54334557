"""Passing a launcher's stop signals on to the process group it started.

``tfdist launch --netns`` and ``--transport mpi`` run the job under another
command (``unshare``, ``mpiexec``) in a session of its own: a SIGTERM or
Ctrl-C to the launcher must reach that whole group, and the launcher's own
handlers must come back once the command ended. No TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence


@contextlib.contextmanager
def passing_on(
    group: int, signums: Sequence[int], then: Callable[[int], None] | None = None
) -> Iterator[None]:
    """While the block runs, each of ``signums`` this process receives goes
    to process group ``group`` (and ``then(signum)`` runs after); the previous
    handlers come back at its end. Off the main thread (where no handler can
    be set) it does nothing."""

    def forward(signum, frame):
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            pass
        if then is not None:
            then(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            previous[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
