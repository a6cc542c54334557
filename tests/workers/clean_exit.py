"""One worker of the clean-exit test (tests/strategies/test_clean_exit.py).

A tiny 2-worker Keras fit; then worker 0 stays TFDIST_TEST_LINGER seconds
longer than worker 1 (as a chief that saves or evaluates), past the
coordination service's heartbeat timeout (TFDIST_TEST_HEARTBEAT seconds).
Prints one 'tfdist result:' line when leaving, and 'tfdist exited: TIME'
after tfdist's exit handler ran.
"""

import atexit
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result, say
from tfdist.strategies.multi_worker import configure_coordination

# Registered before the strategy's handler, so it runs after it.
atexit.register(lambda: say(f"tfdist exited: {time.time()}"))

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
configure_coordination(
    resolver.cluster_spec(),
    register_timeout=90,
    heartbeat_timeout=float(os.environ["TFDIST_TEST_HEARTBEAT"]),
)
strategy = tfdist.strategy_from_config()
task = strategy.cluster_resolver.task_id
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.random.RandomState(0).rand(64, 4).astype("float32")
history = model.fit(x, x.sum(1, keepdims=True), batch_size=32, epochs=1, verbose=0)
if task == 0:
    time.sleep(float(os.environ["TFDIST_TEST_LINGER"]))
result({"task": task, "loss": history.history["loss"], "leaving": time.time()})
sys.exit(0)
