"""One process of a pipeline test (tests/pipeline/test_pipeline_processes.py).

Usage: pipeline_task.py MODEL SCHEDULE MICROBATCHES STEPS OPTIMIZER OUT STAGE ADDRESSES

STAGE is this process's stage, ADDRESSES the stages' "host:port" list
(comma-separated); STAGE ``ref`` trains the same model unpipelined on one
device with Keras's fit instead. Every process writes OUT/<STAGE>.npz: the
weights it owns, by path, and its per-step losses. With $PIPELINE_CHUNKS = v
(the interleaved schedule), the model is cut into v stages a process and
STAGE is the process's place: it runs stages STAGE, STAGE + p, ...
"""

import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np

from tests.models.pipeline_models import SPLITS, batches, make_model

model_name, schedule, m, steps, opt_name, out, stage = sys.argv[1:8]
m, steps = int(m), int(steps)
keras.utils.set_random_seed(7)
model = make_model(model_name)
x, y = batches(model_name, steps)


def optimizer():
    return keras.optimizers.SGD(0.02) if opt_name == "sgd" else keras.optimizers.Adam(1e-3)


loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
if stage == "ref":
    model.compile(optimizer=optimizer(), loss=loss)
    history = model.fit(x, y, batch_size=len(y) // steps, shuffle=False, epochs=1, verbose=0)
    weights = {v.path: v.numpy() for v in model.weights}
    np.savez(Path(out) / "ref.npz", losses=np.array(history.history["loss"]), **weights)
    sys.exit(0)

from tfdist.pipeline import split_model  # noqa: E402
from tfdist.pipeline.replicas import Grid  # noqa: E402
from tfdist.pipeline.runtime import StageRunner  # noqa: E402
from tfdist.transport.p2p import connect_peers  # noqa: E402

addresses = sys.argv[8].split(",")
chunks, p = int(os.environ.get("PIPELINE_CHUNKS", "1")), len(addresses)
stages = split_model(model, SPLITS[model_name][: p * chunks - 1])
index = int(stage)
links = connect_peers(index, addresses, Grid(p, chunks=chunks).peers(index))
own = [stages[index + c * p] for c in range(chunks)]
runner = StageRunner(own, len(stages), links, schedule, m, loss, optimizer())
batch = len(y) // steps
flat_x = keras.tree.flatten(x)
losses = []
die_at = int(os.environ.get("PIPELINE_DIE_AT", "-1"))
for step in range(steps):
    if step == die_at and index == len(stages) - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # A stage that dies mid-job.
    part = slice(step * batch, (step + 1) * batch)
    losses.append(runner.train_step(step, [v[part] for v in flat_x], y[part]))
for link in links.values():
    link.close()
weights = {v.path: v.numpy() for s in own for v in s.variables}
np.savez(
    Path(out) / f"{index}.npz",
    losses=np.array(losses),
    peak=np.array(runner.peak_in_flight),
    **weights,
)
