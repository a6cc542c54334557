"""``tfdist profile LOGDIR``: where each worker's step time went, as a PNG.

Reads the records :class:`~tfdist.profiling.callback.StepProfile` wrote
(``LOGDIR/steps.jsonl``) and draws two panels: a stacked bar per worker of
the mean milliseconds per step in each phase, and a line per worker of the
step time over the run. matplotlib is optional; TensorFlow is not needed.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tfdist.errors import TfdistError
from tfdist.profiling.records import PHASES, StepRecord, mean_phases, phases

__all__ = ["load", "plot", "table", "ProfileLogError", "MatplotlibNotInstalledError"]

#: One colour per phase, in PHASES order (colour-blind safe, Okabe-Ito).
COLORS = ("#999999", "#0072B2", "#E69F00", "#CC79A7", "#D55E00", "#F0E442", "#009E73", "#56B4E9")


class ProfileLogError(TfdistError, ValueError):
    """A profile directory without readable records."""


class MatplotlibNotInstalledError(TfdistError, ImportError):
    """matplotlib, which draws the plot, is missing."""


def load(logdir: str | os.PathLike) -> list[StepRecord]:
    """The records in ``LOGDIR/steps.jsonl``.

    Raises:
        ProfileLogError: The file is missing, empty, or a line is not a record
            (the message names the path and the line).
    """
    path = os.path.join(os.fspath(logdir), "steps.jsonl")
    if not os.path.isfile(path):
        raise ProfileLogError(
            f"no step records at {path}: expected the log_dir of a StepProfile "
            "(tfdist.StepProfile(log_dir=...)) whose fit ran at least one epoch"
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(StepRecord.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError) as error:
                raise ProfileLogError(
                    f"{path}, line {number}: not a step record ({error}); "
                    f"received {line.strip()[:80]!r}"
                ) from error
    if not records:
        raise ProfileLogError(
            f"{path} holds no step records: expected one JSON record per "
            "line, written at the end of each epoch"
        )
    return records


def table(summary: dict[int, dict[str, float]]) -> str:
    """The per-worker mean phases as a text table (milliseconds per step)."""
    head = ["worker", *PHASES, "step ms", "bytes/step"]
    rows = [head]
    for worker, s in summary.items():
        rows.append(
            [
                str(worker),
                *(f"{s[p] * 1e3:.1f}" for p in PHASES),
                f"{s['step'] * 1e3:.1f}",
                f"{s['bytes']:,.0f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plot(logdir: str | os.PathLike, output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Draws ``LOGDIR``'s profile to a PNG.

    Args:
        logdir: A :class:`~tfdist.profiling.callback.StepProfile` ``log_dir``.
        output: The PNG; default ``LOGDIR/profile.png``.

    Returns:
        ``{"output": path, "workers": mean_phases(records), "steps": n}``:
        the figures drawn (seconds per step), to compare with the logs.

    Raises:
        ProfileLogError: No readable records.
        MatplotlibNotInstalledError: matplotlib is missing.
    """
    records = load(logdir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise MatplotlibNotInstalledError(
            f"tfdist profile draws with matplotlib, which is not installed ({error}). "
            "Install it with: pip install matplotlib",
            name="matplotlib",
        ) from error
    output = (
        os.fspath(output) if output is not None else os.path.join(os.fspath(logdir), "profile.png")
    )
    summary = mean_phases(records)
    workers = list(summary)
    fig, (bars, lines) = plt.subplots(
        1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    bottom = [0.0] * len(workers)
    for phase, color in zip(PHASES, COLORS):
        heights = [summary[w][phase] * 1e3 for w in workers]
        bars.bar([str(w) for w in workers], heights, bottom=bottom, color=color, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    bars.set_xlabel("worker")
    bars.set_ylabel("ms per step (mean)")
    bars.set_title("Where the step time goes")
    bars.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for w in workers:
        mine = sorted((r for r in records if r.worker == w), key=lambda r: r.step)
        lines.plot(
            [r.step for r in mine],
            [phases(r)["step"] * 1e3 for r in mine],
            marker=".",
            linewidth=1,
            label=f"worker {w}",
        )
    lines.set_xlabel("step")
    lines.set_ylabel("step time (ms)")
    lines.set_title("Step time over the run")
    lines.legend(fontsize=8)
    fig.suptitle(
        f"tfdist profile: {len(workers)} worker(s), "
        f"{int(max(s['steps'] for s in summary.values()))} steps measured"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return {"output": output, "workers": summary, "steps": len(records)}
