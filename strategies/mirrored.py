"""Keras fit under MirroredStrategy: every local GPU, or a split CPU.

One process, several replicas on one machine. On a machine without GPUs this
splits the CPU into 2 logical devices (``--cpu_replicas=2``, the default
here), so Mirrored can be tried on a laptop:

    python strategies/mirrored.py --cpu_replicas=2 --epochs=3

With ``--cpu_replicas=1`` it mirrors over every local GPU instead (over the
CPU alone, 1 replica, when there is none); ``--devices=/gpu:0,/gpu:1`` picks
devices.

Other flags: --compression=bf16 (or topk:0.01, powersgd:4, ...),
--per_replica_batch_size, --model_dir (checkpoints, model.keras and
results.json go there); --help lists them all.
"""

from absl import app, flags

import _common

_common.define_flags()
flags.FLAGS.set_default("strategy", "mirrored")
flags.FLAGS.set_default("cpu_replicas", 2)

if __name__ == "__main__":
    app.run(_common.main)
