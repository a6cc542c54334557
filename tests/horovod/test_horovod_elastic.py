"""tfdist.horovod.elastic: Horovod's elastic API on tfdist's restart-and-resume.

Single-process tests (size() == 1) check commits (in memory, on disk,
atomic under SIGKILL), the resume on entering ``elastic.run``, the Keras
callbacks and the errors. The slow test runs a 2-worker job under
``tfdist launch --max-restarts 2`` whose workers fail twice
(tests/workers/hvd_elastic.py) and checks that it ends where an
uninterrupted run does.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, subprocess_env
from tfdist.errors import ConfigError
from tfdist.horovod import commits

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from tfdist.horovod import elastic  # noqa: E402

X = np.random.default_rng(3).normal(size=(16, 3)).astype("float32")
Y = X @ np.array([[1.0], [-2.0], [0.5]], "float32")


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    """hvd.init() with no launcher variables: one rank."""
    import tfdist.horovod as hvd

    hvd.init()
    assert hvd.size() == 1 and hvd.rank() == 0


@pytest.fixture(autouse=True)
def no_commit_dir(monkeypatch):
    monkeypatch.delenv("TFDIST_ELASTIC_DIR", raising=False)
    monkeypatch.delenv("TFDIST_JOB_DIR", raising=False)


def compiled(seed, inputs=3):
    model = keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed)),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_commit_dir_precedence(tmp_path):
    assert commits.commit_dir({}) is None
    assert commits.commit_dir({"TFDIST_JOB_DIR": "/j"}) == Path("/j/elastic")
    assert commits.commit_dir({"TFDIST_JOB_DIR": "/j", "TFDIST_ELASTIC_DIR": "/e"}) == Path("/e")


def test_restore_undoes_what_came_after_the_commit():
    model = compiled(1)
    state = elastic.KerasState(model, epoch=0, history=[])
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    state.epoch, state.history = 1, ["epoch 0"]
    state.commit()
    committed = values(model.variables), values(model.optimizer.variables)
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    state.epoch = 2
    state.history.append("epoch 1")  # In place: the commit kept a copy.
    assert values(model.optimizer.variables)[0] != committed[1][0]  # Iterations moved.
    state.restore()
    assert_same(values(model.variables), committed[0])
    assert_same(values(model.optimizer.variables), committed[1])
    assert (state.epoch, state.history) == (1, ["epoch 0"])


def test_commits_go_to_disk_atomically_and_a_restart_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TFDIST_ELASTIC_DIR", str(tmp_path))
    model = compiled(1)
    state = elastic.KerasState(model, batch=0)
    for batch in range(2):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
        state.batch = batch + 1
        state.commit()
    path = tmp_path / f"{state._name}.commit"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # No temp file left.
    payload = pickle.loads(path.read_bytes())
    assert payload["commit"] == 2 and payload["attrs"] == {"batch": 2}
    committed = values(model.variables), values(model.optimizer.variables)

    # "Restart": a new model (other weights), the same state name, and a temp
    # file as a crash mid-write would leave (never read).
    (tmp_path / f".{state._name}.999.tmp").write_bytes(b"half a commit")
    model2 = compiled(2)
    state2 = elastic.KerasState(model2, batch=0)
    state2._name = state._name
    state2.commit()  # Before elastic.run: in memory only, the file stays.
    assert pickle.loads(path.read_bytes())["commit"] == 2
    resets = []
    state2.register_reset_callbacks([lambda: resets.append(state2.batch)])

    @elastic.run
    def train(s, extra):
        return s.batch, extra, values(model2.variables), values(model2.optimizer.variables)

    batch, extra, weights, slots = train(state2, "x")
    assert (batch, extra, resets) == (2, "x", [2])
    assert_same(weights, committed[0])
    assert_same(slots, committed[1])
    assert "resumed from commit 2" in capsys.readouterr().out
    # Entering again in the same process syncs only: no second restore.
    state2.batch = 5
    state2.commit()
    model2.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    moved = values(model2.variables)
    assert train(state2, "y")[0] == 5 and resets == [2]
    assert_same(values(model2.variables), moved)


def test_without_a_directory_commits_stay_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = elastic.ObjectState(epoch=3)
    state.commit()
    assert list(tmp_path.iterdir()) == []
    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])
    assert elastic.run(lambda s: s.epoch)(state) == 3 and resets == []


def test_a_commit_of_another_model_or_a_foreign_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_ELASTIC_DIR", str(tmp_path))
    state = elastic.KerasState(compiled(1), epoch=0)
    state.commit()
    other = elastic.KerasState(compiled(1, inputs=4), epoch=0)
    other._name = state._name
    with pytest.raises(ConfigError, match="field 'commit'") as info:
        elastic.run(lambda s: None)(other)
    assert "(3, 1)" in str(info.value) and "(4, 1)" in str(info.value)

    (tmp_path / f"{state._name}.commit").write_bytes(pickle.dumps({"model": []}))
    again = elastic.KerasState(compiled(1), epoch=0)
    again._name = state._name
    with pytest.raises(ConfigError, match="TFDIST_ELASTIC_DIR.*format"):
        elastic.run(lambda s: None)(again)


def test_keras_callbacks_track_epochs_batches_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_ELASTIC_DIR", str(tmp_path))
    model = compiled(1)
    state = elastic.KerasState(model, epoch=1, batch=0)
    batches = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(state.batch)

    callbacks = [
        elastic.UpdateEpochStateCallback(state),
        elastic.UpdateBatchStateCallback(state),
        elastic.CommitStateCallback(state, batches_per_commit=3),
        Seen(),
    ]
    model.fit(X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    payload = pickle.loads((tmp_path / f"{state._name}.commit").read_bytes())
    # 8 batches: commits after batches 3 and 6 and at both epoch ends.
    assert payload["commit"] == 4
    assert payload["attrs"] == {"epoch": 3, "batch": 0}
    assert batches == [0, 1, 2, 3] * 2
    with pytest.raises(ConfigError, match="batches_per_commit"):
        elastic.CommitStateCallback(state, batches_per_commit=0)


def test_update_batch_state_announces_the_steps_left_after_a_resume():
    model = compiled(1)
    state = elastic.KerasState(model, epoch=0, batch=3)
    announced = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            announced.append(self.params["steps"])

    model.fit(
        X,
        Y,
        batch_size=4,
        epochs=2,
        verbose=0,
        callbacks=[elastic.UpdateBatchStateCallback(state), Steps()],
    )
    # 4 steps per epoch: 4 - 3 in the first epoch after the resume, then 4 - 0.
    assert announced == [1, 4]


def test_tensorflow_state_and_bad_arguments():
    v = tf.Variable([1.0, 2.0])
    state = elastic.TensorFlowState([v], step=0)
    state.commit()
    v.assign([5.0, 6.0])
    state.step = 9
    state.restore()
    assert v.numpy().tolist() == [1.0, 2.0] and state.step == 0
    with pytest.raises(ConfigError, match="field 'variables'"):
        elastic.TensorFlowState(None)
    with pytest.raises(ConfigError, match="field 'state'"):
        elastic.run(lambda s: None)("not a state")
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ConfigError, match="field 'model'.*built"):
        elastic.KerasState(unbuilt, optimizer=keras.optimizers.SGD())
    with pytest.raises(ConfigError, match="field 'optimizer'"):
        elastic.KerasState(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
    with pytest.raises(ConfigError, match="field '_hidden'"):
        elastic.ObjectState(_hidden=1)
    with pytest.raises(ConfigError, match="field 'handle'.*picklable"):
        elastic.ObjectState(handle=lambda: None)


WRITER = """
import importlib.util, sys
# commits.py alone: the tfdist.horovod package would import TensorFlow (seconds).
spec = importlib.util.spec_from_file_location("commits", sys.argv[2])
commits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(commits)
store = commits.CommitStore(sys.argv[1], "state-0")
n = int(sys.argv[3])
while True:
    n += 1
    store.write({"commit": n, "data": bytes([n % 256]) * (4 << 20)})
    if n == int(sys.argv[3]) + 1:
        print("ready", flush=True)  # One commit made.
"""


def test_a_kill_during_a_commit_never_leaves_half_a_commit(tmp_path):
    """SIGKILL a process that commits 4 MiB in a loop: the file is always whole."""
    store = commits.CommitStore(tmp_path, "state-0")
    last = torn = 0
    # Four kills at different points, then more until one lands mid-write
    # (on a loaded machine four may all fall between writes: seen in CI).
    for attempt in range(16):
        if attempt >= 4 and torn:
            break
        delay = (0.05, 0.2, 0.35, 0.5)[attempt % 4] + 0.013 * attempt
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), commits.__file__, str(last)],
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline() == "ready\n"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        temps = [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
        torn += bool(temps)  # Killed mid-write.
        for temp in temps:
            temp.unlink()
        payload = store.read()
        data = payload["data"]
        assert len(data) == 4 << 20 and data == bytes([payload["commit"] % 256]) * len(data)
        assert payload["commit"] > last  # This writer's commits, the last whole one.
        last = payload["commit"]
    assert torn >= 1  # Some kill did tear a write.
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".commit"] == ["state-0.commit"]


@pytest.mark.slow
def test_a_job_killed_twice_resumes_from_its_commits(tmp_path):
    """2 workers, max_restarts=2: a custom loop and a fit each lose a worker once."""
    from tfdist.engines.launch import launch

    out = io.StringIO()
    result = launch(
        str(REPO / "tests" / "workers" / "hvd_elastic.py"),
        [str(tmp_path)],
        workers=2,
        max_restarts=2,
        output=out,
        handle_signals=False,
        stop_timeout=3,
    )
    text = out.getvalue()
    assert result.ok and result.restarts == 2, text[-4000:]
    seen = {
        (a, r): json.loads((tmp_path / f"attempt-{a}-rank-{r}.json").read_text())
        for a in range(3)
        for r in range(2)
    }

    # Attempt 0: the ranks start different; entering elastic.run syncs them.
    assert seen[0, 0]["part1_before_sync"] != seen[0, 1]["part1_before_sync"]
    assert seen[0, 0]["part1_entry"] == seen[0, 1]["part1_entry"]
    assert seen[0, 1]["part1_steps"] == list(range(8))  # Failed after step 7.
    # Attempt 1: resumed from the commit at batch 6 (steps 6 and 7 redone),
    # reset callbacks ran once; part 2 started afresh and failed in epoch 2.
    for r in range(2):
        assert seen[1, r]["part1_start"] == 6 and seen[1, r]["part1_steps"] == list(range(6, 12))
        assert seen[1, r]["resets"] == ["part1"]
        assert seen[1, r]["part2_start"] == 0
    assert seen[1, 0]["part2_entry"] == seen[1, 1]["part2_entry"]
    # Attempt 2: part 1 resumed at its end, part 2 at epoch 2.
    for r in range(2):
        final = seen[2, r]
        assert final["done"] and final["part1_start"] == 12 and final["part1_steps"] == []
        assert final["part2_start"] == 2 and final["part2_epoch"] == 4
        assert final["resets"] == ["part1", "part2"]
        # Where an uninterrupted run ends (and training did move the weights).
        assert final["part1_diff"] < 1e-6 and final["part2_diff"] < 1e-6, final
        assert final["part1_moved"] > 1e-2
    for key in ("part1_end", "part2_end"):
        assert seen[2, 0][key] == seen[2, 1][key]
    assert seen[2, 0]["commits"] == ["state-0.commit", "state-1.commit"]
    assert "resumed from commit 2" in text and "resumed from commit 4" in text
    assert not Path(seen[2, 0]["job_dir"]).exists()  # The launch removed its scratch dir.
