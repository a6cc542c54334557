"""Keras ``model.fit`` under ParameterServerStrategy.

Keras 3's ``model.fit`` does not support ParameterServerStrategy; under
tfdist's, ``model.fit`` runs ``tfdist.fit``, which takes the same arguments
and runs the training on the chief (the coordinator), scheduling steps
asynchronously on the workers.

On one machine, either let the script start its own servers (subprocesses
on 127.0.0.1):

    python strategies/parameter_server.py --local_workers=2 --local_ps=1

or run every task of a cluster with ``tfdist launch`` (ps and workers serve,
the chief runs this script):

    tfdist launch --chief --workers 2 --ps 1 strategies/parameter_server.py

On several hosts, give every task its TF_CONFIG (``tfdist hosts SPEC --
strategies/parameter_server.py`` prints each host's command) and run this
script on each: on ps and worker tasks ``strategy_from_config()`` serves the
cluster and never returns; the chief trains. With ``--model_dir`` the chief
backs up every epoch (``backup/``; a restarted chief resumes from it), writes
a checkpoint per epoch and the trained model.
"""

from __future__ import annotations

import contextlib
import json
import os

from absl import app, flags

import _common

_common.define_flags()
flags.DEFINE_integer(
    "local_workers",
    0,
    "Start a local cluster with this many "
    "worker servers (and --local_ps ps) instead of reading "
    "TF_CONFIG; 0: use TF_CONFIG.",
)
flags.DEFINE_integer("local_ps", 1, "Parameter servers of the --local_workers cluster.")
flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Steps per epoch over all workers; default: examples / per_replica_batch_size.",
)
flags.FLAGS.set_default("strategy", "parameter_server")
FLAGS = flags.FLAGS


def train(
    strategy,
    *,
    epochs: int,
    batch_size: int,
    steps_per_epoch: int | None,
    examples: int,
    learning_rate: float,
    seed: int,
    model_dir: str | None,
) -> dict:
    """Trains under ``strategy`` with ``model.fit``; returns the final metrics.

    Args:
        strategy: Any strategy; under ParameterServerStrategy this runs on
            the chief.
        epochs: Epochs to train.
        batch_size: Examples per step (per worker under ParameterServer).
        steps_per_epoch: Steps per epoch; None for one pass over the data.
        examples: Training examples to make; a quarter more are held out.
        learning_rate: Adam's learning rate.
        seed: Seeds the data and the initial weights.
        model_dir: Backups, checkpoints and the trained model go here.
    """
    import numpy as np

    import tfdist

    x, y = _common.make_data(examples + examples // 4, seed)
    x_val, y_val = x[examples:], y[examples:]
    x, y = x[:examples], y[:examples]
    with strategy.scope():
        model = _common.build_model(learning_rate, seed)
    callbacks = []
    if model_dir:
        callbacks += [
            tfdist.BackupAndRestore(os.path.join(model_dir, "backup")),
            tfdist.ModelCheckpoint(
                os.path.join(model_dir, "checkpoints", "epoch-{epoch:02d}.keras")
            ),
        ]
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=2,
    )
    final = model.get_weights()
    result = {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "batch_size": batch_size,
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": float(history.history["accuracy"][-1]),
        "val_loss": [float(v) for v in history.history["val_loss"]],
        "val_accuracy": float(history.history["val_accuracy"][-1]),
        "steps_per_epoch": steps_per_epoch or int(np.ceil(examples / batch_size)),
        "epochs_run": len(history.history["loss"]),
        "iterations": int(model.optimizer.iterations.numpy()),
        "params": int(sum(w.size for w in final)),
        "weights_sha256": _common.weights_sha256(final),
    }
    if model_dir:
        result["saved_model"] = _common.save_model(model, strategy, model_dir)
    return result


def main(_argv) -> None:
    import tfdist
    from tfdist.errors import TfdistError

    cluster = contextlib.nullcontext()
    if FLAGS.local_workers:
        try:
            cluster = tfdist.local_cluster(workers=FLAGS.local_workers, ps=FLAGS.local_ps)
        except TfdistError as error:
            _common.exit_with(error)
        os.environ["TF_CONFIG"] = json.dumps(cluster.tf_config)
        print(f"local cluster: {cluster.cluster}", flush=True)
    with cluster:
        strategy = _common.strategy_from_flags()
        print(
            f"training: {FLAGS.epochs} epoch(s) on {FLAGS.examples} examples, "
            f"batch {FLAGS.per_replica_batch_size} per step, learning rate "
            f"{FLAGS.learning_rate}, model_dir {FLAGS.model_dir or 'none'}",
            flush=True,
        )
        try:
            result = train(
                strategy,
                epochs=FLAGS.epochs,
                batch_size=FLAGS.per_replica_batch_size,
                steps_per_epoch=FLAGS.steps_per_epoch,
                examples=FLAGS.examples,
                learning_rate=FLAGS.learning_rate,
                seed=FLAGS.seed,
                model_dir=FLAGS.model_dir,
            )
        except TfdistError as error:
            _common.exit_with(error)
        print(
            f"steps: {result['iterations']} optimizer steps for "
            f"{result['epochs_run']} epoch(s) x {result['steps_per_epoch']} steps",
            flush=True,
        )
        _common.report(result, strategy)


if __name__ == "__main__":
    app.run(main)
