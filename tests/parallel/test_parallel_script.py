"""strategies/tensor_parallel.py, run as a user runs it, with tiny settings."""

from __future__ import annotations

import json

from conftest import finish, result_line, start

SCRIPT = "strategies/tensor_parallel.py"
TINY = [
    "--examples=128",
    "--epochs=2",
    "--seq_len=8",
    "--vocab_size=64",
    "--embed_dim=8",
    "--num_heads=2",
    "--ff_dim=16",
    "--per_replica_batch_size=8",
]


#: Loads the saved model with no strategy; prints its weights' fingerprint.
LOAD = """
import sys, keras, tfdist.parallel, tensor_parallel, _common
tensor_parallel._token_and_position_embedding()
model = keras.models.load_model(sys.argv[1])
print("loaded", _common.weights_sha256(model.get_weights()))
"""


def test_script_trains_sharded_like_unsharded(tmp_path):
    """T=2 on 2 logical CPUs: it learns, matches the same model trained
    unsharded on one device, and holds about half the variable bytes. The
    saved model holds the full weights: loaded with no strategy, they are
    bit for bit the ones trained."""
    model_dir = tmp_path / "model"
    [(code, out, err)] = finish(
        [start([SCRIPT, "--compare", *TINY, f"--model_dir={model_dir}"])], timeout=120
    )
    assert code == 0, (out + err)[-4000:]
    assert "mesh: data 1 x tensor 2; tensor groups [0, 1]" in out
    result = result_line(out)
    assert (result["replicas"], result["model_parallel"], result["data_parallel"]) == (2, 2, 1)
    # The token table, 7 attention weights (q/k/v kernels and biases, output
    # kernel) and the MLP's column kernel and bias and row kernel.
    assert result["sharded_weights"] == 11
    assert result["loss"][1] < 0.8 * result["loss"][0], result["loss"]
    compare = result["compare"]
    assert compare["max_loss_diff"] < 1e-5, compare
    assert compare["max_weight_diff"] < 1e-5, compare
    assert compare["max_key_bias_diff"] < 1e-3, compare  # Gradient 0: noise (see the script).
    assert result["variable_bytes_per_device"] < 0.6 * compare["unsharded_variable_bytes"]
    sent = result["sent_bytes_per_step"]
    assert sent["tensor_parallel"] > 10 * sent["data_parallel"] > 0, sent
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [
        "epoch-01.keras",
        "epoch-02.keras",
    ]
    assert json.loads((model_dir / "results.json").read_text()) == result
    [(code, out, err)] = finish([start(["-c", LOAD, result["saved_model"]])], timeout=120)
    assert code == 0, (out + err)[-4000:]
    assert f"loaded {result['weights_sha256']}" in out


def test_script_refuses_a_group_size_that_does_not_divide_the_replicas():
    [(code, out, err)] = finish([start([SCRIPT, "--model_parallel=3", *TINY])], timeout=120)
    assert code == 2, (out + err)[-3000:]
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert "model_parallel" in message and "Received: 3" in message, message
