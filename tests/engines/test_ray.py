"""Ray Train's ``TensorflowTrainer`` with ``tfdist.strategy_from_config()``
inside ``train_loop_per_worker``, on a real local Ray cluster
(tests/workers/ray_train.py): metrics and checkpoints through
``ray.train.report``, a worker killed and the group resumed from
``ray.train.get_checkpoint()``, and tfdist's compression passed through the
train-loop config. (TF's own MultiWorkerMirroredStrategy fails there under
Keras 3: keras-team/keras#20585.)
"""

from __future__ import annotations

import pytest

from conftest import finish, result_line, start

pytest.importorskip(
    "ray.train.tensorflow", reason="ray[train] is not installed (pip install -e '.[test]')"
)


@pytest.mark.slow
def test_tensorflow_trainer_reports_resumes_and_compresses(tmp_path):
    [(code, out, err)] = finish(
        [start(["tests/workers/ray_train.py", tmp_path, "powersgd:2"])], timeout=600
    )
    assert code == 0, (out[-3000:], err[-3000:])
    result = result_line(out)
    assert result["error"] == "None"
    assert result["hosts"] == ["127.0.0.1"]  # TF_CONFIG as Ray wrote it.
    # The last report came from the resumed group, with tfdist's compression.
    assert result["metrics"]["epoch"] == 3 == result["checkpoint_epoch"]
    assert result["metrics"]["compression"] == "powersgd:2"
    # Worker 1 died once, after epoch 1's checkpoint was committed: both ranks
    # started twice, the second time together from that checkpoint.
    assert result["killed"]
    firsts, resumes = zip(*(result["starts"][rank] for rank in ("0", "1")))
    assert firsts == (0, 0) and resumes == (2, 2), result["starts"]
    assert result["epochs"][-1] == 3 and result["losses"][-1] < result["losses"][0]
