"""One worker of the 2-process gradient-accumulation test.

Run through ``tfdist launch --workers 2`` (tests/training/test_grad_accumulation.py).
For each setting in argv[1] ("none", "powersgd": PowerSGD rank 1 after one
dense step) it trains with ``gradient_accumulation_steps=4`` and with a 4x
larger batch under MultiWorkerMirrored, and prints one 'tfdist result:' line.
"""

import sys

import numpy as np

import accumulation_check
import tfdist
from protocol import result
from tfdist.compression import PowerSGD

K = 4
results = {}
for setting in sys.argv[1].split(","):
    compression = {"none": None, "powersgd": PowerSGD(rank=1, warmup_steps=1)}[setting]

    def strategy():
        return tfdist.strategy_from_config(compression=compression, register_timeout=120)  # noqa: B023 - called in this iteration only

    accumulating = strategy()
    ours = accumulation_check.train(accumulating, k=K, micro_steps=4 * K)
    reference = accumulation_check.reference(strategy(), k=K, micro_steps=4 * K)
    results[setting] = {
        "replicas": accumulating.num_replicas_in_sync,
        "iterations": [ours["iterations"], reference["iterations"]],
        "max_weight_difference": max(
            float(np.max(np.abs(a - b))) for a, b in zip(ours["weights"], reference["weights"])
        ),
        "sent_steps": [i for i, sent in enumerate(ours["sent"]) if sent > 0],
        "state_changed_without_applying": any(
            s["state_changed"] for s in ours["states"] if not s["applied"]
        ),
        "bytes_ratio": sum(ours["sent"]) / sum(reference["sent"]),
    }
result(results)
