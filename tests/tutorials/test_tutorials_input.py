"""TensorFlow's "Distributed input" tutorial, as a test.

tests/workers/tutorial_input.py runs the steps of tensorflow/docs
site/en/tutorials/distribute/input.ipynb in a fresh process, because the
tutorial's first step is its own device set-up (2 logical CPUs before any
other TensorFlow work), which the pytest process has already done its own
way. Each strategy comes from tfdist.strategy_from_config(), where the
tutorial calls tf.distribute.MirroredStrategy(); the same process then runs
the same steps with TensorFlow's MirroredStrategy(), and every step must
compute the same: batches split over both devices, per-replica batches from
the input context, get_next_as_optional ending a loop, an element_spec
signature, a preprocessing layer in dataset_fn, enumerate-indexed outputs,
values from the replica context and a generator dataset.

No gradients are all-reduced in this tutorial, so there is no compressed
variant.
"""

from __future__ import annotations

from conftest import finish, result_line, start


def test_input_tutorial_computes_what_tensorflows_mirrored_strategy_computes():
    [(code, out, err)] = finish([start(["tests/workers/tutorial_input.py"])], timeout=300)
    assert code == 0, err[-4000:]
    result = result_line(out)
    ours, theirs = result["tfdist"], result["tensorflow"]
    assert result["logical_cpus"] == 2
    # TensorFlow's MirroredStrategy() uses the 2 logical CPUs the script set
    # up, for each of the tutorial's 9 strategies...
    assert theirs["strategies"] == [["MirroredStrategy", 2]] * 9
    assert theirs["split_batch"] == [8, 8]
    assert theirs["replica_values"] == [0, 1]
    # ...and so does the automatic choice, with the same results everywhere.
    assert ours["strategies"] == theirs["strategies"]
    for step in theirs:
        assert ours[step] == theirs[step], step
    assert [i for i, _ in ours["predicted"]] == list(range(24))
    assert all(value == 2 * i for i, value in ours["predicted"])
    assert ours["optional"] == [sum(range(9)), 3]  # 3 batches of range(9), then stop.
