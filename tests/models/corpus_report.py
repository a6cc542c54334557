"""The corpus's figures, printed at the end of a pytest run (tests/conftest.py).

Each test that trains a model adds a row: model, path, setting, the first
and last epoch's mean loss, and the largest difference of its weights from
one device's where that comparison holds. Under pytest-xdist the rows are
added in the workers and printed by the controller: they go to the file the
controller names in ``TFDIST_CORPUS_ROWS`` (tests/conftest.py).
"""

from __future__ import annotations

import json
import os

ROWS: list[dict] = []


def add(model: str, path: str, setting: str, losses: list, difference: float | None = None):
    """Records one run; ``losses`` are its epochs' means."""
    row = {
        "model": model,
        "path": path,
        "setting": setting,
        "first": float(losses[0]),
        "last": float(losses[-1]),
        "difference": None if difference is None else float(difference),
    }
    shared = os.environ.get("TFDIST_CORPUS_ROWS")
    if shared:
        with open(shared, "a") as f:  # One short line per write: appends stay whole.
            f.write(json.dumps(row) + "\n")
    else:
        ROWS.append(row)


def rows() -> list[dict]:
    """The rows this run recorded, in every process."""
    shared = os.environ.get("TFDIST_CORPUS_ROWS")
    if shared and os.path.exists(shared):
        with open(shared) as f:
            return ROWS + [json.loads(line) for line in f if line.strip()]
    return list(ROWS)


def table() -> str | None:
    """The rows as a table, or None when no test trained a corpus model."""
    recorded = rows()
    if not recorded:
        return None
    lines = [f"{'model':<18} {'path':<22} {'setting':<11} {'first':>8} {'last':>8}  vs one device"]
    for row in recorded:
        diff = "" if row["difference"] is None else f"{row['difference']:.1e}"
        lines.append(
            f"{row['model']:<18} {row['path']:<22} {row['setting']:<11} "
            f"{row['first']:8.4f} {row['last']:8.4f}  {diff}"
        )
    return "\n".join(lines)
