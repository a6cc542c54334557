"""tests/workers/protocol.py: the lines that tests parse stay whole.

A worker's stdout and stderr often share one pipe, where TensorFlow's C++
logger writes whole lines. Under PYTHONUNBUFFERED, print() writes a line's
text and its newline apart, and a log line between the two glued itself to
the protocol line; ``say`` writes both in one write.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
LOG_LINE = "E0000 00:00:1795433773.187567    4577 chatty.cc:1] a log line"

# A worker in small: a thread writes C++-like log lines to fd 2 in one write
# each, as fast as it can, while the main thread says 300 numbered lines. The
# pause after each line lets the logger run between them (else the main thread
# may keep the GIL through all 300): print() glued lines in 30 runs of 30.
CHATTY = f"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from protocol import result, say

done, logged = threading.Event(), [0]

def log():
    while not done.is_set():
        os.write(2, {(LOG_LINE + chr(10)).encode()!r})
        logged[0] += 1

logger = threading.Thread(target=log)
logger.start()
while logged[0] < 10:
    time.sleep(0.001)
for n in range(300):
    say(f"tfdist line: {{n}} of 300")
    time.sleep(0.0001)
result({{"lines": 300, "text": "ü"}})
done.set()
logger.join()
"""


def test_said_lines_stay_whole_beside_a_chatty_logger():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-c", CHATTY, str(WORKERS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # One pipe, as the tests read the workers.
        env=env,
        timeout=60,
    )
    text = done.stdout.decode()
    assert done.returncode == 0, text[-3000:]
    lines = text.splitlines()
    ours = [line for line in lines if line != LOG_LINE]
    glued = [line for line in ours if "a log line" in line or not line]
    assert ours[:-1] == [f"tfdist line: {n} of 300" for n in range(300)], glued[:5]
    assert ours[-1].startswith("tfdist result: "), ours[-1]
    assert json.loads(ours[-1][len("tfdist result: ") :]) == {"lines": 300, "text": "ü"}


def _protocol():
    """tests/workers/protocol.py, loaded without putting tests/workers on sys.path."""
    spec = importlib.util.spec_from_file_location("_worker_protocol", WORKERS / "protocol.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_say_writes_what_print_left_first_and_the_rest_of_a_partial_write(monkeypatch):
    protocol = _protocol()
    read_fd, write_fd = os.pipe()
    stdout = open(write_fd, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    writes = []

    def short_write(fd, data):
        writes.append(bytes(data[:7]))
        return os.write(fd, data[:7])  # A pipe may take part of a long line.

    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(protocol, "os", types.SimpleNamespace(write=short_write))
    print("before, unflushed", end="")
    protocol.say("tfdist step: 12 loss=0.5 ü")
    protocol.result({"a": [1, 2]})
    monkeypatch.undo()
    stdout.close()
    with open(read_fd, "rb") as pipe:
        out = pipe.read()
    said = 'tfdist step: 12 loss=0.5 ü\ntfdist result: {"a": [1, 2]}\n'
    assert out == b"before, unflushed" + said.encode()
    assert len(writes) > 2 and all(len(w) <= 7 for w in writes)
