"""DP=2 x T=2 over four MultiWorkerMirrored worker processes on 127.0.0.1.

TensorFlow gives a MultiWorkerMirrored worker without GPUs one replica, so a
2 x 2 mesh takes four processes (two per tensor group); the tensor groups'
collectives then cross processes like the data-parallel ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import finish, result_line, start

pytestmark = pytest.mark.slow


def test_four_workers_dp2_tp2_match_the_unsharded_model(tmp_path):
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs = [
        start(["tests/workers/parallel_fit_mw.py"], tf_config=config)
        for _, _, config in spec_lib.all_task_configs(local_spec(4))
    ]
    results = finish(procs, timeout=300)
    for code, out, err in results:
        assert code == 0, f"worker failed ({code}):\n{out[-2000:]}\n{err[-4000:]}"
    runs = sorted((result_line(out) for _, out, _ in results), key=lambda r: r["task"])
    assert [r["task"] for r in runs] == [f"worker:{i}" for i in range(4)]
    for run in runs:
        assert run["mesh"] == "data 2 x tensor 2; tensor groups [0, 1] [2, 3]"
        assert run["shard"] == [8, 8]
        np.testing.assert_allclose(run["got"], run["expected"], rtol=1e-5)
        assert run["got"][-1] < run["got"][0]
        assert run["weights"] < 1e-5, run
        # Both kinds of traffic crossed the processes.
        assert run["traffic"]["tensor_parallel"] > 0 and run["traffic"]["data_parallel"] > 0
    print(
        f"\nmeasured: 4 workers, DP=2 x T=2, loss {runs[0]['got']}, largest weight "
        f"difference {max(r['weights'] for r in runs):.2e}; bytes per replica "
        f"{runs[0]['traffic']}"
    )
