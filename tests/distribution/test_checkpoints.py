"""Checkpoints of split weights under keras.distribution.ModelParallel
(tfdist.parallel.saving, tfdist.training.chief_save), on 4 logical CPUs.

Every Keras way out (``save_weights``, ``model.save``, ``ModelCheckpoint``,
``BackupAndRestore``, keras-hub's ``save_to_preset``) writes a split weight
into the file block by block, never gathering it whole, and the files hold
full weights: they restore onto another mesh shape and with no
distribution, optimizer state included. A save killed midway leaves the
previous file whole. Across 4 processes: tests/workers/keras_model_parallel_job.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import textwrap

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")
from conftest import finish, result_line, start  # noqa: E402
from tfdist.parallel import saving, sharding  # noqa: E402
from tiny_lms import batches, causal_lm  # noqa: E402


def _model_parallel(keras, shape):
    devices = keras.distribution.list_devices("cpu")[: int(np.prod(shape))]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh), batch_dim_name="batch"
    )


@pytest.fixture
def gathers(monkeypatch):
    """Counts the whole-weight gathers (full values of split weights)."""
    calls = []
    for name in ("full_value", "full_tensor"):
        real = getattr(sharding, name)

        def counted(variable, real=real, name=name):
            calls.append((name, getattr(variable, "path", "?")))
            return real(variable)

        monkeypatch.setattr(sharding, name, counted)
    return calls


def test_saves_write_blocks_and_restore_on_other_meshes(keras_mod, tmp_path, gathers):
    keras = keras_mod
    x, y = batches(skewed=True)
    keras.utils.set_random_seed(1)
    keras.distribution.set_distribution(_model_parallel(keras, (2, 2)))
    lm = causal_lm(keras, "llama")
    lm.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch{epoch}.keras")),
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False),
        ],
    )
    lm.save_weights(tmp_path / "lm.weights.h5")
    lm.save(tmp_path / "lm.keras")
    lm.backbone.save_to_preset(str(tmp_path / "preset"))
    assert gathers == [], "a save gathered a whole weight"
    # Only now read the full values (gathers) to compare against.
    assert lm.backbone.token_embedding.embeddings.shape == (128, 16)
    trained = lm.get_weights()
    slots = saving.full_weights(lm.optimizer.variables)
    assert not any(name.startswith(".tfdist-save-") for name in os.listdir(tmp_path))

    def same(model, where, optimizer=True):
        for path, a, b in zip([v.path for v in model.weights], trained, model.get_weights()):
            np.testing.assert_array_equal(b, a, err_msg=f"{where}: {path}")
        if optimizer:
            got = saving.full_weights(model.optimizer.variables)
            assert len(got) == len(slots), where
            for v, a, b in zip(model.optimizer.variables, slots, got):
                np.testing.assert_array_equal(b, a, err_msg=f"{where}: {v.path}")

    def fresh():
        model = causal_lm(keras, "llama")
        model.optimizer.build(model.trainable_variables)
        return model

    for shape in ((1, 4), None):
        keras.distribution.set_distribution(shape and _model_parallel(keras, shape))
        where = f"mesh {shape}" if shape else "no distribution"
        model = fresh()
        if shape:
            assert model.backbone.token_embedding.embeddings.shape == (64, 32)
        model.load_weights(tmp_path / "lm.weights.h5")
        same(model, f"load_weights, {where}")
        # BackupAndRestore of a finished run restores its weights and state,
        # and trains no further epoch.
        model = fresh()
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
            ],
        )
        assert history.history == {}, where
        same(model, f"BackupAndRestore, {where}")
        backbone = keras_hub.models.LlamaBackbone.from_preset(str(tmp_path / "preset"))
        for v, a in zip(backbone.weights, backbone.get_weights()):
            want = trained[[w.path for w in lm.weights].index(v.path)]
            np.testing.assert_array_equal(a, want, err_msg=f"from_preset, {where}: {v.path}")
    # No distribution: the .keras files (keras-hub's LM does not compile on load).
    for name in ("lm.keras", "epoch2.keras"):
        same(keras.models.load_model(tmp_path / name), name, optimizer=False)


KILLED_SAVE = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys
    import h5py
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    import keras, keras_hub
    import tfdist
    from tiny_lms import batches, causal_lm, fit

    path = sys.argv[1]
    devices = keras.distribution.list_devices("cpu")
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh), batch_dim_name="batch"))
    lm = causal_lm(keras, "llama")
    fit(lm)
    lm.save_weights(path)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in lm.get_weights())).hexdigest()
    print("tfdist result: " + json.dumps({"sha256": digest}), flush=True)
    fit(lm)
    writes = []
    real = h5py.Dataset.__setitem__

    def write(self, key, value):
        # Killed in the middle of a split weight (written block by block):
        # after its first block, with other weights written before it.
        if self.name in writes and len(set(writes)) > 3:
            os.kill(os.getpid(), signal.SIGKILL)
        writes.append(self.name)
        return real(self, key, value)

    h5py.Dataset.__setitem__ = write
    lm.save_weights(path)
    print("not killed", flush=True)
    """
)


@pytest.mark.slow
def test_a_killed_save_leaves_the_previous_file_whole(keras_mod, tmp_path):
    """One process on a (2, 2) mesh saves, trains, and is killed (SIGKILL)
    halfway through writing a split weight's blocks in its next save to the
    same path: the file holds the first save, whole, and loads."""
    from conftest import REPO

    keras = keras_mod
    path = tmp_path / "lm.weights.h5"
    process = start(
        ["-c", KILLED_SAVE, str(path)],
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "distribution")]),
    )
    [(code, out, err)] = finish([process], timeout=300)
    assert code == -signal.SIGKILL, err[-3000:]
    assert "not killed" not in out
    [want] = [result_line(line)["sha256"] for line in out.splitlines() if "tfdist result" in line]
    leftovers = [n for n in os.listdir(tmp_path) if n != "lm.weights.h5"]
    # The killed save's staging directory, which the next save here removes.
    assert [n.startswith(".tfdist-save-") for n in leftovers] == [True], leftovers
    model = causal_lm(keras, "llama")
    model.load_weights(path)
    got = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    assert got == want
