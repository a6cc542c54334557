"""Ruff's lint and format checks over the repository (pyproject.toml's [tool.ruff]).

The rule set and every ignored rule are chosen, with their reasons, in
pyproject.toml. A private access (SLF001) outside tfdist/compat/ carries a
``# noqa: SLF001 - reason`` on its line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None and not os.environ.get("TFDIST_REQUIRE_TOOLS"),
    reason="ruff is not installed (pip install -e '.[test]'); CI requires it",
)


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ruff_check_finds_nothing():
    done = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_ruff_format_would_change_nothing():
    done = ruff("format", "--check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]


def test_a_private_access_in_tfdist_is_reported_and_one_in_tests_is_not():
    probe = "import keras\n\nkernel = keras.layers.Dense(1)._kernel\n"
    found = ruff("check", "--no-cache", "--stdin-filename", "tfdist/probe.py", "-", stdin=probe)
    assert found.returncode == 1 and "SLF001" in found.stdout, found.stdout + found.stderr
    # tfdist/compat/ and the tests may reach private state (per-file ignores).
    for path in ("tfdist/compat/probe.py", "tests/probe.py"):
        done = ruff("check", "--no-cache", "--stdin-filename", path, "-", stdin=probe)
        assert done.returncode == 0, (path, done.stdout + done.stderr)


def test_each_marked_private_access_says_why():
    unexplained = []
    for path in sorted((REPO / "tfdist").rglob("*.py")):
        if "compat" in path.relative_to(REPO / "tfdist").parts[:1]:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            match = re.search(r"# noqa: [A-Z0-9, ]*SLF001(.*)$", line)
            if match and len(match.group(1).strip(" -").split()) < 3:
                unexplained.append(f"{path.relative_to(REPO)}:{number}")
    assert not unexplained, unexplained
