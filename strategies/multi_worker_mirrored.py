"""Keras fit under MultiWorkerMirroredStrategy, one process per worker.

Start one process per task, each with its own TF_CONFIG, e.g. on one machine:

    tfdist tf-config two_workers --task worker:0   # prints worker 0's TF_CONFIG
    TF_CONFIG='...' python strategies/multi_worker_mirrored.py &
    TF_CONFIG='...' python strategies/multi_worker_mirrored.py

strategy_from_config() reads TF_CONFIG (or a Slurm step) and returns tfdist's
MultiWorkerMirroredStrategy, which fixes Keras 3 fit in multi-worker jobs.
"""

from absl import app, flags

import _common

_common.define_flags()
flags.FLAGS.set_default("strategy", "multi_worker_mirrored")

if __name__ == "__main__":
    app.run(_common.main)
