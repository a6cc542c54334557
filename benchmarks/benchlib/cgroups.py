"""A memory limit per process: cgroup-v1 memory cgroups, made and removed here.

A worker joins its cgroup from the shell that then execs Python, so the limit
holds from its first allocation. Without a writable cgroup-v1 memory
controller (no root, or cgroup v2 only), :func:`available` is False and the
caller says so rather than measuring without a limit.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    """Whether memory cgroups can be made here."""
    return os.access(ROOT, os.W_OK)


def require(script: str) -> None:
    """Exits, saying why, where memory cgroups cannot be made.

    Raises:
        SystemExit: No writable cgroup-v1 memory controller.
    """
    if not available():
        raise SystemExit(
            f"{script}: no writable cgroup-v1 memory controller at {ROOT} "
            "(run as root on a cgroup-v1 machine)"
        )


def make(name: str, limit_bytes: int | None) -> Path:
    """A fresh cgroup ``name``, its memory (and memory+swap) limited."""
    path = ROOT / name
    path.mkdir()
    if limit_bytes is not None:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        memsw = path / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(str(limit_bytes))
    return path


def remove(path: Path) -> None:
    """Removes the cgroup once its processes are gone (they leave it as they exit)."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.2)


def joined(path: Path | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run by a shell that first joins cgroup ``path`` (none: as is)."""
    if path is None:
        return list(argv)
    command = " ".join(shlex.quote(a) for a in argv)
    return ["sh", "-c", f"echo $$ > {shlex.quote(str(path / 'cgroup.procs'))} && exec {command}"]


def usage(path: Path) -> dict:
    """The cgroup's peak usage (MiB), how often it hit its limit, and its OOM kills."""
    oom = dict(line.split() for line in (path / "memory.oom_control").read_text().splitlines())
    return {
        "max_usage_mib": int((path / "memory.max_usage_in_bytes").read_text()) / 2**20,
        "failcnt": int((path / "memory.failcnt").read_text()),
        "oom_kills": int(oom.get("oom_kill", 0)),
    }
