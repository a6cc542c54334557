"""compression="auto" across 2 worker processes: every worker makes the same choice."""

from __future__ import annotations

import re

import pytest

from conftest import finish, result_line, start
from tfdist import spec as spec_lib
from tfdist.engines.net import local_spec

pytestmark = pytest.mark.slow


def test_two_workers_measure_once_and_choose_alike():
    spec = local_spec(2)
    procs = [
        start(
            ["tests/workers/multi_worker_fit.py"], tf_config=config, TFDIST_TEST_COMPRESSION="auto"
        )
        for _, _, config in spec_lib.all_task_configs(spec)
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = (result_line(out) for _, out, _ in results)
    lines = [
        next(line for line in r["description"].splitlines() if "compression:" in line)
        for r in (chief, other)
    ]
    # The measured link is all-gathered (slowest replica), so the whole
    # decision, figures included, is the same on both workers.
    assert lines[0] == lines[1]
    assert re.search(r"compression: auto -> (none|bf16|powersgd:4) \(", lines[0]), lines[0]
    assert "Mbit/s sent per replica" in lines[0] and "2 replicas" in lines[0]
    assert chief["weights_sha256"] == other["weights_sha256"]
    assert chief["loss"][-1] < chief["loss"][0]
