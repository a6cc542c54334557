"""What else the machine was doing while a benchmark ran, and this process's memory."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any


def load_snapshot() -> dict:
    """The load averages and the busiest processes, as ``uptime``/``ps`` show them."""
    snap: dict[str, Any] = {"time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        snap["loadavg"] = [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        snap["loadavg"] = None
    try:
        ps = subprocess.run(
            ["ps", "-eo", "pcpu,pid,comm", "--sort=-pcpu"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()[1:6]
        snap["top"] = [" ".join(line.split()) for line in ps]
    except (OSError, subprocess.SubprocessError):
        snap["top"] = []
    return snap


def status_kb(field: str) -> int:
    """A field of this process's ``/proc/self/status`` in kB (``VmRSS``, ``VmHWM``...)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_over(step: Any) -> tuple[Any, int, int, float]:
    """Runs ``step()`` with this process's peak reset (``/proc/self/clear_refs``).

    Returns:
        ``step()``'s value, the resident set before it and the peak during it
        (``VmRSS``, ``VmHWM``, kB), and its seconds.
    """
    before = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # The peak starts again here.
    started = time.perf_counter()
    value = step()
    return value, before, status_kb("VmHWM"), time.perf_counter() - started
