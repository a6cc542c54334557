"""One rank of an MPI job (``mpiexec -n N python mpi_job.py MODE ...``).

``compare SETTING...``: for each compression setting, the same Keras fit
twice in this job, once over TensorFlow's collectives and once over MPI
(``transport="mpi"``), from the same weights and batches. The model has an
Embedding (sparse gradients) and Dense layers. Rank 0 prints the weights'
largest difference, the losses and what MPI carried.

``plain``: what a user's script does under ``tfdist launch --transport mpi``
or ``mpiexec`` with ``TFDIST_TRANSPORT=mpi``: ``strategy_from_config()``
and a fit; each rank prints its weights' checksum and what MPI carried.

``hang`` / ``die``: a fit over MPI with ``collective_timeout=5``; rank 1
stops itself (SIGSTOP) or exits (``os._exit(3)``) before its third step, so
rank 0's collectives never finish.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import tensorflow as tf

from protocol import say

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402 - after the thread settings, which must precede any TF op

import tfdist  # noqa: E402
from tfdist.record import record_of  # noqa: E402
from tfdist.transport import tf_config_from_mpi  # noqa: E402


def data(rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    ids = rng.integers(0, 40, size=(192, 3)).astype("int32")
    x = rng.random((192, 16), dtype=np.float32)
    y = ((x.sum(axis=1) + ids.sum(axis=1) / 20) > 11).astype("int32")
    return ids, x, y


def build_model() -> keras.Model:
    """An Embedding (sparse gradients) beside Dense layers, seeded."""
    keras.utils.set_random_seed(0)
    ids_in, x_in = keras.Input((3,), dtype="int32"), keras.Input((16,))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(40, 8)(ids_in))
    hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pooled, x_in]))
    return keras.Model([ids_in, x_in], keras.layers.Dense(2)(hidden))


def fit(strategy, rank: int, steps_per_epoch: int = 6, callbacks=()) -> tuple[list, list]:
    with strategy.scope():
        model = build_model()
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    ids, x, y = data(rank)
    dataset = tf.data.Dataset.from_tensor_slices(((ids, x), y)).batch(32)
    history = model.fit(
        strategy.experimental_distribute_dataset(dataset),
        epochs=2,
        steps_per_epoch=steps_per_epoch,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model.get_weights(), history.history["loss"]


def compare(settings: list[str]) -> None:
    config = tf_config_from_mpi()
    rank = config["task"]["index"]
    out = {}
    for setting in settings:
        compression = None if setting == "none" else setting
        w_tf, loss_tf = fit(tfdist.strategy_from_config(config, compression=compression), rank)
        strategy = tfdist.strategy_from_config(config, transport="mpi", compression=compression)
        w_mpi, loss_mpi = fit(strategy, rank)
        transport = record_of(strategy).transport
        out[setting] = {
            "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(w_tf, w_mpi)),
            "changed": max(
                float(np.abs(a - b).max()) for a, b in zip(w_tf, build_model().get_weights())
            ),
            "loss_tf": loss_tf,
            "loss_mpi": loss_mpi,
            "calls": dict(transport.calls),
            "sent": dict(transport.sent),
            "describe": strategy.describe(),
        }
    if rank == 0:
        say("tfdist result: " + json.dumps(out))


class FailBeforeThirdStep(keras.callbacks.Callback):
    """Rank 1 stops itself (SIGSTOP: hung) or exits (os._exit: dead) before step 3."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2:
            if self.how == "hang":
                print("rank 1 stops itself", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            print("rank 1 dies", flush=True)
            os._exit(3)


def fail(how: str) -> None:
    strategy = tfdist.strategy_from_config(transport="mpi", collective_timeout=5)
    rank = strategy.cluster_resolver.task_id
    fit(strategy, rank, callbacks=[FailBeforeThirdStep(how)] if rank == 1 else [])
    print(f"rank {rank} finished", flush=True)


def plain() -> None:
    strategy = tfdist.strategy_from_config()
    rank = strategy.cluster_resolver.task_id
    weights, loss = fit(strategy, rank)
    transport = record_of(strategy).transport
    result = {
        "rank": rank,
        "replicas": strategy.num_replicas_in_sync,
        "checksum": float(sum(np.abs(w).sum() for w in weights)),
        "loss": loss,
        "allreduce_calls": None if transport is None else transport.calls["allreduce"],
        "attempt": os.environ.get("TFDIST_LAUNCH_ATTEMPT"),
    }
    # One write (say): print() writes the text and its newline apart (unbuffered),
    # and two ranks' lines interleaved on mpiexec's stdout ('Extra data').
    say(f"rank {rank} result: {json.dumps(result)}")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2:])
    elif sys.argv[1] == "plain":
        plain()
    elif sys.argv[1] in ("hang", "die"):
        fail(sys.argv[1])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
