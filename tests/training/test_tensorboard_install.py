"""tfdist.TensorBoard without the tensorboard package (issue 15, item 11).

TensorFlow 2.21 no longer installs tensorboard, so after ``pip install -e .``
it is missing. A subprocess hides it with an import blocker (it is installed
here, through the test extra) and checks what a user sees.
"""

from __future__ import annotations

import re

from conftest import REPO, finish, result_line, start

SCRIPT = """
import importlib.abc, json, sys, tempfile

class NoTensorBoard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTensorBoard())
import keras
import numpy as np
import tfdist

out = {}
logs = tempfile.mkdtemp()
try:
    tfdist.TensorBoard(logs)
    out["tfdist"] = "constructed"
except ImportError as error:
    out["tfdist"] = [type(error).__name__, isinstance(error, tfdist.TfdistError),
                     error.name, str(error)]
# Keras's own callback: accepted, then fails once the first step has run.
batches = []
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
try:
    model.fit(np.zeros((8, 4)), np.zeros((8, 1)), epochs=3, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batches.append(batch)),
        keras.callbacks.TensorBoard(logs)])
except Exception as error:
    out["keras"] = [type(error).__name__, str(error), batches]
print("tfdist result: " + json.dumps(out))
"""


def test_tensorboard_without_the_package_says_how_to_install_it():
    [(code, out, err)] = finish([start(["-c", SCRIPT])], timeout=300)
    assert code == 0, err[-3000:]
    result = result_line(out)
    assert result["tfdist"] != "constructed"
    name, is_tfdist_error, missing, message = result["tfdist"]
    assert (name, is_tfdist_error, missing) == ("TensorBoardNotInstalledError", True, "tensorboard")
    assert "needs the 'tensorboard' package" in message
    assert "pip install 'tfdist[tensorboard]'" in message
    # What tfdist saves the user from: Keras's callback fails only after the
    # first training step, when it writes that step's loss.
    assert result["keras"] == [
        "TBNotInstalledError",
        "TensorBoard is not installed, missing implementation for tf.summary.scalar",
        [0],
    ]


def test_the_install_hint_names_an_extra_that_exists():
    from tfdist.training.callbacks import TensorBoard

    pyproject = (REPO / "pyproject.toml").read_text()
    extras = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    assert "pip install 'tfdist[tensorboard]'" in TensorBoard.INSTALL_HINT
    assert re.search(r'^tensorboard = \["tensorboard[>=<~]', extras, re.MULTILINE)
    # Not a run-time dependency: tfdist's own run-time needs stay four.
    deps = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "tensorboard" not in deps
