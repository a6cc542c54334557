"""A 2-worker job for the watchdog test (TF_CONFIG set by the test).

Both workers run 150 small all-reduces and report their thread counts
before and after. Then worker 1 stops itself (SIGSTOP: hung, not dead) and
worker 0 runs one more all-reduce, which must fail with tfdist's message
within collective_timeout (TFDIST_COLLECTIVE_TIMEOUT) plus a probe.
"""

import json
import os
import signal
import time

import tensorflow as tf

import tfdist
from protocol import say


def threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


strategy = tfdist.strategy_from_config()
rank = strategy.cluster_resolver.task_id


@tf.function
def all_reduce():
    def body():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(
            "SUM", tf.ones([64]) * tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        )

    return strategy.run(body)


first = float(all_reduce()[0])
before = threads()
for _ in range(150):
    total = float(all_reduce()[0])
after = threads()
result = {
    "rank": rank,
    "sum": total,
    "first": first,
    "threads_before": before,
    "threads_after": after,
    "timeout": strategy.watchdog.timeout if strategy.watchdog else None,
}
if rank == 1:
    say("tfdist result: " + json.dumps(result))
    time.sleep(1.0)  # Let worker 0 enter its next all-reduce first.
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)  # Only reached if the test sends SIGCONT.
start = time.monotonic()
try:
    float(all_reduce()[0])
    result["error"] = None
except Exception as error:  # noqa: BLE001 - the test checks the type and text
    result["error"] = f"{type(error).__name__}: {error}"
result["seconds_to_error"] = time.monotonic() - start
result["watchdog_failure"] = strategy.watchdog.failure if strategy.watchdog else None
say("tfdist result: " + json.dumps(result))
os._exit(0)
