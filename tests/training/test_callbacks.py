"""tfdist's Keras callbacks: BackupAndRestore, warm-up, chief-only writers.

In one process: 2 logical CPU replicas (Mirrored). An interrupted and
resumed fit must end with the weights of an uninterrupted one. The chief /
non-chief split is checked in one 2-worker job (slow).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import types

import numpy as np
import pytest

import tfdist
from conftest import REPO, finish, result_line, start
from tfdist import spec as spec_lib
from tfdist.engines.net import local_spec
from tfdist.errors import ConfigError

sys.path.insert(0, str(REPO / "strategies"))
import _common  # The scripts' model and data.

EXAMPLES, GLOBAL_BATCH, EPOCHS = 256, 32, 4
STEPS = EXAMPLES // GLOBAL_BATCH  # per epoch
LR = 0.01


@pytest.fixture(scope="module")
def strategy(tf_cpus):
    return tfdist.strategy_from_config(cpu_replicas=2)


@pytest.fixture(scope="module")
def callbacks_mod(tf_cpus):
    from tfdist.training import callbacks

    return callbacks


def dataset(tf):
    x, y = _common.make_data(EXAMPLES, 3)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)


def new_model(strategy, lr=LR, optimizer=None):
    with strategy.scope():
        model = _common.build_model(lr, seed=3)
        if optimizer is not None:
            import keras

            model.compile(
                optimizer=optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
    return model


def fit(tf, model, epochs=EPOCHS, callbacks=()):
    return model.fit(
        dataset(tf), epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks)
    )


def weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


class Interrupted(Exception):
    pass


def interrupter(epoch, batch=None):
    """A callback that raises at the start of ``epoch``, or after its ``batch``."""
    import keras

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e
            if e == epoch and batch is None:
                raise Interrupted(e)

        def on_train_batch_end(self, b, logs=None):
            if self.epoch == epoch and b == batch:
                raise Interrupted(epoch, b)

    return Interrupt()


def make_recorder():
    """A callback recording the epochs run and the rate before each batch."""
    import keras

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs, self.rates = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append(epoch)
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.rates.append(
                (self.epoch, batch, float(self.model.optimizer.learning_rate.numpy()))
            )

    return Recorder()


@pytest.fixture(scope="module")
def reference(tf_cpus, strategy):
    """An uninterrupted fit: final weights and optimizer step count."""
    model = new_model(strategy)
    fit(tf_cpus, model)
    return {"weights": weights(model), "iterations": int(model.optimizer.iterations.numpy())}


def files_in(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


# --------------------------------------------------------------------------
# BackupAndRestore, in one process.


def test_resume_after_an_interruption_equals_an_uninterrupted_fit(
    tf_cpus, strategy, callbacks_mod, reference, tmp_path
):
    backup_dir = str(tmp_path / "backup")
    first = new_model(strategy)
    sigterm = signal.getsignal(signal.SIGTERM)
    # Two epochs complete, then a failure in the middle of the third.
    with pytest.raises(Interrupted):
        fit(
            tf_cpus,
            first,
            callbacks=[callbacks_mod.BackupAndRestore(backup_dir), interrupter(2, batch=3)],
        )
    # The fit's preemption watcher ended with it: SIGTERM ends this process again.
    assert signal.getsignal(signal.SIGTERM) == sigterm
    pointer = json.loads((tmp_path / "backup" / "checkpoint.json").read_text())
    assert (pointer["epoch"], pointer["step"]) == (2, 0)
    assert files_in(backup_dir) == ["checkpoint.json", pointer["file"]]
    assert pointer["writer"] == "local" and pointer["pid"] == os.getpid()
    # The interrupted model went on past the backup: resuming must not reuse it.
    assert int(first.optimizer.iterations.numpy()) == 2 * STEPS + 4

    second, recorder = new_model(strategy), make_recorder()
    backup = callbacks_mod.BackupAndRestore(backup_dir)
    history = fit(tf_cpus, second, callbacks=[backup, recorder])
    assert backup.resumed_from["file"] == pointer["file"]
    assert recorder.epochs == [2, 3]
    assert len(history.history["loss"]) == 2
    assert int(second.optimizer.iterations.numpy()) == reference["iterations"]
    np.testing.assert_allclose(weights(second), reference["weights"], atol=1e-5, rtol=0)
    assert not os.path.exists(backup_dir)  # delete_checkpoint=True
    assert second._initial_epoch is None  # A later fit starts where asked.


@pytest.mark.parametrize(
    "save_freq, stop, saved",
    [
        (3, (2, 6), (2, 5)),  # mid-epoch backup: resume skips 5 batches of epoch 2
        (4, (2, 1), (2, 0)),  # a backup on an epoch's last batch moves to the next
    ],
)
def test_resume_from_a_backup_every_n_batches(
    tf_cpus, strategy, callbacks_mod, reference, tmp_path, save_freq, stop, saved
):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        fit(
            tf_cpus,
            new_model(strategy),
            callbacks=[
                callbacks_mod.BackupAndRestore(backup_dir, save_freq=save_freq),
                interrupter(*stop),
            ],
        )
    pointer = callbacks_mod.read_backup_pointer(backup_dir)
    assert (pointer["epoch"], pointer["step"]) == saved

    model, recorder = new_model(strategy), make_recorder()
    fit(
        tf_cpus,
        model,
        callbacks=[callbacks_mod.BackupAndRestore(backup_dir, save_freq=save_freq), recorder],
    )
    assert recorder.epochs == [2, 3]
    # Exactly the batches after the backup were trained: no more, no fewer.
    assert int(model.optimizer.iterations.numpy()) == reference["iterations"]
    np.testing.assert_allclose(weights(model), reference["weights"], atol=1e-5, rtol=0)


def test_leftovers_of_interrupted_saves_do_not_break_resume(
    tf_cpus, strategy, callbacks_mod, reference, tmp_path
):
    backup_dir = tmp_path / "backup"
    with pytest.raises(Interrupted):
        fit(
            tf_cpus,
            new_model(strategy),
            callbacks=[callbacks_mod.BackupAndRestore(str(backup_dir)), interrupter(2)],
        )
    pointer = callbacks_mod.read_backup_pointer(backup_dir)
    # What a kill at each point of a save leaves behind: a partial weights
    # file, a renamed backup whose pointer was never written, a partial pointer.
    rng = np.random.default_rng(0)
    (backup_dir / ".tmp-4242-0a1b.weights.h5").write_bytes(rng.bytes(3000))
    (backup_dir / "ckpt-000099.weights.h5").write_bytes(b"\x89HDF\r\n" + rng.bytes(500))
    (backup_dir / ".tmp-4242-0c1d.json").write_text('{"file": "ckpt-0000')
    assert callbacks_mod.read_backup_pointer(backup_dir) == pointer

    model = new_model(strategy)
    backup = callbacks_mod.BackupAndRestore(str(backup_dir))
    fit(tf_cpus, model, callbacks=[backup])
    assert backup.resumed_from["file"] == pointer["file"]
    np.testing.assert_allclose(weights(model), reference["weights"], atol=1e-5, rtol=0)
    # The chief swept the leftovers, so the directory could be removed.
    assert not backup_dir.exists()


def test_a_damaged_backup_is_refused(tf_cpus, strategy, callbacks_mod, tmp_path):
    backup_dir = tmp_path / "backup"
    with pytest.raises(Interrupted):
        fit(
            tf_cpus,
            new_model(strategy),
            epochs=2,
            callbacks=[callbacks_mod.BackupAndRestore(str(backup_dir)), interrupter(1)],
        )
    path = backup_dir / callbacks_mod.read_backup_pointer(backup_dir)["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(callbacks_mod.BackupError, match="is damaged"):
        fit(
            tf_cpus,
            new_model(strategy),
            epochs=2,
            callbacks=[callbacks_mod.BackupAndRestore(str(backup_dir))],
        )


def test_backup_arguments_are_checked(callbacks_mod, tmp_path):
    cls = callbacks_mod.BackupAndRestore
    for bad in (0, -1, "batch", True, 2.5):
        with pytest.raises(ConfigError, match="field 'save_freq'"):
            cls(str(tmp_path), save_freq=bad)
    for bad in ("", None, "gs://bucket/backup"):
        with pytest.raises(ConfigError, match="field 'backup_dir'"):
            cls(bad)
    with pytest.raises(ConfigError, match="field 'delete_checkpoint'"):
        cls(str(tmp_path), delete_checkpoint="yes")
    assert cls(tmp_path / "b", save_freq=7).save_freq == 7


# --------------------------------------------------------------------------
# Chief detection.


def test_chief_detection_from_a_cluster_resolver(tf_cpus, callbacks_mod, strategy):
    tf = tf_cpus
    assert callbacks_mod.is_chief(strategy) is True
    assert callbacks_mod.is_chief(tf.distribute.get_strategy()) is True
    assert callbacks_mod.num_workers(strategy) == 1

    def holder(spec, task_type, task_id):
        # Anything with a cluster_resolver, like TensorFlow's strategies.
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type=task_type, task_id=task_id
        )
        return types.SimpleNamespace(cluster_resolver=resolver)

    workers = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    with_chief = {"chief": ["127.0.0.1:3"], **workers}
    assert callbacks_mod.is_chief(holder(workers, "worker", 0)) is True
    assert callbacks_mod.is_chief(holder(workers, "worker", 1)) is False
    assert callbacks_mod.is_chief(holder(with_chief, "chief", 0)) is True
    assert callbacks_mod.is_chief(holder(with_chief, "worker", 0)) is False
    assert callbacks_mod.num_workers(holder(with_chief, "worker", 0)) == 3


# --------------------------------------------------------------------------
# Learning rate.


def test_scale_learning_rate(strategy, callbacks_mod):
    scale = callbacks_mod.scale_learning_rate
    assert scale(0.1, strategy) == pytest.approx(0.2)
    assert scale(0.1, strategy, base_batch=64, per_replica_batch=64) == pytest.approx(0.2)
    assert scale(0.1, strategy, base_batch=256, per_replica_batch=32) == pytest.approx(0.025)
    with pytest.raises(ConfigError, match="field 'base_batch'"):
        scale(0.1, strategy, per_replica_batch=32)
    with pytest.raises(ConfigError, match="field 'per_replica_batch'"):
        scale(0.1, strategy, base_batch=32)
    for bad in (0, -0.1, "0.1", True, float("nan")):
        with pytest.raises(ConfigError, match="field 'base_lr'"):
            scale(bad, strategy)
    with pytest.raises(ConfigError, match="field 'per_replica_batch'. .*Received: 0"):
        scale(0.1, strategy, base_batch=32, per_replica_batch=0)
    with pytest.raises(ConfigError, match="field 'strategy'"):
        scale(0.1, "mirrored")


def test_warmup_ramps_the_rate_per_batch(tf_cpus, strategy, callbacks_mod):
    target = callbacks_mod.scale_learning_rate(LR, strategy)  # 2 replicas: 0.02
    model, recorder = new_model(strategy, lr=target), make_recorder()
    warmup = callbacks_mod.LearningRateWarmup(warmup_epochs=2)
    history = fit(tf_cpus, model, epochs=3, callbacks=[warmup, recorder])
    # Horovod's rule, written out: from target / replicas up to target over
    # 2 epochs, shifted by one batch so that the ramp ends on its last batch.
    initial = target / 2
    expected = [
        (e, b, initial + (target - initial) * min(1.0, (e + (b + 1) / STEPS) / 2))
        for e in range(3)
        for b in range(STEPS)
    ]
    assert [r[:2] for r in recorder.rates] == [r[:2] for r in expected]
    np.testing.assert_allclose([r[2] for r in recorder.rates], [r[2] for r in expected], rtol=1e-6)
    assert recorder.rates[0][2] == pytest.approx(0.01 + 0.01 / 16, rel=1e-6)
    assert recorder.rates[2 * STEPS - 1][2] == pytest.approx(target, rel=1e-6)
    np.testing.assert_allclose(
        history.history["learning_rate"], [expected[STEPS - 1][2], target, target], rtol=1e-6
    )


def test_warmup_with_explicit_rates_and_bad_arguments(tf_cpus, strategy, callbacks_mod):
    model, recorder = new_model(strategy), make_recorder()
    warmup = callbacks_mod.LearningRateWarmup(
        warmup_epochs=0.5, initial_lr=0.0, target_lr=0.04, steps_per_epoch=STEPS
    )
    fit(tf_cpus, model, epochs=1, callbacks=[warmup, recorder])
    expected = [0.04 * min(1.0, (b + 1) / STEPS / 0.5) for b in range(STEPS)]
    np.testing.assert_allclose([r[2] for r in recorder.rates], expected, rtol=1e-6)

    cls = callbacks_mod.LearningRateWarmup
    for field, kwargs in [
        ("warmup_epochs", {"warmup_epochs": 0}),
        ("warmup_epochs", {"warmup_epochs": "5"}),
        ("initial_lr", {"initial_lr": -1.0}),
        ("target_lr", {"target_lr": 0}),
        ("steps_per_epoch", {"steps_per_epoch": 0}),
        ("steps_per_epoch", {"steps_per_epoch": 2.0}),
    ]:
        with pytest.raises(ConfigError) as error:
            cls(**kwargs)
        assert f"field '{field}'" in str(error.value)
        assert f"Received: {next(iter(kwargs.values()))!r}" in str(error.value)

    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
    scheduled = new_model(strategy, optimizer=lambda: keras.optimizers.Adam(schedule))
    with pytest.raises(ConfigError, match="field 'optimizer.learning_rate'"):
        fit(tf_cpus, scheduled, epochs=1, callbacks=[cls(warmup_epochs=1)])


# --------------------------------------------------------------------------
# Two workers (slow): one writer, same resume point, no scratch left.


def _run_workers(spec, tmp_path, check=True, per_worker_env=None, **env):
    procs = []
    for i, (task_type, index, config) in enumerate(spec_lib.all_task_configs(spec)):
        scratch = tmp_path / f"tmp-{task_type}{index}"
        scratch.mkdir(exist_ok=True)
        extra = dict(env, **(per_worker_env[i] if per_worker_env else {}))
        procs.append(
            start(["tests/workers/backup_fit.py"], tf_config=config, TMPDIR=str(scratch), **extra)
        )
    results = finish(procs, timeout=300)
    if not check:
        return results
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    return [result_line(out) for _, out, _ in results]


def _tfdist_scratch(tmp_path):
    return sorted(str(p) for p in tmp_path.glob("tmp-*/tfdist-*"))


@pytest.mark.slow
def test_two_workers_back_up_from_the_chief_and_resume_together(tf_cpus, strategy, tmp_path):
    shared = {
        "TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"),
        "TFDIST_TEST_CKPT_PATH": str(tmp_path / "ckpt" / "model-{epoch:02d}.keras"),
        "TFDIST_TEST_TB_DIR": str(tmp_path / "tb"),
    }
    spec = local_spec(2)
    chief, other = _run_workers(spec, tmp_path, TFDIST_TEST_INTERRUPT="2", **shared)
    assert chief["chief"] and not other["chief"]
    assert chief["interrupted"] and other["interrupted"]
    assert chief["epochs_run"] == other["epochs_run"] == [0, 1, 2]
    # On disk: the chief's pointer naming the chief's backup, nothing else.
    pointer = json.loads((tmp_path / "backup" / "checkpoint.json").read_text())
    assert (pointer["writer"], pointer["pid"]) == ("worker:0", chief["pid"])
    assert (pointer["epoch"], pointer["step"]) == (2, 0)
    assert files_in(tmp_path / "backup") == ["checkpoint.json", pointer["file"]]
    assert _tfdist_scratch(tmp_path) == []  # Removed at exit after the failure.
    # The other worker ran the same saves (they may be collectives) into
    # scratch directories.
    assert (chief["saves_written"], chief["saves_discarded"]) == (2, 0)
    assert (other["saves_written"], other["saves_discarded"]) == (0, 2)
    assert len(other["backup_scratch"]) == 2 and chief["backup_scratch"] == []

    chief2, other2 = _run_workers(spec, tmp_path, **shared)
    for result in (chief2, other2):
        assert result["interrupted"] is None
        assert result["resumed_from"]["file"] == pointer["file"]
        assert result["epochs_run"] == [2, 3]
    assert chief2["weights"] == other2["weights"]
    assert not (tmp_path / "backup").exists()
    assert _tfdist_scratch(tmp_path) == []
    # ModelCheckpoint: the chief wrote all four epochs to the real path.
    assert files_in(tmp_path / "ckpt") == [f"model-{e:02d}.keras" for e in range(1, 5)]
    # TensorBoard event files carry the writer's pid: only the chiefs' are there.
    pids = {
        int(re.search(r"\.(\d+)\.\d+\.v2$", p.name).group(1))
        for p in (tmp_path / "tb").rglob("events.out.tfevents.*")
    }
    assert pids == {chief["pid"], chief2["pid"]}
    assert (chief2["saves_written"], other2["saves_written"]) == (2, 0)
    assert other2["saves_discarded"] == 2
    assert other2["ckpt_scratch"] and other2["tb_scratch"]
    assert chief2["scratch_left"] == other2["scratch_left"] == []

    # The resumed job trained like an uninterrupted one: the same losses as
    # 2 replicas in one process (as in test_multi_worker), epochs 3 and 4.
    model = new_model(strategy)
    x, y = _common.make_data(1024, 3)
    import tensorflow as tf

    history = model.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=4, verbose=0, shuffle=False
    )
    np.testing.assert_allclose(chief2["loss"], history.history["loss"][2:], rtol=1e-3)
    np.testing.assert_allclose(chief2["weights"], weights(model), atol=1e-3)


@pytest.mark.slow
def test_a_kill_at_any_moment_leaves_a_loadable_backup(tf_cpus, callbacks_mod, tmp_path):
    # One process backing up after every batch: most of its time goes into
    # saves, so a SIGKILL at a random instant often lands in one.
    import hashlib
    import time

    backup_dir = tmp_path / "backup"
    rng = np.random.default_rng(1)
    leftovers = []
    for _kill in range(3):
        proc = start(
            ["tests/workers/backup_fit.py"],
            TFDIST_TEST_BACKUP_DIR=str(backup_dir),
            TFDIST_TEST_SAVE_FREQ="1",
            TFDIST_TEST_EPOCHS="1000",
        )
        try:
            deadline = time.monotonic() + 120
            before = (callbacks_mod.read_backup_pointer(backup_dir) or {}).get("save_count", 0)
            while (callbacks_mod.read_backup_pointer(backup_dir) or {}).get(
                "save_count", 0
            ) < before + 5:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 0.3))
        finally:
            proc.kill()
            proc.communicate()
        pointer = callbacks_mod.read_backup_pointer(backup_dir)
        path = backup_dir / pointer["file"]
        assert path.stat().st_size == pointer["size"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == pointer["sha256"]
        model = _common.build_model(LR, seed=3)
        model.build((None, 16))
        model.optimizer.build(model.trainable_variables)
        model.load_weights(str(path))  # Loads: weights and optimizer state.
        steps_per_epoch = 1024 // (32 * pointer["replicas"])  # as the worker fits
        assert int(model.optimizer.iterations.numpy()) == (
            pointer["epoch"] * steps_per_epoch + pointer["step"]
        )
        leftovers.append(sorted(set(os.listdir(backup_dir)) - {"checkpoint.json", pointer["file"]}))
    print("left by the kills besides the pointed-to backup:", leftovers)


@pytest.mark.slow
def test_two_workers_with_compression_state_agree_before_loading(tmp_path):
    # Error-feedback residuals are on-read variables: saving them reads across
    # workers, and loading them broadcasts. So every worker saves and loads,
    # and they first agree on what they found.
    spec = local_spec(2)
    shared = {
        "TFDIST_TEST_BACKUP_DIR": str(tmp_path / "backup"),
        "TFDIST_TEST_EPOCHS": "3",
        "TFDIST_TEST_COMPRESSION": "topk:0.1",
    }
    first = _run_workers(spec, tmp_path, TFDIST_TEST_INTERRUPT="1", **shared)
    assert [r["saves_written"] for r in first] == [1, 0]
    assert [r["saves_discarded"] for r in first] == [0, 1]

    # A backup_dir that is not shared: worker 1 finds nothing. Both stop at
    # once with the same error, rather than one loading (a broadcast the other
    # never joins) or training from another state.
    results = _run_workers(
        spec,
        tmp_path,
        check=False,
        per_worker_env=[{}, {"TFDIST_TEST_BACKUP_DIR": str(tmp_path / "elsewhere")}],
        **shared,
    )
    for (code, _, err), mine in zip(results, ["read epoch=1 step=0", "found no backup"]):
        assert code != 0
        assert "BackupError: The workers did not find the same backup" in err
        assert mine in err

    chief, other = _run_workers(spec, tmp_path, **shared)
    assert chief["epochs_run"] == other["epochs_run"] == [1, 2]
    assert chief["resumed_from"]["file"] == other["resumed_from"]["file"]
    assert chief["weights"] == other["weights"]
