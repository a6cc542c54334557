"""One worker of a slow-network job: a tfdist worker (Keras ``fit`` under
MultiWorkerMirrored with one compression configuration) or a PyTorch DDP rank
(:mod:`benchlib.torch_peer`). Run as ``slow_network.py --mode=tf_worker`` or
``--mode=torch_worker``; each writes its JSON to ``--out``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from benchlib import torch_peer
from benchlib.mlp import accuracy, initial_weights, make_data, param_count, worker_slice
from benchlib.timing import step_timer
from slow_network_configs import ACC_WARMUP, FLAGS

# ---------------------------------------------------------------- workers


def pack_bytes(layers: Sequence[int], packs: int = 8) -> int:
    """``bytes_per_pack`` of the ``+packs`` configuration: the bfloat16
    gradients in about ``packs`` packs of at least 1 MiB."""
    return max(1 << 20, -(-2 * param_count(layers) // packs))


def _tf_compression(config: str, warmup: int):
    from tfdist.compression import AutoCompression, PowerSGD

    name = config.split("/", 1)[1].removesuffix("+packs").removesuffix("+mpi")
    if name == "fp32":
        return None
    if name.startswith("powersgd"):
        rank, _, warm = name.split(":")[1].partition("+")
        return PowerSGD(
            int(rank),
            warmup_steps=warmup,
            seed=FLAGS.seed,
            warmup_dtype="bfloat16" if warm == "bf16warm" else "float32",
        )
    if name == "auto":
        if warmup == ACC_WARMUP:
            return "auto"  # The default candidates (PowerSGD with 10 warm-up steps).
        # The default candidates, with PowerSGD's warm-up steps of this run
        # (auto still picks their precision).
        return AutoCompression(candidates=("none", "bf16", PowerSGD(4, warmup_steps=warmup)))
    return name


def _data(rank: int, world: int):
    layers = [int(w) for w in FLAGS.layers]
    (x, y), (xt, yt) = make_data(
        FLAGS.steps * world * FLAGS.batch, FLAGS.test_examples, layers[0], layers[-1]
    )
    xs, ys = worker_slice(x, y, rank, world, FLAGS.batch)
    return layers, xs, ys, xt, yt


def tf_worker() -> None:
    """One worker of a tfdist job (TF_CONFIG in the environment)."""
    import tensorflow as tf

    if FLAGS.threads:
        # A core's worth of threads per worker in both frameworks: PyTorch
        # runs its ops one at a time on the calling thread, so TensorFlow
        # gets one inter-op thread (its default, one per core, makes the
        # workers of one machine fight for the cores: 10% slower steps).
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    import keras

    import tfdist

    # "+packs": the all-reduce in several packs (TensorFlow's
    # bytes_per_pack), last layers first, so that it overlaps backprop and
    # the optimizer; one pack otherwise (TensorFlow's default).
    packs = FLAGS.config.endswith("+packs")
    strategy = tfdist.strategy_from_config(
        compression=_tf_compression(FLAGS.config, FLAGS.warmup),
        # "+mpi": the gradients' all-reduce over MPI (the workers are mpiexec's ranks).
        transport="mpi" if FLAGS.config.endswith("+mpi") else "tf",
        register_timeout=300,
        bytes_per_pack=pack_bytes([int(w) for w in FLAGS.layers]) if packs else 0,
    )
    rank = strategy.cluster_resolver.task_id
    layers, xs, ys, xt, yt = _data(rank, FLAGS.world)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((layers[0],))]
            + [keras.layers.Dense(w, activation="relu") for w in layers[1:-1]]
            + [keras.layers.Dense(layers[-1])]
        )
        model.set_weights(initial_weights(layers))
        model.compile(
            optimizer=keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def dataset(ctx):
        data = tf.data.Dataset.from_tensor_slices((xs, ys.astype("int32")))
        return data.batch(FLAGS.batch, drop_remainder=True).prefetch(2)

    times: list[float] = []
    evals: list[list[float]] = []

    class Evaluate(keras.callbacks.Callback):
        """Held-out accuracy every ``--evals`` steps on rank 0, with the seconds so far."""

        def on_train_batch_end(self, batch, logs=None):
            if FLAGS.evals and (batch + 1) % FLAGS.evals == 0 and rank == 0:
                evals.append([batch + 1, accuracy(self.model.get_weights(), xt, yt), sum(times)])

    data = strategy.distribute_datasets_from_function(dataset)
    # The timer first: Keras calls callbacks in order, so this step's time is
    # in ``times`` before Evaluate sums them, and the evaluation is not timed.
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=FLAGS.steps,
        verbose=0,
        callbacks=[step_timer(times), Evaluate()],
    )
    _write(
        {
            "step_times": times,
            "evals": evals,
            "compression": str(strategy.compression),
            "describe": strategy.describe(),
            "params": model.count_params(),
            "rank": rank,
        }
    )


def torch_worker() -> None:
    """One rank of a PyTorch DDP job (gloo)."""
    layers, xs, ys, xt, yt = _data(FLAGS.rank, FLAGS.world)
    torch_peer.run_rank(FLAGS, layers, (xs, ys, xt, yt), Path(FLAGS.out))


def _write(result: dict) -> None:
    # mpiexec's ranks share one command line: "{rank}" in --out is theirs.
    Path(FLAGS.out.replace("{rank}", str(result.get("rank", FLAGS.rank)))).write_text(
        json.dumps(result)
    )
