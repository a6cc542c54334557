"""The weights file written by stage: each stage's part, joined, is the file
Keras writes for the whole model, and reading by stage reads only a stage's
layers. In one process: the stages' plans over one model (the multi-process
save and load are in test_pipeline_processes.py)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from tests.pipeline.weights_files import h5_contents
from tfdist.compat.keras_src import saving_lib
from tfdist.pipeline import split_model
from tfdist.pipeline.saving import join_parts, local_copy, part_file, plan_for

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def _mlp():
    import keras

    keras.utils.set_random_seed(3)
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="d0")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dense(8, activation="relu", name="d1")(h)
    skip = keras.layers.Dense(8, name="skip")(inp)
    h = keras.layers.Add(name="add")([h, skip])
    out = keras.layers.Dense(3, name="head")(keras.layers.Dense(8, name="d2")(h))
    return keras.Model(inp, out)


def _contents(path) -> dict:
    """h5_contents with each value as its bytes, to compare with ==."""
    with local_copy(str(path)) as local:
        return {
            name: (*item[:3], item[3].tobytes()) if isinstance(item, tuple) else item
            for name, item in h5_contents(local).items()
        }


_RAM = itertools.count()


@pytest.fixture(params=["local", "url"])
def where(request, tmp_path):
    """A directory to save in: local, or a URL (TensorFlow's in-memory
    ``ram://`` file system, through tf.io.gfile, as ``gs://`` would be)."""
    if request.param == "local":
        return str(tmp_path)
    return f"ram://tfdist-saving-{os.getpid()}-{next(_RAM)}"


def _names(directory: str) -> list[str]:
    """The files in ``directory``, local or at a URL."""
    import tensorflow as tf

    return sorted(os.path.basename(p) for p in tf.io.gfile.glob(directory + "/*"))


@pytest.mark.parametrize("splits", [["d1"], ["d1", "d2"], ["bn", "add", "head"]])
def test_the_joined_parts_are_keras_s_own_file(tmp_path, where, splits):
    model = _mlp()
    stages = split_model(model, splits)
    reads = [s.variables for s in stages]
    target = f"{where}/model.weights.h5"
    for k in range(len(stages)):
        plan = plan_for(model, reads, k)
        assert not plan.taken and all(not v for v in plan.sent.values())
        saving_lib.save_weights_only(model, part_file(target, k), objects_to_skip=plan.skip_save)
        # A part holds this stage's weights and no other's.
        datasets = [n for n, v in _contents(part_file(target, k)).items() if isinstance(v, tuple)]
        assert len(datasets) == len(reads[k])
    join_parts([part_file(target, k) for k in range(len(stages))], target)
    model.save_weights(f"{where}/keras.weights.h5")
    assert _contents(target) == _contents(f"{where}/keras.weights.h5")
    assert _names(where) == ["keras.weights.h5", "model.weights.h5"]


def test_a_stage_reads_only_its_layers(tmp_path):
    model = _mlp()
    model.save_weights(tmp_path / "m.weights.h5")
    trained = [v.numpy() for v in model.weights]
    stages = split_model(model, ["d1"])
    reads = [s.variables for s in stages]
    plan = plan_for(model, reads, 1)
    for v in model.weights:
        v.assign(np.zeros(v.shape, v.dtype))
    model.load_weights(tmp_path / "m.weights.h5", objects_to_skip=plan.skip_load)
    mine = {id(v) for v in reads[1]}
    for v, value in zip(model.weights, trained):
        expected = value if id(v) in mine else np.zeros_like(value)
        np.testing.assert_array_equal(v.numpy(), expected, err_msg=v.path)
    assert {id(v) for v in plan.load} == mine


def test_a_layer_two_stages_train_is_written_by_the_first_with_the_other_s_weight():
    # keras-hub's untied ReversibleEmbedding: the embeddings are stage 0's,
    # the output projection (reverse_embeddings) the last stage's.
    import keras
    from keras_hub.layers import ReversibleEmbedding

    keras.utils.set_random_seed(0)
    tokens = keras.Input((4,), dtype="int32", name="tokens")
    embedding = ReversibleEmbedding(11, 6, tie_weights=False, name="embed")
    h = keras.layers.Dense(6, name="mid")(embedding(tokens))
    h = keras.layers.Dense(6, name="late")(h)
    model = keras.Model(tokens, embedding(h, reverse=True))
    stages = split_model(model, ["mid", "late"])
    reads = [s.variables for s in stages]
    reverse = embedding.reverse_embeddings
    assert [id(reverse) in {id(v) for v in r} for r in reads] == [False, False, True]
    plans = [plan_for(model, reads, k) for k in range(3)]
    # Stage 2 sends it, stage 1 passes it on, stage 0 takes it and writes
    # the layer; the others leave the layer out of their parts.
    assert [[v.path for v in p.taken] for p in plans] == [[reverse.path], [], []]
    assert plans[0].sent == plans[2].sent == {1: [reverse], 2: [reverse]}
    assert embedding not in plans[0].skip_save
    assert embedding in plans[1].skip_save and embedding in plans[2].skip_save
    # Reading, both stages that compute with it read it.
    assert embedding not in plans[0].skip_load and embedding not in plans[2].skip_load
    assert embedding in plans[1].skip_load


def _first_of_two_parts(where: str) -> str:
    """The target ``m.weights.h5`` in ``where`` of an MLP in 2 stages, with
    stage 0's part written and stage 1's not."""
    model = _mlp()
    stages = split_model(model, ["d1"])
    target = f"{where}/m.weights.h5"
    plan = plan_for(model, [s.variables for s in stages], 0)
    saving_lib.save_weights_only(model, part_file(target, 0), objects_to_skip=plan.skip_save)
    return target


def test_a_missing_part_leaves_no_file(where):
    target = _first_of_two_parts(where)
    with pytest.raises(FileNotFoundError) as error:
        join_parts([part_file(target, 0), part_file(target, 1)], target)
    assert f"missing {where}/m.part1.weights.h5 (process 1)" in str(error.value)
    assert "every process must reach the path" in str(error.value)
    assert _names(where) == ["m.part0.weights.h5"]  # No target, no partial file.


def test_a_part_that_cannot_be_read_leaves_no_file_and_keeps_the_parts(where):
    import tensorflow as tf

    target = _first_of_two_parts(where)
    with tf.io.gfile.GFile(part_file(target, 1), "wb") as f:
        f.write(b"not an HDF5 file")  # A part cut short, say.
    with pytest.raises(OSError):
        join_parts([part_file(target, 0), part_file(target, 1)], target)
    # Failing midway, the join leaves no target and no partial file behind,
    # and keeps the parts.
    assert _names(where) == ["m.part0.weights.h5", "m.part1.weights.h5"]


def test_states_round_trip_and_a_state_that_does_not_fit_changes_nothing(where):
    import tensorflow as tf

    from tfdist.errors import ConfigError
    from tfdist.pipeline.saving import read_state, write_state

    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype("float32") for s in [(3, 4), (4,), ()]]
    values.append(np.array(7, "int64"))
    saved = [tf.Variable(v) for v in values]
    path = f"{where}/sub/m.weights.h5.stage1.npz"
    write_state(path, saved)
    assert _names(f"{where}/sub") == ["m.weights.h5.stage1.npz"]
    fresh = [tf.Variable(np.zeros_like(v)) for v in values]
    read_state(path, fresh, "optimizer state", "test")
    for got, want in zip(fresh, values):
        np.testing.assert_array_equal(got.numpy(), want)
    other = [tf.Variable(np.zeros((3, 4), "float32")), tf.Variable(np.zeros((5,), "float32"))]
    with pytest.raises(
        ConfigError, match=r"filepath.*2 variables of optimizer state.*stage1\.npz: 4 variables"
    ) as error:
        read_state(path, other, "optimizer state", "test")
    assert "4 variables shaped [(3, 4), (4,), (), ()]" in str(error.value)
    assert "[(3, 4), (5,)]" in str(error.value)  # What this process has.
    assert all(not v.numpy().any() for v in other)
    read_state(f"{where}/absent.npz", other, "optimizer state", "test")  # None saved.
    assert all(not v.numpy().any() for v in other)
