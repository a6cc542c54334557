"""strategies/keras_distribution.py, run as a user runs it, with tiny settings."""

from __future__ import annotations

import pytest

from conftest import finish, result_line, start

pytest.importorskip("keras_hub")

SCRIPT = "strategies/keras_distribution.py"
TINY = ["--epochs=2", "--examples=32", "--vocab_size=128", "--hidden=32", "--seq_len=8"]

#: Loads the saved model with no distribution; prints its weights' fingerprint.
LOAD = """
import sys, keras, _common
model = keras.models.load_model(sys.argv[1])
print("loaded", _common.weights_sha256(model.get_weights()))
"""


def test_script_shards_llama_like_the_unsharded_model(tmp_path):
    model_dir = tmp_path / "model"
    [(code, out, err)] = finish(
        [start([SCRIPT, "--compare", *TINY, f"--model_dir={model_dir}"])], timeout=300
    )
    assert code == 0, (out + err)[-4000:]
    result = result_line(out)
    assert result["replicas"] == 4 and result["mesh"] == [2, 2]
    assert "token_embedding/embeddings" in out and "tensor-parallel (vocabulary)" in out
    # Embeddings and, per layer, q/k/v/output kernels and 3 feed-forward kernels.
    assert result["split_weights"] == 1 + 2 * 7
    assert result["loss"][-1] < result["loss"][0], result["loss"]
    assert result["compare"]["max_loss_diff"] < 1e-5, result["compare"]
    assert result["compare"]["max_weight_diff"] < 1e-5, result["compare"]
    assert result["weights_per_device"] < 0.5 * result["full_weights"]
    [(code, out, err)] = finish([start(["-c", LOAD, result["saved_model"]])], timeout=120)
    assert code == 0, (out + err)[-4000:]
    assert f"loaded {result['weights_sha256']}" in out


def test_script_runs_keras_hubs_lora_recipe_like_one_device():
    """--lora_rank and --generate: keras-hub's distributed tuning recipe
    (Gemma, enable_lora, fit, generate with a seeded top-k sampler) on a
    (2, 2) mesh, against the same recipe on one device."""
    [(code, out, err)] = finish(
        [
            start(
                [
                    SCRIPT,
                    "--family=gemma",
                    "--lora_rank=2",
                    "--generate=4",
                    "--sampler=top_k",
                    "--compare",
                    *TINY,
                    "--epochs=1",
                ]
            )
        ],
        timeout=300,
    )
    assert code == 0, (out + err)[-4000:]
    result = result_line(out)
    assert result["trainable_weights"] == 2 * 2 * 2  # (query, value) x (a, b) per layer.
    assert result["compare"]["max_weight_diff"] < 1e-5, result["compare"]
    assert result["compare"]["generated_equal"] is True, result
    assert [len(row) for row in result["generated"]] == [8, 8]


def test_script_refuses_a_bad_mesh_in_one_line():
    [(code, out, err)] = finish([start([SCRIPT, "--mesh=2x2", *TINY])], timeout=120)
    assert code == 2, (out + err)[-3000:]
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert "--mesh" in message and "Received: '2x2'" in message, message
    [(code, out, err)] = finish([start([SCRIPT, "--strategy=mirrored", *TINY])], timeout=120)
    assert code == 2 and "--strategy: expected auto" in err, (out + err)[-3000:]
    [(code, out, err)] = finish([start([SCRIPT, "--generate=-1", *TINY])], timeout=120)
    assert code == 2 and "Received: --generate=-1" in err, (out + err)[-3000:]
