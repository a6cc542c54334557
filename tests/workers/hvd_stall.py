"""An in-graph collective that only rank 0 issues (tests/horovod/test_horovod_traps.py).

Rank 0 calls a tf.function that all-reduces; rank 1 never does and stays
alive past the timeout, so the failure must come from collective_timeout.
"""

import os
import time

import tfdist.horovod as hvd
from protocol import result

hvd.init()

import tensorflow as tf  # noqa: E402

timeout = float(os.environ["TFDIST_COLLECTIVE_TIMEOUT"])
together = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy())  # Both ranks.


@tf.function
def step(x):
    return hvd.allreduce(x, op=hvd.Sum)


out = {"rank": hvd.rank(), "together": together, "in_step": float(step(tf.constant(2.0)))}
if hvd.rank() == 0:
    began = time.monotonic()
    try:
        step(tf.constant(3.0))
        out["error"] = None
    except tf.errors.OpError as error:
        out["error"] = error.message
    out["after"] = time.monotonic() - began
result(out)
if hvd.rank() == 1:
    time.sleep(timeout + 6)
os._exit(0)
