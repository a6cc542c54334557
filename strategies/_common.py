"""What the scripts in strategies/ share: flags, a model, data, the fit.

strategies/ is the repository root's folder of example scripts, not the
package tfdist/strategies/, which defines the strategies they use.

The data are made here (a fixed random classification task), so nothing is
downloaded. Each script only picks its defaults and calls :func:`main`.

Every script prints the strategy it chose and why, the training settings, one
line per epoch (the chief), the final metrics, and one machine-readable
line::

    tfdist result: {"strategy": ..., "loss": [...], "accuracy": ..., ...}

With ``--model_dir`` the chief also writes there: a checkpoint per epoch
(``checkpoints/epoch-NN.keras``), the trained model (``model.keras``) and the
result (``results.json``). The other workers of a multi-worker job run the
same saves into temporary directories (a save can be a collective that every
worker must join) and remove them.

A tfdist error (a bad flag or TF_CONFIG, no TPU, a peer that never joined)
ends the script with one line on stderr and exit code 2, not a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any, NoReturn

# Keep TensorFlow's C++ start-up chatter out of the scripts' output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from absl import flags, logging

import tfdist
from tfdist.errors import TfdistError

FLAGS = flags.FLAGS

#: Exit code of a script that stopped on a tfdist error (as the tfdist CLI).
ERROR_EXIT_CODE = 2


def define_flags() -> None:
    """tfdist's strategy flags plus the training flags of these scripts."""
    tfdist.define_flags()
    flags.DEFINE_integer("epochs", 3, "Epochs to train.")
    flags.DEFINE_integer(
        "per_replica_batch_size",
        32,
        "Batch size per replica; the global batch is this times the number of replicas.",
    )
    flags.DEFINE_integer("examples", 4096, "Training examples to make.")
    flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate.")
    flags.DEFINE_string(
        "model_dir",
        None,
        "Where the chief writes a checkpoint per epoch "
        "(checkpoints/), the trained model (model.keras) and "
        "results.json; default: nothing is written.",
    )
    flags.DEFINE_integer("seed", 0, "Seed for the data and the weights.")
    flags.DEFINE_enum(
        "jit_compile",
        "auto",
        ["auto", "true", "false"],
        "XLA (Keras compile's jit_compile): 'true' compiles each "
        "replica's step; 'auto' turns it on where Keras would (a GPU).",
    )
    flags.DEFINE_string(
        "backup_dir",
        None,
        "tfdist.BackupAndRestore directory, one that every worker "
        "sees: a rerun (a restarted or requeued job) resumes from it. "
        "On SIGTERM the workers save there at one step and exit 143.",
    )
    adopt_flags()


def adopt_flags() -> None:
    """Lists the tfdist and training flags in the script's ``--help``.

    absl's ``--help`` shows the main module's key flags only; the flags are
    defined in ``tfdist.strategies.flags`` and here.
    """
    import tfdist.strategies.flags as tfdist_flags

    main_module = sys.argv[0]
    for module in (tfdist_flags, sys.modules[__name__]):
        for flag in FLAGS.get_flags_for_module(module.__name__):
            FLAGS.register_key_flag_for_module(main_module, flag)


def exit_with(error: BaseException) -> NoReturn:
    """Ends the script with the error's message on one line of stderr."""
    script = os.path.basename(sys.argv[0]) or "script"
    message = " ".join(str(error).split())
    print(f"{script}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(ERROR_EXIT_CODE)


def strategy_from_flags() -> Any:
    """``tfdist.strategy_from_flags()``, printing what it chose and why.

    Exits with one line on stderr (see :func:`exit_with`) on a tfdist error.
    Keeps absl's INFO lines (TensorFlow's and tfdist's) out of the output.
    """
    logging.set_verbosity(logging.WARNING)
    try:
        strategy = tfdist.strategy_from_flags()
    except TfdistError as error:
        exit_with(error)
    print(tfdist.describe(strategy), flush=True)
    return strategy


def make_data(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A 3-class task on 16 features that a small MLP learns in a few epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 16)).astype("float32")
    w = rng.normal(size=(16, 3)).astype("float32")
    y = np.argmax(x @ w + 0.1 * rng.normal(size=(examples, 3)), axis=1)
    return x, y.astype("int32")


def build_model(
    learning_rate: float, seed: int, steps_per_execution: int = 1, jit_compile: bool | str = "auto"
) -> Any:
    """The scripts' model: a compiled 16-64-3 MLP with fixed initial weights.

    Args:
        learning_rate: Adam's learning rate.
        seed: Seeds Keras's initializers.
        steps_per_execution: Keras's ``compile`` argument.
        jit_compile: Keras's ``compile`` argument: XLA (True, False or
            ``"auto"``).

    Returns:
        A compiled ``keras.Sequential``; call this inside ``strategy.scope()``.
    """
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
    )
    return model


def weights_sha256(weights: list[np.ndarray]) -> str:
    """Bit-for-bit fingerprint of a model's weights (``model.get_weights()``)."""
    flat = np.concatenate([np.asarray(w, "float32").ravel() for w in weights])
    return hashlib.sha256(flat.astype("<f4").tobytes()).hexdigest()


def _is_chief(strategy: Any) -> bool:
    from tfdist.training.callbacks import is_chief

    return is_chief(strategy)


def save_model(model: Any, strategy: Any, model_dir: str) -> str:
    """Saves ``model`` as ``model_dir/model.keras`` from the chief.

    The other workers save into a temporary directory that is removed: under
    MultiWorkerMirrored, saving on-read variables (tfdist's compression
    state) is a collective that every worker must join.
    """
    if _is_chief(strategy):
        os.makedirs(model_dir, exist_ok=True)
        path = os.path.join(model_dir, "model.keras")
        model.save(path)
        return path
    scratch = tempfile.mkdtemp(prefix="tfdist-model-")
    try:
        model.save(os.path.join(scratch, "model.keras"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return os.path.join(model_dir, "model.keras")


def train(
    strategy: Any,
    *,
    epochs: int,
    per_replica_batch_size: int,
    examples: int,
    learning_rate: float,
    seed: int,
    callbacks: list | None = None,
    model_dir: str | None = None,
    steps_per_execution: int = 1,
    jit_compile: bool | str = "auto",
) -> dict:
    """Fits the model under ``strategy``; returns the final metrics.

    Args:
        strategy: The strategy to fit under.
        epochs: Epochs to train.
        per_replica_batch_size: Examples per replica per step.
        examples: Examples to make (see :func:`make_data`).
        learning_rate: Adam's learning rate.
        seed: Seeds the data and the initial weights.
        callbacks: Extra Keras callbacks.
        model_dir: If given, a checkpoint per epoch goes to
            ``model_dir/checkpoints/`` and the trained model to
            ``model_dir/model.keras`` (written by the chief only).
        steps_per_execution: Steps per call of Keras's train function.
        jit_compile: XLA: True, False or ``"auto"`` (Keras's ``compile``).

    Returns:
        The strategy's name, replicas, global batch, the loss per epoch, the
        final accuracy, the number of weights and two fingerprints of the
        final weights (``weights_sha256`` is bit-for-bit); with
        ``model_dir``, the saved model's path as ``saved_model``.
    """
    import tensorflow as tf

    global_batch = per_replica_batch_size * strategy.num_replicas_in_sync
    x, y = make_data(examples, seed)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    # Every worker makes the same data, so shard by element, explicitly.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = data.with_options(options)
    with strategy.scope():
        model = build_model(learning_rate, seed, steps_per_execution, jit_compile)
    callbacks = list(callbacks or [])
    if model_dir:
        callbacks.append(
            tfdist.ModelCheckpoint(
                os.path.join(model_dir, "checkpoints", "epoch-{epoch:02d}.keras")
            )
        )
    chief = getattr(strategy, "is_chief", True)
    history = model.fit(
        data, epochs=epochs, verbose=2 if chief else 0, shuffle=False, callbacks=callbacks
    )
    final = model.get_weights()
    weights = np.concatenate([w.ravel() for w in final])
    result = {
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": float(history.history["accuracy"][-1]),
        "params": int(weights.size),
        "weights_checksum": float(np.sum(weights * np.arange(1, weights.size + 1) % 7)),
        # Bit-for-bit identity of the final weights (multi-worker checks).
        "weights_sha256": weights_sha256(final),
    }
    if model_dir:
        result["saved_model"] = save_model(model, strategy, model_dir)
    return result


def print_settings(strategy: Any) -> None:
    """One line with the training settings the flags chose."""
    replicas = strategy.num_replicas_in_sync
    print(
        f"training: {FLAGS.epochs} epoch(s) on {FLAGS.examples} examples, "
        f"global batch {FLAGS.per_replica_batch_size * replicas} "
        f"({FLAGS.per_replica_batch_size} per replica x {replicas} "
        f"replica(s)), learning rate {FLAGS.learning_rate}, model_dir "
        f"{FLAGS.model_dir or 'none'}",
        flush=True,
    )


def report(result: dict, strategy: Any) -> None:
    """Prints the final metrics and the result line; writes results.json.

    ``results.json`` goes to ``--model_dir`` (when given), from the chief.
    """
    loss = result["loss"]
    print(
        f"final: loss {loss[-1]:.4f} (first epoch {loss[0]:.4f}), "
        f"accuracy {result['accuracy']:.4f}",
        flush=True,
    )
    print("tfdist result: " + json.dumps(result), flush=True)
    if FLAGS.model_dir and _is_chief(strategy):
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        with open(os.path.join(FLAGS.model_dir, "results.json"), "w") as f:
            json.dump(result, f)


def jit_compile_flag() -> bool | str:
    """``--jit_compile`` as Keras's ``compile`` takes it."""
    return {"true": True, "false": False}.get(FLAGS.jit_compile, "auto")


def main(_argv: list[str]) -> None:
    """Builds the strategy from the flags, trains, and reports."""
    strategy = strategy_from_flags()
    print_settings(strategy)
    callbacks = []
    if getattr(strategy, "compression", None) is not None and strategy.compression.enabled:
        from tfdist.compression import CommunicationStats

        callbacks.append(CommunicationStats())
    # Saves on preemption, resumes a rerun (after the stats, read below).
    backup = [tfdist.BackupAndRestore(FLAGS.backup_dir)] if FLAGS.backup_dir else []
    try:
        result = train(
            strategy,
            epochs=FLAGS.epochs,
            per_replica_batch_size=FLAGS.per_replica_batch_size,
            examples=FLAGS.examples,
            learning_rate=FLAGS.learning_rate,
            seed=FLAGS.seed,
            callbacks=callbacks + backup,
            model_dir=FLAGS.model_dir,
            jit_compile=jit_compile_flag(),
        )
    except TfdistError as error:
        exit_with(error)
    if callbacks and callbacks[0].last is not None:
        print(f"tfdist compression {strategy.compression}: {callbacks[0].last}", flush=True)
        result["comm"] = callbacks[0].last.as_logs()
    report(result, strategy)
