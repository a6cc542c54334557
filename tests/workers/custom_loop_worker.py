"""One worker of the 2-process custom-loop test (tests/training/test_custom_loop.py).

Run through ``tfdist launch --workers 2``. For each compression setting in
argv[1] (comma-separated; "none" for none) it builds the strategy with
strategy_from_config, runs the loop of loop_check (no fit, no
optimizer.build) and compares the first update with the reference
reduction of both workers' gradients. Prints one 'tfdist result:' line.
"""

import sys

import loop_check
import tfdist
from protocol import result

results = {}
for setting in sys.argv[1].split(","):
    strategy = tfdist.strategy_from_config(
        compression=loop_check.compression_of(setting), register_timeout=120
    )
    # PowerSGD's default warm-up is dense; run past it.
    steps = 12 if setting.startswith("powersgd") else 3
    found = loop_check.check(strategy, loop_check.run(strategy, steps=steps))
    found["replicas"] = strategy.num_replicas_in_sync
    results[setting] = found
result(results)
