"""A plain-Python task for the launcher tests (no TensorFlow: quick).

Usage: task.py MODE [DIR]. It prints a line naming its task, a warning, and a
TensorFlow INFO line that has the word "error".
With DIR, it writes its pid (and its grandchild's) to DIR/TASK.pid and its
cluster's ports to DIR/ports-ATTEMPT and its TFDIST_JOB_DIR to DIR/jobdir-ATTEMPT. Modes:

* ok: exit 0.
* fail-1: worker 1 exits 3; the others sleep until stopped.
* fail-1-once: like fail-1 on the first attempt only; then everyone exits 0.
* kill-1: worker 1 kills itself with SIGKILL.
* sleep: everyone sleeps until stopped.
* interfaces: print the network interfaces this process sees.
* chatty: print() 300 numbered lines while a thread writes a C++-like log
  line to stderr in one write at a time, as TensorFlow's logger does; exit 0.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from protocol import write_pid

config = json.loads(os.environ["TF_CONFIG"])
task_type, index = config["task"]["type"], config["task"]["index"]
attempt = int(os.environ["TFDIST_LAUNCH_ATTEMPT"])
mode = sys.argv[1]
out = Path(sys.argv[2]) if len(sys.argv) > 2 else None
workers = len(config["cluster"].get("worker", []))
print(f"task {task_type}:{index} of {workers} workers, attempt {attempt}", flush=True)
print("WARNING: a warning", flush=True)
# A TensorFlow INFO line with "error" in it (a PS worker prints it at its end).
print(
    "I0000 00:00:1795433773.187567    4577 kernel_and_device.cc:101] Ignoring "
    "error status when releasing multi-device function handle",
    flush=True,
)

if out is not None:
    # A grandchild, to check that stopping reaches the whole process group.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    write_pid(out / f"{task_type}-{index}-child.pid", child.pid)
    write_pid(out / f"{task_type}-{index}.pid")
    ports = sorted(a.rsplit(":", 1)[1] for job in config["cluster"].values() for a in job)
    (out / f"ports-{attempt}").write_text(" ".join(ports))
    job_dir = os.environ["TFDIST_JOB_DIR"]
    (out / f"jobdir-{attempt}").write_text(f"{job_dir} {int(os.path.isdir(job_dir))}")

if mode == "interfaces":
    print("interfaces: " + ",".join(sorted(n for _, n in socket.if_nameindex())), flush=True)
    sys.exit(0)
if mode == "chatty":
    done = threading.Event()

    def log():
        while not done.is_set():
            os.write(2, b"E0000 00:00:1795433773.187567    4577 chatty.cc:1] a log line\n")

    logger = threading.Thread(target=log)
    logger.start()
    for n in range(300):
        print(f"line {n} of {task_type}:{index}")  # The text, then its newline.
    done.set()
    logger.join()
    sys.exit(0)
failing = task_type == "worker" and index == 1
if mode == "fail-1-once" and attempt > 0:
    sys.exit(0)
if mode in ("fail-1", "fail-1-once", "kill-1") and failing:
    time.sleep(0.5)  # Let the others start.
    if mode == "kill-1":
        os.kill(os.getpid(), signal.SIGKILL)
    print("worker 1 fails now", flush=True)
    sys.exit(3)
if mode == "ok":
    sys.exit(0)
time.sleep(600)
