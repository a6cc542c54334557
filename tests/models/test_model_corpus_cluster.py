"""The model corpus across processes: 2 workers under ``tfdist launch``, and
``model.fit`` under a parameter-server cluster (tests/workers/corpus_fit.py).

The multi-worker runs must equal the one-device runs of this process on the
same global batches, where corpus.Case.exact_steps says they can.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import corpus
import corpus_report
import tfdist
from conftest import REPO, finish, result_line, start

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5
WORKER = REPO / "tests" / "workers" / "corpus_fit.py"


def available(names):
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        print("skipped keras-hub cases:", corpus.HUB_MISSING)
        return [n for n in names if not corpus.CASES[n].hub]
    return list(names)


def weights(path) -> list:
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


#: The models the cluster paths take: GPT-2 (a tied, dense token table), BERT
#: (sparse tables all-gathered across processes) and the two CNNs (BatchNorm
#: statistics per worker, and synchronized across processes). Gemma's
#: gradients are GPT-2's kinds; it trains under every in-process path in
#: test_model_corpus.py. The parameter-server fit takes the same but
#: MobileNetV2.
ACROSS_PROCESSES = [name for name in corpus.CASES if name != "gemma"]


def test_two_workers_under_launch_equal_one_device(tf_cpus, tmp_path):
    names = available(ACROSS_PROCESSES)
    # GPT-2 again with bf16 compression, from a second strategy in each worker.
    wanted = names + (["gpt2:bf16"] if "gpt2" in names else [])
    [(code, out, err)] = finish(
        [
            start(
                [
                    "-m",
                    "tfdist",
                    "launch",
                    "--workers",
                    "2",
                    sys.executable,
                    WORKER,
                    "multi_worker",
                    tmp_path,
                    *wanted,
                ]
            )
        ],
        timeout=900,
    )
    assert code == 0, (out[-3000:], err[-3000:])
    for name in names:
        entry = corpus.CASES[name]
        key = f"{name}-none"
        first, second = (weights(tmp_path / f"worker{i}-{key}.npz") for i in (0, 1))
        # Trained weights are mirrored: equal on both workers. Keras 3's
        # BatchNormalization moving statistics (aggregation "none") keep each
        # worker's own batches unless synchronized=True, so they may differ.
        trainable = _cases(out)[key]["trainable"]
        assert (
            corpus.max_difference(
                [w for w, t in zip(first, trainable) if t],
                [w for w, t in zip(second, trainable) if t],
            )
            == 0.0
        ), name
        losses = _losses(out, key)
        if entry.exact_steps:
            reference = corpus.train(
                entry, tfdist.strategy_from_config(cpu_replicas=1), **corpus.exact_run(entry)
            )
            difference = corpus.max_difference(first, reference["weights"])
            corpus_report.add(name, "launch 2 workers", "none", _epochs(out, key), difference)
            assert difference <= TOLERANCE, (name, difference)
            np.testing.assert_allclose(losses, reference["losses"], rtol=TOLERANCE)
        else:
            corpus_report.add(name, "launch 2 workers", "none", _epochs(out, key))
            assert _epochs(out, key)[-1] < _epochs(out, key)[0], name
    if "gpt2" in names:
        epochs = _epochs(out, "gpt2-bf16")
        corpus_report.add("gpt2", "launch 2 workers", "bf16", epochs)
        assert epochs[-1] < epochs[0], epochs


def _cases(out):
    # tfdist launch prefixes each line with its task; take worker 0's result.
    for line in out.splitlines():
        if "tfdist result: " in line and "worker0" in line:
            return result_line(line[line.index("tfdist result: ") :])["cases"]
    raise AssertionError(f"no result from worker 0:\n{out[-3000:]}")


def _losses(out, key):
    return _cases(out)[key]["losses"]


def _epochs(out, key):
    return _cases(out)[key]["epochs"]


def test_parameter_server_fit_learns(tmp_path):
    # model.fit under ParameterServerStrategy (tfdist.fit), 2 workers and a ps.
    names = available(["gpt2", "bert", "mobilenet_v3_sync"])
    [(code, out, err)] = finish([start([WORKER, "ps", tmp_path, *names])], timeout=900)
    assert code == 0, (out[-3000:], err[-3000:])
    cases = result_line(out)["cases"]
    for name in names:
        epochs = cases[f"{name}-none"]["epochs"]
        corpus_report.add(name, "parameter server", "none", epochs)
        assert np.all(np.isfinite(epochs)) and epochs[-1] < epochs[0], (name, epochs)
