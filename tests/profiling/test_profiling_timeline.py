"""The timeline, the plot and `tfdist profile` on records built here (pure Python)."""

from __future__ import annotations

import json
import math

import pytest

from tfdist.cli import commands as cli
from tfdist.profiling import plot as plot_lib, timeline
from tfdist.profiling.records import (
    PHASES,
    Span,
    StepRecord,
    derive_waits,
    from_row,
    mean_phases,
    phases,
    row_width,
    to_row,
    union_length,
)


def _record(worker, step, t0, skew=0.0, wait=0.01, spans=2):
    """A step starting at ``t0`` (true time) on a worker whose clock reads ``skew`` ahead."""
    t = t0 + skew
    peers = t + 0.002 + 0.02 + wait
    out = [
        Span("all_reduce", peers + 0.001 + 0.004 * i, peers + 0.004 * (i + 1), 1000.0 * (i + 1))
        for i in range(spans)
    ]
    last = max((s.end for s in out), default=peers)
    return StepRecord(
        worker,
        step,
        0,
        t,
        t + 0.002,
        t + 0.022,
        peers,
        last + 0.001,
        last + 0.003,
        last + 0.004,
        out,
    )


def _job(skew=0.25):
    records = []
    for step in range(1, 6):
        t0 = 100.0 + step
        records.append(_record(0, step, t0, wait=0.03))
        # Worker 1 is busier and waits less; both leave the barrier together.
        records.append(_record(1, step, t0 - 0.02, skew=skew, wait=0.05))
    return records


def test_phases_add_up_and_overlapping_collectives_count_once():
    r = _record(0, 1, 10.0)
    r.spans.append(Span("all_gather", r.spans[0].start, r.spans[0].end, 10.0))
    p = phases(r)
    assert math.isclose(sum(p[k] for k in PHASES), p["step"])
    assert p["communicate"] == pytest.approx(union_length((s.start, s.end) for s in r.spans))
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert from_row(to_row(r, 8)) == r and len(to_row(r, 8)) == row_width(8)


def test_align_recovers_a_clock_skew_from_the_barrier():
    offsets = timeline.align(_job(skew=0.25))
    assert offsets[0] == 0.0
    assert offsets[1] == pytest.approx(0.25, abs=1e-9)


def test_chrome_trace_has_a_track_per_worker_and_ordered_phases_inside_each_step():
    records = _job()
    trace = timeline.chrome_trace(records, timeline.align(records))
    json.loads(json.dumps(trace))
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {0: "worker 0", 1: "worker 1"}
    steps = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            steps.setdefault((e["pid"], e["args"]["step"]), []).append(e)
    assert len(steps) == len(records)
    for r in records:
        envelope, *events = steps[(r.worker, r.step)]
        assert envelope["name"] == f"step {r.step}"
        assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
        for e in events:
            assert (
                envelope["ts"] <= e["ts"]
                and e["ts"] + e["dur"] <= envelope["ts"] + envelope["dur"] + 1e-3
            )
        assert sum(e["args"]["bytes"] for e in events if e["name"] == "communicate") == r.bytes
        by_name = {}
        for e in events:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
        for phase in ("compute", "wait", "communicate"):
            assert by_name[phase] == pytest.approx(phases(r)[phase] * 1e6, abs=1e-2)
    # Aligned, both workers leave the barrier at the same instant.
    for step in range(1, 6):
        waits = [next(e for e in steps[(w, step)] if e["name"] == "wait") for w in (0, 1)]
        ends = [w["ts"] + w["dur"] for w in waits]
        assert ends[0] == pytest.approx(ends[1], abs=1e-2)


def test_write_is_atomic_and_read_returns_it(tmp_path):
    path = tmp_path / "trace.json"
    timeline.write(path, _job())
    assert timeline.read(path)["traceEvents"]
    before = path.read_text()

    bad = _job()
    bad[0].spans[0] = Span("all_reduce", 1.0, 2.0, object())  # not JSON
    with pytest.raises(TypeError):
        timeline.write(path, bad)
    assert path.read_text() == before  # The old file is intact, no temp file left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    assert timeline.worker_path("a/trace.json", 1) == "a/trace.worker-1.json"


def _logdir(tmp_path, records):
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    return tmp_path


def test_plot_writes_a_png_of_the_figures_it_returns(tmp_path):
    records = _job()
    figures = plot_lib.plot(_logdir(tmp_path, records))
    assert figures["output"] == str(tmp_path / "profile.png")
    assert (tmp_path / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figures["workers"] == mean_phases(records)
    assert figures["steps"] == len(records)


def test_tfdist_profile_prints_the_table_and_refuses_a_bad_logdir(tmp_path, capsys):
    records = _job()
    (tmp_path / "ok").mkdir()
    logdir = _logdir(tmp_path / "ok", records)
    assert cli.main(["profile", str(logdir), "--output", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    step_ms = mean_phases(records)[1]["step"] * 1e3
    assert f"{step_ms:.1f}" in out and str(tmp_path / "p.png") in out
    assert cli.main(["profile", str(tmp_path / "missing")]) == 2
    assert "no step records at" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "steps.jsonl").write_text(json.dumps(records[0].to_json()) + "\nnot json\n")
    assert cli.main(["profile", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_launch_timeline_reaches_every_task(tmp_path):
    import subprocess
    import sys

    from conftest import subprocess_env

    out = tmp_path / "env"
    code = (
        "import os, sys; open(sys.argv[1] + os.environ['TF_CONFIG'][-3:-2], 'w')"
        ".write(os.environ.get('TFDIST_TIMELINE', ''))"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--timeline",
            "rel/trace.json",
            "-c",
            code,
            str(out),
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(p.read_text() for p in tmp_path.glob("env*"))
    assert seen == [str(tmp_path / "rel" / "trace.json")] * 2
    done = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "--timeline", str(tmp_path), "-c", "pass"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "timeline" in done.stderr and str(tmp_path) in done.stderr


def test_without_a_barrier_the_wait_is_the_first_collectives_excess():
    # Worker 1 joins the collective 30 ms late; both leave it together.
    def record(worker, joins, step=3):
        t = 50.0
        first = Span("all_reduce", t + joins, t + 0.05, 100.0)
        second = Span("all_reduce", t + 0.051, t + 0.06, 10.0)
        return StepRecord(
            worker,
            step,
            0,
            t - 0.01,
            t - 0.009,
            t + joins,
            t + joins,
            t + 0.061,
            t + 0.07,
            t + 0.071,
            [first, second],
        )

    fast, slow, alone = record(0, 0.0), record(1, 0.03), record(0, 0.0, step=4)
    derive_waits([fast, slow, alone])
    assert phases(fast)["wait"] == pytest.approx(0.03)
    assert phases(slow)["wait"] == pytest.approx(0.0)
    assert phases(fast)["communicate"] == pytest.approx(phases(slow)["communicate"])
    assert phases(alone)["wait"] == 0.0  # No peer's record for that step: left alone.
    assert fast.bytes == slow.bytes == 110.0
    offsets = timeline.align([fast, slow])
    assert offsets[1] == pytest.approx(0.0, abs=1e-9)
