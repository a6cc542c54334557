"""A plain-Python trainer for the launcher's preemption tests (no TensorFlow).

It follows the preemption protocol of PREEMPTED_EXIT_CODE and the status
record: it "trains" one step every STEP seconds, and on the preemption
signal ($TFDIST_PREEMPT_SIGNAL, SIGTERM by default) the tasks agree on a
step, as TF's protocol does (the first signalled task writes
$TFDIST_JOB_DIR/stop-at-ATTEMPT: its next step), and each, at that step, writes
$TFDIST_JOB_DIR/preempted/<task>.json atomically and exits 143.
The step count survives restarts in DIR/progress (the "backup"), so a
restarted job resumes where the save left it.

Usage: preempt_task.py MODE DIR [STEPS] [STEP_SECONDS]. Every task appends a
line "attempt size task start_step end_step how" to DIR/log. Modes:

* save: saves on the signal (after SAVE_DELAY seconds, from $PREEMPT_SAVE_DELAY).
* ignore: ignores the signal (TensorFlow without a watcher: killed at the end
  of the grace period).
* die: the default handler (killed by the signal, nothing saved).
* late: ignores the signal for $PREEMPT_LATE seconds (default 2), then saves
  on it.
* preempt-1: like save; worker 1 of attempt 0 signals itself at step 3.
* kill-last: like save; on attempt 0 the last worker SIGKILLs itself at step 3.

A chief (of a parameter-server job) logs "preempted-servers-down" instead of
"preempted" if a ps or worker server did not answer when it saved.
"""

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from protocol import write_pid

config = json.loads(os.environ["TF_CONFIG"])
task_type, index = config["task"]["type"], config["task"]["index"]
task = f"{task_type}:{index}"
size = len(config["cluster"].get("worker", []))
attempt = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
mode, out = sys.argv[1], Path(sys.argv[2])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
step_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.1
save_delay = float(os.environ.get("PREEMPT_SAVE_DELAY", "0"))
signum = signal.Signals[os.environ.get("TFDIST_PREEMPT_SIGNAL", "SIGTERM")]
progress = out / "progress"
start = int(progress.read_text()) if progress.exists() else 0
requested = []


def log(end: int, how: str) -> None:
    with open(out / "log", "a") as f:
        f.write(f"{attempt} {size} {task} {start} {end} {how}\n")


def _answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def on_signal(number, frame):
    requested.append(time.time())


if mode in ("save", "preempt-1", "kill-last"):
    signal.signal(signum, on_signal)
elif mode == "late":
    # As a TensorFlow task before fit: the signal is swallowed until the
    # watcher takes it over, LATE seconds after the start.
    signal.signal(signum, signal.SIG_IGN)
    late = time.monotonic() + float(os.environ.get("PREEMPT_LATE", "2"))
elif mode == "ignore":
    signal.signal(signum, signal.SIG_IGN)
write_pid(out / f"{task_type}-{index}-{attempt}.pid")
tmp = out / f".cluster-{attempt}-{task_type}-{index}.json"
tmp.write_text(json.dumps(config["cluster"]))
os.replace(tmp, out / f"cluster-{attempt}.json")
print(f"{task} of {size} starts at step {start}", flush=True)
if task_type == "worker" and index == 0:
    # As a collective's first step does: the chief steps (and moves the
    # "backup") only once every worker of the attempt has read its start.
    # Without this, a worker that started late under load read the chief's
    # next step (CI: worker:1 resumed at 21 after a save at 20).
    joined = time.monotonic() + 60
    while time.monotonic() < joined and not all(
        (out / f"worker-{i}-{attempt}.pid").exists() for i in range(size)
    ):
        time.sleep(0.02)
step = start
while step < steps:
    time.sleep(step_seconds)
    if mode == "late" and time.monotonic() > late:
        mode = "save"
        signal.signal(signum, on_signal)
    step += 1
    if index == 0 and task_type == "worker":
        # The chief's "backup", atomically.
        (out / "progress.tmp").write_text(str(step))
        os.replace(out / "progress.tmp", progress)
    if attempt == 0 and step == start + 3:
        if mode == "preempt-1" and index == 1:
            os.kill(os.getpid(), signum)
        if mode == "kill-last" and index == size - 1:
            log(step, "killed")
            os.kill(os.getpid(), signal.SIGKILL)
    stop_file = Path(os.environ["TFDIST_JOB_DIR"]) / f"stop-at-{attempt}"
    if requested and not stop_file.exists():
        # The agreement, as TF's protocol does it: the first signalled task
        # publishes "stop after step N+1"; every task stops there.
        try:
            fd = os.open(stop_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(step + 1).encode())
            os.close(fd)
        except FileExistsError:
            pass
    stop_at = stop_file.read_text() if stop_file.exists() else ""
    if stop_at and step >= int(stop_at):
        time.sleep(save_delay)
        record = {
            "task": task,
            "attempt": attempt,
            "step": step,
            "epoch": step // 10,
            "batch": step % 10,
            "backup": str(progress),
            "signal_time": requested[0] if requested else None,
            "saved_time": time.time(),
            "exit_time": time.time(),
        }
        directory = Path(os.environ["TFDIST_JOB_DIR"]) / "preempted"
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{task_type}-{index}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, directory / f"{task_type}-{index}.json")
        how = "preempted"
        if task_type == "chief":
            # A parameter-server job's chief saves through its servers: they
            # must still be up now.
            up = all(
                _answers(a) for job in ("ps", "worker") for a in config["cluster"].get(job, [])
            )
            how = "preempted" if up else "preempted-servers-down"
        log(step, how)
        print(f"{task} saved at step {step}", flush=True)
        sys.exit(143)
log(step, "done")
print(f"{task} done at step {step}", flush=True)
