"""Keras fit with gradient compression, and the bytes it saves.

On one machine this mirrors over 2 logical CPUs (``--cpu_replicas=2``) and
compresses with PowerSGD of rank 4 (``--compression=powersgd:4``):

    python strategies/compressed.py --epochs=3
    python strategies/compressed.py --compression=topk:0.05

Under a multi-worker TF_CONFIG (``tfdist launch --workers 2
strategies/compressed.py``, or one process per host) the same script trains
with MultiWorkerMirrored across the workers, compressing what they send.

Before training it prints the bytes per step that
``tfdist.compression.predict_traffic`` predicts for this model; after, what
the ``CommunicationStats`` callback counted: bytes each replica sent for the
last step, the dense fp32 all-reduce it replaces, their ratio, and the totals
over the run (PowerSGD's first steps are dense warm-up steps).
"""

from __future__ import annotations

from absl import app, flags

import _common
from tfdist.errors import TfdistError

_common.define_flags()
flags.FLAGS.set_default("compression", "powersgd:4")
flags.FLAGS.set_default("cpu_replicas", 2)
FLAGS = flags.FLAGS


def main(_argv: list[str]) -> None:
    """Trains with compression and prints the traffic per step."""
    from tfdist.compression import CommunicationStats, predict_traffic

    strategy = _common.strategy_from_flags()
    _common.print_settings(strategy)
    replicas = strategy.num_replicas_in_sync
    if not strategy.compression.enabled or replicas < 2:
        _common.exit_with(
            TfdistError(
                f"nothing to compress: compression={strategy.compression}, "
                f"{replicas} replica(s) in sync. Give --compression and at least "
                "2 replicas (--cpu_replicas=2, or a multi-worker TF_CONFIG)."
            )
        )
    # The prediction needs only the shapes: a model outside the strategy.
    model = _common.build_model(FLAGS.learning_rate, FLAGS.seed)
    predicted = predict_traffic(model, strategy.compression, replicas)
    print(f"predicted for {strategy.compression} after any warm-up: {predicted}", flush=True)

    stats = CommunicationStats()
    try:
        result = _common.train(
            strategy,
            epochs=FLAGS.epochs,
            per_replica_batch_size=FLAGS.per_replica_batch_size,
            examples=FLAGS.examples,
            learning_rate=FLAGS.learning_rate,
            seed=FLAGS.seed,
            callbacks=[stats],
            model_dir=FLAGS.model_dir,
        )
    except TfdistError as error:
        _common.exit_with(error)
    last = stats.last
    total_ratio = stats.total_dense_bytes / stats.total_bytes
    print(
        f"bytes per step (last step): {last.sent:,.0f} sent per replica, "
        f"{last.dense_sent:,.0f} for a dense fp32 all-reduce: "
        f"ratio {last.ratio:.2f}x",
        flush=True,
    )
    print(
        f"whole run ({stats.steps} steps): {stats.total_bytes:,.0f} bytes sent "
        f"per replica instead of {stats.total_dense_bytes:,.0f}: "
        f"ratio {total_ratio:.2f}x",
        flush=True,
    )
    result["compression"] = str(strategy.compression)
    result["comm"] = last.as_logs()
    result["comm_predicted"] = predicted.as_logs()
    result["comm_total"] = {
        "steps": stats.steps,
        "bytes": stats.total_bytes,
        "dense_bytes": stats.total_dense_bytes,
        "ratio": total_ratio,
    }
    _common.report(result, strategy)


if __name__ == "__main__":
    app.run(main)
