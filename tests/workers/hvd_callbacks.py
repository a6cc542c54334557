"""A 2-worker Horovod-style fit for tests/horovod/test_horovod_callbacks.py.

Usage: ``tfdist launch --workers 2 hvd_callbacks.py OUT_DIR``. Every rank
writes OUT_DIR/rank-N.json with what it saw:

* digests (sha256) of the model's weights, the optimizer's variables and the
  Dropout's seed state when training begins, right after the broadcast at the
  end of batch 0, and at the end.
  The ranks start from different weights (seed 10 + rank), and rank 0 alone
  has built its optimizer with non-zero momentum slots (as after loading a
  checkpoint on rank 0 only);
* the logs of each epoch before and after MetricAverageCallback, and History;
* the learning rate before every batch, as set by LearningRateWarmupCallback.
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

import tfdist.horovod as hvd

hvd.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS, BATCH, EPOCHS, WARMUP = 3, 8, 3, 2
out = Path(sys.argv[1])
rank, size = hvd.rank(), hvd.size()

keras.utils.set_random_seed(10 + rank)
rng = np.random.default_rng(rank)  # Each rank its own data, as in Horovod.
x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
y = x @ np.array([[1.0], [2.0], [-1.0], [0.5]]) + rng.normal(size=(STEPS * BATCH, 1))
y = y.astype("float32")

model = keras.Sequential(
    [
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(1),
    ]
)
weights = hvd.callbacks.model_state_variables(model)
seed_states = [v for v in model.variables if all(v is not w for w in weights)]
assert len(seed_states) == 1 and len(weights) == 4, (seed_states, weights)
initial_lr = 0.05 * size
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(initial_lr, momentum=0.9))
model.compile(optimizer=opt, loss="mse", metrics=["mean_absolute_error"])
if rank == 0:
    opt.build(model.trainable_variables)
    for slot in opt.momentums:
        slot.assign(tf.fill(slot.shape, 0.01))


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(keras.ops.convert_to_numpy(v)).tobytes())
    return h.hexdigest()


def digests():
    return {
        "model": digest(weights),
        "optimizer": digest(opt.variables),
        "seed_state": digest(seed_states),
    }


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = {"raw_logs": [], "averaged_logs": [], "rates": []}
        self.epoch = 0

    def on_train_begin(self, logs=None):
        self.seen["digest_train_begin"] = digests()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


class AfterBroadcast(Recorder):
    def on_train_batch_end(self, batch, logs=None):
        if "digest_after_batch_0" not in self.seen:
            self.seen["digest_after_batch_0"] = digests()


recorder = AfterBroadcast()


class Logs(keras.callbacks.Callback):
    def __init__(self, key):
        super().__init__()
        self.key = key

    def on_epoch_end(self, epoch, logs=None):
        recorder.seen[self.key].append(dict(logs))


class Rates(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        recorder.seen["rates"].append([recorder.epoch, batch, rate])


callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    recorder,
    Logs("raw_logs"),
    hvd.callbacks.MetricAverageCallback(),
    Logs("averaged_logs"),
    hvd.callbacks.LearningRateWarmupCallback(
        initial_lr=initial_lr, warmup_epochs=WARMUP, verbose=1
    ),
    Rates(),
]
history = model.fit(
    x,
    y,
    batch_size=BATCH,
    epochs=EPOCHS,
    shuffle=False,
    callbacks=callbacks,
    verbose=1 if rank == 0 else 0,
)

# Ranks that log different metric names: every rank raises, none hangs.
try:
    hvd.callbacks.average_logs({"loss": 1.0, f"only_on_rank_{rank}": 2.0})
    mismatch = None
except ValueError as error:
    mismatch = str(error)

result = dict(
    recorder.seen,
    mismatch=mismatch,
    size=size,
    steps=STEPS,
    warmup_epochs=WARMUP,
    initial_lr=initial_lr,
    history=history.history,
    digest_end=digests(),
    weights=np.concatenate([w.ravel() for w in model.get_weights()]).tolist(),
)
(out / f"rank-{rank}.json").write_text(json.dumps(result))
print(f"rank {rank} done", flush=True)
