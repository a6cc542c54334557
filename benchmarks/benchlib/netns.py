"""A private network namespace whose loopback is the benchmark's link.

A script re-runs itself under ``unshare -n`` (:func:`rerun_inside`): the new
namespace has only a loopback, so jobs on 127.0.0.1 see a real link that
``tc qdisc ... tbf`` can limit (:func:`tc_command`), and nothing outside it is
touched; it dies with the ``unshare`` process. Needs root, util-linux and
iproute2.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

#: The rate of an unthrottled link.
NO_LIMIT = "none"
TOOLS = ("unshare", "ip", "tc")


def parse_rate(text: str) -> float:
    """Bits per second of a tc rate such as ``100mbit`` or ``1gbit``; inf for ``none``."""
    text = text.strip().lower()
    if text == NO_LIMIT:
        return math.inf
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    raise ValueError(f"Expected a rate like '100mbit' or '1gbit'. Received: {text!r}")


def tc_command(rate: str) -> list[str]:
    """The tc command that limits the namespace's loopback to ``rate``."""
    parse_rate(rate)
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        "lo",
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "256kb",
        "latency",
        "200ms",
    ]


def missing_requirements() -> str | None:
    """Why this machine cannot make the namespace (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return "root: it creates a network namespace (unshare -n) and limits its loopback with tc"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(map(repr, missing))} (util-linux, iproute2)"
    return None


def require(script: str) -> None:
    """Exits with a message naming what ``script`` needs, if anything is missing."""
    why = missing_requirements()
    if why is not None:
        raise SystemExit(f"{script} needs {why}.")


def rerun_inside(script: str, argv: Sequence[str]) -> None:
    """Runs ``python script argv --mode=inside`` in a new private network namespace."""
    args = [sys.executable, script, *argv]
    subprocess.run(["unshare", "-n", "--", *args, "--mode=inside"], check=True)


def has_other_interfaces() -> bool:
    """Whether this namespace has more than a loopback (so not one ``unshare`` made)."""
    out = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return any(n != "lo" for n in names)


def loopback_up(mtu: int | None = None) -> None:
    """Brings the namespace's loopback up, at ``mtu`` if given (1500: like Ethernet)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if mtu is not None:
        subprocess.run(["ip", "link", "set", "lo", "mtu", str(mtu)], check=True)


def unthrottle() -> None:
    """Removes the rate limit (the namespace goes away anyway)."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
