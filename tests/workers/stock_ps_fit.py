"""Canary worker: Keras's own ``model.fit`` under TensorFlow's own
ParameterServerStrategy (keras-team/keras#18624), on a local cluster of
threads. Prints what the fit raised, or None."""

import json

import keras
import numpy as np
import tensorflow as tf

import tfdist
from protocol import say

with tfdist.local_cluster(workers=1, ps=1, mode="in_process") as cluster:
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    data = (
        tf.data.Dataset.from_tensor_slices(
            (np.ones((64, 4), "float32"), np.ones((64, 1), "float32"))
        )
        .batch(8)
        .repeat()
    )
    try:
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
        result = {"error": None, "message": ""}
    except Exception as error:  # noqa: BLE001 - the canary reports whatever it is.
        result = {"error": type(error).__name__, "message": str(error)[:600]}
say("tfdist result: " + json.dumps(result))
