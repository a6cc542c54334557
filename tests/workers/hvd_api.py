"""Horovod's collectives and optimizers on 2 ranks (tests/horovod/test_horovod_api.py).

Prints one ``tfdist result:`` JSON; the test compares ranks and checks values
computed here from each rank's own inputs.
"""

import sys

import tfdist.horovod as hvd
from protocol import result

hvd.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist.compression import CommunicationStats, step_traffic  # noqa: E402
from tfdist.compression.keras_hook import state_variables  # noqa: E402

r, n = hvd.rank(), hvd.size()
out: dict = {"rank": r}

# Collectives, eagerly and in a tf.function.
mine = tf.constant([1.0 + r, 10.0 * r])
out["avg"] = hvd.allreduce(mine).numpy().tolist()
out["sum"] = hvd.allreduce(mine, op=hvd.Sum).numpy().tolist()
out["min"] = hvd.allreduce(mine, op=hvd.Min).numpy().tolist()
out["max"] = hvd.allreduce(mine, op=hvd.Max).numpy().tolist()
out["scaled"] = (
    hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy().tolist()
)
out["int_sum"] = hvd.allreduce(tf.constant([r + 1], tf.int64), op=hvd.Sum).numpy().tolist()
out["grouped"] = [
    t.numpy().tolist()
    for t in hvd.grouped_allreduce(
        [mine, tf.constant([[float(r)]]), tf.constant([r], tf.int32)], op=hvd.Sum
    )
]
out["fp16_allreduce"] = hvd.allreduce(mine, compression=hvd.Compression.fp16).numpy().tolist()
out["gather"] = hvd.allgather(tf.fill([r + 1, 2], float(r))).numpy().tolist()
out["bcast_bool"] = hvd.broadcast(tf.constant([r == 1, True]), 1).numpy().tolist()
out["bcast_i64"] = hvd.broadcast(tf.constant([2**40 + r], tf.int64), 1).numpy().tolist()
out["object"] = hvd.broadcast_object({"from": r, "text": "é" * 5}, root_rank=1)
out["objects"] = hvd.allgather_object(("rank", r, [r] * r))
slices = tf.IndexedSlices(tf.fill([r + 1, 3], 1.0 + r), tf.range(r + 1), tf.constant([4, 3]))
got = hvd.allreduce(slices)
out["slices"] = tf.convert_to_tensor(got).numpy().tolist()


@tf.function
def in_graph(x):
    return hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, 0)


s, g, b = in_graph(mine)
out["graph"] = [s.numpy().tolist(), g.numpy().tolist(), b.numpy().tolist()]
hvd.barrier()
out["join"] = hvd.join()

# DistributedOptimizer in fit with each compression setting: the same weights
# on both ranks, a falling loss, and the bytes tfdist counts.
rng = np.random.RandomState(r)
x = rng.rand(64, 16).astype("float32")
y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).astype("int32")
fits = {}
from tfdist.compression import TopKCompressor  # noqa: E402

auto = None
for setting in ["none", "fp16", "bf16", "topk", "powersgd:2", "auto"]:
    # A tfdist compressor object works too (top-k on every tensor, however small).
    compression = {
        "none": hvd.Compression.none,
        "fp16": hvd.Compression.fp16,
        "topk": TopKCompressor(0.25, min_size=0),
    }.get(setting, setting)
    if setting == "auto":
        from tfdist.compression.auto import AutoCompression

        compression = auto = AutoCompression()
    keras.utils.set_random_seed(r)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
    )
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=compression)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stats = CommunicationStats()
    hvd.broadcast_variables(model.variables, 0)
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[stats])
    w = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    spread = max(float(np.abs(o - w).max()) for o in hvd.allgather_object(w))
    t = step_traffic(opt)
    fits[setting] = {
        "spread": spread,
        "loss": hist.history["loss"],
        "sent": t.sent,
        "dense": t.dense_sent,
        "stats_sent": stats.last.sent,
        "state": len(state_variables(opt)),
    }
    if setting == "none":
        model.save(sys.argv[1] + f"/model_{r}.keras")
out["fits"] = fits
out["auto_choice"] = f"auto -> {auto.decision.choice}"

# hvd.load_model: the optimizer comes back distributed, with its state.
loaded = hvd.load_model(sys.argv[1] + f"/model_{r}.keras")
out["loaded_distributed"] = hvd.optimizer.is_distributed(loaded.optimizer)
out["loaded_iterations"] = int(loaded.optimizer.iterations.numpy())
loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
w = np.concatenate([v.numpy().ravel() for v in loaded.trainable_variables])
out["loaded_spread"] = max(float(np.abs(o - w).max()) for o in hvd.allgather_object(w))

# DistributedGradientTape with PowerSGD (error feedback) in a tf.function loop.
keras.utils.set_random_seed(0)
tm = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(2)])
topt = keras.optimizers.SGD(0.1)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, tm(xb, training=True))
    tape = hvd.DistributedGradientTape(tape, compression="powersgd:1")
    out["tape_isinstance"] = isinstance(tape, tf.GradientTape)
    grads = tape.gradient(loss, tm.trainable_variables)
    topt.apply_gradients(zip(grads, tm.trainable_variables))
    return loss


losses = [
    float(train_step(x[i : i + 16], y[i : i + 16])) for i in range(0, 64, 16) for _ in range(3)
]
w = np.concatenate([v.numpy().ravel() for v in tm.trainable_variables])
out["tape_spread"] = max(float(np.abs(o - w).max()) for o in hvd.allgather_object(w))
tt = hvd.tape_traffic(tm.trainable_variables, compression="powersgd:1")
out["tape_sent"], out["tape_dense"] = tt.sent, tt.dense_sent
out["tape_losses"] = [losses[0], losses[-1]]
result(out)
