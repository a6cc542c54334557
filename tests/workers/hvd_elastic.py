"""Two elastic loops that fail once each, for tests/horovod/test_horovod_elastic.py.

Usage: ``tfdist launch --workers 2 --max-restarts 2 hvd_elastic.py OUT_DIR``.

* Part 1, a custom loop (Horovod's TF2 elastic example's calls):
  ``TensorFlowKerasState(model, opt, batch=0)``, DistributedGradientTape,
  a commit every 3 batches. On attempt 0, rank 1 exits with code 3 after
  step 7: the last commit holds batch 6, steps 6 and 7 are redone.
* Part 2, ``model.fit`` (Horovod's Keras elastic example's calls):
  ``KerasState(model, epoch=0, batch=0)`` and the three elastic callbacks,
  committing at epoch ends. On attempt 1, rank 1 exits during epoch 2.
* On the attempt that finishes, every rank trains both parts again without
  elastic and without failures, from rank 0's initial weights, and reports
  the largest difference: an interrupted run must end where an
  uninterrupted one does.

Each rank writes OUT_DIR/attempt-A-rank-R.json as it goes.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

import tfdist.horovod as hvd

hvd.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

out = Path(sys.argv[1])
rank, size = hvd.rank(), hvd.size()
attempt = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
STEPS, COMMIT_EVERY, FAIL_AFTER_STEP = 12, 3, 7
EPOCHS, PER_EPOCH, BATCH, FAIL_EPOCH = 4, 3, 8, 2
seen = {"attempt": attempt, "resets": [], "part1_steps": []}


def record(**items):
    seen.update(items)
    (out / f"attempt-{attempt}-rank-{rank}.json").write_text(json.dumps(seen))


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
    return h.hexdigest()


def make_model(seed):
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", kernel_initializer=init(seed=seed)),
            keras.layers.Dense(1, kernel_initializer=init(seed=seed + 1)),
        ]
    )


def fail(where):
    print(f"rank {rank} fails on purpose {where}", flush=True)
    os._exit(3)


rng = np.random.default_rng(rank)  # Each rank its own data.
x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
y = np.sin(x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
loss_fn = keras.losses.MeanSquaredError()


def make_step(model, opt):
    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def batch(i):
    return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


# Part 1: a custom loop.
model1 = make_model(100 + 10 * rank)  # Different on each rank until the sync.
opt1 = keras.optimizers.Adam(0.01)
step1 = make_step(model1, opt1)
state1 = hvd.elastic.TensorFlowKerasState(model1, opt1, batch=0)
state1.register_reset_callbacks([lambda: seen["resets"].append("part1")])
record(part1_before_sync=digest(model1.variables))


@hvd.elastic.run
def train1(state):
    record(part1_entry=digest(model1.variables), part1_start=state.batch)
    for i in range(state.batch, STEPS):
        step1(*batch(i))
        state.batch = i + 1
        seen["part1_steps"].append(i)
        if state.batch % COMMIT_EVERY == 0:
            state.commit()
        if attempt == 0 and rank == 1 and i == FAIL_AFTER_STEP:
            record()
            fail(f"after step {i}")


train1(state1)
record(part1_end=digest(model1.variables))

# Part 2: model.fit with the elastic Keras callbacks.
x2, y2 = x[: PER_EPOCH * BATCH], y[: PER_EPOCH * BATCH]
model2 = make_model(200 + 10 * rank)
model2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
state2 = hvd.elastic.KerasState(model2, epoch=0, batch=0)
state2.register_reset_callbacks([lambda: seen["resets"].append("part2")])


class FailOnce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if attempt == 1 and rank == 1 and state2.epoch == FAIL_EPOCH and batch == 1:
            record()
            fail(f"in epoch {state2.epoch}")


@hvd.elastic.run
def train2(state):
    record(part2_start=state.epoch, part2_entry=digest(model2.variables))
    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=100),
        FailOnce(),
    ]
    model2.fit(
        x2,
        y2,
        batch_size=BATCH,
        epochs=EPOCHS - state.epoch,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


train2(state2)
record(part2_end=digest(model2.variables), part2_epoch=state2.epoch)

# The same training, uninterrupted and without elastic, from rank 0's start.
ref1 = make_model(100)
ref_opt1 = keras.optimizers.Adam(0.01)
ref_step1 = make_step(ref1, ref_opt1)
for i in range(STEPS):
    ref_step1(*batch(i))
ref2 = make_model(200)
ref2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
ref2.fit(x2, y2, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)


def max_diff(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


job_dir = os.environ.get("TFDIST_JOB_DIR", "")
record(
    part1_diff=max_diff(model1, ref1),
    part2_diff=max_diff(model2, ref2),
    part1_moved=max_diff(model1, make_model(100)),
    job_dir=job_dir,
    commits=sorted(os.listdir(Path(job_dir) / "elastic")) if rank == 0 else [],
    done=True,
)
