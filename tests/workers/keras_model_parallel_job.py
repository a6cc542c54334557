"""One worker of a 4-process keras.distribution.ModelParallel job
(tests/distribution/test_model_parallel.py, under ``tfdist launch --workers 4``).

Written as keras-hub's docs write it for JAX: ``initialize()``, a (2, 2)
``DeviceMesh`` over ``list_devices()``, Llama's own ``get_layout_map``,
``ModelParallel``, then build, compile and fit. Every process first trains
an unsharded twin alone, from the same seed, on the same global batches;
the sharded model starts from the twin's initial weights. Only worker 0
trains the twin and generates with it: every worker's sharded model must
equal the others' (the test compares digests), so worker 0's twin serves all
four (each worker trained its own twin before, 4 times the work on 2 cores).
Each device holds
one block of each split weight, so the tensor groups and the data-parallel
groups both cross processes. The first batch's ids fall in the first 96 of
the vocabulary's 256: the second vocabulary block of each tensor group sees
no id (issue 38). Then it saves (``save_weights``, ``model.save``,
``save_to_preset``) into ``TFDIST_CHECKPOINT_DIR``, counting the whole-weight
gathers the saves make (none: each block comes to the chief on its own), for
the test to restore on other meshes in one process. Last, each worker seeds
its initializers differently and builds the model again: every split weight
must hold worker 0's draw; and loads the saved preset with ``from_preset``,
each worker making its blocks locally (no broadcast of initial values).
Prints one "tfdist result:" line.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tfdist  # keras.distribution on TensorFlow
from protocol import result
from tfdist.distribution import local_values

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distribution"))
from tiny_lms import batches, causal_lm, fit, generations

# First: MultiWorkerMirrored must be made before TensorFlow runs anything.
keras.distribution.initialize()
# Blocks cross processes in pieces of at most 4 KiB (4 MiB by default): the
# tiny model's blocks then move in several, as a large model's do.
tfdist.parallel.sharding.PIECE_BYTES = 4096
chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
keras.utils.set_random_seed(1)
twin = causal_lm(keras, "llama")  # No distribution set: one device.
initial = twin.get_weights()
x, _ = batches(skewed=True)
twin_losses = twin_weights = twin_logits = want_tokens = None
if chief:
    # Before the distribution is set: the samplers' seed variables (which
    # generations() makes) would otherwise be made under MultiWorkerMirrored,
    # whose initial-value broadcast this worker alone would wait on.
    twin_losses = fit(twin, skewed=True)
    twin_weights = twin.get_weights()
    twin_logits = twin.predict(x, batch_size=8, verbose=0)
    want_tokens = generations(twin)  # Recompiles the twin.

devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
)
lm = causal_lm(keras, "llama")
lm.set_weights(initial)
losses = fit(lm, skewed=True)
strategy = lm.distribute_strategy
weights = lm.get_weights()  # Full values: a collective, on every worker.
table = tfdist.distribution.report(lm)
embeddings = lm.backbone.token_embedding.embeddings
logits = lm.predict(x, batch_size=8, verbose=0)

checkpoints = Path(os.environ["TFDIST_CHECKPOINT_DIR"])
gathers = []


def counting(real):
    def counted(variable):
        gathers.append(variable.path)
        return real(variable)

    return counted


sharding = tfdist.parallel.sharding
sharding.full_value = counting(sharding.full_value)
sharding.full_tensor = counting(sharding.full_tensor)
lm.save_weights(checkpoints / "lm.weights.h5")
lm.save(checkpoints / "lm.keras")
lm.backbone.save_to_preset(str(checkpoints / "preset"))
gathers_while_saving = list(gathers)
slots = tfdist.parallel.saving.full_weights(lm.optimizer.variables)  # A collective.

# Workers whose initializers draw differently: every split weight holds
# worker 0's draw, which a one-device model seeded as worker 0 makes.
distribution = keras.distribution.distribution()
keras.distribution.set_distribution(None)
keras.utils.set_random_seed(100)
worker0 = causal_lm(keras, "llama").get_weights()
keras.distribution.set_distribution(distribution)
keras.utils.set_random_seed(100 + strategy.cluster_resolver.task_id)
drawn = causal_lm(keras, "llama").get_weights()
initial_difference = max(float(np.max(np.abs(a - b))) for a, b in zip(drawn, worker0))

# The preset loads across the processes, each block made as this worker's
# own zeros (no broadcast from worker 0) and read from the file piece by piece.
task_id = strategy.cluster_resolver.task_id
with strategy.scope():
    broadcast = strategy.experimental_local_results(tf.Variable(float(task_id)))[0]
    with local_values.created_locally(strategy):
        own = strategy.experimental_local_results(tf.Variable(float(task_id)))[0]
extended_after = type(strategy.extended).__name__
saved_backbone = lm.backbone.get_weights()  # A collective.
loaded = keras_hub.models.LlamaBackbone.from_preset(str(checkpoints / "preset"))
preset_difference = max(
    float(np.max(np.abs(a - b))) for a, b in zip(loaded.get_weights(), saved_backbone)
)
# generate() runs on every replica (keras-hub calls it outside one): greedy,
# top-k with a seed and greedy ending early at stop tokens, as the twin.
# Last: generations() recompiles the model.
tokens = generations(lm)
result(
    {
        "task": strategy.task,
        "replicas": strategy.num_replicas_in_sync,
        "mesh": tfdist.parallel.mesh_of(strategy).describe(),
        "devices": devices,
        "losses": losses,
        "twin_losses": twin_losses,
        "largest_difference": chief
        and max(float(np.max(np.abs(a - b))) for a, b in zip(weights, twin_weights)),
        "predict_difference": chief and float(np.max(np.abs(logits - twin_logits))),
        "logits_sha256": hashlib.sha256(np.asarray(logits).tobytes()).hexdigest(),
        "block": list(embeddings.shape),
        "local_block": [
            list(b.shape) for b in strategy.experimental_local_results(embeddings.value)
        ],
        "bytes_per_device": table.bytes_per_device,
        "full_bytes": table.full_bytes,
        "traffic": tfdist.parallel.traffic(strategy),
        "sha256": hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest(),
        "optimizer_sha256": hashlib.sha256(b"".join(w.tobytes() for w in slots)).hexdigest(),
        "gathers_while_saving": gathers_while_saving,
        "initial_difference_from_worker_0": initial_difference,
        "initial_values": [float(broadcast.numpy()), float(own.numpy())],
        "extended_after": extended_after,
        "preset_difference": preset_difference,
        "preset_block": list(loaded.token_embedding.embeddings.shape),
        "tokens": tokens,
        "twin_tokens": want_tokens,
    }
)
