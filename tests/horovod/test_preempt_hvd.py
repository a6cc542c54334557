"""Preemption under the Horovod API: ``hvd.elastic`` stops every rank at the
same commit and the restarted job resumes from it, with no step lost.

One real 2-rank job under ``tfdist.engines.launch.launch`` with ``max_restarts=1``:
rank 1 gets SIGTERM mid-run, every rank writes the next commit and exits
with code 143, the launcher restarts the job, and it resumes at that commit.
Its final weights equal an uninterrupted job's.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from conftest import REPO, subprocess_env
from tfdist.engines.launch import launch

pytestmark = pytest.mark.slow

WORKER = str(REPO / "tests" / "workers" / "preempt_hvd.py")
STEPS = 30


def _results(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        _, sep, rest = line.partition("tfdist result: ")
        if sep:
            found.append(json.loads(rest))
    return found


def _run(out_dir, signal_rank_at: int | None = None):
    out_dir.mkdir()
    output = io.StringIO()
    sent = {}

    def signal_when_ready():
        progress = out_dir / "progress"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if progress.exists():
                for line in progress.read_text().splitlines():
                    attempt, rank, pid, batch = map(int, line.split())
                    if attempt == 0 and rank == 1 and batch >= signal_rank_at:
                        os.kill(pid, signal.SIGTERM)
                        sent["batch"] = batch
                        return
            time.sleep(0.01)

    thread = None
    if signal_rank_at is not None:
        thread = threading.Thread(target=signal_when_ready, daemon=True)
        thread.start()
    env = {k: v for k, v in subprocess_env().items() if k.startswith(("PYTHON", "TF_CPP"))}
    result = launch(
        WORKER,
        [str(out_dir)],
        workers=2,
        max_restarts=1,
        output=output,
        env=env,
        show_all=True,
        handle_signals=False,
    )
    if thread:
        thread.join(5)
    return result, output.getvalue(), sent


def test_sigterm_to_one_rank_stops_all_at_one_commit_and_the_restart_resumes_there(tmp_path):
    reference, ref_text, _ = _run(tmp_path / "reference")
    assert reference.exit_code == 0, ref_text[-3000:]
    want = _results(ref_text)
    assert len(want) == 2 and want[0]["iterations"] == STEPS

    result, text, sent = _run(tmp_path / "preempted", signal_rank_at=8)
    assert result.exit_code == 0 and result.restarts == 1, text[-4000:]
    assert {a.returncode for a in result.attempts} == {143}, result.attempts
    got = _results(text)
    assert len(got) == 2
    progress = [
        tuple(map(int, line.split()))
        for line in (tmp_path / "preempted" / "progress").read_text().splitlines()
    ]
    last_batch_0 = max(b for a, _, _, b in progress if a == 0)
    for result_line in got:
        assert result_line["attempt"] == 1
        # The restart began right after the last batch attempt 0 trained:
        # nothing redone, nothing skipped.
        assert result_line["started"] == last_batch_0 + 1
        # Signalled after batch B: stopped at the commit after batch B+1 or B+2.
        assert sent["batch"] + 1 <= last_batch_0 <= sent["batch"] + 2
        assert result_line["iterations"] == STEPS
        np.testing.assert_allclose(result_line["weights"], want[0]["weights"], rtol=0, atol=1e-6)
