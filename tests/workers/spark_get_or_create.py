"""tfdist.spark.run as spark-tensorflow-distributor's runner is used.

Run as a script by tests/engines/test_spark.py, in a fresh process with no Spark
session: ``run(train, num_workers=2, epochs=..., learning_rate=...)`` must get
its session itself (``SparkSession.builder.getOrCreate()``), and ``train``
takes no context: it reads it from ``tfdist.spark.context()``. ``train`` is
defined here, in ``__main__``, so cloudpickle sends it by value; the tasks
import ``_common`` (strategies/) from the PYTHONPATH they inherit.

Prints one ``result: {...}`` JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys

from protocol import say


def train(epochs: int, learning_rate: float = 0.01) -> dict:
    """Keras code with no strategy in it; run() supplies the scope."""
    import numpy as np
    import tensorflow as tf

    import _common
    import tfdist.spark

    ctx = tfdist.spark.context()
    in_scope = tf.distribute.get_strategy()
    x, y = _common.make_data(1024, 3)
    model = _common.build_model(learning_rate, 3)
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, shuffle=False)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    report = {
        "worker_index": ctx.worker_index,
        "is_chief": ctx.is_chief,
        "scope_is_ctx_strategy": in_scope is ctx.strategy,
        "variables_mirrored": type(model.trainable_variables[0].value).__name__,
        "task": ctx.strategy.task,
        "loss": [float(v) for v in history.history["loss"]],
        "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
    }
    reports = [json.loads(r) for r in ctx.all_gather(json.dumps(report))]
    return {
        "tasks": reports,
        "replicas": ctx.strategy.num_replicas_in_sync,
        "tf_config": ctx.tf_config,
    }


def main() -> None:
    from pyspark.sql import SparkSession

    import tfdist.spark

    before = SparkSession.getActiveSession()
    result = tfdist.spark.run(
        train,
        num_workers=2,
        epochs=int(sys.argv[1]),
        learning_rate=0.02,
        timeout=300,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    session = SparkSession.getActiveSession()
    conf = session.sparkContext.getConf()
    result["session"] = {
        "active_before": before is not None,
        "master": session.sparkContext.master,
        **{
            key: conf.get(key, None)
            for key in (
                "spark.python.worker.reuse",
                "spark.scheduler.barrier.maxConcurrentTasksCheck.interval",
                "spark.driver.host",
                "spark.driver.bindAddress",
                "spark.pyspark.python",
            )
        },
    }
    say("result: " + json.dumps(result))
    session.stop()


if __name__ == "__main__":
    main()
