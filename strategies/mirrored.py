"""Keras fit under MirroredStrategy: every local GPU, or a split CPU.

On a machine without GPUs this splits the CPU into 2 logical devices, so
Mirrored can be tried on a laptop:

    python strategies/mirrored.py --cpu_replicas=2 --epochs=3
"""

from absl import app, flags

import _common

_common.define_flags()
flags.FLAGS.set_default("strategy", "mirrored")
flags.FLAGS.set_default("cpu_replicas", 2)

if __name__ == "__main__":
    app.run(_common.main)
