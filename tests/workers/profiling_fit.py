"""One worker of a profiled multi-worker fit (tests/profiling/test_profiling_multiworker.py).

Trains an MLP under ``strategy_from_config()`` with ``StepProfile`` and
``CommunicationStats`` and prints one 'tfdist result:' line with what both
reported. Arguments: OUT_DIR [--compression C] [--slow-worker W --sleep S]
[--steps N] [--width W] [--epochs E]. The slow worker sleeps S seconds per
batch in its input pipeline. The timeline comes from ``TFDIST_TIMELINE``
(``tfdist launch --timeline``).
"""

import argparse
import json
import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result
from tfdist.compression import CommunicationStats
from tfdist.profiling import StepProfile

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--compression", default=None)
parser.add_argument("--slow-worker", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--width", type=int, default=128)
args = parser.parse_args()

warnings_seen = []


class Keep(logging.Handler):
    def emit(self, record):
        warnings_seen.append(record.getMessage())


logging.getLogger("tfdist.profiling").addHandler(Keep(level=logging.WARNING))

strategy = tfdist.strategy_from_config(register_timeout=90, compression=args.compression)
task = json.loads(os.environ["TF_CONFIG"])["task"]
rng = np.random.default_rng(0)
batch = 32
x = rng.normal(size=(batch * args.steps, 64)).astype("float32")
y = rng.integers(0, 10, size=batch * args.steps)
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)
if task["index"] == args.slow_worker:

    def slow(a, b):
        slept = tf.py_function(lambda: time.sleep(args.sleep) or 0.0, [], tf.float32)
        with tf.control_dependencies([slept]):  # The batch waits for the sleep.
            return tf.identity(a), b

    data = data.map(slow)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
data = data.with_options(options)

with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
stats = CommunicationStats(every_batch=True)
profile = StepProfile(log_dir=os.path.join(args.out_dir, "logs"))
history = model.fit(
    data, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, callbacks=[stats, profile]
)
result(
    {
        "task": f"{task['type']}:{task['index']}",
        "worker": profile.worker,
        "chief": profile.chief,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "comm_bytes": stats.last.sent,
        "records": len(profile.records),
        "all_records": len(profile.all_records),
        "stragglers": [[e, s.worker, s.factor] for e, s in profile.stragglers],
        "warnings": warnings_seen,
        "timeline": profile.timeline,
    }
)
