"""What a benchmark records about its run, and its report rewritten from the JSON."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
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
