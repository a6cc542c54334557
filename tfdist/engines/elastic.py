"""Elastic sizes for ``tfdist launch``: ``--workers MIN:MAX`` and host discovery.

The launcher (:mod:`tfdist.engines.launch`) decides when a job changes size; this
module only parses the size range and runs the discovery script. It imports
no TensorFlow.

A host-discovery script (Horovod's ``--host-discovery-script``) is any
executable that prints the worker slots available now, either

* one integer (``2``), or
* Horovod's lines ``HOST:SLOTS`` (or ``HOST``, one slot), whose slots are
  summed. ``tfdist launch`` runs every worker on this machine, so the host
  names are not used.

Empty lines and lines starting with ``#`` are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

from tfdist.errors import ConfigError

__all__ = ["WORKER_FAILED", "parse_workers", "parse_slots", "Discovery"]

#: What a failed worker of an elastic job leads to (``--worker-failed``):
#: "restart" the job at its size while restarts remain, then shrink;
#: "shrink" at once (the failed worker's slot is taken as gone).
WORKER_FAILED = ("restart", "shrink")

_HOST_LINE = re.compile(r"^([A-Za-z0-9_.\-\[\]:]+?)(?::(\d+))?$")
_SOURCE = "tfdist launch"


def parse_workers(value: Any, source: str = _SOURCE) -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:2"`` or ``(1, 2)`` -> (1, 2).

    Raises:
        ConfigError: Not a count or MIN:MAX, MIN < 1, or MIN > MAX (field
            ``'workers'``).
    """
    expected = "a worker count >= 1 or MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2)"
    if isinstance(value, bool):
        raise ConfigError("workers", value, expected, source=source)
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, str):
        parts = value.strip().split(":")
        if len(parts) > 2 or not all(re.fullmatch(r"\d+", p.strip()) for p in parts):
            raise ConfigError("workers", value, expected, source=source)
        low, high = int(parts[0]), int(parts[-1])
    elif (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        low, high = value
    else:
        raise ConfigError("workers", value, expected, source=source)
    if low < 1 or low > high:
        raise ConfigError(
            "workers",
            value,
            expected,
            source=source,
            hint="MIN must be at least 1 and not above MAX." if low > high else None,
        )
    return low, high


def parse_slots(text: str, script: str = "", source: str = _SOURCE) -> int:
    """The slot count a discovery script printed (see the module docstring).

    Raises:
        ConfigError: The output is neither one integer nor HOST[:SLOTS]
            lines (field ``'host_discovery_script'``, with the output).
    """
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    expected = "output of one integer (the worker slots available) or lines HOST[:SLOTS]"
    if len(lines) == 1 and re.fullmatch(r"\d+", lines[0]):
        return int(lines[0])
    if not lines:
        raise ConfigError(
            "host_discovery_script",
            script,
            expected,
            source=source,
            received=f"{script!r} printed nothing",
        )
    slots = 0
    for line in lines:
        match = _HOST_LINE.match(line)
        if match is None or line.isdigit():
            raise ConfigError(
                "host_discovery_script",
                script,
                expected,
                source=source,
                received=f"{script!r} printed {line!r}",
            )
        slots += int(match.group(2) or 1)
    return slots


class Discovery:
    """Runs a host-discovery script and reads its slot count.

    Args:
        script: Path of an executable.
        timeout: Seconds one run may take.

    Raises:
        ConfigError: The script is missing or not executable (field
            ``'host_discovery_script'``).
    """

    def __init__(
        self, script: str | os.PathLike, timeout: float = 10.0, source: str = _SOURCE
    ) -> None:
        self.script = os.fspath(script)
        self.timeout = timeout
        self._source = source
        if not os.path.isfile(self.script):
            raise ConfigError(
                "host_discovery_script",
                self.script,
                "an executable file",
                source=source,
                received=f"{self.script!r}: no such file",
            )
        if not os.access(self.script, os.X_OK):
            raise ConfigError(
                "host_discovery_script",
                self.script,
                "an executable file",
                source=source,
                received=f"{self.script!r}: not executable",
                hint=f"chmod +x {self.script}",
            )

    def slots(self) -> int:
        """Runs the script once; the slots it reports.

        Raises:
            ConfigError: It failed, timed out or printed something else than
                a slot count (field ``'host_discovery_script'``).
        """
        expected = "a script that exits 0 and prints the worker slots available"
        try:
            done = subprocess.run(
                [os.path.abspath(self.script)],
                capture_output=True,
                text=True,
                timeout=self.timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(
                "host_discovery_script",
                self.script,
                expected,
                source=self._source,
                received=f"{self.script!r} did not answer in {self.timeout:g} s",
            ) from None
        except OSError as error:
            raise ConfigError(
                "host_discovery_script",
                self.script,
                expected,
                source=self._source,
                received=f"{self.script!r} could not run: {error}",
            ) from None
        if done.returncode != 0:
            raise ConfigError(
                "host_discovery_script",
                self.script,
                expected,
                source=self._source,
                received=f"{self.script!r} exited with code {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()[-200:]!r}",
            )
        return parse_slots(done.stdout, self.script, self._source)
