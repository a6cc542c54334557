"""horovod.run() of a function that calls hvd.init() and all-reduces, from __main__.

Usage: hvd_run_allreduce.py OUT_JSON. The script is written as a Horovod
user writes one: the framework imported at the top, the function in
``__main__``, the launch under the ``__main__`` guard.
"""

import json
import sys

import tensorflow as tf

import tfdist.horovod as hvd


def train(scale):
    hvd.init()
    value = tf.constant([float(hvd.rank() + 1) * scale, 1.0])
    total = hvd.allreduce(value, op=hvd.Sum)
    mean = hvd.allreduce(value)  # Horovod's default: the average.
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "sent": value.numpy().tolist(),
        "sum": total.numpy().tolist(),
        "mean": mean.numpy().tolist(),
    }


if __name__ == "__main__":
    # `import horovod; horovod.run(...)` becomes `import tfdist.horovod as horovod`.
    import tfdist.horovod as horovod

    run = getattr(horovod, "run", None)
    if run is None:  # Before tfdist.horovod re-exports it.
        from tfdist.horovod.run import run
    results = run(train, args=(3.0,), np=2)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
