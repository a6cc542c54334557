"""Running a launch inside a private network namespace (``unshare -n``), so that a
job on 127.0.0.1 can be given a slow link with ``tc``. No TensorFlow.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import IO

from tfdist.engines import forwarding
from tfdist.engines.launch_results import DEFAULT_GRACE
from tfdist.errors import ConfigError


def netns_command(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run in a new private network namespace.

    Inside, only a loopback interface exists (brought up first), so the
    TensorFlow servers of a local job cannot be reached from the network.
    Root can create one with ``unshare -n``; other users need user
    namespaces (``unshare -rn``).
    """
    mode = "-n" if os.geteuid() == 0 else "-rn"
    return ["unshare", mode, "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def run_in_netns(
    argv: Sequence[str], output: IO[str] | None = None, grace: float = DEFAULT_GRACE
) -> int:
    """Runs ``argv`` in a private network namespace; returns its exit code.

    SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 to this process are passed on to
    the inner launcher (``argv``), which runs the grace period itself.

    Raises:
        ConfigError: A namespace cannot be created here (field ``'netns'``),
            with the system's reason.
    """
    command = netns_command(argv)
    probe = subprocess.run(netns_command(["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        raise ConfigError(
            "netns",
            True,
            "a machine where this user may create a network "
            "namespace (root, or unprivileged user namespaces)",
            source="tfdist launch",
            received=probe.stderr.strip() or "failed",
            hint="Run without --netns.",
        )
    env = dict(os.environ, TFDIST_IN_NETNS="1")
    proc = subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        stdout=None if output is None else subprocess.PIPE,
        stderr=subprocess.STDOUT if output is not None else None,
        text=True,
    )

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    try:
        with forwarding.passing_on(proc.pid, forwarded):
            if output is not None:
                for line in proc.stdout:
                    output.write(line)
            return proc.wait()
    finally:
        if proc.poll() is None:
            # The inner launcher stops its tasks on SIGTERM, within its grace.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace + 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
