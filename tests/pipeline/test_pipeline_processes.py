"""A model trained in pipeline stages on real processes equals the same model
trained unpipelined on one device with Keras's fit (issue 41's exactness):
an MLP with a skip connection and a keras-hub Llama split at its blocks,
GPipe and 1F1B, SGD and Adam, activations and gradients over TCP on
127.0.0.1 (tfdist.transport.p2p). A stage that dies makes the others fail
naming it; stages given other split points refuse to start."""

from __future__ import annotations

import sys
import zipfile

import numpy as np
import pytest

from conftest import finish, start
from tests.pipeline.weights_files import h5_contents
from tfdist.engines.net import free_ports
from tfdist.pipeline.schedule import simulate

#: TensorFlow processes: with the suite's other multi-process tests, one at a time.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tf_cpus")]  # Keras here too.

TASK = "tests/workers/pipeline_task.py"
FIT = "tests/workers/pipeline_fit.py"
STEPS = 20
#: float32 sums taken per micro-batch rather than over the whole batch.
TOL = 1e-5


def _addresses(count: int) -> list[str]:
    return [f"127.0.0.1:{port}" for port in free_ports(count)]


def _train(tmp_path, model, schedule, microbatches, optimizer, stages, chunks=1):
    addresses = ",".join(_addresses(stages))
    common = [TASK, model, schedule, microbatches, STEPS, optimizer, tmp_path]
    procs = [start([*common, "ref"])]
    env = {"PIPELINE_CHUNKS": str(chunks)}
    procs += [start([*common, s, addresses], **env) for s in range(stages)]
    results = finish(procs, timeout=600)
    for code, out, err in results:
        assert code == 0, (out[-2000:], err[-4000:])
    ref = np.load(tmp_path / "ref.npz")
    parts = [np.load(tmp_path / f"{s}.npz") for s in range(stages)]
    return ref, parts


def _largest_difference(ref, parts) -> float:
    paths = {p for part in parts for p in part.files} - {"losses", "peak"}
    assert paths == set(ref.files) - {"losses"}  # Every weight, owned by one stage.
    worst = 0.0
    for part in parts:
        for path in set(part.files) - {"losses", "peak"}:
            worst = max(worst, float(np.abs(part[path] - ref[path]).max()))
    return worst


@pytest.mark.parametrize(
    "model, schedule, optimizer, stages, microbatches, chunks",
    [
        ("mlp", "gpipe", "sgd", 2, 4, 1),
        ("mlp", "1f1b", "adam", 4, 4, 1),
        ("llama", "1f1b", "adam", 2, 4, 1),
        # Batch normalization with one micro-batch: the batch's statistics.
        ("cnn", "gpipe", "adam", 3, 1, 1),
        # Interleaved 1F1B: 2 processes run 4 stages, 2 each (0 and 2, 1 and 3).
        ("mlp", "interleaved", "adam", 2, 4, 2),
        ("llama", "interleaved", "sgd", 2, 2, 2),
    ],
)
def test_pipelined_training_equals_one_device(
    tmp_path, model, schedule, optimizer, stages, microbatches, chunks
):
    ref, parts = _train(tmp_path, model, schedule, microbatches, optimizer, stages, chunks)
    worst = _largest_difference(ref, parts)
    assert worst < TOL, worst
    # Every stage logs the same losses; their mean is fit's epoch loss.
    losses = [part["losses"] for part in parts]
    for other in losses[1:]:
        np.testing.assert_array_equal(other, losses[0])
    assert np.mean(losses[0]) == pytest.approx(float(ref["losses"][-1]), abs=1e-5)
    assert losses[0][-1] != losses[0][0]  # It trained.
    peaks = [int(part["peak"]) for part in parts]
    expected = simulate(schedule, stages, microbatches, chunks=chunks).peak_in_flight
    assert tuple(peaks) == expected
    if schedule == "gpipe":
        assert peaks == [microbatches] * stages
    elif schedule == "1f1b":
        assert peaks == [min(stages - s, microbatches) for s in range(stages)]


def test_a_dead_stage_makes_the_others_fail_naming_it(tmp_path):
    addresses = ",".join(_addresses(2))
    common = [TASK, "mlp", "gpipe", 2, 1000, "sgd", tmp_path]
    procs = [start([*common, s, addresses], PIPELINE_DIE_AT="5") for s in range(2)]
    results = finish(procs, timeout=300)
    (code0, out0, err0), (code1, _, err1) = results
    assert code1 == 9 or code1 == -9, err1[-2000:]  # Stage 1 killed itself (SIGKILL).
    assert code0 != 0, err0[-2000:]
    assert "PeerError" in err0 and "stage 1" in err0, err0[-3000:]
    if sys.platform.startswith("linux"):
        assert "closed the connection" in err0 or "reset" in err0, err0[-3000:]


def test_stages_given_other_split_points_refuse_to_start_naming_them(tmp_path):
    """Layers of one width pass tensors of the same shapes whatever the split:
    without the check, these stages would train a wrong model silently."""
    addresses = ",".join(_addresses(2))
    common = [FIT, "mlp", "1f1b", 2, 2, tmp_path]
    procs = [start([*common, s, addresses], PIPELINE_SPLIT="1:d3") for s in range(2)]
    (code0, _, err0), (code1, _, err1) = finish(procs, timeout=300)
    assert code0 != 0 and code1 != 0
    assert "field 'split_points'" in err0 and "stage 1 was given ['d3']" in err0, err0[-3000:]
    assert "field 'split_points'" in err1 and "stage 0 was given ['d2']" in err1, err1[-3000:]
    assert not list(tmp_path.glob("fit-*.npz"))  # Neither trained.


def test_fit_evaluate_predict_and_save_equal_the_unpipelined_model(tmp_path):
    # A keras-hub Llama in 2 stages (GPipe, 2 micro-batches) under Keras's
    # own fit, evaluate, predict and save, as a user's script calls them.
    import keras

    # Each stage builds only its own weights (PipelineModel given the
    # builder): what it held before fit is its stage's, and the model it
    # trains and saves is the same.
    addresses = ",".join(_addresses(2))
    common = [FIT, "llama", "gpipe", 2, 4, tmp_path]
    procs = [start([*common, "ref"])]
    procs += [start([*common, s, addresses], PIPELINE_BY_STAGE="1") for s in range(2)]
    for code, out, err in finish(procs, timeout=600):
        assert code == 0, (out[-2000:], err[-4000:])
    held = [set(np.load(tmp_path / f"held-{s}.npy").tolist()) for s in range(2)]
    owned = [set(np.load(tmp_path / f"w-{s}.npz").files) - {"sent"} for s in range(2)]
    assert held == owned and not held[0] & held[1], held
    ref = np.load(tmp_path / "fit-ref.npz")
    for stage in range(2):
        got = np.load(tmp_path / f"fit-{stage}.npz")
        np.testing.assert_allclose(got["fit"], ref["fit"], rtol=0, atol=TOL)
        # A compiled metric: the last stage's, logged on every stage.
        np.testing.assert_array_equal(got["fit_acc"], ref["fit_acc"])
        assert float(got["evaluate_acc"]) == float(ref["evaluate_acc"])
        assert float(got["evaluate"]) == pytest.approx(float(ref["evaluate"]), abs=TOL)
        np.testing.assert_allclose(got["predict"], ref["predict"], rtol=0, atol=TOL)
    # pipe.trace, set before compile: every fit step's passes, each stage's
    # own (GPipe, 2 micro-batches: 2 forwards and 2 backwards a step).
    for stage in range(2):
        traced = np.load(tmp_path / f"traced-{stage}.npy", allow_pickle=True).tolist()
        steps = sorted({step for step, _ in traced})
        assert steps == list(range(len(steps))) and len(steps) == 2 * 4, steps  # 2 epochs.
        for step in steps:
            kinds = [kind for s, kind in traced if s == step]
            assert [k for k in kinds if k in ("F", "B")] == ["F", "F", "B", "B"], kinds
    assert not (tmp_path / "1.keras").exists()  # Stage 0 writes the model.
    # Written by stage: the archive Keras writes, around the joined weights.
    members = [zipfile.ZipFile(tmp_path / f"{n}.keras").namelist() for n in ("0", "ref")]
    assert sorted(members[0]) == sorted(members[1])
    saved = keras.models.load_model(tmp_path / "0.keras", compile=False)
    plain = keras.models.load_model(tmp_path / "ref.keras", compile=False)
    assert type(saved).__name__ == type(plain).__name__ == "LlamaCausalLM"
    worst = max(
        float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(saved.weights, plain.weights)
    )
    assert [w.path for w in saved.weights] == [w.path for w in plain.weights]
    assert worst < TOL, worst
    # save_weights by stage: the file Keras writes for the model, every
    # group, attribute and dataset, joined from the stages' parts (removed);
    # load_weights by stage reads back each stage's weights and no other.
    _assert_same_weights_file(tmp_path / "pipe.weights.h5", tmp_path / "ref.weights.h5")
    assert sorted(p.name for p in tmp_path.glob("*.weights.h5")) == [
        "pipe.weights.h5",
        "ref.weights.h5",
    ]
    for stage in range(2):
        loaded = np.load(tmp_path / f"loaded-{stage}.npz")
        trained = np.load(tmp_path / f"w-{stage}.npz")
        assert set(loaded.files) == owned[stage]
        for path in loaded.files:
            np.testing.assert_array_equal(loaded[path], trained[path])
        # save (.keras), save_weights and load_weights leave each stage
        # holding its own weights only.
        for when in ("before-load", "after"):
            kept = set(np.load(tmp_path / f"held-{when}-{stage}.npy").tolist())
            assert kept == held[stage], (when, stage, sorted(kept ^ held[stage])[:5])


def _assert_same_weights_file(got, want) -> None:
    # The optimizer's state is each stage's own file beside it
    # (FILEPATH.stageK.npz); the model's own optimizer is not the pipeline's.
    a, b = (
        {k: v for k, v in h5_contents(path).items() if not k.startswith("optimizer")}
        for path in (got, want)
    )
    assert len(b) > 20 and sorted(a) == sorted(b)
    for name, value in b.items():
        if isinstance(value, tuple):
            assert a[name][:3] == value[:3], name
            np.testing.assert_allclose(a[name][3], value[3], rtol=0, atol=TOL, err_msg=name)
        else:
            # Layer names: the stage's worker built the model twice (make_model
            # above its builder), so its auto-names have other suffixes.
            assert a[name].keys() == value.keys(), name
            assert {k: v for k, v in a[name].items() if k != "name"} == {
                k: v for k, v in value.items() if k != "name"
            }, name


@pytest.mark.parametrize(
    "model, schedule, mesh, replicas",
    [
        # Three axes: 2 replicas x 2 stages x a "model" axis of 2, on 4
        # processes of 2 logical CPUs, Megatron's column and row splits.
        ("mlp", "1f1b", "1x2", 2),
        # keras-hub's own layout map: attention and MLP split over "model",
        # the vocabulary too (its gradients are IndexedSlices).
        ("llama", "gpipe", "1x2", 1),
    ],
)
def test_stages_laid_out_over_each_process_s_devices_equal_one_device(
    tmp_path, model, schedule, mesh, replicas
):
    # Each process lays its stage out over its own mesh of logical CPUs
    # (PipelineModel's distribution=), under Keras's fit, evaluate, predict,
    # save and save_weights/load_weights by stage.
    import json

    import keras

    ranks = 2 * replicas
    addresses = ",".join(_addresses(ranks))
    common = [FIT, model, schedule, 2, 4, tmp_path]
    env = {"PIPELINE_BY_STAGE": "1", "PIPELINE_MESH": mesh, "PIPELINE_REPLICAS": str(replicas)}
    procs = [start([*common, "ref"])]  # Each stage's process makes its own devices:
    procs += [start([*common, r, addresses], fresh=True, **env) for r in range(ranks)]
    for code, out, err in finish(procs, timeout=600):
        assert code == 0, (out[-2000:], err[-4000:])
    ref = np.load(tmp_path / "fit-ref.npz")
    for rank in range(ranks):
        stage = rank % 2
        got = np.load(tmp_path / f"fit-{rank}.npz")
        for key in ("fit", "evaluate", "predict"):
            np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=TOL, err_msg=key)
        assert float(got["evaluate_acc"]) == float(ref["evaluate_acc"])
        # Laid out as the map says: split weights, each device a block.
        laid = json.loads((tmp_path / f"layouts-{rank}.json").read_text())
        split = {path for path, (shape, block, _) in laid.items() if block != shape}
        assert len(split) >= 2, laid
        assert any(how.startswith("tensor-parallel") for _, _, how in laid.values()), laid
        trained = np.load(tmp_path / f"w-{rank}.npz")
        owned = set(trained.files) - {"sent"}
        assert (int(trained["sent"]) > 0) == (replicas > 1)  # The replicas' all-reduce.
        assert set(laid) == owned
        # Saved by stage as whole weights, and read back into the blocks.
        loaded = np.load(tmp_path / f"loaded-{rank}.npz")
        assert set(loaded.files) == owned
        for path in loaded.files:
            np.testing.assert_array_equal(loaded[path], trained[path])
        # Adam's state too: saved whole beside the file, each block read back.
        state = np.load(tmp_path / f"opt-{rank}.npz")
        count = len(state.files) // 2
        assert count > 2 * len(split)
        for i in range(count):
            np.testing.assert_array_equal(state[f"a{i}"], state[f"b{i}"])
        saved = np.load(tmp_path / f"pipe.weights.h5.stage{stage}.npz")
        whole = {tuple(shape) for path, (shape, block, _) in laid.items() if path in split}
        assert whole <= {saved[k].shape for k in saved.files}  # Moments of split weights.
    saved = keras.models.load_model(tmp_path / "0.keras", compile=False)
    plain = keras.models.load_model(tmp_path / "ref.keras", compile=False)
    assert [w.path for w in saved.weights] == [w.path for w in plain.weights]
    worst = max(
        float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(saved.weights, plain.weights)
    )
    assert worst < TOL, worst
    _assert_same_weights_file(tmp_path / "pipe.weights.h5", tmp_path / "ref.weights.h5")


def test_backup_and_restore_resumes_the_stages_as_it_resumes_one_device(tmp_path):
    # Every process fails in the second epoch; the same command again
    # resumes from BackupAndRestore's backup (stage 0 writes it, both stages
    # read it), as the plain model does from its own.
    addresses = ",".join(_addresses(2))
    common = [FIT, "mlp", "1f1b", 2, 4, tmp_path]
    backup = {"PIPELINE_BACKUP": str(tmp_path / "backup")}

    def job(**env):
        procs = [start([*common, "ref"], **env)]
        procs += [start([*common, s, addresses], **env) for s in range(2)]
        return finish(procs, timeout=600)

    for code, _, err in job(PIPELINE_CRASH="1", **backup):
        assert code != 0 and "crash on purpose" in err, err[-3000:]
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == ["pipe", "ref"]
    assert not list(tmp_path.glob("*.keras"))
    for code, out, err in job(**backup):
        assert code == 0, (out[-2000:], err[-4000:])
    ref = np.load(tmp_path / "fit-ref.npz")
    assert len(ref["fit"]) == 1  # It resumed: only the second epoch ran.
    for stage in range(2):
        got = np.load(tmp_path / f"fit-{stage}.npz")
        np.testing.assert_allclose(got["fit"], ref["fit"], rtol=0, atol=TOL)
        # A compiled metric: the last stage's, logged on every stage.
        np.testing.assert_array_equal(got["fit_acc"], ref["fit_acc"])
        assert float(got["evaluate_acc"]) == float(ref["evaluate_acc"])
        np.testing.assert_allclose(got["predict"], ref["predict"], rtol=0, atol=TOL)
    # BackupAndRestore deletes its backup at the end of a fit, on both sides.
    assert not (tmp_path / "backup" / "pipe").exists()
    assert not (tmp_path / "backup" / "ref").exists()


def test_two_replicas_of_two_stages_equal_one_device_and_fp16_halves_their_bytes(tmp_path):
    # 2 pipelines x 2 stages on 4 processes (rank = replica * 2 + stage),
    # Keras's fit: each replica trains on half of every batch, each stage's
    # gradients are averaged over its 2 replicas. Without compression the
    # weights are the plain model's; with fp16 on the replicas' all-reduce
    # (and error feedback) they stay equal across replicas, the ring sends
    # half the bytes, and each replica's residuals survive save and load.
    import keras

    steps = 4
    common = [FIT, "mlp", "1f1b", 2, steps]

    def job(out, compression, ref):
        out.mkdir()
        addresses = ",".join(_addresses(4))
        env = {"PIPELINE_REPLICAS": "2", "PIPELINE_COMPRESSION": compression}
        if compression:
            env["PIPELINE_ERROR_FEEDBACK"] = "1"
        procs = [start([*common, out, "ref"])] if ref else []
        procs += [start([*common, out, rank, addresses], **env) for rank in range(4)]
        for code, stdout, err in finish(procs, timeout=600):
            assert code == 0, (stdout[-2000:], err[-4000:])
        return [np.load(out / f"w-{rank}.npz") for rank in range(4)]

    plain = job(tmp_path / "none", "", ref=True)
    ref = np.load(tmp_path / "none" / "fit-ref.npz")
    saved = keras.models.load_model(tmp_path / "none" / "0.keras", compile=False)
    plain_ref = keras.models.load_model(tmp_path / "none" / "ref.keras", compile=False)
    worst = max(
        float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(saved.weights, plain_ref.weights)
    )
    assert worst < TOL, worst
    for rank in range(4):
        got = np.load(tmp_path / "none" / f"fit-{rank}.npz")
        np.testing.assert_allclose(got["fit"], ref["fit"], rtol=0, atol=TOL)
        # A compiled metric: the last stage's, logged on every stage.
        np.testing.assert_array_equal(got["fit_acc"], ref["fit_acc"])
        assert float(got["evaluate_acc"]) == float(ref["evaluate_acc"])
        np.testing.assert_allclose(got["predict"], ref["predict"], rtol=0, atol=TOL)
    half = job(tmp_path / "fp16", "fp16", ref=False)
    for runs in (plain, half):
        for stage in range(2):  # Replica 1's stage equals replica 0's, bit for bit.
            a, b = runs[stage], runs[2 + stage]
            assert set(a.files) == set(b.files)
            for name in set(a.files) - {"sent"}:
                np.testing.assert_array_equal(a[name], b[name])
    # fp16 with error feedback: each replica's residuals (its own rounding
    # errors) are saved with save_weights and read back by load_weights.
    residuals = [np.load(tmp_path / "fp16" / f"ef-{rank}.npz") for rank in range(4)]
    for rank, got in enumerate(residuals):
        count = len(got.files) // 2
        assert count == len([n for n in half[rank].files if n != "sent"]), rank
        for i in range(count):
            np.testing.assert_array_equal(got[f"a{i}"], got[f"b{i}"])
        assert any(np.abs(got[f"b{i}"]).max() > 0 for i in range(count)), rank
    assert not np.array_equal(residuals[0]["b0"], residuals[2]["b0"])  # Each replica's own.
    fp16_fit = np.load(tmp_path / "fp16" / "fit-0.npz")["fit"]
    np.testing.assert_allclose(fp16_fit, ref["fit"], rtol=0, atol=1e-2)
    assert not np.array_equal(fp16_fit, ref["fit"])  # fp16 rounding did reach the weights.
    # Per training step (2 epochs of `steps`), a ring of 2 sends each
    # member's half of the float32 sum and then its summed half: 4 bytes a
    # weight; fp16 gathers 2 bytes a weight. The logged loss (a float64) and,
    # on the last stage, the accuracy's sum and count add at most 16 more.
    updates = 2 * steps
    for rank in range(4):
        weights = sum(plain[rank][name].size for name in set(plain[rank].files) - {"sent"})
        for runs, width in ((plain, 4), (half, 2)):
            sent = int(runs[rank]["sent"])
            assert updates * width * weights <= sent <= updates * (width * weights + 16), (
                rank,
                width,
                sent,
                weights,
            )
