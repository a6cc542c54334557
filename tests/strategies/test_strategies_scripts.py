"""The scripts in strategies/, run as users run them.

strategies/mirrored.py is run by tests/test_readme.py (it is the README's
first command), so it is not run again here. Each run is a subprocess with
tiny data and 2 epochs.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO, finish, result_line, results_by_task, start, subprocess_env

SCRIPTS = sorted(p for p in (REPO / "strategies").glob("*.py") if not p.name.startswith("_"))
#: Every script takes these (the issue's list); more are allowed.
COMMON_FLAGS = ("strategy", "compression", "epochs", "per_replica_batch_size", "model_dir")
TINY = ["--epochs=2", "--examples=1024"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_lists_the_common_flags_in_its_help(script):
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr[-2000:]  # absl exits 1 after --help.
    listed = set(re.findall(r"^  --(?:\[no\])?(\w+)", done.stdout, re.M))
    missing = [name for name in COMMON_FLAGS if name not in listed]
    assert not missing, f"{script.name} --help does not list {missing}:\n{done.stdout}"


@pytest.mark.slow
def test_multi_worker_mirrored_script_through_tfdist_launch(tmp_path, tf_cpus):
    model_dir = tmp_path / "model"
    proc = start(
        [
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            "strategies/multi_worker_mirrored.py",
            *TINY,
            f"--model_dir={model_dir}",
        ]
    )
    [(code, out, err)] = finish([proc], timeout=300)
    assert code == 0, (out + err)[-4000:]
    assert "[worker:0]   this task: worker:0 (chief)" in out
    assert "[worker:1]   this task: worker:1 (not chief)" in out
    results = results_by_task(out)
    assert sorted(results) == ["worker:0", "worker:1"], out[-3000:]
    chief, other = results["worker:0"], results["worker:1"]
    for result in (chief, other):
        assert result["strategy"] == "MultiWorkerMirroredStrategy"
        assert result["replicas"] == 2 and len(result["loss"]) == 2
        assert result["loss"][-1] < 0.7 * result["loss"][0], result["loss"]
    # Synchronous training: both workers end with bit-identical weights.
    assert chief["weights_sha256"] == other["weights_sha256"]
    assert chief["weights_checksum"] == other["weights_checksum"]

    # --model_dir: the chief's result, a checkpoint per epoch and the model.
    assert json.loads((model_dir / "results.json").read_text()) == chief
    checkpoints = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
    assert checkpoints == ["epoch-01.keras", "epoch-02.keras"]
    import keras

    sys.path.insert(0, str(REPO / "strategies"))
    import _common

    saved = keras.models.load_model(model_dir / "model.keras")
    assert _common.weights_sha256(saved.get_weights()) == chief["weights_sha256"]


def _closed_local_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tpu_script_without_a_tpu_fails_at_once_with_one_line():
    port = _closed_local_port()
    tried = {"local": [], f"grpc://127.0.0.1:{port}": [f"--tpu=grpc://127.0.0.1:{port}"]}
    procs = [start(["strategies/tpu.py", *args, *TINY]) for args in tried.values()]
    # finish() fails the test on a hang (TensorFlow's own behaviour here).
    outputs = finish(procs, timeout=120)
    for tpu, (code, out, err) in zip(tried, outputs):
        assert code == 2, (code, out[-2000:], err[-3000:])
        assert "Traceback" not in err and "tfdist result" not in out
        errors = [line for line in err.splitlines() if "tpu.py: error:" in line]
        assert len(errors) == 1, err[-3000:]
        assert errors[0].startswith(f"tpu.py: error: No TPU found for tpu='{tpu}'")
        assert errors[0] == err.rstrip("\n").splitlines()[-1]  # The last word.
        assert "unset TPU_NAME" in errors[0]
    assert f"nothing answers at 127.0.0.1:{port}" in outputs[1][2]


def test_compressed_script_sends_fewer_bytes_and_learns():
    [(code, out, err)] = finish([start(["strategies/compressed.py", *TINY])], timeout=240)
    assert code == 0, err[-4000:]
    assert "MirroredStrategy (mirrored): 2 replica(s) in sync" in out
    result = result_line(out)
    assert result["compression"] == "powersgd:4" and result["replicas"] == 2
    comm = result["comm"]
    # The dense reference: a ring all-reduce of every float32 weight.
    n = result["replicas"]
    assert comm["comm_dense_bytes"] == 2 * (n - 1) / n * 4 * result["params"]
    assert comm["comm_bytes"] < comm["comm_dense_bytes"]
    assert comm["comm_ratio"] == pytest.approx(comm["comm_dense_bytes"] / comm["comm_bytes"])
    assert comm["comm_ratio"] > 1
    # What was counted after the warm-up is what predict_traffic foretold.
    assert result["comm_predicted"] == comm
    # Over the whole run PowerSGD's dense warm-up steps lower the ratio.
    total = result["comm_total"]
    assert total["steps"] == 2 * 1024 // result["global_batch"]
    assert 1 < total["ratio"] < comm["comm_ratio"]
    assert f"ratio {comm['comm_ratio']:.2f}x" in out
    assert result["loss"][-1] < 0.7 * result["loss"][0], result["loss"]
