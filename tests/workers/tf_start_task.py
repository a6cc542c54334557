"""A task for `tfdist launch` that starts TensorFlow (tests/engines/test_launch.py).

Importing TensorFlow and listing its devices prints TensorFlow's start-up
noise on a CPU machine. Then each task prints one line, and logs one real
error through absl. With ``fail``, worker 1 then raises (a traceback).
"""

import json
import os
import sys

import tensorflow as tf
from absl import logging

tf.config.list_physical_devices()  # Device start-up: the cuInit line.
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
print(f"task {index}: {len(tf.config.list_physical_devices('CPU'))} CPU", flush=True)
logging.error("a real error from task %d", index)
if sys.argv[1:] == ["fail"] and index == 1:
    raise RuntimeError("task 1 fails on purpose")
