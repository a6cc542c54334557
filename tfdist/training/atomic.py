"""Files written whole or not at all: a temporary file, flushed to disk, then
renamed over the old one.

A reader (a restarted worker, another process) sees the old file or the new
one, never a part of one; the rename outlives a crash once the directory is
flushed too (:func:`fsync`). No TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO


def fsync(path: str) -> None:
    """Flushes the file or directory at ``path`` to disk, if it can."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # Some filesystems refuse to fsync a directory.
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str, tmp: str, opened: IO) -> Iterator[IO]:
    """Yields ``opened``, a file open on ``tmp``. When the block ends without
    an error, flushes it to disk and renames ``tmp`` over ``path``; ``tmp`` is
    removed either way, so ``path`` is the old file or the whole new one.

    Flush the directory after (:func:`fsync`) for the rename to outlive a crash.
    """
    try:
        with opened as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
