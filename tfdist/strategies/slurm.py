"""A Slurm cluster resolver that works on nodes without GPUs.

TensorFlow's ``SlurmClusterResolver`` counts GPUs with ``nvidia-smi`` and
fails where it is missing (FileNotFoundError), and with ``gpus_per_node=0`` it
fails with "range() arg 3 must not be zero" (measured on TF 2.21). This
subclass counts GPUs without failing, places tasks on ports without GPUs, and
only touches ``CUDA_VISIBLE_DEVICES`` when there are GPUs to share out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from collections.abc import Mapping

from tfdist.compat.tf_python import ClusterSpec, slurm_cluster_resolver
from tfdist.errors import ConfigError

#: Ports handed to one job step span at most this many per node.
_PORT_SPAN = 64
#: Derived port bases lie in [_PORT_LOW, _PORT_HIGH - _PORT_SPAN]. The range
#: ends below 32768, where the ephemeral ranges of Linux (32768-60999) and
#: IANA (49152-65535) start: srun, slurmstepd and every outgoing connection
#: on the node take ports from there, so a base inside it can collide.
_PORT_LOW = 20000
_PORT_HIGH = 32768


def default_port_base(env: Mapping[str, str] | None = None) -> int:
    """A TensorFlow port base derived from the Slurm job and step ids.

    A fixed base (TensorFlow uses 8888) collides when two job steps share a
    node. Hashing the job and step ids spreads bases over 20000-32704, so
    that a step's ports (the base plus one per task on the node, at most
    64) stay below the kernel's ephemeral port range, from which srun,
    slurmstepd and outgoing connections take theirs. Every task computes the same base from the
    same ids, so the tasks of a step agree on each other's addresses.

    Args:
        env: The environment; defaults to ``os.environ``.

    Returns:
        The first port for the tasks on each node.
    """
    env = os.environ if env is None else env
    key = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
    return _PORT_LOW + zlib.crc32(key.encode()) % (_PORT_HIGH - _PORT_SPAN - _PORT_LOW + 1)


def count_gpus() -> int:
    """Counts this node's GPUs; 0 when there is no NVIDIA driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class SlurmClusterResolver(slurm_cluster_resolver.SlurmClusterResolver):
    """``SlurmClusterResolver`` for CPU-only and GPU nodes alike.

    Args:
        jobs: Job name to number of tasks; defaults to one worker per task.
        port_base: First port on each node; defaults to
            :func:`default_port_base`.
        gpus_per_node: GPUs on each node; defaults to :func:`count_gpus`.
        **kwargs: Passed to TensorFlow's resolver.

    Raises:
        ConfigError: A node has GPUs but fewer than its tasks (TensorFlow's
            resolver would fail with "range() arg 3 must not be zero").
    """

    def __init__(
        self, jobs=None, port_base: int | None = None, gpus_per_node: int | None = None, **kwargs
    ):
        if port_base is None:
            port_base = default_port_base()
        if gpus_per_node is None:
            gpus_per_node = count_gpus()
        self._no_gpus = gpus_per_node == 0
        if self._no_gpus:
            # TF divides by gpus_per_task; give it a harmless 0/0 split and
            # skip GPU placement in cluster_spec below.
            kwargs.setdefault("gpus_per_task", 0)
            kwargs["auto_set_gpu"] = False
        super().__init__(jobs=jobs, port_base=port_base, gpus_per_node=gpus_per_node, **kwargs)
        if not self._no_gpus and self._gpus_per_task < 1:
            # More tasks than GPUs on a node: TF's placement would fail later
            # with "range() arg 3 must not be zero".
            tasks = max(self._task_configuration.values())
            raise ConfigError(
                "gpus_per_task",
                self._gpus_per_task,
                f"at least 1 GPU per task ({tasks} tasks share a node with {gpus_per_node} GPU(s))",
                source="Slurm environment",
                hint="Start at most as many tasks per node as it has GPUs "
                "(srun --ntasks-per-node), or hide the GPUs with "
                "CUDA_VISIBLE_DEVICES= to train on the CPU.",
            )

    def cluster_spec(self) -> ClusterSpec:
        if not self._no_gpus:
            return super().cluster_spec()
        tasks = []
        for host, num_tasks in sorted(self._task_configuration.items()):
            tasks += [f"{host}:{self._port_base + i}" for i in range(num_tasks)]
        self._cluster_allocation = {}
        start = 0
        for task_type, num_tasks in sorted(self._jobs.items()):
            self._cluster_allocation[task_type] = tasks[start : start + num_tasks]
            if start <= self._rank < start + num_tasks:
                self.task_type, self.task_id = task_type, self._rank - start
            start += num_tasks
        return ClusterSpec(self._cluster_allocation)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        if self._no_gpus:
            return {}
        return super().num_accelerators(task_type, task_id, config_proto)
