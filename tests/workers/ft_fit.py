"""One worker of the fault-tolerance test: a 2-worker fit of 4 epochs with
tfdist.BackupAndRestore. With MODE 'kill', worker 1 SIGKILLs itself in the
middle of epoch 3 on the launcher's first attempt.

Usage: ft_fit.py BACKUP_DIR MODE. Prints one 'tfdist result:' line."""

import os
import signal
import sys

import keras
import tensorflow as tf

import _common
import tfdist
from protocol import result

backup_dir, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
strategy = tfdist.strategy_from_config(register_timeout=60)
x, y = _common.make_data(2048, 3)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
data = data.with_options(options)
with strategy.scope():
    model = _common.build_model(0.01, 3)


class Killer(keras.callbacks.Callback):
    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (
            mode == "kill"
            and attempt == 0
            and strategy.task == "worker:1"
            and self.epoch == 2
            and batch == 5
        ):
            os.kill(os.getpid(), signal.SIGKILL)


backup = tfdist.BackupAndRestore(backup_dir, delete_checkpoint=False)
history = model.fit(
    data,
    epochs=4,
    callbacks=[backup, Killer()],
    shuffle=False,
    verbose=2 if strategy.is_chief else 0,
)
result(
    {
        "task": strategy.task,
        "attempt": attempt,
        "epochs_run": history.epoch,
        "loss": history.history["loss"],
        "accuracy": history.history["accuracy"],
        "resumed_epoch": (backup.resumed_from or {}).get("epoch"),
        "weights": [float(w.sum()) for w in model.get_weights()],
    }
)
