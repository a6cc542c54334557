"""benchmarks/profiling.py's arithmetic on runs built here (its real run is
recorded in benchmarks/results/profiling.md; the notebook runs it small)."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import profiling as bench
from benchlib import netns


def _phases(compute, communicate, step):
    return {
        "0": {
            "compute": compute,
            "compress": 0.0,
            "decompress": 0.0,
            "wait": 0.0,
            "communicate": communicate,
            "step": step,
            "bytes": 10.0,
        }
    }


def test_pairs_alternate_their_order():
    assert [bench.arm_order(p, ["off", "on"]) for p in range(3)] == [
        ["off", "on"],
        ["on", "off"],
        ["off", "on"],
    ]
    assert bench.median_step([9.0, 1.0, 2.0, 3.0], skip=1) == 2.0
    with pytest.raises(ValueError, match="more than 3"):
        bench.median_step([1.0, 2.0], skip=3)


def test_summary_takes_the_median_ratio_over_pairs_and_the_larger_share():
    runs = []
    for pair, (off, on) in enumerate([(1.0, 1.02), (2.0, 2.2), (1.0, 0.99)]):
        runs.append({"config": "fp32", "arm": "off", "pair": pair, "step_s": off})
        runs.append(
            {
                "config": "fp32",
                "arm": "on",
                "pair": pair,
                "step_s": on,
                "phases": _phases(0.1 * on, 0.8 * on, on),
            }
        )
    rows = bench.summarize({"runs": runs, "meta": {}})
    row = rows["fp32"]
    assert row["overhead"] == pytest.approx(statistics.median([1.02, 1.1, 0.99]))
    assert row["off_s"] == 1.0 and row["on_s"] == pytest.approx(1.02)
    assert row["communicate"] == pytest.approx(0.8) and row["compute"] == pytest.approx(0.1)
    assert row["larger"] == "communicate"
    meta = {
        "command": "python benchmarks/profiling.py",
        "when": "now",
        "cpus": 2,
        "load": [0.1, 0.2, 0.3],
        "rate": "100mbit",
        "layers": [4, 2],
        "params": 10,
        "batch": 32,
        "steps": 12,
        "skip": 3,
        "pairs": 3,
    }
    text = bench.markdown({"meta": meta, "runs": runs}, rows)
    assert "| fp32 | 1000.0 ms | 1020.0 ms | 1.020 (met) | — |" in text
    assert "| communicate |" in text


@pytest.mark.skipif(
    netns.missing_requirements() is not None, reason=f"needs {netns.missing_requirements()}"
)
def test_a_failure_inside_the_namespace_shows_its_error_not_a_bare_calledprocesserror(tmp_path):
    # What notebooks/06_profiling.ipynb shows when the benchmark fails: the
    # inner run's own error, then one line, no traceback of the outer process.
    done = subprocess.run(
        [sys.executable, "benchmarks/profiling.py", "--rate=fast", f"--results_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Expected a rate like '100mbit' or '1gbit'. Received: 'fast'" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "benchmarks/profiling.py: the run in the network namespace failed with exit code 1"
    ), done.stderr
    assert "CalledProcessError" not in done.stderr
