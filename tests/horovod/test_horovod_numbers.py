"""tfdist.horovod's numbers stay true: two 2-worker jobs of benchmarks/horovod_shim.py.

hvd.DistributedOptimizer (fit: SGD, Adam) and DistributedGradientTape give
MultiWorkerMirrored's weights within 1e-5; Compression.fp16 sends half of
Compression.none's bytes, counted by step_traffic and read from the
collectives of the traced step. The pure pieces are checked without TensorFlow.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "bench_horovod_shim", REPO / "benchmarks" / "horovod_shim.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_rank_gets_its_contiguous_half_of_each_global_batch():
    shim = _benchmark()
    assert shim.rank_rows(8, 4, 0, 2) == [0, 1, 4, 5]
    assert shim.rank_rows(8, 4, 1, 2) == [2, 3, 6, 7]
    assert shim.rank_rows(9, 4, 1, 2) == [2, 3, 6, 7]  # A partial last batch is dropped.
    with pytest.raises(ValueError, match="global_batch=5"):
        shim.rank_rows(10, 5, 0, 2)
    assert shim.max_abs_diff([[1.0, 2.0]], [[1.0, 2.5]]) == 0.5
    assert [shim.round_order(i) for i in range(2)] == [
        ("hvd", "hvd_logs", "mwms"),
        ("mwms", "hvd_logs", "hvd"),
    ]


@pytest.mark.slow
def test_hvd_matches_multi_worker_mirrored_and_fp16_halves_the_bytes(tmp_path):
    args = [
        sys.executable,
        "benchmarks/horovod_shim.py",
        "--mode=numbers",
        "--check_steps=4",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    numbers = json.loads((tmp_path / "horovod_shim.json").read_text())["numbers"]
    ranks = numbers["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["size"] == 2

    for r in ranks:
        diff = r["diff"]
        for case in ("fit_sgd", "fit_adam", "tape_adam"):
            assert diff[case] <= 1e-5, (case, diff)
        # The check can fail: a rank alone on its half ends far from the
        # averaged run, which itself moved.
        for name in ("sgd", "adam"):
            assert diff[f"alone_fit_{name}"] > 1e-3, diff
            assert diff[f"moved_fit_{name}"] > 1e-3, diff

        none, fp16 = r["traffic"]["none"], r["traffic"]["fp16"]
        assert none["replicas"] == fp16["replicas"] == 2
        assert none["sent"] > 0 and none["sent"] == 2 * fp16["sent"]
        assert none["sent"] == none["dense_sent"]
        # What the traced fit step really hands to the collectives.
        assert {d for _, _, d in none["wire"]} == {"float32"}
        assert {d for _, _, d in fp16["wire"]} == {"float16"}
        assert none["wire_bytes"] == 2 * fp16["wire_bytes"] == none["sent"]
        tape = r["tape_traffic"]
        assert tape["none"]["sent"] == 2 * tape["fp16"]["sent"] == tape["none"]["wire_bytes"]
        assert {d for _, d in tape["fp16"]["reduced"]} == {"float16"}
        assert tape["none"]["counted"] == 2 * tape["fp16"]["counted"] == tape["none"]["sent"]

    failed = [row for row in numbers["rows"] if not row["ok"]]
    assert not failed, failed
