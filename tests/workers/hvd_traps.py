"""Horovod's semantic traps, one 2-rank job (tests/horovod/test_horovod_traps.py).

Run under ``tfdist launch --workers 2`` with TFDIST_COLLECTIVE_TIMEOUT set.
Each check prints ``tfdist result: {...}`` once at the end; the timeout check
runs last because it aborts this process's collectives.
"""

import os
import sys
import time

import tfdist.horovod as hvd
from protocol import result

cuda_before = os.environ.get("CUDA_VISIBLE_DEVICES")
hvd.init()  # Before any device set-up, as Horovod's examples do.

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

out: dict = {}
# 1. Device set-up after init(): TensorFlow's runtime has not started yet,
# so this does not raise "Visible devices cannot be modified after being
# initialized"; CUDA_VISIBLE_DEVICES is left alone.
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_visible_devices(cpus, "CPU")
out["visible_devices_set"] = True
out["cuda_unchanged"] = os.environ.get("CUDA_VISIBLE_DEVICES") == cuda_before
r, n = hvd.rank(), hvd.size()
out["rank"], out["size"] = r, n

rng = np.random.RandomState(0)
x = rng.rand(32, 6).astype("float32")
y = (x.sum(1) > 3).astype("int32")


def weights(model):
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def spread(model):
    """Max abs difference of the weights between ranks."""
    mine = weights(model)
    return float(max(np.abs(w - mine).max() for w in hvd.allgather_object(mine)))


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )


# 2. No sharding, rebatching or LR rescaling: each rank trains on everything it
# is given, at the learning rate the script set.
model = make_model(r)
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * n))
model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hvd.broadcast_variables(model.variables, root_rank=0)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 4 batches.
model.fit(data, epochs=2, verbose=0, shuffle=False)
out["steps"] = int(opt.iterations.numpy())
out["lr"] = float(opt.learning_rate.numpy())
out["fit_spread"] = spread(model)
out["is_sgd"] = isinstance(opt, keras.optimizers.SGD)

# 3. Rank-0-only work involves no collective: a save and a checkpoint
# callback on rank 0, then training and collectives go on together.
ckpt_dir = sys.argv[1]
callbacks = (
    [keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "ckpt.keras"))] if r == 0 else []
)
if r == 0:
    model.save(os.path.join(ckpt_dir, "model.keras"))
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
out["after_save_spread"] = spread(model)
out["saved_files"] = sorted(os.listdir(ckpt_dir)) if r == 0 else []

# 4. Mixed precision: compile wraps the optimizer in a LossScaleOptimizer.
# Rank 1's first batch overflows float16; both ranks must skip that step
# together instead of rank 0 waiting in an all-reduce rank 1 never joins.
keras.mixed_precision.set_global_policy("mixed_float16")
mp = make_model(0)
mp.compile(
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
xm = x.copy()
if r == 1:
    xm[0] = 1e30
mp.fit(xm, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
out["lso_wrapped"] = type(mp.optimizer).__name__
out["lso_scale"] = float(mp.optimizer.dynamic_scale.numpy())
out["lso_inner_steps"] = int(mp.optimizer.inner_optimizer.iterations.numpy())
out["lso_spread"] = spread(mp)
keras.mixed_precision.set_global_policy("float32")

# 5. XLA: jit_compile=True cannot compile the multi-process all-reduce; it is
# turned off (with a log line) and training works.
jm = make_model(r)
jm.compile(
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    jit_compile=True,
)
out["jit_compile"] = jm.jit_compile
hvd.broadcast_variables(jm.variables, 0)
jm.fit(x, y, batch_size=8, epochs=1, verbose=0)
out["jit_spread"] = spread(jm)

# 6. backward_passes_per_step=2: the first pass only accumulates (nothing
# sent, weights unchanged); the second sends the sum once.
from tfdist.compression import step_traffic  # noqa: E402

am = make_model(0)
aopt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
grads = []
for part in (slice(0, 8), slice(8, 16)):
    with tf.GradientTape() as tape:
        logits = am(x[part] + r)
        loss = tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(y[part], logits, from_logits=True)
        )
    grads.append(tape.gradient(loss, am.trainable_variables))
start = weights(am)
start_vars = [v.numpy() for v in am.trainable_variables]
aopt.apply_gradients(zip(grads[0], am.trainable_variables))
out["bpps_first_changed"] = float(np.abs(weights(am) - start).max())
out["bpps_first_sent"] = step_traffic(aopt).sent
aopt.apply_gradients(zip(grads[1], am.trainable_variables))
summed = [hvd.allreduce(a + b) for a, b in zip(*grads)]  # Average over ranks of the sum.
expected = np.concatenate([(w0 - 0.1 * g.numpy()).ravel() for w0, g in zip(start_vars, summed)])
out["bpps_error"] = float(np.abs(weights(am) - expected).max())
out["bpps_second_sent"] = step_traffic(aopt).sent
out["bpps_iterations"] = int(aopt.iterations.numpy())

# A tfdist multi-worker strategy cannot join the same job's collectives.
import tfdist  # noqa: E402

try:
    tfdist.strategy_from_config()
    out["strategy_beside"] = None
except tfdist.ConfigError as error:
    out["strategy_beside"] = str(error)

# 7. Ranks that issue different collectives at the same point fail at once,
# naming both, and stay usable.
try:
    if r == 0:
        hvd.allreduce(tf.constant([1.0]), name="loss")
    else:
        hvd.broadcast(tf.constant([1.0]), 0, name="weights")
    out["mismatch"] = None
except hvd.CollectiveMismatchError as error:
    out["mismatch"] = str(error)
hvd.barrier()
out["after_mismatch"] = float(hvd.allreduce(tf.constant(1.0 + r)).numpy())

# 8. A collective only rank 0 issues fails within collective_timeout.
if r == 0:
    began = time.monotonic()
    try:
        hvd.allreduce(tf.constant([2.0]), name="only_rank_0")
        out["timeout"] = None
    except hvd.CollectiveTimeoutError as error:
        out["timeout"] = str(error)
    out["timeout_after"] = time.monotonic() - began
result(out)
if r == 1:
    # Stay alive past rank 0's timeout: the failure must come from the
    # collective_timeout, not from this process exiting.
    time.sleep(float(os.environ["TFDIST_COLLECTIVE_TIMEOUT"]) + 6)
os._exit(0)  # The aborted collectives cannot shut down cleanly.
