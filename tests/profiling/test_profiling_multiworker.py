"""A profiled 2-worker job under ``tfdist launch --timeline``, one worker slowed.

One launch (two MultiWorkerMirrored processes on 127.0.0.1) serves every
check: the merged Chrome trace, the straggler report and the plot. Worker 1
sleeps in its input pipeline, so worker 0 waits for it at every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from conftest import REPO, result_line, subprocess_env

pytestmark = pytest.mark.slow

SLEEP, STEPS, EPOCHS = 0.15, 8, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    trace = out / "trace.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "--timeline",
            str(trace),
            "tests/workers/profiling_fit.py",
            str(out),
            "--slow-worker",
            "1",
            "--sleep",
            str(SLEEP),
            "--steps",
            str(STEPS),
            "--epochs",
            str(EPOCHS),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = {}
    for line in done.stdout.splitlines():
        if "tfdist result: " in line:
            result = result_line(line[line.index("tfdist result: ") :])
            results[result["worker"]] = result
    assert sorted(results) == [0, 1], done.stdout[-3000:]
    return out, trace, results


def test_the_slowed_worker_is_named_and_the_fast_one_is_not(job):
    _, _, results = job
    chief = results[0]
    assert chief["chief"] and not results[1]["chief"]
    # Every epoch names worker 1, and only it, on every worker.
    for r in results.values():
        assert [(e, w) for e, w, _ in r["stragglers"]] == [(e, 1) for e in range(EPOCHS)]
    assert len(chief["warnings"]) == EPOCHS
    assert all("worker 1 is a straggler" in w for w in chief["warnings"])
    assert results[1]["warnings"] == []  # Only the chief warns.
    slow, fast = results[1]["history"], results[0]["history"]
    for e in range(EPOCHS):
        # Where the time went: the slow worker waited for its input (the
        # dataset's sleeps overlap in part, so less than SLEEP per step), the
        # fast one as long for the slow one; their steps took as long.
        assert slow["profile_input_ms"][e] > 5 * fast["profile_input_ms"][e]
        assert fast["profile_wait_ms"][e] > 5 * slow["profile_wait_ms"][e]
        assert fast["profile_wait_ms"][e] == pytest.approx(slow["profile_input_ms"][e], rel=0.35)
        assert slow["profile_step_ms"][e] == pytest.approx(fast["profile_step_ms"][e], rel=0.2)


def _trace_steps(trace: dict) -> dict:
    """(pid, step) -> (envelope event, [phase events]) of a Chrome trace."""
    steps: dict = defaultdict(lambda: [None, []])
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        key = (event["pid"], event["args"]["step"])
        if event["name"].startswith("step "):
            steps[key][0] = event
        else:
            steps[key][1].append(event)
    return steps


def test_the_merged_timeline_has_one_track_per_worker_with_ordered_spans(job):
    out, trace_path, results = job
    trace = json.loads(trace_path.read_text())  # Chrome-trace JSON
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    assert names == {0: "worker 0", 1: "worker 1"}
    steps = _trace_steps(trace)
    per_worker = defaultdict(int)
    for (pid, step), (envelope, events) in steps.items():
        assert envelope is not None, (pid, step)
        per_worker[pid] += 1
        begin, end = envelope["ts"], envelope["ts"] + envelope["dur"]
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts)
        for e in events:  # Inside the step's wall time.
            assert begin - 1 <= e["ts"] and e["ts"] + e["dur"] <= end + 1, (pid, step, e)
        sent = sum(e["args"]["bytes"] for e in events if e["name"] == "communicate")
        # The bytes in the trace are CommunicationStats' bytes.
        assert sent == results[pid]["comm_bytes"]
    assert dict(per_worker) == {w: results[w]["records"] for w in (0, 1)}
    for worker in (0, 1):  # Each worker's own track beside it.
        own = json.loads((out / f"trace.worker-{worker}.json").read_text())
        assert {e["pid"] for e in own["traceEvents"] if e.get("ph") == "X"} == {worker}


def test_the_plot_is_written_and_its_figures_match_the_logs(job):
    out, _, results = job
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "profile",
            str(out / "logs"),
            "--output",
            str(out / "profile.png"),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tfdist.profiling.plot import plot

    figures = plot(str(out / "logs"), output=str(out / "again.png"))
    summary = json.loads((out / "logs" / "summary.json").read_text())
    for worker in (0, 1):
        history = results[worker]["history"]
        counts = [summary["epochs"][e][str(worker)]["steps"] for e in range(EPOCHS)]
        for phase in ("compute", "wait", "communicate", "step"):
            logged = sum(n * history[f"profile_{phase}_ms"][e] for e, n in enumerate(counts)) / sum(
                counts
            )
            assert figures["workers"][worker][phase] * 1e3 == pytest.approx(logged, rel=1e-6)
        assert f"{figures['workers'][worker]['step'] * 1e3:.1f}" in done.stdout
