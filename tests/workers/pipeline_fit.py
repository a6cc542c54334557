"""A process of a pipelined Keras ``fit`` (tests/pipeline/test_pipeline_processes.py).

Usage: pipeline_fit.py MODEL SCHEDULE MICROBATCHES STEPS OUT STAGE [ADDRESSES]

STAGE ``ref`` runs the plain model on one device instead. Every process
calls fit (2 epochs), evaluate, predict and save, as a user's script does
(the plain model also save_weights to OUT/ref.weights.h5),
and writes OUT/fit-<STAGE>.npz: the fit and evaluate losses and accuracy
(a compiled metric, ``acc``), and the
predictions; the model is saved to OUT/<STAGE>.keras (stage 0's file is the
pipelined model's). With $PIPELINE_BACKUP, fit has a BackupAndRestore there
(one folder for the plain model, one the stages share); with $PIPELINE_CRASH,
every process fails in the second epoch. With $PIPELINE_REPLICAS = R, the
ADDRESSES are R pipelines' (STAGE is then the process's rank, replica-major)
and $PIPELINE_COMPRESSION their all-reduce's compression (with error
feedback if $PIPELINE_ERROR_FEEDBACK: each process then saves its residuals
with save_weights, zeroes them, loads them back and writes both to
OUT/ef-<STAGE>.npz); every process
also writes OUT/w-<STAGE>.npz, the weights its stage owns, and the bytes its
replicas' ring sent. With $PIPELINE_BY_STAGE, each process builds only its
stage's weights (PipelineModel given the model's builder) and writes the
model's weights it held before fit to OUT/held-<STAGE>.npy; the stages then
save_weights to OUT/pipe.weights.h5, zero their weights and load_weights it,
writing what they read to OUT/loaded-<STAGE>.npz and the weights they held
before and after to OUT/held-{before-load,after}-<STAGE>.npy. With
$PIPELINE_MESH = "BxT" (and $PIPELINE_BY_STAGE), each stage process splits
its CPU into B x T logical devices and lays its stage out over a (batch,
model) mesh of them (tests/models/pipeline_models.layout_map). With
$PIPELINE_SPLIT = "STAGE:a,b", that stage is given the split points a, b
instead of the others' (they refuse to start).
"""

import os
import sys
from pathlib import Path

MESH = (
    tuple(int(n) for n in os.environ["PIPELINE_MESH"].split("x"))
    if os.environ.get("PIPELINE_MESH")
    else None
)
if MESH and sys.argv[6] != "ref":  # Before TensorFlow makes its devices.
    from tfdist.strategies.local import logical_cpus

    logical_cpus(MESH[0] * MESH[1])

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.models.pipeline_models import SPLITS, batches, layout_map, make_model  # noqa: E402

model_name, schedule, m, steps, out, stage = sys.argv[1:7]


class Crash(keras.callbacks.Callback):
    """A failure in the second epoch, after its first batch, on every process."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 1:
            raise RuntimeError("crash on purpose")


m, steps, out = int(m), int(steps), Path(out)
keras.utils.set_random_seed(7)
model = make_model(model_name)
x, y = batches(model_name, steps)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if stage != "ref":
    from tfdist.pipeline import PipelineModel

    addresses = sys.argv[7].split(",")
    replicas = int(os.environ.get("PIPELINE_REPLICAS", "1"))
    stages = len(addresses) // replicas
    replica, index = divmod(int(stage), stages)
    if os.environ.get("PIPELINE_BY_STAGE"):
        keras.utils.set_random_seed(7)  # The builder draws what make_model drew above.
        model = lambda: make_model(model_name)  # noqa: E731
    distribution = None
    if MESH:
        import tfdist

        distribution = tfdist.distribution.ModelParallel(
            layout_map=layout_map(model_name, MESH), batch_dim_name="batch"
        )
    points = SPLITS[model_name][: stages - 1]
    given = os.environ.get("PIPELINE_SPLIT", "")  # "STAGE:a,b": that stage's own points.
    if given.split(":")[0] == str(index):
        points = given.split(":")[1].split(",")
    model = PipelineModel(
        model,
        points,
        microbatches=m,
        schedule=schedule,
        replicas=replicas,
        compression=os.environ.get("PIPELINE_COMPRESSION") or None,
        error_feedback=True if os.environ.get("PIPELINE_ERROR_FEEDBACK") else None,
        stage=index,
        replica=replica,
        addresses=addresses,
        recv_timeout=120,
        distribution=distribution,
    )
if stage != "ref":
    from tfdist.compat.deferred import is_materialized

    held = [v.path for v in model.whole.weights if is_materialized(v)]
    np.save(out / f"held-{stage}.npy", np.array(held))
accuracy = keras.metrics.SparseCategoricalAccuracy(name="acc")
if stage != "ref":
    from tfdist.pipeline.trace import Trace

    model.trace = Trace()  # Before compile: the runner it makes takes it.
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=[accuracy])
batch = len(y) // steps
callbacks = []
if os.environ.get("PIPELINE_BACKUP"):
    backup = os.path.join(os.environ["PIPELINE_BACKUP"], stage if stage == "ref" else "pipe")
    callbacks.append(keras.callbacks.BackupAndRestore(backup, save_freq="epoch"))
if os.environ.get("PIPELINE_CRASH"):
    callbacks.append(Crash())
history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
evaluated = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
predicted = model.predict(x, batch_size=batch, verbose=0)
if stage != "ref":
    spans = model.trace.spans
    np.save(out / f"traced-{stage}.npy", np.array([(s.step, s.kind) for s in spans], object))
    owned = {v.path: v.numpy() for v in model.stages[model.stage_index].variables}
    if MESH:  # What each weight of the stage got: its block and how it runs.
        import json

        import tfdist

        rows = [
            r for s in model.own for r in tfdist.distribution.report(s.model, distribution).rows
        ]
        # A layer the stages share (an untied embedding) lists both stages' weights.
        laid = {r.path: [list(r.shape), list(r.block), r.how] for r in rows if r.path in owned}
        (out / f"layouts-{stage}.json").write_text(json.dumps(laid))
    np.savez(out / f"w-{stage}.npz", sent=np.array(model.sent_to_replicas()), **owned)
model.save(out / f"{stage}.keras")
if stage == "ref" or os.environ.get("PIPELINE_BY_STAGE"):
    weights_file = out / ("ref.weights.h5" if stage == "ref" else "pipe.weights.h5")
    model.save_weights(weights_file)
if stage != "ref" and os.environ.get("PIPELINE_ERROR_FEEDBACK"):
    # Each replica's residuals are saved beside the weights and read back.
    residuals = model._compression_state()
    before = {f"b{i}": v.numpy() for i, v in enumerate(residuals)}
    model.save_weights(out / "ef.weights.h5")
    for v in residuals:
        v.assign(np.zeros_like(v.numpy()))
    model.load_weights(out / "ef.weights.h5")
    after = {f"a{i}": v.numpy() for i, v in enumerate(residuals)}
    np.savez(out / f"ef-{stage}.npz", **before, **after)
if stage != "ref" and os.environ.get("PIPELINE_BY_STAGE"):
    # Read back by stage: this stage's weights come back; no other is made.
    from tfdist.parallel import sharding

    state = model.optimizer.variables  # Read back too, whole (laid out: each device its block).
    state_before = {f"b{i}": sharding.full_value(v) for i, v in enumerate(state)}
    for v in [v for s in model.own for v in s.variables] + state:
        sharding.assign_full(v, np.zeros_like(sharding.full_value(v)))
    before = [v.path for v in model.whole.weights if is_materialized(v)]
    np.save(out / f"held-before-load-{stage}.npy", np.array(before))
    model.load_weights(weights_file)
    loaded = {v.path: v.numpy() for s in model.own for v in s.variables}
    np.savez(out / f"loaded-{stage}.npz", **loaded)
    state_after = {f"a{i}": sharding.full_value(v) for i, v in enumerate(state)}
    np.savez(out / f"opt-{stage}.npz", **state_before, **state_after)
    held = [v.path for v in model.whole.weights if is_materialized(v)]
    np.save(out / f"held-after-{stage}.npy", np.array(held))
np.savez(
    out / f"fit-{stage}.npz",
    fit=np.array(history.history["loss"]),
    evaluate=np.array(evaluated["loss"]),
    fit_acc=np.array(history.history["acc"]),
    evaluate_acc=np.array(evaluated["acc"]),
    predict=predicted,
)
