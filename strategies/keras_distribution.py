"""A keras-hub causal LM sharded by its own layout map, through keras.distribution.

Keras's recipe for model parallelism, as keras-hub's docs write it for JAX, on
TensorFlow after ``import tfdist``: a ``DeviceMesh``, the backbone's
``get_layout_map(mesh)``, ``ModelParallel`` and ``set_distribution``. On a
machine without GPUs this splits the CPU into one logical device per mesh
position; under ``tfdist launch`` (a ``TF_CONFIG`` with a cluster) each
process brings its devices and ``keras.distribution.initialize()`` joins them:

    python strategies/keras_distribution.py                       # (2, 2) on 4 CPUs
    python strategies/keras_distribution.py --family=gemma --mesh=1,2
    python strategies/keras_distribution.py --layout=data_parallel
    python strategies/keras_distribution.py --lora_rank=4 --generate=8 --compare
    tfdist launch --workers 4 python strategies/keras_distribution.py --lora_rank=4 --generate=8

The model is keras-hub's Llama, Gemma or Qwen CausalLM built from its
constructor at a small size (nothing is downloaded), trained with Adam on a
synthetic next-token task. It prints what each weight got
(``tfdist.distribution.report``), one line per epoch and ``tfdist result:
{...}``. ``--compare`` first trains the same model unsharded on one device
from the same weights and reports the largest differences. ``--model_dir``
gets ``model.keras`` with full weights (it loads with no distribution).
``--lora_rank`` follows keras-hub's distributed tuning recipe
(``backbone.enable_lora``), and ``--generate`` ends with ``generate()``.

Needs keras-hub beside the base install: ``pip install -e '.[keras-hub]'``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

import _common
from tfdist.errors import TfdistError

# The scripts' common flags: --compression, --epochs, --per_replica_batch_size
# (one row per mesh position), --examples, --learning_rate, --seed and
# --model_dir (model.keras only) apply; the distribution chooses the strategy,
# so --strategy stays "auto".
_common.define_flags()
FLAGS = flags.FLAGS
FLAGS.set_default("epochs", 2)
FLAGS.set_default("per_replica_batch_size", 2)
FLAGS.set_default("examples", 64)
FLAGS.set_default("learning_rate", 1e-3)
flags.DEFINE_enum("family", "llama", ["llama", "gemma", "qwen"], "keras-hub model family.")
flags.DEFINE_enum(
    "layout",
    "model_parallel",
    ["model_parallel", "data_parallel"],
    "ModelParallel with the backbone's layout map, or DataParallel.",
)
flags.DEFINE_string("mesh", "2,2", "The (batch, model) mesh shape, e.g. 1,2.")
flags.DEFINE_integer("seq_len", 16, "Tokens per row.")
flags.DEFINE_integer("vocab_size", 512, "Vocabulary size.")
flags.DEFINE_integer("hidden", 64, "Hidden width.")
flags.DEFINE_integer("layers", 2, "Decoder layers.")
flags.DEFINE_bool(
    "compare", False, "Also train unsharded on one device and report the differences."
)
flags.DEFINE_integer(
    "lora_rank",
    0,
    "keras-hub's distributed tuning recipe: backbone.enable_lora(rank) before compiling "
    "(the base weights frozen and still split, the adapters trained). 0: off.",
)
flags.DEFINE_integer(
    "generate",
    0,
    "After fit, generate() this many tokens after 4-token prompts (keras-hub's KV "
    "cache; across processes too). 0: off.",
)
flags.DEFINE_enum(
    "sampler",
    "greedy",
    ["greedy", "top_k"],
    "generate()'s sampler: greedy, or top-k (k=5) seeded with --seed.",
)


def causal_lm(keras, keras_hub):
    """The family's CausalLM at --hidden/--layers, compiled with Adam."""
    models = keras_hub.models
    common = dict(
        vocabulary_size=FLAGS.vocab_size,
        num_layers=FLAGS.layers,
        hidden_dim=FLAGS.hidden,
        num_query_heads=4,
        num_key_value_heads=2,
        intermediate_dim=4 * FLAGS.hidden,
    )
    if FLAGS.family == "gemma":
        lm = models.GemmaCausalLM(
            models.GemmaBackbone(**common, head_dim=FLAGS.hidden // 4), preprocessor=None
        )
    elif FLAGS.family == "llama":
        lm = models.LlamaCausalLM(models.LlamaBackbone(**common), preprocessor=None)
    else:
        lm = models.QwenCausalLM(models.QwenBackbone(**common), preprocessor=None)
    if FLAGS.lora_rank:
        lm.backbone.enable_lora(rank=FLAGS.lora_rank)
    lm.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def next_token_data(rows: int, seq_len: int, vocab: int, seed: int = 0):
    """Sequences that count up from a random start: the next token is learnable."""
    rng = np.random.default_rng(seed)
    ids = (rng.integers(0, vocab, (rows, 1)) + np.arange(seq_len + 1)) % vocab
    ids = ids.astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}, ids[:, 1:]


def generated(lm, x, keras_hub) -> list[list[int]]:
    """``generate()`` of --generate tokens after each of 2 prompts (the first 4
    tokens of the first 2 rows) with --sampler; keras-hub's KV cache runs it."""
    prompt_length = 4
    width = prompt_length + FLAGS.generate
    ids = np.zeros((2, width), "int32")
    ids[:, :prompt_length] = x["token_ids"][:2, :prompt_length]
    mask = np.zeros((2, width), bool)
    mask[:, :prompt_length] = True
    sampler = (
        keras_hub.samplers.TopKSampler(k=5, seed=FLAGS.seed)
        if FLAGS.sampler == "top_k"
        else "greedy"
    )
    lm.compile(sampler=sampler)  # A fresh sampler: the twin draws from the same seed.
    out = lm.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
    return np.asarray(out["token_ids"]).tolist()


def mesh_shape() -> tuple[int, int]:
    try:
        batch, model = (int(p) for p in FLAGS.mesh.split(","))
    except ValueError:
        _common.exit_with(
            ValueError(f"--mesh: expected two integers like 2,2. Received: {FLAGS.mesh!r}")
        )
    return batch, model


def main(_argv: list[str]) -> None:
    batch, model = mesh_shape()
    in_cluster = bool(json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster"))
    if FLAGS.generate < 0 or FLAGS.lora_rank < 0:
        _common.exit_with(
            ValueError(
                "--generate and --lora_rank: expected 0 or more. Received: "
                f"--generate={FLAGS.generate}, --lora_rank={FLAGS.lora_rank}"
            )
        )
    if FLAGS.strategy != "auto":
        _common.exit_with(
            ValueError(
                f"--strategy: expected auto (keras.distribution chooses the strategy). "
                f"Received: {FLAGS.strategy!r}"
            )
        )
    rows = FLAGS.per_replica_batch_size * batch * model  # The global batch.
    import tensorflow as tf

    if not in_cluster:  # Before TensorFlow runs anything: one logical CPU per position.
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * (batch * model),
        )
    import keras

    try:
        import keras_hub
    except ModuleNotFoundError as e:
        _common.exit_with(
            ModuleNotFoundError(
                f"{e}: this script builds keras-hub's models; "
                "install them with pip install -e '.[keras-hub]'"
            )
        )

    import tfdist

    try:
        if in_cluster:
            keras.distribution.initialize()
        x, y = next_token_data(FLAGS.examples, FLAGS.seq_len, FLAGS.vocab_size, FLAGS.seed)
        keras.utils.set_random_seed(FLAGS.seed)
        twin = causal_lm(keras, keras_hub)  # No distribution yet: one device.
        initial = twin.get_weights()
        twin_losses = (
            twin.fit(x, y, batch_size=rows, epochs=FLAGS.epochs, shuffle=False, verbose=0).history[
                "loss"
            ]
            if FLAGS.compare
            else None
        )
        devices = keras.distribution.list_devices()
        backbone = {
            "gemma": keras_hub.models.GemmaBackbone,
            "llama": keras_hub.models.LlamaBackbone,
            "qwen": keras_hub.models.QwenBackbone,
        }[FLAGS.family]
        if FLAGS.layout == "model_parallel":
            device_mesh = keras.distribution.DeviceMesh(
                (batch, model), ["batch", "model"], devices[: batch * model]
            )
            distribution = tfdist.distribution.ModelParallel(
                layout_map=backbone.get_layout_map(device_mesh),
                batch_dim_name="batch",
                compression=FLAGS.compression,
            )
        else:
            distribution = tfdist.distribution.DataParallel(
                devices=devices[: batch * model], compression=FLAGS.compression
            )
        keras.distribution.set_distribution(distribution)
        lm = causal_lm(keras, keras_hub)
        lm.set_weights(initial)
    except TfdistError as error:
        _common.exit_with(error)
    strategy = lm.distribute_strategy
    print(tfdist.describe(strategy), flush=True)
    table = tfdist.distribution.report(lm, distribution)
    print(table, flush=True)
    history = lm.fit(x, y, batch_size=rows, epochs=FLAGS.epochs, shuffle=False, verbose=0).history[
        "loss"
    ]
    for epoch, loss in enumerate(history, 1):
        print(f"epoch {epoch}: loss {loss:.4f}", flush=True)
    weights = lm.get_weights()  # Full values (a collective across processes).
    result = {
        "family": FLAGS.family,
        "layout": FLAGS.layout,
        "mesh": [batch, model],
        "replicas": strategy.num_replicas_in_sync,
        "task": strategy.task,
        "loss": history,
        "weights_per_device": table.bytes_per_device,
        "full_weights": table.full_bytes,
        "split_weights": sum(r.how != "replicated" for r in table.rows),
        "weights_sha256": _common.weights_sha256(weights),
    }
    if FLAGS.compare:
        result["compare"] = {
            "twin_loss": twin_losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(history, twin_losses)),
            "max_weight_diff": max(
                float(np.max(np.abs(a - b))) for a, b in zip(weights, twin.get_weights())
            ),
        }
    if FLAGS.lora_rank:
        result["trainable_weights"] = len(lm.trainable_weights)
    if FLAGS.generate:
        result["generated"] = generated(lm, x, keras_hub)
        if FLAGS.compare:
            twin_tokens = generated(twin, x, keras_hub)
            result["compare"]["generated_equal"] = result["generated"] == twin_tokens
    if FLAGS.model_dir:  # Every worker saves (full values are a collective); the chief keeps it.
        result["saved_model"] = _common.save_model(lm, strategy, FLAGS.model_dir)
    print("tfdist result: " + json.dumps(result), flush=True)
    keras.distribution.set_distribution(None)


if __name__ == "__main__":
    sys.exit(app.run(main))
