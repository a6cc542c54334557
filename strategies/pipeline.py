"""A Keras model trained in pipeline stages, one stage per worker process.

Run it with ``tfdist launch`` (or ``srun -n P``, ``mpiexec -n P``), one
worker per stage:

    tfdist launch --workers 2 strategies/pipeline.py
    tfdist launch --workers 4 strategies/pipeline.py --model=mlp --schedule=gpipe
    tfdist launch --workers 2 strategies/pipeline.py --model=llama --microbatches=2
    tfdist launch --workers 4 strategies/pipeline.py --replicas=2 --compression=fp16
    tfdist launch --workers 2 strategies/pipeline.py --schedule=interleaved --chunks=2
    tfdist launch --workers 2 strategies/pipeline.py --stage_mesh=1x2
    tfdist launch --workers 4 strategies/pipeline.py --split=parameters

``--model=llama`` is a small keras-hub Llama (built from a config: nothing is
downloaded; it needs keras-hub beside the base install:
``pip install -e '.[keras-hub]'``) split at its transformer blocks; ``--model=mlp`` a 6-layer MLP
split at its Dense layers. The data are synthetic and shaped like real data
(skewed classes or Zipf-distributed token ids, sequences of uneven length).
Every worker builds the same model from the same seed and gets the same
data; worker ``k`` runs stage ``k``. Keras's ``fit``, ``evaluate`` and
``predict`` run as usual and log the same numbers on every worker; stage 0
saves the whole trained model to ``--model_dir`` as an ordinary Keras model.

``--replicas=R`` trains ``R`` copies of the pipeline data-parallel on ``R x
P`` workers (worker ``replica * P + stage``); ``--compression`` applies to
their all-reduce, and is refused with one replica (there is nothing to
compress). ``--per_replica_batch_size`` is the batch of one pipeline.
``--strategy`` is refused: no tf.distribute strategy runs here.

``--split=parameters`` cuts the model where the stages hold equal numbers of
weights (``tfdist.pipeline.balance``, from the weights' shapes: every worker
finds the same split points) instead of the same number of blocks each.

``--stage_mesh=BxT`` lays each worker's stage out over a (batch, model) mesh
of ``B x T`` of its devices with a ``ModelParallel`` (keras-hub's layout
map for the Llama; Megatron's column and row splits for the MLP): the third
axis. A worker with fewer devices (a CPU) splits its CPU into that many
logical devices.

With ``--compare``, worker 0 also trains the same model unpipelined on one
device and reports the largest weight difference. Each worker prints
``tfdist result: {...}``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
from absl import app, flags

import _common
from tfdist.errors import ConfigError, TfdistError

_common.define_flags()
FLAGS = flags.FLAGS
FLAGS.set_default("epochs", 2)
FLAGS.set_default("examples", 512)
FLAGS.set_default("learning_rate", 1e-3)
flags.DEFINE_enum("model", "llama", ["llama", "mlp"], "The model to pipeline.")
flags.DEFINE_enum("schedule", "1f1b", ["1f1b", "gpipe", "interleaved"], "The pipeline schedule.")
flags.DEFINE_integer("chunks", 1, "Stages per worker (the interleaved schedule).")
flags.DEFINE_integer("microbatches", 4, "Micro-batches per batch (they must divide it).")
flags.DEFINE_integer("replicas", 1, "Copies of the pipeline, trained data-parallel.")
flags.DEFINE_bool("compare", False, "Also train unpipelined on worker 0 and compare.")
flags.DEFINE_enum(
    "split",
    "even",
    ["even", "parameters"],
    "Where the stages begin: the same number of blocks each, or equal weights "
    "(tfdist.pipeline.balance by parameters: the same answer on every worker).",
)
flags.DEFINE_string(
    "stage_mesh",
    None,
    "BxT: lay each worker's stage out over a (batch, model) mesh of its devices.",
)


def check_flags() -> None:
    """The common flags this script cannot honour yet are refused, not ignored."""
    if FLAGS.replicas < 1:
        raise ConfigError(
            "replicas", FLAGS.replicas, "an integer >= 1", source="strategies/pipeline.py"
        )
    if FLAGS.compression not in (None, "", "none") and FLAGS.replicas == 1:
        raise ConfigError(
            "compression",
            FLAGS.compression,
            "none with --replicas=1: one pipeline has no data-parallel all-reduce to compress",
            source="strategies/pipeline.py",
        )
    if FLAGS.strategy != "auto":
        raise ConfigError(
            "strategy",
            FLAGS.strategy,
            "'auto': each worker runs one pipeline stage, with no tf.distribute strategy",
            source="strategies/pipeline.py",
        )
    if FLAGS.stage_mesh:
        mesh_shape(FLAGS.stage_mesh)


def mesh_shape(text: str) -> tuple[int, int]:
    """``"BxT"`` as ``(B, T)``.

    Raises:
        ConfigError: Not two positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(
            "stage_mesh", text, "BxT, e.g. 1x2 (batch x model)", source="strategies/pipeline.py"
        )
    return int(parts[0]), int(parts[1])


def stage_distribution(name: str, shape: tuple[int, int]) -> Any:
    """A ModelParallel over ``shape`` of this worker's devices (its CPU split
    into as many logical devices where it has fewer)."""
    import keras
    import tensorflow as tf

    import tfdist
    from tfdist.strategies.local import logical_cpus

    count = shape[0] * shape[1]
    if not tf.config.list_physical_devices("GPU"):
        logical_cpus(count)  # Before TensorFlow makes its devices.
    mesh = keras.distribution.DeviceMesh(
        shape, ["batch", "model"], keras.distribution.list_devices()[:count]
    )
    if name == "llama":
        import keras_hub

        layouts = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    else:  # Megatron: a column layer, then a row layer; the logits' columns.
        layouts = keras.distribution.LayoutMap(mesh)
        layouts["dense_[024]/kernel"] = (None, "model")
        layouts["dense_[024]/bias"] = ("model",)
        layouts["dense_[13]/kernel"] = ("model", None)
        layouts["logits/kernel"] = (None, "model")
    return tfdist.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


#: The MLP's hidden widths.
WIDTHS = [64, 64, 64, 64, 64]


def split_points_for(name: str, stages: int) -> list[str]:
    """Where :func:`make_model`'s model is cut into ``stages`` stages."""
    if name == "mlp":
        layers = [f"dense_{i}" for i in range(1, len(WIDTHS))] + ["logits"]
    else:
        layers = [f"transformer_layer_{i}" for i in range(1, max(4, stages))]
    return _evenly(layers, stages)


def make_model(name: str, stages: int) -> Any:
    """The model to cut into ``stages`` stages."""
    import keras

    if name == "mlp":
        inp = keras.Input((32,), name="features")
        h = inp
        for i, width in enumerate(WIDTHS):
            h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
        return keras.Model(inp, keras.layers.Dense(10, name="logits")(h))
    import keras_hub

    blocks = max(4, stages)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=1024,
        num_layers=blocks,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _evenly(candidates: list[str], stages: int) -> list[str]:
    """``stages - 1`` split points spread over ``candidates``."""
    if stages - 1 > len(candidates):
        raise SystemExit(f"--workers: at most {len(candidates) + 1} stages for this model")
    step = (len(candidates) + 1) / stages
    return [candidates[round(step * k) - 1] for k in range(1, stages)]


def make_data(name: str, examples: int, seed: int = 0) -> tuple[Any, np.ndarray]:
    """Skewed classes over features on several scales, or Zipf token ids."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        x = rng.standard_normal((examples, 32)).astype("float32") * np.geomspace(0.1, 10, 32)
        y = np.minimum(rng.zipf(1.6, examples) - 1, 9).astype("int32")
        return x.astype("float32"), y
    length = 16
    ids = np.minimum(rng.zipf(1.3, (examples, length + 1)), 1023).astype("int32")
    mask = np.arange(length)[None, :] < rng.integers(4, length + 1, examples)[:, None]
    x = {"token_ids": np.where(mask, ids[:, :-1], 0), "padding_mask": mask}
    return x, np.where(mask, ids[:, 1:], 0).astype("int32")


def train(pipelined: bool, stages: int) -> tuple[Any, dict]:
    import keras

    from tfdist.pipeline import PipelineModel

    distribution = None
    if pipelined and FLAGS.stage_mesh:  # Before TensorFlow makes its devices.
        distribution = stage_distribution(FLAGS.model, mesh_shape(FLAGS.stage_mesh))

    def build() -> Any:
        keras.utils.set_random_seed(FLAGS.seed)
        return make_model(FLAGS.model, stages * FLAGS.chunks)

    split_points, costs = split_points_for(FLAGS.model, stages * FLAGS.chunks), None
    if FLAGS.split == "parameters":
        from tfdist.pipeline import balance

        found = balance(build, stages * FLAGS.chunks, by="parameters")  # No weight is made.
        split_points, costs = list(found.split_points), list(found.costs)
    # Under layouts, the stage's weights are made under them: give the builder.
    model = build if distribution is not None else build()
    if pipelined:
        compression = FLAGS.compression if FLAGS.compression not in ("", "none") else None
        model = PipelineModel(
            model,
            split_points,
            microbatches=FLAGS.microbatches,
            schedule=FLAGS.schedule,
            chunks=FLAGS.chunks,
            replicas=FLAGS.replicas,
            compression=compression,
            distribution=distribution,
        )
    model.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = make_data(FLAGS.model, FLAGS.examples, FLAGS.seed)
    started = time.perf_counter()
    batch = FLAGS.per_replica_batch_size * FLAGS.replicas
    history = model.fit(x, y, batch_size=batch, epochs=FLAGS.epochs, shuffle=False, verbose=0)
    seconds = time.perf_counter() - started
    report = {
        "loss": [round(v, 6) for v in history.history["loss"]],
        "evaluate": round(float(np.ravel(model.evaluate(x, y, verbose=0))[0]), 6),
        "fit_seconds": round(seconds, 2),
        "split_points": split_points,
        "stage_costs": costs,
    }
    return model, report


def main(argv: list[str]) -> None:
    del argv
    try:
        check_flags()
    except TfdistError as error:
        _common.exit_with(error)
    from tfdist.pipeline import stage_from_environment

    try:
        _, addresses = stage_from_environment()
    except TfdistError as error:
        _common.exit_with(error)
    workers = len(addresses)
    stages = workers // FLAGS.replicas
    if stages < 2 or workers % FLAGS.replicas:
        raise SystemExit(
            "Run it with `tfdist launch --workers P strategies/pipeline.py` (or `srun -n P`, "
            "`mpiexec -n P`): one worker per stage (R x P workers with --replicas=R; got "
            f"{workers} for --replicas={FLAGS.replicas})."
        )
    model, report = train(True, stages)
    stage = model.stage_index
    for epoch, loss in enumerate(report["loss"], 1):
        print(f"{model.grid.name(model.rank)}: epoch {epoch} loss {loss:.4f}")
    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        model.save(os.path.join(FLAGS.model_dir, "model.keras"))
    if FLAGS.compare:
        model.gather_weights()  # Every stage takes part; stage 0 gets all weights.
    if FLAGS.compare and model.rank == 0:
        plain, report["plain"] = train(False, stages)
        report["max_weight_diff"] = max(
            float(np.abs(a.numpy() - b.numpy()).max())
            for a, b in zip(model.whole.weights, plain.weights)
        )
    report["sent_to_replicas"] = model.sent_to_replicas()
    model.close()
    place = {"stage": stage, "replica": model.replica, "stages": stages}
    print("tfdist result: " + json.dumps({**place, **report}))


if __name__ == "__main__":
    app.run(main)
