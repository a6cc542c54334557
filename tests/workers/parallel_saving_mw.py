"""One worker of the 2-process save/load check (tests/parallel/test_parallel_saving.py).

Two MultiWorkerMirrored workers with one replica each form one tensor group
(T=2, the group spans the processes, so a full value is a gather every
worker joins). The worker fits the MLP a few Adam steps, then saves it with
model.save (the chief's file) and tf.train.Checkpoint (its own directory),
and loads both back: with no strategy, and at T=2 in the same job. Prints
one 'tfdist result:' line with the shapes and the differences it saw.
"""

import os
import zipfile

import h5py
import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result
from tfdist import parallel as tp

out = os.environ["TFDIST_TEST_DIR"]
strategy = tfdist.strategy_from_config(register_timeout=90)
index = strategy.cluster_resolver.task_id
tp.attach(strategy, 2)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype("float32")
y = rng.normal(size=(64, 4)).astype("float32")


def build():
    model = keras.Sequential(
        [keras.Input((8,)), tp.ColumnParallelDense(16, activation="relu"), tp.RowParallelDense(4)]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


with strategy.scope():
    model = build()
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
local = [c.numpy() for c in strategy.experimental_local_results(model.layers[0].kernel.value)]
weights = model.get_weights()
slots = tp.saving.full_weights(model.optimizer.variables)
path = os.path.join(out, "mw.keras")
model.save(path)
ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
    os.path.join(out, f"ckpt_{index}", "c")
)

with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as f, h5py.File(f) as h5:
    saved_kernel = h5["layers/column_parallel_dense/vars/0"][()]
plain = keras.models.load_model(path)
with strategy.scope():
    again = keras.models.load_model(path)
    restored = build()
    restored.optimizer.build(restored.trainable_variables)
tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(ckpt).assert_consumed()


def diff(a, b):
    return max(float(np.abs(np.asarray(p) - np.asarray(q)).max()) for p, q in zip(a, b))


result(
    {
        "index": index,
        "local_shard": list(local[0].shape),
        "full": [list(w.shape) for w in weights],
        "saved_kernel": list(saved_kernel.shape),
        "saved_vs_full": float(np.abs(saved_kernel - weights[0]).max()),
        "weights_checksum": float(sum(np.abs(w).sum() for w in weights)),
        "plain": diff(plain.get_weights(), weights),
        "plain_slots": diff(tp.saving.full_weights(plain.optimizer.variables), slots),
        "again": diff(again.get_weights(), weights),
        "again_shard": list(again.layers[0].kernel.shape),
        "again_slots": diff(tp.saving.full_weights(again.optimizer.variables), slots),
        "restored": diff(restored.get_weights(), weights),
        "restored_slots": diff(tp.saving.full_weights(restored.optimizer.variables), slots),
    }
)
