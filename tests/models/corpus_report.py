"""The corpus's figures, printed at the end of a pytest run (tests/conftest.py).

Each test that trains a model adds a row: model, path, setting, the first
and last epoch's mean loss, and the largest difference of its weights from
one device's where that comparison holds.
"""

from __future__ import annotations

ROWS: list[dict] = []


def add(model: str, path: str, setting: str, losses: list, difference: float | None = None):
    """Records one run; ``losses`` are its epochs' means."""
    ROWS.append(
        {
            "model": model,
            "path": path,
            "setting": setting,
            "first": losses[0],
            "last": losses[-1],
            "difference": difference,
        }
    )


def table() -> str:
    lines = [f"{'model':<18} {'path':<22} {'setting':<11} {'first':>8} {'last':>8}  vs one device"]
    for row in ROWS:
        diff = "" if row["difference"] is None else f"{row['difference']:.1e}"
        lines.append(
            f"{row['model']:<18} {row['path']:<22} {row['setting']:<11} "
            f"{row['first']:8.4f} {row['last']:8.4f}  {diff}"
        )
    return "\n".join(lines)
