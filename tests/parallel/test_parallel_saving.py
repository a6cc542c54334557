"""Full weights outside a tensor-parallel model (tfdist.parallel.saving).

One MLP (ColumnParallelDense + RowParallelDense) is trained a few Adam steps
with ``fit`` at T=2 on 2 logical CPUs, next to the unsharded Keras model
with the same initial weights; it is saved with ``model.save`` and
``tf.train.Checkpoint`` and loaded with no strategy, at T=1 and at T=4.
A loaded model must predict what the T=2 model predicts, and its optimizer
state must carry on: one more epoch after loading matches one more epoch of
the T=2 model.
"""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

EPOCH = dict(batch_size=16, epochs=1, shuffle=False, verbose=0)


def _build(keras, col, row):
    # Named: the files' paths follow the names, which Keras numbers per process.
    model = keras.Sequential(
        [
            keras.Input((8,)),
            col(16, activation="relu", name="column_parallel_dense"),
            row(4, name="row_parallel_dense"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=keras.losses.MeanSquaredError())
    return model


def _strategy(tfdist, replicas, tp):
    strategy = tfdist.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    tfdist.parallel.attach(strategy, tp)
    return strategy


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def env(tf_cpus):
    import keras

    import tfdist
    from tfdist import parallel as tp

    return tf_cpus, keras, tfdist, tp


@pytest.fixture(scope="module")
def trained(env, tmp_path_factory):
    """The T=2 model after one epoch (4 Adam steps), saved both ways, then
    continued one epoch; and the unsharded reference after the same epoch."""
    tf, keras, tfdist, tp = env
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    ref = _build(keras, keras.layers.Dense, keras.layers.Dense)
    initial = ref.get_weights()
    ref.fit(x, y, **EPOCH)

    s2 = _strategy(tfdist, 2, 2)
    with s2.scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    for v, w in zip(model.weights, initial):
        tp.assign_full(v, w)
    model.fit(x, y, **EPOCH)

    out = tmp_path_factory.mktemp("parallel_saving")
    kernel = model.layers[0].kernel
    run = {
        "x": x,
        "y": y,
        "s2": s2,
        "model": model,
        "ref": ref,
        "dir": out,
        "components": [c.numpy() for c in s2.experimental_local_results(kernel.value)],
        "keras_read": kernel.numpy(),
        "kernel_full": tp.full_value(kernel),
        "weights": model.get_weights(),
        "slots": [tp.full_value(v) for v in model.optimizer.variables],
        "predict": model.predict(x, verbose=0),
        "keras_file": str(out / "t2.keras"),
        "ckpt": tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
            str(out / "ckpt" / "t2")
        ),
    }
    model.save(run["keras_file"])
    run["h5_file"] = str(out / "t2.h5")
    model.save(run["h5_file"])  # Keras's legacy HDF5 format.
    model.fit(x, y, **EPOCH)
    run["continued"] = model.get_weights()
    return run


@pytest.fixture(scope="module")
def strategies(env):
    _, _, tfdist, _ = env
    return {"t1": _strategy(tfdist, 2, 1), "t4": _strategy(tfdist, 4, 4)}


def _saved_shapes(keras_file: str, tmp_path) -> dict[str, tuple]:
    import h5py

    with zipfile.ZipFile(keras_file) as archive:
        archive.extract("model.weights.h5", tmp_path)
    shapes = {}
    with h5py.File(tmp_path / "model.weights.h5") as f:
        f.visititems(
            lambda name, obj: shapes.__setitem__(name, obj.shape) if hasattr(obj, "shape") else None
        )
    return shapes


def test_the_trap_shards_differ_and_files_hold_full_values(env, trained, tmp_path):
    tf, _, _, tp = env
    first, second = trained["components"]
    # Each replica holds a different shard of the (8, 16) kernel.
    assert first.shape == second.shape == (8, 8)
    assert np.abs(first - second).max() > 1e-3
    # Keras's own read of the variable is component 0 alone: a shard.
    np.testing.assert_array_equal(trained["keras_read"], first)
    np.testing.assert_array_equal(trained["kernel_full"], np.concatenate([first, second], 1))

    shapes = _saved_shapes(trained["keras_file"], tmp_path)
    assert shapes["layers/column_parallel_dense/vars/0"] == (8, 16)
    assert shapes["layers/column_parallel_dense/vars/1"] == (16,)
    assert shapes["layers/row_parallel_dense/vars/0"] == (16, 4)
    # Adam's moments of the column kernel (optimizer vars 2, 3) are whole too.
    assert shapes["optimizer/vars/2"] == shapes["optimizer/vars/3"] == (8, 16)

    saved = dict(tf.train.list_variables(trained["ckpt"]))
    full = sorted(
        tuple(v.shape) if tp.spec_of(v) is None else tp.spec_of(v).full_shape
        for v in trained["model"].optimizer.variables
    )
    in_ckpt = sorted(tuple(saved[k]) for k in saved if "optimizer/_variables/" in k)
    assert in_ckpt == [s for s in full if s != ()]
    reader = tf.train.load_checkpoint(trained["ckpt"])
    kernel = reader.get_tensor("optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE")
    np.testing.assert_array_equal(kernel, trained["kernel_full"])


def test_get_weights_match_the_unsharded_reference(trained):
    assert [w.shape for w in trained["weights"]] == [(8, 16), (16,), (16, 4), (4,)]
    assert _max_diff(trained["weights"], trained["ref"].get_weights()) < 1e-5


def test_set_weights_takes_full_shapes(env, trained):
    _, keras, _, tp = env
    s2, ref = trained["s2"], trained["ref"]
    with s2.scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    weights = ref.get_weights()
    model.set_weights(weights)
    assert _max_diff(model.get_weights(), weights) == 0.0
    kernel = model.layers[0].kernel
    spec = tp.spec_of(kernel)
    for t, component in enumerate(s2.experimental_local_results(kernel.value)):
        np.testing.assert_array_equal(component.numpy(), tp.sharding.shard_of(weights[0], spec, t))
    # A layer's own set_weights too; a shard-shaped value is refused.
    model.layers[0].set_weights([weights[0] * 2, weights[1]])
    np.testing.assert_array_equal(tp.full_value(kernel), weights[0] * 2)
    with pytest.raises(ValueError, match=r"\(8, 16\) \(the full shape"):
        model.layers[0].set_weights([weights[0][:, :8], weights[1]])
    # The optimizer's too: Adam's moments are sharded like their weights.
    with s2.scope():
        model.optimizer.build(model.trainable_variables)
    model.optimizer.set_weights(trained["slots"])
    assert _max_diff(tp.saving.full_weights(model.optimizer.variables), trained["slots"]) == 0


@pytest.mark.parametrize("where", ["none", "t1", "t4"])
def test_load_model_predicts_and_resumes(env, trained, strategies, where):
    tf, keras, _, tp = env
    if where == "none":
        model = keras.models.load_model(trained["keras_file"])
    else:
        with strategies[where].scope():
            model = keras.models.load_model(trained["keras_file"])
    kernel = model.layers[0].kernel
    if where == "t4":
        assert tuple(kernel.shape) == (8, 4) and tp.spec_of(kernel).full_shape == (8, 16)
    else:
        assert tuple(kernel.shape) == (8, 16) and tp.spec_of(kernel) is None
    assert _max_diff(model.get_weights(), trained["weights"]) < 1e-7
    assert _max_diff(tp.saving.full_weights(model.optimizer.variables), trained["slots"]) < 1e-7
    np.testing.assert_allclose(
        model.predict(trained["x"], verbose=0), trained["predict"], atol=1e-6
    )
    model.fit(trained["x"], trained["y"], **EPOCH)
    assert _max_diff(model.get_weights(), trained["continued"]) < 1e-5


@pytest.mark.parametrize("where", ["none", "t4"])
def test_legacy_h5_holds_full_values(env, trained, strategies, where):
    import h5py

    _, keras, _, tp = env
    with h5py.File(trained["h5_file"]) as f:
        names = [
            n.decode() if isinstance(n, bytes) else n
            for n in f["model_weights/column_parallel_dense"].attrs["weight_names"]
        ]
        kernel = f["model_weights/column_parallel_dense"][names[0]][()]
        group = f["optimizer_weights"]
        slots = [group[n][()] for n in group.attrs["weight_names"]]
    np.testing.assert_array_equal(kernel, trained["weights"][0])
    assert _max_diff(slots, trained["slots"]) == 0.0
    if where == "none":
        model = keras.models.load_model(trained["h5_file"])
    else:
        with strategies[where].scope():
            model = keras.models.load_model(trained["h5_file"])
        assert tuple(model.layers[0].kernel.shape) == (8, 4)
    # (Keras's legacy loader builds a Sequential's optimizer without the
    # layers' variables, so its slots are not restored, sharded or not.)
    assert _max_diff(model.get_weights(), trained["weights"]) < 1e-7
    np.testing.assert_allclose(
        model.predict(trained["x"], verbose=0), trained["predict"], atol=1e-6
    )


@pytest.mark.parametrize("where", ["t1", "t4"])
def test_checkpoint_round_trip(env, trained, strategies, where):
    tf, keras, _, tp = env
    strategy = strategies[where]
    with strategy.scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    if where == "t1":  # Slots exist before the restore: restored at once.
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
    # At T=4 the optimizer builds after the restore (a deferred restore of
    # its slots, which are sharded only once created).
    status = tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(trained["ckpt"])
    if where == "t4":
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
        assert tuple(model.optimizer.variables[2].shape) == (8, 4)
        assert tp.spec_of(model.optimizer.variables[2]).full_shape == (8, 16)
    else:  # Whole at T=1.
        assert tuple(model.optimizer.variables[2].shape) == (8, 16)
        assert tp.spec_of(model.layers[0].kernel) is None
    status.assert_consumed()
    assert _max_diff(model.get_weights(), trained["weights"]) < 1e-7
    assert _max_diff(tp.saving.full_weights(model.optimizer.variables), trained["slots"]) < 1e-7
    np.testing.assert_allclose(
        model.predict(trained["x"], verbose=0), trained["predict"], atol=1e-6
    )
    model.fit(trained["x"], trained["y"], **EPOCH)
    assert _max_diff(model.get_weights(), trained["continued"]) < 1e-5


def test_unsharded_weights_load_into_shards(env, trained):
    _, keras, _, tp = env
    # The same model code outside any strategy: unsharded weights.
    plain = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    plain.set_weights(trained["ref"].get_weights())
    assert tp.spec_of(plain.layers[0].kernel) is None
    path = str(trained["dir"] / "unsharded.weights.h5")
    plain.save_weights(path)
    with trained["s2"].scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    model.load_weights(path)
    assert tuple(model.layers[0].kernel.shape) == (8, 8)
    assert _max_diff(model.get_weights(), trained["ref"].get_weights()) == 0.0
    np.testing.assert_allclose(
        model.predict(trained["x"], verbose=0),
        trained["ref"].predict(trained["x"], verbose=0),
        atol=1e-6,
    )


def test_a_shard_shaped_saved_value_is_refused(env, trained):
    _, keras, _, tp = env
    with trained["s2"].scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    store = {"0": np.zeros((8, 8), "float32"), "1": np.zeros((16,), "float32")}
    with pytest.raises(ValueError, match=r"expected the full shape \(8, 16\)"):
        model.layers[0].load_own_variables(store)
    # The variable is back to its per-replica assign afterwards.
    assert "assign" not in vars(model.layers[0].kernel)


def test_wrappers_compose_with_compression_once(env):
    from tfdist import compat
    from tfdist.compat.keras_src import BaseOptimizer
    from tfdist.compression import keras_hook
    from tfdist.parallel import saving

    saving.install()  # Installs compression's first: the registry orders them anyway.
    before = (BaseOptimizer.save_own_variables, BaseOptimizer.load_own_variables)
    keras_hook.install()
    saving.install()
    assert (BaseOptimizer.save_own_variables, BaseOptimizer.load_own_variables) == before
    for method, name in zip(before, ("save_own_variables", "load_own_variables")):
        # Ours outside, compression's inside (its state keys stay its own),
        # each once, around Keras's own method.
        kind = name.split("_")[0]
        assert method.__tfdist_patches__ == (
            f"compression.{kind}",
            f"tensor_parallel.{kind}_optimizer",
        )
        assert method.__wrapped__.__wrapped__ is compat.pristine(BaseOptimizer, name)
        assert method.__wrapped__.__code__.co_filename.endswith("compression/keras_hook.py")
        assert method.__code__.co_filename.endswith("parallel/saving.py")


def test_compression_state_saves_with_the_shards(env, trained):
    """DP=2 x T=2 with top-k compression: the state (a residual per shard,
    per replica) resumes exactly in the same layout; another layout loads
    the weights and slots, and starts the state from zeros with a warning."""
    _, keras, tfdist, tp = env
    x, y = trained["x"], trained["y"]
    strategy = tfdist.strategy_from_config(cpu_replicas=4, compression="topk:0.2")
    tp.attach(strategy, 2)
    with strategy.scope():
        model = _build(keras, tp.ColumnParallelDense, tp.RowParallelDense)
    model.fit(x, y, **EPOCH)
    assert tfdist.compression.keras_hook.state_variables(model.optimizer)
    path = str(trained["dir"] / "compressed.keras")
    model.save(path)
    slots = tp.saving.full_weights(model.optimizer.variables)
    with strategy.scope():
        same = keras.models.load_model(path)
    model.fit(x, y, **EPOCH)
    same.fit(x, y, **EPOCH)
    assert _max_diff(same.get_weights(), model.get_weights()) < 1e-6

    other = tfdist.strategy_from_config(cpu_replicas=4, compression="topk:0.2")
    tp.attach(other, 4)
    with other.scope(), pytest.warns(UserWarning, match="shapes differ"):
        moved = keras.models.load_model(path)
    assert tuple(moved.layers[0].kernel.shape) == (8, 4)
    assert _max_diff(tp.saving.full_weights(moved.optimizer.variables), slots) < 1e-7


def test_every_worker_agrees_whether_a_full_value_is_local(env):
    """Reading a full value locally on some workers while others join the
    gather would hang them: the rule must give one answer per job, for a
    split over the tensor group and for one over both mesh axes."""
    import types

    from tfdist.parallel.mesh import Mesh
    from tfdist.parallel.sharding import DATA, TENSOR, ShardSpec

    for workers in (1, 2, 3, 4):
        for local in (1, 2, 3, 4, 8):
            n = workers * local
            for tp in (t for t in range(1, n + 1) if n % t == 0):
                runtime = types.SimpleNamespace(mesh=Mesh(n, tp))
                for splits in (((0, TENSOR),), ((0, TENSOR), (1, DATA)), ((1, DATA),)):
                    spec = ShardSpec((n * 4, n * 4), runtime, None, splits)
                    covered = [
                        spec.local_cover(w * local, local) is not None for w in range(workers)
                    ]
                    # One answer for the job: local only where every worker can.
                    assert spec.every_process_covers(local) == all(covered)
                    if tp > 1 and splits == ((0, TENSOR),) and local % tp == 0:
                        assert all(covered)  # Whole tensor groups are local.
    # Where workers differ (worker 1 of 3 holds both data blocks, 0 and 2 one
    # each), the job gathers: reading locally on worker 1 alone would hang.
    spec = ShardSpec((24, 24), types.SimpleNamespace(mesh=Mesh(6, 3)), None, ((1, DATA),))
    assert [spec.local_cover(w * 2, 2) is not None for w in range(3)] == [False, True, False]
    assert not spec.every_process_covers(2)


@pytest.mark.slow
def test_two_workers_save_and_load_full_values(tf_cpus, tmp_path):
    """MultiWorkerMirrored, one replica per worker, T=2: every full value is
    a gather both workers join, in model.save, get_weights and the
    checkpoint alike."""
    from conftest import finish, result_line, start
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs = [
        start(
            ["tests/workers/parallel_saving_mw.py"], tf_config=config, TFDIST_TEST_DIR=str(tmp_path)
        )
        for _, _, config in spec_lib.all_task_configs(local_spec(2))
    ]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = sorted((result_line(out) for _, out, _ in results), key=lambda r: r["index"])
    for run in (chief, other):
        assert run["local_shard"] == [8, 8]
        assert run["full"] == [[8, 16], [16], [16, 4], [4]]
        assert run["saved_kernel"] == [8, 16] and run["saved_vs_full"] == 0.0
        assert run["again_shard"] == [8, 8]
        for key in ("plain", "plain_slots", "again", "again_slots", "restored", "restored_slots"):
            assert run[key] < 1e-7, (key, run)
    assert chief["weights_checksum"] == other["weights_checksum"]
