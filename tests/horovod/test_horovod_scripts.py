"""A Horovod-style Keras script (tests/workers/hvd_keras_script.py) under `tfdist launch`.

One 2-worker job, as a Horovod user would run it after changing the import:
the ranks start from different weights and read differently shuffled data,
and must end with identical weights; the logged metrics are the means over
the ranks; the rate warms up from lr/size to lr; only rank 0 writes
checkpoints and progress; the Keras 2 compile argument is accepted with one
warning per rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, subprocess_env

SCRIPT = REPO / "tests" / "workers" / "hvd_keras_script.py"
EPOCHS, WARMUP_EPOCHS, STEPS, BASE_LR = 3, 2, 16, 0.002  # as in the script


def worker_lines(stdout: str, rank: int) -> list[str]:
    prefix = f"[worker:{rank}] "
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


def rank_result(stdout: str, rank: int) -> dict:
    for line in worker_lines(stdout, rank):
        if line.startswith("tfdist result: "):
            return json.loads(line[len("tfdist result: ") :])
    raise AssertionError(f"no result from rank {rank}:\n{stdout[-4000:]}")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("hvd_keras")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--show-all",
            str(SCRIPT),
            str(out),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    return done.stdout, out


@pytest.mark.slow
def test_ranks_and_sizes(job):
    stdout, _ = job
    results = [rank_result(stdout, rank) for rank in (0, 1)]
    assert [(r["rank"], r["size"], r["local_rank"]) for r in results] == [(0, 2, 0), (1, 2, 1)]
    # The script scaled the rate by size() itself; nothing rescaled it again.
    assert all(r["scaled_lr"] == pytest.approx(BASE_LR * 2) for r in results)
    assert all(r["lr"] == pytest.approx(BASE_LR * 2) for r in results)
    assert all(len(r["rates"]) == EPOCHS * (STEPS // 2) for r in results)
    # Steps divided by size() by the script; fit ran them all, nothing rebatched.
    assert all(r["iterations"] == EPOCHS * (STEPS // 2) for r in results)


@pytest.mark.slow
def test_different_starts_end_with_identical_weights(job):
    stdout, _ = job
    first, second = (rank_result(stdout, rank) for rank in (0, 1))
    assert first["initial"] != second["initial"]  # each rank's own seed
    assert first["final"] == second["final"], (first, second)
    assert first["abs_sum"] == second["abs_sum"]
    assert first["final"] != first["initial"]  # it trained
    assert np.isfinite(first["loss"]).all()


@pytest.mark.slow
def test_only_rank_0_writes_checkpoints_and_progress(job, tf_cpus):
    stdout, out = job
    first, second = (rank_result(stdout, rank) for rank in (0, 1))
    assert (first["checkpoint_callbacks"], second["checkpoint_callbacks"]) == (1, 0)
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"checkpoint-{epoch}.keras" for epoch in range(1, EPOCHS + 1)]
    # The last checkpoint holds the final (common) weights.
    import keras

    sys.path.insert(0, str(SCRIPT.parent))
    from hvd_keras_script import checksum

    model = keras.models.load_model(out / f"checkpoint-{EPOCHS}.keras", compile=False)
    assert checksum(model.get_weights())[0] == first["final"]
    # Keras's progress output ("Epoch 1/3", step counters) on rank 0 only.
    epoch_line = re.compile(r"^Epoch \d+/%d" % EPOCHS)
    assert sum(bool(epoch_line.match(line)) for line in worker_lines(stdout, 0)) == EPOCHS
    assert not any(epoch_line.match(line) for line in worker_lines(stdout, 1))


@pytest.mark.slow
def test_keras_2_compile_argument_warns_once_per_rank(job):
    stdout, _ = job
    for rank in (0, 1):
        warned = [
            line
            for line in worker_lines(stdout, rank)
            if "HorovodSpellingWarning" in line and "experimental_run_tf_function" in line
        ]
        assert len(warned) == 1, worker_lines(stdout, rank)
        # Named at the script's compile line, not at a tfdist or Keras wrapper.
        assert warned[0].startswith(f"{SCRIPT}:"), warned


@pytest.mark.slow
def test_logged_metrics_are_the_means_over_ranks(job):
    stdout, _ = job
    first, second = (rank_result(stdout, rank) for rank in (0, 1))
    for name in ("loss", "accuracy"):
        local = [[logs[name] for logs in r["local_logs"]] for r in (first, second)]
        assert local[0] != local[1]  # each rank saw its own batches
        mean = np.mean(local, axis=0)
        np.testing.assert_allclose(first[name], mean, rtol=1e-6)
        np.testing.assert_allclose(second[name], mean, rtol=1e-6)


@pytest.mark.slow
def test_learning_rate_warms_up_from_lr_over_size(job):
    stdout, _ = job
    first, second = (rank_result(stdout, rank) for rank in (0, 1))
    assert first["rates"] == second["rates"]
    rates, scaled = np.array(first["rates"]), first["scaled_lr"]
    warmup = WARMUP_EPOCHS * (STEPS // 2)
    ramp = rates[:warmup]
    assert scaled / 2 <= ramp[0] < ramp[-1] <= scaled * (1 + 1e-6)
    assert np.all(np.diff(ramp) > 0)
    np.testing.assert_allclose(rates[warmup:], scaled, rtol=1e-6)
    done = [
        line for line in worker_lines(stdout, 0) if "finished gradual learning rate warmup" in line
    ]
    assert len(done) == 1 and f"Epoch {WARMUP_EPOCHS}:" in done[0]
    assert not any("warmup" in line for line in worker_lines(stdout, 1))
