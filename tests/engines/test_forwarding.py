"""tfdist/engines/forwarding.py: a stop signal reaches the child's group, then
the launcher's own handler is back."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tfdist.engines import forwarding


def test_a_signal_goes_to_the_group_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    # A shell leading its own group, and a child of it in the same group.
    child = subprocess.Popen(
        ["sh", "-c", "sleep 600 & wait"], start_new_session=True, stdout=subprocess.PIPE
    )
    seen = []
    try:
        with forwarding.passing_on(child.pid, (signal.SIGUSR1,), seen.append):
            assert signal.getsignal(signal.SIGUSR1) is not before
            os.kill(os.getpid(), signal.SIGUSR1)  # Handled before kill returns.
            assert child.wait(timeout=30) == -signal.SIGUSR1
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    # The group's other member (sleep) got it too: the group empties once
    # whoever adopted the orphan reaps it.
    deadline = time.monotonic() + 30
    while _group_alive(child.pid):
        assert time.monotonic() < deadline, "sleep 600 outlived the SIGUSR1 sent to its group"
        time.sleep(0.05)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_group_already_gone_is_no_error():
    child = subprocess.Popen(["true"], start_new_session=True)
    child.wait()
    seen = []
    with forwarding.passing_on(child.pid, (signal.SIGUSR2,), seen.append):
        os.kill(os.getpid(), signal.SIGUSR2)
    assert seen == [signal.SIGUSR2]
