"""Keras fit under TPUStrategy.

On a Cloud TPU VM the TPU is local (``--tpu=local``, the default):

    python strategies/tpu.py --epochs=3

For a TPU node, or a TPU reached over the network, give its name or address:

    python strategies/tpu.py --tpu=my-tpu          # name, on Google Cloud
    python strategies/tpu.py --tpu=grpc://10.0.0.2:8470

strategy_from_config(strategy="tpu", tpu=...) checks that the TPU is there
before TensorFlow looks for it (TensorFlow hangs or fails late). Without one
the script stops at once with a one-line error naming what it tried, e.g.

    tpu.py: error: No TPU found for tpu='local': this machine has no local TPU device. ...

and exit code 2. The TPU runs each replica's batch on one core, so the
global batch is --per_replica_batch_size times the number of cores.
Gradient compression does not apply under TPUStrategy.
"""

from absl import app, flags

import _common

_common.define_flags()
flags.FLAGS.set_default("strategy", "tpu")
flags.FLAGS.set_default("tpu", "local")

if __name__ == "__main__":
    app.run(_common.main)
