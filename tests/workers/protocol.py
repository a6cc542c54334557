"""The lines of a worker's output that tests parse, each in one write.

Under PYTHONUNBUFFERED, ``print(text, flush=True)`` writes the text, then its
newline, in two write() calls. Many tests read a worker's stdout and stderr on
one pipe, where TensorFlow's C++ logger writes whole lines: one that landed
between the two writes glued itself to the line ("tfdist batch: 0 3E0000 ...").

The workers run as ``python tests/workers/NAME.py``: ``from protocol import say``.
"""

from __future__ import annotations

import json
import os
import sys


def say(line: str) -> None:
    """Writes one line, newline included, to stdout's file descriptor in one write.

    What print() left in ``sys.stdout``'s buffer goes out first, to keep the
    order. A pipe may take only part of a long line: the rest follows.

    Args:
        line: The line, without its newline.
    """
    sys.stdout.flush()
    data = f"{line}\n".encode()  # UTF-8
    fd = sys.stdout.fileno()
    while data:
        data = data[os.write(fd, data) :]


def result(obj) -> None:
    """Says the worker's ``tfdist result:`` line: ``obj`` as JSON.

    Args:
        obj: What the test reads back with ``json.loads``.
    """
    say("tfdist result: " + json.dumps(obj))


def write_pid(path, pid: int | None = None) -> None:
    """Writes a pid (this process's by default) to ``path``, whole or not at all.

    Tests wait for the file to exist, then read it: a plain write let them
    read "" (CI, test_tasks_that_do_not_exit_are_killed_after_the_grace_period).

    Args:
        path: The pid file (a str or Path); ``path.tmp`` is written first.
        pid: The pid to write; None for this process's.
    """
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid() if pid is None else pid))
    os.replace(tmp, path)
