"""The chief of a parameter-server job preempted mid-epoch (tests/training/test_preempt_ps.py).

    python preempt_ps.py SIGNAL WORKDIR

Starts its own ``tfdist.local_cluster`` (2 workers, 1 ps: server
subprocesses on 127.0.0.1; they inherit ``TFDIST_JOB_DIR`` and
``TFDIST_GRACE``) and trains with ``tfdist.fit`` and ``tfdist.BackupAndRestore``
for 3 epochs of 24 steps. After each batch it prints ``tfdist batch: E B``
and sleeps a little, so that the test can signal it mid-epoch.

SIGNAL: ``none`` (the test signals the chief itself, or nothing); or
``ps:0@E:B`` / ``worker:1@E:B``: this script sends SIGTERM to that server's
process after batch B of epoch E, once per WORKDIR.

Prints one ``tfdist result:`` line when fit returns. Preempted, it exits
with fit's ``SystemExit(143)``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from protocol import say

SIGNAL, WORKDIR = sys.argv[1], sys.argv[2]
STEPS, EPOCHS, BATCH = 24, 3, 32

import tfdist  # noqa: E402

attempt = len([n for n in os.listdir(WORKDIR) if n.startswith("logs-")])
cluster = tfdist.local_cluster(workers=2, ps=1, log_dir=os.path.join(WORKDIR, f"logs-{attempt}"))
strategy = tfdist.strategy_from_config(cluster.tf_config)

import keras  # noqa: E402
import numpy as np  # noqa: E402


def data(rows=STEPS * BATCH):
    rs = np.random.RandomState(0)
    x = rs.randint(0, 64, (rows, 4)).astype("int32")
    y = ((x[:, 0] < 32) ^ (x[:, 1] < 16)).astype("int32")
    return x, y


with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(64, 16),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


class Progress(keras.callbacks.Callback):
    """Prints each batch end; signals a server once, where asked."""

    def __init__(self):
        super().__init__()
        self.epoch, self.batches, self.signalled = 0, [], None
        self.task, self.at = None, None
        marker = os.path.join(WORKDIR, "signalled")
        if SIGNAL != "none" and not os.path.exists(marker):
            self.task, where = SIGNAL.split("@")
            self.at = tuple(int(v) for v in where.split(":"))
        self.marker = marker

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append((self.epoch, batch))
        say(f"tfdist batch: {self.epoch} {batch}")
        if self.at is not None and (self.epoch, batch) >= self.at and self.signalled is None:
            open(self.marker, "w").close()
            os.kill(cluster.pid(self.task), signal.SIGTERM)
            self.signalled = {"task": self.task, "at": [self.epoch, batch], "time": time.time()}
            say(f"tfdist signalled: {self.task} at {self.epoch} {batch}")
        time.sleep(0.03)


x, y = data()
backup = os.path.join(WORKDIR, "backup")
from tfdist.training.callbacks import read_backup_pointer  # noqa: E402

at_start = read_backup_pointer(backup)
say(f"tfdist start: {json.dumps(at_start)}")
progress = Progress()
result = {}
try:
    tfdist.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[tfdist.BackupAndRestore(backup), progress],
    )
    result = {
        "iterations": int(model.optimizer.iterations.numpy()),
        "planned": EPOCHS * STEPS,
        "resumed_from": at_start,
        "first_batch": progress.batches[0] if progress.batches else None,
        "batches": len(progress.batches),
        "signalled": progress.signalled,
        "servers": {t: cluster._server(t).proc.poll() for t in cluster.tasks},
    }
finally:
    codes = {t: cluster._server(t).proc.poll() for t in cluster.tasks}
    say(f"tfdist servers: {json.dumps(codes)}")
    cluster.stop()
say("tfdist result: " + json.dumps(result))
sys.stdout.flush()  # Anything printed before, when run without -u.
os._exit(0)  # Skip TensorFlow's teardown of the stopped servers' functions.
