"""One task of a 2-worker job that creates several multi-worker strategies in
sequence and fits a tiny model under each (tests/strategies/test_late_strategy.py).

    python strategy_sequence.py COUNT LAG

worker:0 waits LAG seconds before each strategy after the first, so that
worker:1 always reaches the new strategy's first collective first (the
order that lost it, tfdist.strategies.rejoin). Then worker:0 creates one more
strategy that worker:1 never creates, with a 3 s register_timeout, and
records the error. Prints one "tfdist result:" line.
"""

import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import result

COUNT, LAG = int(sys.argv[1]), float(sys.argv[2])
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int64")

fits, task = [], None
for number in range(COUNT):
    if number and task == "worker:0":
        time.sleep(LAG)
    strategy = tfdist.strategy_from_config(register_timeout=60)
    task = strategy.task
    with strategy.scope():
        keras.utils.set_random_seed(number)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    # Each worker reads its own half of every global batch of 16.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    history = model.fit(data, epochs=2, verbose=0)
    fits.append(
        {
            "replicas": strategy.num_replicas_in_sync,
            "loss": history.history["loss"],
            "kernel": model.get_weights()[0].ravel().tolist(),
        }
    )

unmatched = None
if task == "worker:0":
    started = time.monotonic()
    try:
        tfdist.strategy_from_config(register_timeout=3)
    except tfdist.ClusterJoinError as error:
        unmatched = {"error": str(error), "seconds": time.monotonic() - started}
result({"task": task, "fits": fits, "unmatched": unmatched})
