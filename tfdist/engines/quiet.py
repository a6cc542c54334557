"""TensorFlow's start-up noise, and a filter that drops only that.

On a machine without a GPU, every process that imports TensorFlow 2.21
writes these lines to its stderr (fd 2) before its first useful line, and
``TF_CPP_MIN_LOG_LEVEL`` does not stop them: they are logged before absl's
``InitializeLog`` (here most of them twice in one process)::

    WARNING: All log messages before absl::InitializeLog() is called are ...
    I0000 00:00:1795432475.557413  8183 port.cc:153] oneDNN custom operations ...
    I0000 00:00:1795432475.557731  8183 cudart_stub.cc:31] Could not find cuda ...
    I0000 00:00:1795432475.771975  8183 cpu_feature_guard.cc:227] This ...
    To enable the following instructions: AVX2 AVX512F ..., in other ...
    E0000 00:00:1795432477.875512  8183 cuda_platform.cc:52] failed call to ...

and a multi-worker task, unless ``TF_CPP_MIN_LOG_LEVEL`` is 1 or more, logs
its cluster's start-up at INFO level (coordination service, gRPC server,
barriers passed).

:class:`NoiseFilter` recognizes exactly these lines (:data:`NOISE`), nothing
else: other log lines, warnings, errors and tracebacks pass. The cuInit
error passes too unless the same process said first that it found no CUDA
driver: on a machine with a driver, it is a real error.
:func:`filtered_stderr` runs a block with fd 2 going through the filter
(``tfdist info``); ``tfdist launch`` filters what it shows of its tasks
(their log files keep every line).

This module imports no TensorFlow, and runs as a script: the filter
process of :func:`filtered_stderr` (``python quiet.py`` copies stdin to
stdout without the noise).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["NOISE", "NoiseFilter", "filtered_stderr"]


def _glog(level: str, file: str, message: str) -> re.Pattern[str]:
    """A log line in either of TensorFlow's formats (regular expressions):

    * glog: level, MMDD (0000 before InitializeLog), time, thread,
      ``file:line]``, message;
    * TF 2.16 to 2.20's own: ``YYYY-MM-DD HH:MM:SS.ffffff: LEVEL
      path/to/file:line] message``.
    """
    return re.compile(
        rf"(?:{level}\d{{4}} \d\d:\d\d:[\d.]+ +\d+ "
        rf"|\d{{4}}-\d\d-\d\d \d\d:\d\d:[\d.]+: {level} (?:\S+/)?)"
        rf"{file}:\d+\] {message}"
    )


#: The start-up lines dropped, by name, as observed with TensorFlow 2.16 to
#: 2.21 on a CPU machine (``tfdist info``; tasks of ``tfdist launch``). Each
#: must match a whole line.
NOISE: dict[str, re.Pattern[str]] = {
    "absl-preinit": re.compile(
        r"WARNING: All log messages before absl::InitializeLog\(\) is called "
        r"are written to STDERR"
    ),
    "onednn": _glog(
        "I",
        r"port\.cc",
        r"oneDNN custom operations are on\. You may see "
        r"slightly different numerical results due to floating-point "
        r"round-off errors from different computation orders\. To turn them "
        r"off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`\.",
    ),
    "no-cuda-driver": _glog(
        "I",
        r"cudart_stub\.cc",
        r"Could not find cuda drivers on your "
        r"machine, GPU will not be used\.",
    ),
    "cpu-instructions": _glog(
        "I",
        r"cpu_feature_guard\.cc",
        r"This TensorFlow binary is optimized "
        r"to use available CPU instructions in performance-critical "
        r"operations\.",
    ),
    # The second line of "cpu-instructions": dropped only right after it.
    "cpu-instructions-2": re.compile(
        r"To enable the following instructions: [A-Z0-9_ ]+, in other "
        r"operations, rebuild TensorFlow with the appropriate compiler flags\."
    ),
    # Dropped only after "no-cuda-driver" in the same process.
    "cuinit": _glog("E", r"cuda_platform\.cc", r"failed call to cuInit: .*"),
    # TF 2.16 to 2.19 register their CUDA plugins twice, on any machine.
    "plugin-registered-twice": _glog(
        "E",
        r"cuda_(?:fft|dnn|blas)\.cc",
        r"Unable to register (cu[A-Za-z]+) factory: "
        r"Attempting to register factory for plugin \1 when one has already been "
        r"registered",
    ),
    "placer-registered-twice": _glog(
        "W",
        r"computation_placer\.cc",
        r"computation placer already registered\. Please "
        r"check linkage and avoid linking the same target more than once\.",
    ),
    # TF 2.16 without TensorRT (never needed on a CPU).
    "no-tensorrt": _glog("W", r"py_utils\.cc", r"TF-TRT Warning: Could not find TensorRT"),
    # A multi-worker task's cluster start-up, at INFO level.
    "cluster-start": _glog(
        "I",
        r"(?:coordination_service(?:_agent)?\.(?:cc|h)|grpc_server_lib\.cc)",
        r"(?:Initializing CoordinationService"
        r"|Started server with target: grpc://\S+"
        r"|Barrier\(\S+\) has passed with status: OK"
        r"|/job:\S+ has connected to coordination service\. Incarnation: \d+"
        r"|Coordination agent has successfully connected\.)",
    ),
}


class NoiseFilter:
    """Tells, line by line, which lines of one process's output are noise.

    Stateful (use one per process): the cuInit error is noise only after
    "Could not find cuda drivers", and the CPU-instructions notice's second
    line only right after its first.
    """

    def __init__(self) -> None:
        self._no_cuda_driver = False
        self._previous = ""

    def is_noise(self, line: str) -> bool:
        """Whether ``line`` (without its newline) is start-up noise."""
        line = line.rstrip("\r\n")
        name = next((n for n, p in NOISE.items() if p.fullmatch(line)), "")
        if name == "no-cuda-driver":
            self._no_cuda_driver = True
        noise = bool(name) and (
            (name != "cuinit" or self._no_cuda_driver)
            and (name != "cpu-instructions-2" or self._previous == "cpu-instructions")
        )
        self._previous = name if noise else ""
        return noise

    def keep(self, lines: Iterator[str]) -> Iterator[str]:
        """The lines that are not noise."""
        return (line for line in lines if not self.is_noise(line))


def _copy_without_noise(source: BinaryIO, target: BinaryIO) -> None:
    """Copies ``source`` to ``target`` line by line, without the noise."""
    noise = NoiseFilter()
    for raw in iter(source.readline, b""):
        if not noise.is_noise(raw.decode("utf-8", "replace")):
            target.write(raw)
            target.flush()


@contextlib.contextmanager
def filtered_stderr(enabled: bool = True) -> Iterator[None]:
    """Runs the block with this process's fd 2 going through the filter.

    What TensorFlow's C++ code writes before absl's ``InitializeLog`` goes
    straight to fd 2, so ``sys.stderr`` cannot catch it; fd 2 becomes a pipe
    to a small filter process that writes every other line to the real
    stderr as it comes. Being another process, the filter still writes the
    last lines of a process that aborts (a fatal "Check failed" line).

    Args:
        enabled: False runs the block unfiltered (``--verbose``).
    """
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        reader = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=saved,
            stderr=saved,
            close_fds=True,
        )
    except OSError:  # No filter: the noise shows, nothing else changes.
        os.close(saved)
        yield
        return
    os.dup2(reader.stdin.fileno(), 2)
    reader.stdin.close()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # The pipe closes: the filter ends after its last line.
        os.close(saved)
        try:
            reader.wait(10)
        except subprocess.TimeoutExpired:  # A child of the block holds the pipe.
            pass


if __name__ == "__main__":
    import signal

    # Ctrl-C reaches the whole process group: the filter goes on until its
    # input ends, so that it shows the last lines of the process it serves.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _copy_without_noise(sys.stdin.buffer, sys.stdout.buffer)
