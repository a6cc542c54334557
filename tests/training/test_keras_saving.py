"""Keras's own saving and checkpoint callbacks under `tfdist launch --workers 2`.

The worker (tests/workers/keras_tutorial_save.py) does what TensorFlow's
multi-worker Keras tutorial does: fit with Keras's BackupAndRestore and
ModelCheckpoint, ``model.save`` on every worker (the tutorial's
``write_filepath`` way, and every worker to the same path), ``load_model``
right after. Before tfdist.training.saving, the two workers wrote the same
files: "unable to lock file" (BlockingIOError) in fit, a ``.keras`` archive
with a bad CRC, and worker 1 loading the chief's model before it existed
("File not found").

Two launches: without compression, with worker 1 SIGKILLed in epoch 2 and
the job restarted (BackupAndRestore resumes); and with top-k compression,
whose error-feedback state makes every save a collective.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest

import tfdist
from conftest import REPO
from tfdist.training import chief_save, saving as keras_saving

SCRIPT = str(REPO / "tests" / "workers" / "keras_tutorial_save.py")
EPOCHS, STEPS = 3, 6


def digest(weights) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()


def lines_with(prefix: str, lines: list[str]) -> list[dict]:
    found = []
    for line in lines:
        _, _, rest = line.partition("] ")
        if rest.startswith(prefix):
            found.append(json.loads(rest[len(prefix) :]))
    return found


def run_job(out_dir, tmp_dir, **env):
    from tfdist.engines.launch import launch

    out = io.StringIO()
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "strategies")]),
        "TMPDIR": str(tmp_dir),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **env,
    }
    result = launch(
        SCRIPT,
        [str(out_dir)],
        workers=2,
        show_all=True,
        output=out,
        handle_signals=False,
        env=env,
        stop_timeout=5,
        max_restarts=1 if "TFDIST_TEST_KILL" in env else 0,
    )
    lines = out.getvalue().splitlines()
    assert result.ok, "\n".join(lines[-60:])
    return result, lines


def files_under(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path)
        for d, dirs, files in os.walk(path)
        for f in files + [x + "/" for x in dirs if not os.listdir(os.path.join(d, x))]
    )


def check_job(tf, out_dir, tmp_dir, results, epochs_run, *, chief_only):
    chief, other = results["worker:0"], results["worker:1"]
    for result in (chief, other):
        missing = result["errors"].pop("missing_dir_save")
        assert missing.startswith("FileNotFoundError") and "no-such-dir" in missing
        assert result["errors"] == {}
        assert result["epochs_run"] == epochs_run
        assert result["iterations"] == EPOCHS * STEPS
        # Every load right after the saves saw the chief's final weights.
        trained = chief["trained_digest"]
        assert result["trained_digest"] == trained
        assert (result["tutorial_digest"], result["same_digest"], result["weights_digest"]) == (
            trained,
            trained,
            trained,
        )
    # Worker 1 wrote its own copy where the tutorial told it to, then deleted it.
    assert other["own_copy_existed"] is True

    # On disk: the chief's files, complete, and nothing else (no backup left
    # after a finished fit, no workertemp_1/, no temporary files).
    expected = (
        ["ckpt/best.weights.h5"]
        + [f"ckpt/model-{e:02d}.keras" for e in range(1, EPOCHS + 1)]
        + ["keras-model.keras", "same/model.keras", "same/model.weights.h5"]
    )
    if chief_only:
        expected.append("chief-only.keras")
    assert files_under(out_dir) == sorted(expected)
    assert [name for name in os.listdir(tmp_dir) if name.startswith("tfdist-")] == []

    import keras

    for name in ("keras-model.keras", "same/model.keras", f"ckpt/model-{EPOCHS:02d}.keras") + (
        ("chief-only.keras",) if chief_only else ()
    ):
        model = keras.models.load_model(out_dir / name)
        assert digest(model.get_weights()) == chief["trained_digest"], name
    return chief


@pytest.mark.slow
def test_the_tutorials_saves_and_callbacks_on_two_workers(tf_cpus, tmp_path):
    # 1. No compression; worker 1 is SIGKILLed in the middle of epoch 2.
    out_dir, tmp_dir = tmp_path / "plain", tmp_path / "tmp-plain"
    tmp_dir.mkdir()
    result, lines = run_job(out_dir, tmp_dir, TFDIST_TEST_KILL="1:3")
    assert result.restarts == 1
    assert (result.attempts[0].task, result.attempts[0].how) == (
        "worker:1",
        "was killed by SIGKILL",
    ), "\n".join(lines[-80:])
    final = {r["task"]: r for r in lines_with("tfdist result: ", lines) if r["attempt"] == 1}
    epoch_ends = [
        r
        for r in lines_with("tfdist epoch: ", lines)
        if r["attempt"] == 0 and r["task"] == "worker:0"
    ]
    assert [r["epoch"] for r in epoch_ends] == [0]
    for task in ("worker:0", "worker:1"):
        # Keras's BackupAndRestore resumed both workers from the chief's
        # backup of epoch 1: its weights and optimizer step, at epoch 2.
        assert final[task]["begin_digest"] == epoch_ends[0]["digest"]
        assert final[task]["begin_iterations"] == STEPS
    chief = check_job(tf_cpus, out_dir, tmp_dir, final, [1, 2], chief_only=True)

    # The best-loss weights: the loss fell every epoch, so the last epoch's.
    losses = [r["loss"] for r in lines_with("tfdist epoch: ", lines) if r["task"] == "worker:0"]
    assert losses == sorted(losses, reverse=True)
    sys_path_model = _tutorial_model(tf_cpus)
    sys_path_model.load_weights(out_dir / "ckpt" / "best.weights.h5")
    assert digest(sys_path_model.get_weights()) == chief["trained_digest"]

    # 2. Top-k compression: the error-feedback state is saved with an
    # all-reduce, so every save is a collective of both workers.
    out_dir, tmp_dir = tmp_path / "topk", tmp_path / "tmp-topk"
    tmp_dir.mkdir()
    result, lines = run_job(out_dir, tmp_dir, TFDIST_TEST_COMPRESSION="topk:0.1")
    final = {r["task"]: r for r in lines_with("tfdist result: ", lines)}
    check_job(tf_cpus, out_dir, tmp_dir, final, [0, 1, 2], chief_only=False)


def _tutorial_model(tf):
    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    return model


# --------------------------------------------------------------------------
# In one process: nothing changes outside a multi-worker job.


def test_single_process_saves_are_keras_own(tf_cpus, tmp_path):
    import keras
    from keras.src.saving import saving_lib

    keras_saving.install()
    wrapped = saving_lib.save_model
    keras_saving.install()  # Wraps once.
    assert saving_lib.save_model is wrapped and wrapped.__wrapped__ is not wrapped
    for strategy in (
        tfdist.strategy_from_config(cpu_replicas=2),
        tfdist.strategy_from_config(strategy="one_device"),
        tf_cpus.distribute.get_strategy(),
    ):
        with strategy.scope():
            model = _tutorial_model(tf_cpus)
        assert keras_saving.active(model) == (False, True)
        path = tmp_path / f"{type(strategy).__name__}.keras"
        model.save(path)
        assert digest(keras.models.load_model(path).get_weights()) == digest(model.get_weights())
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"{name}.keras"
        for name in ("MirroredStrategy", "OneDeviceStrategy", "_DefaultDistributionStrategy")
    )


# --------------------------------------------------------------------------
# The chief's atomic write, in one process (real Keras saves).


def _trained_model(tf):
    model = _tutorial_model(tf)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_the_chief_moves_a_sharded_save_and_leaves_no_temporary_files(tf_cpus, tmp_path):
    def mlp():  # Three 40 kB kernels: one per 50 kB shard.
        return tf_cpus.keras.Sequential(
            [tf_cpus.keras.Input((100,))] + [tf_cpus.keras.layers.Dense(100) for _ in range(3)]
        )

    model = mlp()
    path = tmp_path / "model.weights.json"
    chief_save._chief_save(str(path), lambda p: model.save_weights(p, max_shard_size=5e-5))
    names = sorted(os.listdir(tmp_path))  # The map and its shards; nothing else.
    assert (
        names
        == ["model.weights.json"] + [f"model_{i:05d}.weights.h5" for i in range(len(names) - 1)]
        and len(names) >= 4
    )
    fresh = mlp()
    fresh.load_weights(path)
    assert digest(fresh.get_weights()) == digest(model.get_weights())


def test_a_failed_save_leaves_the_previous_file_whole(tf_cpus, tmp_path):
    model = _trained_model(tf_cpus)
    path = tmp_path / "model.keras"
    chief_save._chief_save(str(path), model.save)
    before = path.read_bytes()

    def interrupted(staged):
        with open(staged, "wb") as f:
            f.write(before[:1000])  # Half a zip, then the save dies.
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        chief_save._chief_save(str(path), interrupted)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.keras"]


def test_an_unzipped_model_directory_is_replaced_whole(tf_cpus, tmp_path):
    import keras

    model = _trained_model(tf_cpus)
    path = tmp_path / "model_dir"
    for _ in range(2):  # The second save replaces the first directory.
        chief_save._chief_save(str(path), lambda p: model.save(p, zipped=False))
    assert os.listdir(tmp_path) == ["model_dir"]
    assert digest(keras.models.load_model(path).get_weights()) == digest(model.get_weights())


def test_temporary_directories_of_killed_saves_are_swept(tf_cpus, tmp_path):
    import socket
    import subprocess

    model = _trained_model(tf_cpus)
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tfdist-save-{host}-{dead.pid}-0123"
    live = tmp_path / f".tfdist-save-{host}-1-0123"  # pid 1 is alive
    for d in (stale, live):
        d.mkdir()
        (d / "model.keras").write_bytes(b"partial")
    chief_save._chief_save(str(tmp_path / "model.keras"), model.save)
    assert sorted(os.listdir(tmp_path)) == sorted(["model.keras", live.name])
