"""One worker of the 2-process Keras 3 fit test (tests/strategies/test_multi_worker.py).

Reads its TF_CONFIG, builds the strategy through strategy_from_config, fits
the scripts' model, then shows that TensorFlow's own reduce() fails on what
Keras 3 passes it while tfdist's works. Prints one 'tfdist result:' line.
With TFDIST_TEST_COMPRESSION set, fits with that compression and reports the
bytes the CommunicationStats callback counted. TFDIST_TEST_STEPS sets
steps_per_execution, TFDIST_TEST_BYTES_PER_PACK the strategy's bytes_per_pack.
"""

import json
import os
import sys

import tensorflow as tf

import _common
import tfdist
from protocol import say
from tfdist.compression import CommunicationStats
from tfdist.transport.comm import ReplicaComm

compression = os.environ.get("TFDIST_TEST_COMPRESSION")
strategy = tfdist.strategy_from_config(
    register_timeout=90,
    compression=compression,
    bytes_per_pack=int(os.environ.get("TFDIST_TEST_BYTES_PER_PACK", "0")),
)
stats = CommunicationStats()
result = _common.train(
    strategy,
    epochs=2,
    per_replica_batch_size=32,
    examples=1024,
    learning_rate=0.01,
    seed=3,
    callbacks=[stats],
    steps_per_execution=int(os.environ.get("TFDIST_TEST_STEPS", "1")),
)
result["description"] = strategy.describe()
result["comm"] = stats.last.as_logs()
if compression:
    say("tfdist result: " + json.dumps(result))
    sys.exit(0)

per_replica = strategy.run(
    lambda: (
        tf.ones([2])
        * tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32),
        tf.constant(3.0),
    )
)
ours = strategy.reduce("MEAN", per_replica, axis=None)
result["tfdist_reduce"] = [
    ours[0].numpy().tolist(),
    float(ours[1]),
    float(strategy.reduce("SUM", per_replica[1], axis=0)),
]

# tfdist's compressed all-reduce follows the strategy's bytes_per_pack
# between workers: 1 MiB packs of three 2 MiB tensors make three
# collectives, with the sums of one.
shapes = [(512, 1024)] * 3


@tf.function
def packed():
    def fn():
        scale = tf.cast(
            tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32
        )
        return ReplicaComm().all_reduce([tf.fill(s, scale * (i + 1)) for i, s in enumerate(shapes)])

    return strategy.run(fn)


sums = packed()
graph = packed.get_concrete_function().graph.as_graph_def()
nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
result["packed"] = {
    "sums": [sorted(set(t.numpy().ravel().tolist())) for t in sums],
    "collectives": sum(n.op.startswith("CollectiveReduce") for n in nodes),
}

# TensorFlow's own reduce() on the same inputs, last: a failure here must not
# disturb the checks above.
stock = tf.distribute.MultiWorkerMirroredStrategy.reduce
result["stock_errors"] = []
for value, axis in ((per_replica, None), (per_replica[1], 0)):
    try:
        stock(strategy, "MEAN", value, axis=axis)
        result["stock_errors"].append(None)
    except Exception as error:  # noqa: BLE001 - recorded for the test
        result["stock_errors"].append(f"{type(error).__name__}: {error}"[:300])
say("tfdist result: " + json.dumps(result))
sys.exit(0)
