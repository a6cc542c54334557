"""What a benchmark records about its run, and its report rewritten from the JSON."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from benchlib.jobs import REPO


def commit() -> str:
    """The checkout's commit, hash and subject (what tfdist the run measured),
    or ``"unknown"`` outside a git checkout."""
    try:
        return (
            subprocess.run(
                ["git", "-C", str(REPO), "log", "-1", "--format=%h %s"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()[:60]
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rewrite_report(path: Path, notes: Sequence[str], markdown: Callable[[dict], str]) -> str:
    """``--mode=report``: the Markdown beside ``path`` (NAME.json -> NAME.md)
    made again from the recorded run; ``notes`` given now replace the recorded
    ones (in the JSON too). Returns the Markdown."""
    raw = json.loads(path.read_text())
    if notes:
        raw["meta"]["notes"] = list(notes)
        path.write_text(json.dumps(raw, indent=1))
    text = markdown(raw)
    path.with_suffix(".md").write_text(text)
    return text


def header(script: str) -> dict:
    """The fields every result's ``meta`` starts with: the command as run,
    when (UTC), the machine's CPUs, the TensorFlow and Keras versions, the
    commit measured and the load average before the run."""
    return {
        "command": " ".join([f"python benchmarks/{script}", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "tf": metadata.version("tensorflow"),
        "keras": metadata.version("keras"),
        "commit": commit(),
        "load_before": os.getloadavg()[0],
    }


def spread(values: Sequence[float | None]) -> dict:
    """Median, min, max and count of the values that are not None."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def fmt(cell: dict, spec: str = ".2f") -> str:
    """A :func:`spread` cell as ``median (min–max)``, ``—`` when empty."""
    if cell["median"] is None:
        return "—"
    if cell["min"] == cell["max"]:
        return format(cell["median"], spec)
    return (
        f"{format(cell['median'], spec)} ({format(cell['min'], spec)}–{format(cell['max'], spec)})"
    )


def write(results: Path, name: str, result: dict, markdown: Callable[[dict], str]) -> None:
    """Writes ``NAME.json`` and its report ``NAME.md`` under ``results``, and
    prints the report."""
    (results / f"{name}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (results / f"{name}.md").write_text(text)
    print(text)
