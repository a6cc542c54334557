"""One worker of a 2-process keras.distribution job with compression
(tests/distribution/test_initialize.py).

tfdist.distribution.initialize(compression="bf16") joins the job from
TF_CONFIG; a ModelParallel on a 1-D batch mesh splits both kernels over the
2 processes (FSDP), so their gradients are reduce-scattered over the batch
axis, in bfloat16. A second initialize() with other options is refused.
Prints one "tfdist result:" line: losses, weights, bytes sent.
"""

import sys
from pathlib import Path

import keras

import tfdist
from protocol import result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distribution"))
import fsdp_mlp

tfdist.distribution.initialize(compression="bf16")
try:
    tfdist.distribution.initialize(compression="fp16")
    again = None
except tfdist.ConfigError as error:
    again = {"field": error.field, "message": str(error)}

keras.distribution.set_distribution(
    fsdp_mlp.model_parallel(keras, keras.distribution.list_devices())
)
model, loss, weights, sent = fsdp_mlp.fit(keras)
result(
    {
        "task": model.distribute_strategy.task,
        "again": again,
        "loss": loss,
        "weights": [w.tolist() for w in weights],
        "sent": sent,
    }
)
