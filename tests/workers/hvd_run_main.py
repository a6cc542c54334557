"""tfdist.horovod.run() from a script whose functions live in ``__main__``.

Usage: hvd_run_main.py MODE OUT_JSON. MODE is ``cloudpickle`` or ``pickle``
(the serializer run() must use). Runs, with np=2:

* ``task_info``, a ``__main__`` function reading TF_CONFIG, with args and
  kwargs; it returns a ``__main__`` class instance;
* ``fail_on_rank_1``: rank 1 raises, rank 0 sleeps (and must be stopped);
* ``flaky`` with max_restarts=1: rank 1 fails on the first attempt only.

Writes what it saw to OUT_JSON. The run() calls sit under the
``if __name__ == "__main__"`` guard, as the pickle path requires.
"""

import dataclasses
import json
import os
import pickle
import sys
import time


@dataclasses.dataclass
class Seen:
    rank: int
    workers: int
    pid: int
    tag: str


def task_info(tag, *, scale):
    config = json.loads(os.environ["TF_CONFIG"])
    rank = config["task"]["index"]
    return Seen(
        rank=rank * scale,
        workers=len(config["cluster"]["worker"]),
        pid=os.getpid(),
        tag=f"{tag}-{__name__}",
    )


def fail_on_rank_1(pid_dir):
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    path = os.path.join(pid_dir, f"rank-{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # Whole or absent: rank 0 may be stopped any time.
    if rank == 1:
        # The test reads both pids: fail once rank 0 has written its own, or
        # the launcher may stop rank 0 before it starts (seen in a full run).
        other, deadline = os.path.join(pid_dir, "rank-0.pid"), time.monotonic() + 300
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError(f"rank {rank} cannot go on")
    time.sleep(600)  # Stopped by the launcher once rank 1 fails.


def flaky():
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
    if rank == 1 and attempt == 0:
        sys.exit(4)  # Not an exception: the rank just exits.
    return [rank, attempt]


if __name__ == "__main__":
    import importlib

    from tfdist.engines.worker import hvd_worker as _hvd_worker
    from tfdist.horovod.run import RunError, run

    # The module, not the function tfdist.horovod re-exports as `run`.
    run_module = importlib.import_module("tfdist.horovod.run")

    mode, out = sys.argv[1], sys.argv[2]
    run_module._PICKLER = mode
    seen = run(task_info, args=("x",), kwargs={"scale": 10}, np=2)
    pid_dir = os.path.dirname(os.path.abspath(out))
    started = time.monotonic()
    try:
        run(fail_on_rank_1, args=(pid_dir,), num_proc=2)
        error = None
    except RunError as e:
        error = {
            "type": type(e).__name__,
            "rank": e.rank,
            "error_type": e.error_type,
            "error_message": e.error_message,
            "text": str(e),
            "seconds": time.monotonic() - started,
            "pickled_again": str(pickle.loads(pickle.dumps(e))),
        }
    restarted = run(flaky, np=2, max_restarts=1)
    pids = [int(open(os.path.join(pid_dir, f"rank-{r}.pid")).read()) for r in (0, 1)]  # noqa: SIM115 - a one-line read
    result = {
        "serializer": _hvd_worker.pickler(run_module._PICKLER)[0],
        "seen": [dataclasses.asdict(s) for s in seen],
        "types": [type(s).__qualname__ for s in seen],
        "parent_pid": os.getpid(),
        "error": error,
        "failing_pids": pids,
        "restarted": restarted,
    }
    with open(out, "w") as f:
        json.dump(result, f)
