"""Keras fit under MultiWorkerMirroredStrategy, one process per worker.

Every worker runs this script with its own TF_CONFIG. On one machine,
``tfdist launch`` starts both workers on free local ports:

    tfdist launch --workers 2 strategies/multi_worker_mirrored.py --epochs=3

or by hand, one shell per worker (ports from cluster_specs/two_workers.json):

    TF_CONFIG=$(tfdist tf-config two_workers --task worker:0) python strategies/multi_worker_mirrored.py &
    TF_CONFIG=$(tfdist tf-config two_workers --task worker:1) python strategies/multi_worker_mirrored.py

On several hosts, write a spec with their addresses and run on each host the
line ``tfdist hosts SPEC -- strategies/multi_worker_mirrored.py`` prints for
it. strategy_from_config() reads TF_CONFIG (or a Slurm step) and returns
tfdist's MultiWorkerMirroredStrategy, which fixes Keras 3 fit in multi-worker
jobs. Only the chief (worker 0) writes to --model_dir.
"""  # noqa: E501 - its shell commands are copied whole

from absl import app, flags

import _common

_common.define_flags()
flags.FLAGS.set_default("strategy", "multi_worker_mirrored")

if __name__ == "__main__":
    app.run(_common.main)
