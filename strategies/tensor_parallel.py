"""A transformer classifier trained with tensor parallelism (tfdist.parallel).

The replicas form a (data, tensor) mesh: ``--model_parallel=T`` replicas
share each layer's weights (attention heads, MLP units, vocabulary rows),
and DP = replicas / T groups train on different data. On a machine without
GPUs this splits the CPU into 2 logical devices, one tensor group of 2:

    python strategies/tensor_parallel.py --epochs=3
    python strategies/tensor_parallel.py --cpu_replicas=4 --model_parallel=2
    python strategies/tensor_parallel.py --model_parallel=1   # unsharded

The model is keras-io's "Text classification with Transformer": token and
position embeddings (the token table a ``VocabParallelEmbedding``),
``--blocks`` ``TransformerBlock``s (``ParallelMultiHeadAttention`` and a
column/row-parallel MLP), average pooling and a Dense head, on a synthetic
task (made here: nothing is downloaded). Every run starts from the same
initial weights, whatever T, so runs with different meshes compare.

It prints the mesh, one line per epoch, the per-device bytes of the
variables (weights and Adam's slots, sharded ones as their shards), the
bytes a replica sent per step (tensor-parallel activations and
data-parallel gradients), and ``tfdist result: {...}``. ``--compare`` also
trains the same model unsharded on one device and reports the largest
difference of the losses and of the full weights. The sharded forward pass
sums in another order, so activations differ by rounding (~1e-7); with
``--activation=relu`` a pre-activation that rounding moves across 0 now and
then switches a unit's gradient for one example, and Adam carries that on:
the weights then drift apart by ~1e-4 to 1e-2 over some 100 steps while the
losses still agree to ~1e-6. With gelu (the default here) they stay within
~1e-5.

``--model_dir`` gets a checkpoint per epoch, ``model.keras`` and
``results.json``, all with full weights: the model loads with no strategy or
any T that divides its widths (``import tfdist.parallel`` and this script's
``_token_and_position_embedding()`` register its classes).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from absl import app, flags

import _common
import tfdist
from tfdist.errors import TfdistError

_common.define_flags()
FLAGS = flags.FLAGS
FLAGS.set_default("strategy", "mirrored")
FLAGS.set_default("cpu_replicas", 2)
FLAGS.set_default("model_parallel", 2)
FLAGS.set_default("examples", 2048)
FLAGS.set_default("per_replica_batch_size", 16)
flags.DEFINE_integer("vocab_size", 512, "Vocabulary size (T must divide it).")
flags.DEFINE_integer("seq_len", 32, "Tokens per example.")
flags.DEFINE_integer("embed_dim", 32, "Model width.")
flags.DEFINE_integer("num_heads", 4, "Attention heads (T must divide them).")
flags.DEFINE_integer("ff_dim", 64, "The MLP's hidden width (T must divide it).")
flags.DEFINE_integer("blocks", 1, "Transformer blocks.")
flags.DEFINE_string(
    "activation",
    "gelu",
    "The MLP's hidden activation (keras-io's example has relu; see --compare).",
)
flags.DEFINE_bool(
    "compare", False, "Also train unsharded on one device and report the differences."
)


def make_text_data(
    examples: int, vocab: int, seq_len: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token sequences of 2 classes, zero-padded at the end.

    Class c draws 55% of its tokens from its half of the vocabulary and the
    rest from all of it: attention over the sequence tells the classes apart.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=examples)
    half = vocab // 2
    own = rng.integers(1, half, size=(examples, seq_len)) + labels[:, None] * (half - 1)
    anywhere = rng.integers(1, vocab, size=(examples, seq_len))
    tokens = np.where(rng.random((examples, seq_len)) < 0.55, own, anywhere)
    lengths = rng.integers(seq_len // 2, seq_len + 1, size=examples)
    tokens[np.arange(seq_len)[None, :] >= lengths[:, None]] = 0
    return tokens.astype("int32"), labels.astype("int32")


_EMBEDDING = []


def _token_and_position_embedding() -> Any:
    """keras-io's TokenAndPositionEmbedding (a registered Keras class, made
    once), with the token table split over the group and the positions a
    plain replicated weight: an Embedding of positions would give Adam
    IndexedSlices summed over the batch, which Keras treats differently on
    one device and on several."""
    if _EMBEDDING:
        return _EMBEDDING[0]
    import keras

    from tfdist import parallel

    @keras.saving.register_keras_serializable(package="tfdist_examples")
    class TokenAndPositionEmbedding(keras.layers.Layer):
        def __init__(self, vocab: int, seq_len: int, dim: int, **kwargs):
            super().__init__(**kwargs)
            self.vocab, self.seq_len, self.dim = vocab, seq_len, dim
            self.tokens = parallel.VocabParallelEmbedding(vocab, dim, mask_zero=True)

        def build(self, input_shape):
            self.tokens.build(input_shape)
            self.positions = self.add_weight(
                name="positions", shape=(self.seq_len, self.dim), initializer="uniform"
            )

        def call(self, ids):
            return self.tokens(ids) + keras.ops.cast(self.positions, self.compute_dtype)

        def compute_mask(self, ids, mask=None):
            return self.tokens.compute_mask(ids)

        def get_config(self):
            return {
                **super().get_config(),
                "vocab": self.vocab,
                "seq_len": self.seq_len,
                "dim": self.dim,
            }

    _EMBEDDING.append(TokenAndPositionEmbedding)
    return TokenAndPositionEmbedding


def build_model(
    *,
    vocab: int,
    seq_len: int,
    dim: int,
    heads: int,
    ff_dim: int,
    blocks: int,
    activation: str,
    learning_rate: float,
) -> Any:
    """The compiled classifier; tensor-parallel under a mesh, Keras's otherwise."""
    import keras

    from tfdist import parallel

    ids = keras.Input((seq_len,), dtype="int32")
    x = _token_and_position_embedding()(vocab, seq_len, dim)(ids)
    for _ in range(blocks):
        x = parallel.TransformerBlock(
            heads, dim // heads, ff_dim, dropout=0.0, activation=activation
        )(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(2)(x))
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _variable_bytes(model: Any) -> int:
    """Bytes of one device's variables: weights and optimizer slots as held
    (a sharded variable counts its shard)."""
    held = list(model.weights) + list(model.optimizer.variables)
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in held))


def main(_argv: list[str]) -> None:
    """Builds the mesh, trains, and reports."""
    import tensorflow as tf

    from tfdist import parallel

    # --model_parallel: strategy_from_config(model_parallel=T) builds the
    # mesh; describe() shows it.
    strategy = _common.strategy_from_flags()
    mesh = parallel.mesh_of(strategy)
    tp = mesh.tp if mesh is not None else 1
    _common.print_settings(strategy)
    settings = dict(
        vocab=FLAGS.vocab_size,
        seq_len=FLAGS.seq_len,
        dim=FLAGS.embed_dim,
        heads=FLAGS.num_heads,
        ff_dim=FLAGS.ff_dim,
        blocks=FLAGS.blocks,
        activation=FLAGS.activation,
        learning_rate=FLAGS.learning_rate,
    )
    import keras

    keras.utils.set_random_seed(FLAGS.seed)
    # The initial weights, full, from the same model outside the strategy.
    reference = build_model(**settings)
    initial = reference.get_weights()
    try:
        with strategy.scope():
            model = build_model(**settings)
    except TfdistError as error:
        _common.exit_with(error)
    for variable, value in zip(model.weights, initial):
        parallel.assign_full(variable, value)

    replicas = strategy.num_replicas_in_sync
    global_batch = FLAGS.per_replica_batch_size * replicas
    x, y = make_text_data(FLAGS.examples, FLAGS.vocab_size, FLAGS.seq_len, FLAGS.seed)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = data.with_options(options)
    steps = FLAGS.examples // global_batch * FLAGS.epochs
    chief = getattr(strategy, "is_chief", True)
    parallel.reset_traffic(strategy)
    start = time.perf_counter()
    callbacks = []
    if FLAGS.model_dir:  # Files hold full weights (tfdist.parallel.saving).
        callbacks.append(
            tfdist.ModelCheckpoint(
                os.path.join(FLAGS.model_dir, "checkpoints", "epoch-{epoch:02d}.keras")
            )
        )
    if FLAGS.backup_dir:
        callbacks.append(tfdist.BackupAndRestore(FLAGS.backup_dir))
    history = model.fit(
        data, epochs=FLAGS.epochs, verbose=2 if chief else 0, shuffle=False, callbacks=callbacks
    )
    seconds = time.perf_counter() - start
    sent = parallel.traffic(strategy)
    full = [parallel.full_value(v) for v in model.weights]
    result = {
        "strategy": type(strategy).__name__,
        "replicas": replicas,
        "model_parallel": tp,
        "data_parallel": replicas // tp,
        "global_batch": global_batch,
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": float(history.history["accuracy"][-1]),
        "params": int(sum(w.size for w in full)),
        "sharded_weights": sum(parallel.spec_of(v) is not None for v in model.weights),
        "variable_bytes_per_device": _variable_bytes(model),
        "sent_bytes_per_step": {kind: value / steps for kind, value in sent.items()},
        "fit_seconds": round(seconds, 2),
        "weights_sha256": _common.weights_sha256(full),
    }
    print(
        f"variables per device: {result['variable_bytes_per_device']} bytes "
        f"(weights and Adam's slots; {result['params']} parameters in all)",
        flush=True,
    )
    if sent:
        print(
            "sent per replica per step: "
            + ", ".join(
                f"{kind} {value:.0f} bytes" for kind, value in result["sent_bytes_per_step"].items()
            ),
            flush=True,
        )
    if FLAGS.model_dir:
        result["saved_model"] = _common.save_model(model, strategy, FLAGS.model_dir)
    if FLAGS.compare:
        result["compare"] = _compare(reference, x, y, global_batch, result["loss"], full)
        print(f"against unsharded on one device: {result['compare']}", flush=True)
    _common.report(result, strategy)


def _compare(reference: Any, x, y, global_batch: int, losses: list, full: list) -> dict:
    """Trains the unsharded reference on the same batches; the differences."""
    history = reference.fit(
        x[: len(x) // global_batch * global_batch],
        y[: len(y) // global_batch * global_batch],
        batch_size=global_batch,
        epochs=FLAGS.epochs,
        shuffle=False,
        verbose=0,
    )
    ref_losses = history.history["loss"]
    diffs = {
        v.path: float(np.max(np.abs(a - b)))
        for v, a, b in zip(reference.weights, full, reference.get_weights())
    }
    # A key bias's true gradient is 0 (softmax cancels it): Adam turns its
    # rounding noise into steps, so it is reported apart.
    key_bias = [d for path, d in diffs.items() if path.endswith("key/bias")]
    return {
        "unsharded_variable_bytes": _variable_bytes(reference),
        "max_loss_diff": float(np.max(np.abs(np.subtract(losses, ref_losses)))),
        "max_weight_diff": max(d for path, d in diffs.items() if not path.endswith("key/bias")),
        "max_key_bias_diff": max(key_bias, default=0.0),
    }


if __name__ == "__main__":
    app.run(main)
