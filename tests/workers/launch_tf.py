"""A TensorFlow task for the launcher tests: joins its cluster and does one
collective (multi-worker) or 10 remote steps (parameter server, on the chief).
Prints one 'tfdist result:' line."""

import tensorflow as tf

import tfdist
from protocol import result

strategy = tfdist.strategy_from_config(register_timeout=60)
if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = tf.Variable(0.0)

    @tf.function
    def step():
        counter.assign_add(1.0)
        return tf.constant(1.0)

    for _ in range(10):
        coordinator.schedule(step)
    coordinator.join()
    value = float(counter.numpy())
else:
    value = float(strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None))
result({"value": value, "task": strategy.task, "kind": strategy.kind})
