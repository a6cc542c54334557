"""The processes of one attempt of ``tfdist launch``: each task's process and output,
the signals the launcher received, and stopping every task. No TensorFlow.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from tfdist import spec as spec_lib
from tfdist.engines.launch_results import IMPORTANT, PORT_TAKEN, TAIL, TF_INFO, TaskExit
from tfdist.engines.quiet import NoiseFilter


class Signals:
    """The stop signals the launcher received (set by its signal handler).

    The handler only records the signal: the attempt's watch loop passes it
    on and runs the grace period, so a signal never cuts a stop short.
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # The first one.
        self.last: int | None = None
        self.time = 0.0
        self.count = 0

    def __call__(self, signum: int, frame: Any = None) -> None:
        if self.count == 0:
            self.signum, self.time = signum, time.monotonic()
        self.last = signum
        self.count += 1


class Task:
    """One child process and the threads that copy its output.

    stdout and stderr are read by a thread each, so ``tail`` keeps each
    stream's order but interleaves the two in the order the threads read
    them, not the order the task wrote them.
    """

    def __init__(
        self,
        task: str,
        argv: list[str],
        env: dict,
        out: Output,
        shown: bool,
        log_path: Path | None,
        verbose: bool = False,
    ) -> None:
        self.task = task
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL)
        self.port_taken = False
        self._log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115 - open for the task's lifetime
        self._log_lock = threading.Lock()
        self._pumping = 2  # The log is closed when both streams ended.
        # Own session: the launcher signals the whole group, grandchildren too.
        # stdout and stderr on pipes of their own: on one pipe, a line that
        # Python wrote in two parts (print() writes the text, then the
        # newline, under PYTHONUNBUFFERED) took TensorFlow's C++ log line
        # written to stderr in between ("tfdist batch: 0 3E0000 ...").
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
        )
        self._threads = [
            threading.Thread(target=self._pump, args=(stream, out, shown, verbose), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, stream: IO[str], out: Output, shown: bool, verbose: bool) -> None:
        in_traceback = False
        noise = None if verbose else NoiseFilter()
        for line in stream:
            line = line.rstrip("\n")
            if self._log:
                with self._log_lock:
                    self._log.write(line + "\n")
            if PORT_TAKEN.search(line):
                self.port_taken = True
            if noise is not None and noise.is_noise(line):
                continue  # In the log file only.
            self.tail.append(line)
            in_traceback = in_traceback or line.startswith("Traceback")
            if shown or in_traceback or (IMPORTANT.search(line) and not TF_INFO.match(line)):
                out.line(f"[{self.task}] {line}")
        with self._log_lock:
            self._pumping -= 1
            if self._log and not self._pumping:
                self._log.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, timeout: float = 5.0) -> None:
        """Waits for the output to drain after the process ended."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def exit(self) -> TaskExit:
        return TaskExit(self.task, self.proc.returncode, tuple(self.tail))


class Output:
    """Serializes lines from several threads onto one stream."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self._stream.write(text + "\n")
            self._stream.flush()

    def say(self, text: str) -> None:
        self.line(f"[tfdist launch] {text}")


def stop_all(tasks: list[Task], timeout: float) -> None:
    """SIGTERM every running task's process group, then SIGKILL what is left.

    Each task leads its own process group, so this also reaches processes
    the task started (data loaders, shells) even after the task itself
    exited: the group keeps its id while any member lives.
    """
    running = [t for t in tasks if t.poll() is None]
    for t in running:
        t.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for t in running:
        try:
            t.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for t in tasks:
        t.signal(signal.SIGKILL)
        if t.poll() is None:
            t.proc.wait()
        t.finish(1.0)


def compact_json(config: dict) -> str:
    """``config`` as JSON without spaces (a TF_CONFIG value)."""
    return json.dumps(config, separators=(",", ":"))


def tasks_of(spec: dict, evaluator: bool) -> list[tuple[str, int, dict]]:
    """``(type, index, TF_CONFIG)`` of every task of ``spec``, and the evaluator if asked."""
    tasks = [(t, i, cfg) for t, i, cfg in spec_lib.all_task_configs(spec)]
    if evaluator:
        # The evaluator stays outside `cluster`, as TensorFlow expects.
        tasks.append(
            (
                "evaluator",
                0,
                {"cluster": spec["cluster"], "task": {"type": "evaluator", "index": 0}},
            )
        )
    return tasks


def position(record: dict) -> str:
    """``"step 37 (epoch 1, batch 12)"`` from a status record."""
    text = f"step {record.get('step')}"
    if record.get("epoch") is not None:
        text += f" (epoch {record['epoch']}, batch {record.get('batch')})"
    return text
