"""One task of the real-Slurm fit test (tests/engines/test_slurm_engine.py).

Started by ``srun -n2 python tests/workers/slurm_fit.py``: no TF_CONFIG, only
the Slurm step's environment. Builds the strategy through
``strategy_from_config()``, fits the scripts' model, and prints one
'tfdist result:' line with the strategy, the cluster it found, the losses and
a sha256 of the final weights.
"""

import json
import os
import sys

import _common
import tfdist
from protocol import say

strategy = tfdist.strategy_from_config(register_timeout=90)
choice = strategy.choice
result = _common.train(
    strategy, epochs=3, per_replica_batch_size=32, examples=1024, learning_rate=0.01, seed=3
)
result.update(
    {
        "kind": strategy.kind,
        "choice": None
        if choice is None
        else {"name": choice.name, "slurm": choice.slurm, "reason": choice.reason},
        "cluster": strategy.cluster_resolver.cluster_spec().as_dict(),
        "task": strategy.task,
        "is_chief": strategy.is_chief,
        "procid": int(os.environ["SLURM_PROCID"]),
        "slurm_job_id": os.environ["SLURM_JOB_ID"],
        "slurm_step_id": os.environ["SLURM_STEP_ID"],
        "tf_config": os.environ.get("TF_CONFIG"),
    }
)
say("tfdist result: " + json.dumps(result))
sys.exit(0)
