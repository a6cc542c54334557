"""strategies/pipeline.py under `tfdist launch` and `mpiexec`, as a user runs
it, with tiny settings: 2 stages train like the model on one device, and
save it whole."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import finish, results_by_task, start

#: TensorFlow processes: with the suite's other multi-process tests, one at a time.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tf_cpus")]  # Keras here too.

SCRIPT = "strategies/pipeline.py"
TINY = ["--examples=64", "--per_replica_batch_size=16", "--microbatches=2", "--epochs=2"]


def test_the_script_trains_two_stages_like_one_device(tmp_path):
    import keras

    model_dir = tmp_path / "model"
    args = ["-m", "tfdist", "launch", "--workers", "2", "--show-all", SCRIPT, "--model=mlp", *TINY]
    [(code, out, err)] = finish(
        [start([*args, "--compare", f"--model_dir={model_dir}"])], timeout=300
    )
    assert code == 0, (out + err)[-4000:]
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-3000:]
    first, second = results["worker:0"], results["worker:1"]
    assert (first["stage"], second["stage"], first["stages"]) == (0, 1, 2)
    assert first["loss"] == second["loss"] and first["evaluate"] == second["evaluate"]
    np.testing.assert_allclose(first["loss"], first["plain"]["loss"], rtol=0, atol=1e-5)
    assert first["max_weight_diff"] < 1e-5, first
    saved = keras.models.load_model(model_dir / "model.keras")
    assert type(saved).__name__ == "Functional"
    assert len(saved.layers) == 7  # The input, 5 Dense layers and the logits.


def test_the_script_trains_two_replicas_of_two_stages_cut_by_weights_with_compression(tmp_path):
    args = ["-m", "tfdist", "launch", "--workers", "4", "--show-all", SCRIPT, "--model=mlp"]
    [(code, out, err)] = finish(
        [
            start(
                [
                    *args,
                    *TINY,
                    "--per_replica_batch_size=8",
                    "--replicas=2",
                    "--compression=bf16",
                    "--split=parameters",
                ]
            )
        ],
        timeout=300,
    )
    assert code == 0, (out + err)[-4000:]
    results = results_by_task(out)
    assert sorted(results) == [f"worker:{k}" for k in range(4)], out[-3000:]
    places = [
        (results[f"worker:{k}"]["replica"], results[f"worker:{k}"]["stage"]) for k in range(4)
    ]
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)]
    losses = {tuple(results[k]["loss"]) for k in results}
    assert len(losses) == 1  # Every worker logs the replicas' mean loss.
    assert all(results[k]["sent_to_replicas"] > 0 for k in results)
    # Balanced by weights: dense_0 (32 x 64 + 64) and two 64 x 64 layers with
    # biases, against two and the logits (64 x 10 + 10); cutting one layer
    # earlier would give 6,272 against 13,130.
    first = results["worker:0"]
    assert first["split_points"] == ["dense_3"]
    assert first["stage_costs"] == [2112 + 2 * 4160, 2 * 4160 + 650]


def test_the_script_trains_interleaved_chunks_laid_out_over_a_mesh_like_one_device():
    # Interleaved 1F1B: 2 workers run the MLP's 4 stages, 2 each, under
    # PipelineModel's fit, evaluate and its comparison with one device; each
    # worker lays its stages out over a (1, 2) mesh of its CPU's 2 logical
    # devices (Megatron's column and row splits): three axes.
    args = ["-m", "tfdist", "launch", "--workers", "2", "--show-all", SCRIPT, "--model=mlp"]
    more = ["--schedule=interleaved", "--chunks=2", "--compare", "--stage_mesh=1x2"]
    [(code, out, err)] = finish([start([*args, *TINY, *more])], timeout=300)
    assert code == 0, (out + err)[-4000:]
    first = results_by_task(out)["worker:0"]
    assert len(first["split_points"]) == 3  # 4 stages on 2 workers.
    np.testing.assert_allclose(first["loss"], first["plain"]["loss"], rtol=0, atol=1e-5)
    assert first["max_weight_diff"] < 1e-5, first


def test_mpiexec_starts_the_stages_without_tf_config():
    # MPICH's mpiexec: each rank finds its stage from PMI_RANK and PMI_SIZE
    # (ports from TFDIST_PORT_BASE), no TF_CONFIG.
    import os
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    from tfdist.engines.mpi_launch import find_mpiexec
    from tfdist.engines.net import free_ports
    from tfdist.errors import ConfigError

    try:
        mpiexec = find_mpiexec()
    except ConfigError as missing:
        if os.environ.get("TFDIST_REQUIRE_TOOLS"):
            pytest.fail(f"{missing} (TFDIST_REQUIRE_TOOLS=1 requires it)", pytrace=False)
        pytest.skip(str(missing))

    env = subprocess_env()
    env.pop("TF_CONFIG", None)
    env["TFDIST_PORT_BASE"] = str(free_ports(1)[0])
    command = [mpiexec, "-n", "2", sys.executable, SCRIPT, "--model=mlp", *TINY, "--compare"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("tfdist result: ")]
    results = sorted(
        (json.loads(line[len("tfdist result: ") :]) for line in lines), key=lambda r: r["stage"]
    )
    assert [r["stage"] for r in results] == [0, 1], done.stdout[-3000:]
    assert results[0]["loss"] == results[1]["loss"]
    assert results[0]["max_weight_diff"] < 1e-5, results[0]


def test_the_script_refuses_compression_naming_it():
    [(code, out, err)] = finish([start([SCRIPT, "--compression=fp16"])], timeout=120)
    assert code == 2, (out + err)[-2000:]
    assert "field 'compression'" in err and "'fp16'" in err, err[-2000:]
