"""Real multi-process jobs on 127.0.0.1: Keras 3 fit, a missing peer, and a
parameter-server cluster. Each process costs seconds, so there are few."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tfdist
from conftest import finish, result_line, start
from test_strategies import fit_losses
from tfdist import spec as spec_lib
from tfdist.engines.net import local_spec

pytestmark = pytest.mark.slow

SERVE = "import tfdist; tfdist.strategy_from_config()"


def test_two_worker_keras_fit_through_strategy_from_config(tf_cpus):
    spec = local_spec(2)
    procs = [
        start(
            ["tests/workers/multi_worker_fit.py"],
            tf_config=config,
            TFDIST_TEST_BYTES_PER_PACK=str(1 << 20),
        )
        for _, _, config in spec_lib.all_task_configs(spec)
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = (result_line(out) for _, out, _ in results)

    assert chief["replicas"] == other["replicas"] == 2
    assert "this task: worker:0 (chief)" in chief["description"]
    assert "this task: worker:1 (not chief)" in other["description"]
    # Synchronous training: both workers end with the same weights and loss.
    assert chief["weights_checksum"] == other["weights_checksum"]
    assert chief["loss"] == other["loss"]
    assert chief["loss"][-1] < 0.7 * chief["loss"][0]
    # And the same as 2 replicas in one process, with the same global batch.
    mirrored = fit_losses(tfdist.strategy_from_config(cpu_replicas=2))
    np.testing.assert_allclose(chief["loss"], mirrored["loss"], rtol=1e-3)

    # Keras 3 calls reduce() with a tuple and with axis=0 on scalars:
    # TensorFlow's own reduce() fails on both, tfdist's gives the right values.
    assert chief["tfdist_reduce"] == [[1.5, 1.5], 3.0, 6.0]
    tuple_error, scalar_error = chief["stock_errors"]
    assert tuple_error is not None and scalar_error is not None
    assert "Invalid reduction dimension 0" in scalar_error
    # bytes_per_pack=1 MiB splits tfdist's all-reduce of 3 x 2 MiB into one
    # collective per pack, with the right sums.
    assert chief["packed"] == other["packed"] == {"sums": [[3.0], [6.0], [9.0]], "collectives": 3}


@pytest.mark.parametrize("compression,steps", [("powersgd:2", 1), ("topk:0.05", 3)])
def test_two_worker_fit_with_compression_ends_with_identical_weights(tf_cpus, compression, steps):
    # PowerSGD: two all-reduces, warm-up cond and Q state across processes;
    # top-k: an all-gather across processes, with error feedback, 3 steps
    # per execution (Keras 3 fails there without tfdist's fix).
    spec = local_spec(2)
    procs = [
        start(
            ["tests/workers/multi_worker_fit.py"],
            tf_config=config,
            TFDIST_TEST_COMPRESSION=compression,
            TFDIST_TEST_STEPS=str(steps),
        )
        for _, _, config in spec_lib.all_task_configs(spec)
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = (result_line(out) for _, out, _ in results)
    assert "error_feedback=True" in chief["description"]
    assert chief["weights_sha256"] == other["weights_sha256"]
    assert chief["loss"] == other["loss"]
    assert chief["loss"][-1] < 0.7 * chief["loss"][0]
    # The same compression on 2 replicas in one process gives the same run.
    mirrored = fit_losses(tfdist.strategy_from_config(cpu_replicas=2, compression=compression))
    np.testing.assert_allclose(chief["loss"], mirrored["loss"], rtol=1e-3)
    # The callback counted fewer bytes than a dense all-reduce.
    assert chief["comm"]["comm_bytes"] < chief["comm"]["comm_dense_bytes"]


#: One setting of each kind at float32 (a cast, a sparsifier, the low-rank
#: one, the automatic choice), mixed_float16's loss scaling with and without
#: compression, several steps per execution, gradient accumulation:
#: [policy, compression, steps_per_execution, gradient_accumulation_steps].
#: The first also evaluates and predicts. Every setting and both policies
#: under XLA are tests/training/test_xla.py's, on 2 replicas of one process:
#: what 2 workers add is the all-reduce across processes (16 settings' 32
#: fits took 158 s in CI; these 9).
XLA_GRID = (
    [["float32", c, 1, None] for c in (None, "bf16", "topk:0.25", "powersgd:2", "auto")]
    + [["mixed_float16", c, 1, None] for c in (None, "powersgd:2")]
    + [
        ["float32", "topk:0.25", 3, None],
        ["float32", "powersgd:2", 1, 2],
    ]
)


def test_two_worker_xla_fit_equals_the_fit_without_xla(tf_cpus):
    # Keras 3's XLA step aborts the workers (no collectives on CPU under
    # XLA); tfdist compiles each replica's step and all-reduces outside it.
    # One job fits every setting of XLA_GRID twice, with and without XLA,
    # each under a new strategy: processes cost more than fits.
    from test_xla import TOLERANCE

    procs = [
        start(
            ["tests/workers/xla_grid_fit.py"],
            tf_config=config,
            TFDIST_TEST_GRID=json.dumps(XLA_GRID),
        )
        for _, _, config in spec_lib.all_task_configs(local_spec(2))
    ]
    results = finish(procs, timeout=400)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = (result_line(out)["grid"] for _, out, _ in results)
    assert [row["task"] for row in chief] == ["worker:0"] * len(XLA_GRID)
    assert [row["task"] for row in other] == ["worker:1"] * len(XLA_GRID)
    plain = {(row["compression"], row["policy"]): row["loss"]["plain"] for row in chief}
    for (policy, compression, steps, accumulation), row, peer in zip(XLA_GRID, chief, other):
        setting = (
            f"{policy}, {compression}, steps_per_execution={steps}, "
            f"gradient_accumulation_steps={accumulation}"
        )
        assert [row["policy"], row["compression"], row["steps"], row["accumulation"]] == [
            policy,
            compression,
            steps,
            accumulation,
        ]
        assert row["replicas"] == 2
        # 2 epochs of 8 global batches; accumulation applies every N-th.
        assert (
            row["iterations"]["xla"] == row["iterations"]["plain"] == 16 // (accumulation or 1)
        ), setting
        # Synchronous under XLA: both workers end with the same weights.
        assert row["sha256"] == peer["sha256"], setting
        weights, metrics = TOLERANCE.get(
            compression if policy == "float32" else policy, TOLERANCE["float32"]
        )
        assert row["weights_diff"] <= weights, setting
        np.testing.assert_allclose(
            row["loss"]["xla"], row["loss"]["plain"], rtol=metrics, err_msg=setting
        )
        assert row["loss"]["xla"][-1] < row["loss"]["xla"][0], setting
        if compression not in (None, "auto") or accumulation:  # The setting was in effect.
            assert row["loss"]["plain"] != plain[(None, policy)], setting
        if policy == "mixed_float16":
            assert row["optimizer"] == "LossScaleOptimizer", setting
    evaluated = chief[0]
    np.testing.assert_allclose(
        evaluated["evaluate"]["xla"], evaluated["evaluate"]["plain"], rtol=TOLERANCE["float32"][1]
    )
    assert evaluated["predict_diff"] <= 10 * TOLERANCE["float32"][0]
    assert "xla: jit_compile='auto' resolves to off (CPU replicas" in evaluated["description"]


def test_a_peer_that_never_starts_is_named_within_the_timeout():
    # Worker 0 leads the coordination service; worker 1 only registers with
    # it. Start one of each in two separate 2-worker clusters, alone.
    leader_spec, follower_spec = local_spec(2), local_spec(2)
    leader = start(
        ["-c", SERVE],
        TFDIST_REGISTER_TIMEOUT="5",
        tf_config=spec_lib.tf_config_for_task(leader_spec, "worker", 0),
    )
    follower = start(
        ["-c", SERVE],
        TFDIST_REGISTER_TIMEOUT="5",
        tf_config=spec_lib.tf_config_for_task(follower_spec, "worker", 1),
    )
    (lead_code, _, lead_err), (follow_code, _, follow_err) = finish([leader, follower], timeout=120)
    assert lead_code != 0
    assert "ClusterJoinError" in lead_err
    assert f"worker:1 ({leader_spec['cluster']['worker'][1]}) did not join" in lead_err
    assert "register_timeout=5s" in lead_err
    assert follow_code != 0
    assert "ClusterJoinError" in follow_err
    assert f"worker:0 ({follower_spec['cluster']['worker'][0]}) did not join" in follow_err


PS_CHIEF = """
import tensorflow as tf, tfdist
strategy = tfdist.strategy_from_config()
print(strategy.describe(), flush=True)
with strategy.scope():
    total = tf.Variable(0.0)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

@tf.function
def step():
    total.assign_add(1.0)
    return tf.constant(1.0)

for _ in range(20):
    coordinator.schedule(step)
coordinator.join()
print("tfdist result: {\\"total\\": %s, \\"variable_device\\": \\"%s\\"}"
      % (float(total.numpy()), total.device), flush=True)
"""


def test_parameter_server_cluster_servers_and_chief():
    spec = local_spec(2, chief=True, ps=1)
    configs = {(t, i): c for t, i, c in spec_lib.all_task_configs(spec)}
    servers = [start(["-c", SERVE], tf_config=configs[key]) for key in configs if key[0] != "chief"]
    try:
        chief = start(["-c", PS_CHIEF], tf_config=configs[("chief", 0)])
        [(code, out, err)] = finish([chief], timeout=180)
        assert code == 0, err[-4000:]
        assert "ParameterServerStrategy (parameter_server)" in out
        assert "this task: chief:0 (chief)" in out
        result = result_line(out)
        assert result["total"] == 20.0
        assert "/job:ps/" in result["variable_device"]
        for server in servers:  # Servers serve until they are stopped.
            assert server.poll() is None
    finally:
        for server in servers:
            server.kill()
        outputs = finish(servers, timeout=30)
    for _, _, err in outputs:
        assert "is serving the parameter-server cluster" in err


def test_collectives_keep_threads_flat_and_a_hung_peer_fails_the_other():
    # TensorFlow's own collective timeout left two sleeping threads per
    # all-reduce (300 for these 150); tfdist's watchdog keeps one thread.
    procs = [
        start(["tests/workers/watchdog_job.py"], tf_config=config, TFDIST_COLLECTIVE_TIMEOUT="6")
        for _, _, config in spec_lib.all_task_configs(local_spec(2))
    ]
    outs = []
    try:
        procs[0].wait(timeout=180)
    finally:
        for proc in procs:  # Worker 1 is stopped (SIGSTOP): only a kill ends it.
            if proc.poll() is None:
                proc.kill()
            outs.append(proc.communicate())
    assert procs[0].returncode == 0, f"worker 0 failed:\n{outs[0][1][-4000:]}"
    chief, other = result_line(outs[0][0]), result_line(outs[1][0])
    for worker in (chief, other):
        assert worker["first"] == worker["sum"] == 3.0  # 1 + 2: both took part.
        assert worker["threads_after"] - worker["threads_before"] <= 10, worker
        assert worker["timeout"] == 6.0
    # Worker 1 stopped (hung, not dead): worker 0's collective fails with a
    # message naming it and the setting, within the timeout and one probe.
    assert chief["error"] is not None and chief["error"].startswith("UnavailableError"), chief
    assert "/job:worker/replica:0/task:1" in chief["error"]
    assert "collective_timeout=6" in chief["error"]
    assert chief["watchdog_failure"] in chief["error"]
    # Not at once (the timeout counts from worker 1's last answer, at most a
    # probe interval before it stopped), and not much after the timeout.
    assert 2.0 <= chief["seconds_to_error"] <= 6.0 + 10.0 + 5.0, chief
