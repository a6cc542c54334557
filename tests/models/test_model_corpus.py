"""The models users train, under each tfdist path, on 2 logical CPU replicas.

keras-hub's GPT-2, BERT and Gemma and keras.applications' MobileNets (one
with synchronized BatchNorm), built from tiny configs with nothing
downloaded, train under Mirrored with every compression setting (the CNNs
and Gemma with a subset, SETTINGS_OF; GPT-2's and BERT's are in
tests/compression/test_keras_hub_compression.py), under ``mixed_bfloat16``, with gradient
accumulation and with XLA. Each must learn; where the arithmetic allows it
(no compression, no per-replica statistics), 2 replicas must equal one device
on the same global batches within 1e-5. The
multi-worker and parameter-server paths are in test_model_corpus_cluster.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import corpus
import corpus_report
import tfdist

#: The compression settings each model's Mirrored fit takes. GPT-2 and BERT
#: take none here: they learn under every setting in
#: tests/compression/test_keras_hub_compression.py (test_trains_under_every_setting,
#: which also checks each step's bytes). Gemma takes one setting of each kind
#: and the CNN the two that reshape a 4-D kernel: their gradients are otherwise
#: of the kinds GPT-2's take there, and a setting's fit costs 20-40 s in CI,
#: mostly tracing. Gemma: one cast, one sparsifier, the low-rank one and the
#: automatic choice. The CNN is MobileNetV3 with synchronized BatchNorm, under
#: top-k (a flat index into each kernel) and PowerSGD (each kernel as a
#: matrix). Before, Gemma took all 8 settings, MobileNetV3 also bf16 and auto
#: and MobileNetV2 top-k and PowerSGD again.
SETTINGS_OF = {
    "gpt2": (),
    "bert": (),
    "gemma": ("bf16", "topk:0.1", "powersgd:2", "auto"),
    "mobilenet_v2": (),
    "mobilenet_v3_sync": ("topk:0.1", "powersgd:2"),
}
COMPRESSED = [(name, setting) for name in corpus.CASES for setting in SETTINGS_OF[name]]
TOLERANCE = 1e-5
#: MobileNetV2's per-replica BatchNorm lets it only learn, never equal one
#: device: it takes the plain and the XLA fit. The bf16 policy and gradient
#: accumulation take the synchronized MobileNetV3 as their CNN, which equals
#: one device under accumulation (MobileNetV2's two fits, 130 s in CI, only
#: checked that the loss fell).
PER_REPLICA_BN = "mobilenet_v2"
EXCEPT_PER_REPLICA_BN = [name for name in corpus.CASES if name != PER_REPLICA_BN]


def case(name: str) -> corpus.Case:
    """The corpus entry, or a skip naming why keras-hub is missing."""
    entry = corpus.CASES[name]
    if entry.hub:
        pytest.importorskip("keras_hub", reason=corpus.HUB_MISSING)
    return entry


@pytest.fixture(scope="module")
def one_device(tf_cpus):
    """One-device runs, computed once per model and setting."""
    cache = {}

    def run(name: str, **kwargs) -> dict:
        key = (name, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = corpus.train(
                case(name), tfdist.strategy_from_config(cpu_replicas=1), **kwargs
            )
        return cache[key]

    return run


def assert_learns(result: dict):
    losses = result["epochs"]
    assert np.all(np.isfinite(result["losses"])), result["losses"]
    assert losses[-1] < losses[0], f"the loss did not fall: epochs {losses}"


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_mirrored_equals_one_device(tf_cpus, one_device, name):
    entry = case(name)
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    if not entry.exact_steps:  # Per-replica BatchNorm: it must learn.
        ours = corpus.train(entry, strategy, epochs=3)
        corpus_report.add(name, "mirrored x2", "none", ours["epochs"])
        assert_learns(ours)
        return
    ours = corpus.train(entry, strategy, **corpus.exact_run(entry))
    reference = one_device(name, **corpus.exact_run(entry))
    difference = corpus.max_difference(ours["weights"], reference["weights"])
    corpus_report.add(name, "mirrored x2", "none", ours["epochs"], difference)
    np.testing.assert_allclose(ours["losses"], reference["losses"], rtol=TOLERANCE)
    assert difference <= TOLERANCE, difference
    if entry.exact_steps >= 6:
        assert_learns(ours)


def compression(setting: str):
    """The setting as a user passes it; PowerSGD starts compressing at step 3
    of the 9 (its default warm-up, 10 dense steps, would outlast the run)."""
    if setting.startswith("powersgd:"):
        from tfdist.compression import PowerSGD

        return PowerSGD(int(setting.split(":")[1]), warmup_steps=2)
    return setting


#: The CNN's compressed fits take Adam. Under SGD with momentum, per-replica
#: BatchNorm and top-k's delayed coordinates left MobileNetV2's 3 epochs'
#: losses at noise level (measured on an AVX2-only CPU, where TensorFlow runs
#: without oneDNN: 1.516, 1.497, 1.527, and 1.024 only in epoch 4); under
#: Adam(1e-3) 1.523, 1.013, 0.641 (PowerSGD 1.599, 0.957, 0.466).
ADAM_WHEN_COMPRESSED = ("mobilenet_v3_sync",)


@pytest.mark.parametrize(("name", "setting"), COMPRESSED)
def test_mirrored_with_compression_learns(tf_cpus, name, setting):
    entry = case(name)
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression(setting))
    optimizer = "adam" if name in ADAM_WHEN_COMPRESSED else "sgd"
    ours = corpus.train(entry, strategy, epochs=3, optimizer=optimizer)
    corpus_report.add(name, "mirrored x2", setting, ours["epochs"])
    assert_learns(ours)


@pytest.fixture
def mixed_bfloat16():
    import keras

    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy(before)


@pytest.mark.parametrize("name", EXCEPT_PER_REPLICA_BN)
def test_mixed_bfloat16_learns(tf_cpus, mixed_bfloat16, name):
    entry = case(name)
    ours = corpus.train(entry, tfdist.strategy_from_config(cpu_replicas=2), epochs=3)
    corpus_report.add(name, "mirrored x2", "bf16 policy", ours["epochs"])
    assert_learns(ours)


@pytest.mark.parametrize("name", EXCEPT_PER_REPLICA_BN)
def test_gradient_accumulation_equals_one_device(tf_cpus, one_device, name):
    # Two micro-batches per update, on 2 replicas and on one device.
    entry = case(name)
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    assert entry.exact_steps, f"{name} cannot equal one device (EXCEPT_PER_REPLICA_BN)"
    # As many micro-batches as make the updates that can be exact.
    run = (
        {"steps": 4, "epochs": 2}
        if entry.exact_steps >= 6
        else {"steps": 2 * entry.exact_steps, "epochs": 1}
    )
    ours = corpus.train(entry, strategy, accumulation=2, **run)
    reference = one_device(name, accumulation=2, **run)
    difference = corpus.max_difference(ours["weights"], reference["weights"])
    corpus_report.add(name, "mirrored x2", "accumulate 2", ours["epochs"], difference)
    assert difference <= TOLERANCE, difference
    np.testing.assert_allclose(ours["losses"], reference["losses"], rtol=TOLERANCE)


#: XLA on 2 replicas against one device without XLA, on the same global
#: batches (6 steps). Measured on TF 2.21 + Keras 3.15: GPT-2 1.2e-7, BERT
#: 1.5e-8, Gemma 3.4e-7 (the report table shows each run's).
XLA_TOLERANCE = 1e-5


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_xla_under_mirrored_equals_one_device(tf_cpus, one_device, name):
    # compile(jit_compile=True) on 2 replicas: each replica's step compiled,
    # the all-reduce outside XLA (stock Keras fails here).
    entry = case(name)
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    if name == "mobilenet_v3_sync":  # A collective inside the forward pass.
        with pytest.raises(tfdist.ConfigError, match="synchronized=True"):
            corpus.train(entry, strategy, jit_compile=True)
        return
    if not entry.exact_steps:
        ours = corpus.train(entry, strategy, epochs=3, jit_compile=True)
        corpus_report.add(name, "mirrored x2", "xla", ours["epochs"])
        assert_learns(ours)
        return
    ours = corpus.train(entry, strategy, jit_compile=True, **corpus.exact_run(entry))
    reference = one_device(name, **corpus.exact_run(entry))
    difference = corpus.max_difference(ours["weights"], reference["weights"])
    corpus_report.add(name, "mirrored x2", "xla", ours["epochs"], difference)
    np.testing.assert_allclose(ours["losses"], reference["losses"], rtol=XLA_TOLERANCE)
    assert difference <= XLA_TOLERANCE, difference
