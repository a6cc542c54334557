"""Horovod's semantics under tfdist.horovod: the traps of issue 16, one 2-rank job.

The worker (tests/workers/hvd_traps.py) runs under ``tfdist launch --workers 2``
with a short collective_timeout and reports each check; the assertions are here.
What each check guards against, measured on TF 2.21 / Keras 3.15:

* device set-up after ``hvd.init()``: a MultiWorkerMirroredStrategy created in
  init starts the runtime, and ``set_visible_devices`` then raises;
* mixed precision: Keras's LossScaleOptimizer applies (and so all-reduces)
  only on ranks whose gradients are finite; without the global check rank 0
  waits in an all-reduce that rank 1 never joins (this job then times out);
* ``jit_compile=True``: XLA cannot compile the multi-process all-reduce;
* collectives issued in a different order, or on one rank only, must fail
  with a message instead of hanging or silently pairing the wrong tensors.
"""

from __future__ import annotations

import json

import pytest

from conftest import finish, start
from test_strategies_scripts import results_by_task

TIMEOUT = 8


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("hvd_ckpt")
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "tests/workers/hvd_traps.py",
            str(ckpt),
        ],
        TFDIST_COLLECTIVE_TIMEOUT=str(TIMEOUT),
    )
    [(code, out, err)] = finish([proc], timeout=420)
    assert code == 0, (out + err)[-5000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-4000:]
    return results["worker:0"], results["worker:1"], out


pytestmark = pytest.mark.slow


def test_device_set_up_after_init_and_ranks(job):
    r0, r1, _ = job
    assert (r0["rank"], r1["rank"], r0["size"]) == (0, 1, 2)
    for r in (r0, r1):
        assert r["visible_devices_set"] and r["cuda_unchanged"]


def test_no_sharding_rebatching_or_lr_rescaling(job):
    for r in job[:2]:
        # 32 examples in batches of 8 on each rank, 2 epochs: 8 steps each.
        assert r["steps"] == 8
        assert r["lr"] == pytest.approx(0.05 * 2)  # The script's own scaling, untouched.
        assert r["is_sgd"]
        assert r["fit_spread"] == 0.0


def test_rank_zero_only_saving_involves_no_collective(job):
    r0, r1, _ = job
    assert r0["saved_files"] == ["ckpt.keras", "model.keras"]
    assert r1["saved_files"] == []
    assert r0["after_save_spread"] == 0.0


def test_loss_scale_optimizer_skips_on_every_rank_together(job):
    r0, r1, _ = job
    for r in (r0, r1):
        assert r["lso_wrapped"] == "LossScaleOptimizer"
        # 4 batches; rank 1's first overflows: every rank skips it and halves
        # the scale (Keras starts at 2**15).
        assert r["lso_inner_steps"] == 3
        assert r["lso_scale"] == 2.0**14
        assert r["lso_spread"] == 0.0


def test_jit_compile_is_turned_off_with_a_log_line(job):
    r0, r1, out = job
    assert r0["jit_compile"] is False and r1["jit_compile"] is False
    assert r0["jit_spread"] == 0.0
    assert out.count("jit_compile turned off") == 2


def test_backward_passes_accumulate_locally_and_send_once(job):
    for r in job[:2]:
        assert r["bpps_first_changed"] == 0.0 and r["bpps_first_sent"] == 0.0
        assert r["bpps_second_sent"] > 0
        assert r["bpps_error"] < 1e-6
        assert r["bpps_iterations"] == 2  # Every backward pass counts, as in Horovod.


def test_collectives_in_a_different_order_fail_naming_both(job):
    r0, r1, _ = job
    for r in (r0, r1):
        assert "rank 0 issued allreduce 'loss' float32[1]" in r["mismatch"]
        assert "rank 1 issued broadcast(root=0) 'weights' float32[1]" in r["mismatch"]
        assert r["after_mismatch"] == 1.5  # Still in step afterwards.


def test_a_collective_on_one_rank_fails_within_the_timeout(job):
    r0, _, _ = job
    assert "only_rank_0" in r0["timeout"] and "collective_timeout=8" in r0["timeout"]
    assert TIMEOUT <= r0["timeout_after"] < TIMEOUT + 5


def test_a_multi_worker_strategy_is_refused_beside_horovod(job):
    for r in job[:2]:
        assert "hvd.init()" in r["strategy_beside"]
        assert "MultiWorkerMirroredStrategy" in r["strategy_beside"]


def test_an_in_graph_collective_on_one_rank_fails_within_the_timeout():
    # Inside a tf.function no Python runs while the collective waits: the
    # watchdog sees its started/finished counters stand still.
    proc = start(
        ["-m", "tfdist", "launch", "--workers", "2", "--show-all", "tests/workers/hvd_stall.py"],
        TFDIST_COLLECTIVE_TIMEOUT=str(TIMEOUT),
    )
    [(code, out, err)] = finish([proc], timeout=300)
    assert code == 0, (out + err)[-5000:]
    results = results_by_task(out)
    r0, r1 = results["worker:0"], results["worker:1"]
    assert r0["together"] == r1["together"] == 2.0 and r0["in_step"] == r1["in_step"] == 4.0
    assert "a collective inside a tf.function" in r0["error"], r0
    assert f"collective_timeout={TIMEOUT}" in r0["error"]
    assert TIMEOUT <= r0["after"] < TIMEOUT + 5


def _two_free_ports() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 just now."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base
    raise AssertionError("no two consecutive free ports")


def test_ranks_from_horovods_own_variables_without_tf_config():
    # What horovodrun/mpirun give each process: rank variables, no addresses.
    base = _two_free_ports()
    procs = [
        start(
            ["tests/workers/hvd_small_fit.py"],
            HOROVOD_RANK=str(r),
            HOROVOD_SIZE="2",
            HOROVOD_LOCAL_RANK=str(r),
            HOROVOD_LOCAL_SIZE="2",
            TFDIST_PORT_BASE=str(base),
        )
        for r in range(2)
    ]
    results = finish(procs, timeout=300)
    found = []
    for code, out, err in results:
        assert code == 0, (out + err)[-4000:]
        found.append(
            next(
                json.loads(line.split("tfdist result: ", 1)[1])
                for line in out.splitlines()
                if "tfdist result: " in line
            )
        )
    assert [(f["rank"], f["size"], f["local_rank"]) for f in found] == [(0, 2, 0), (1, 2, 1)]
    assert found[0]["sum"] == found[1]["sum"] == 3.0
    assert found[0]["weights_sha256"] == found[1]["weights_sha256"]
