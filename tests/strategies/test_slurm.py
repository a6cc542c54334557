"""tfdist's Slurm resolver on a CPU-only node, where TensorFlow's fails.

The environment is what ``srun -n2`` sets on one node; a real Slurm cluster
is exercised by the Slurm integration tests.
"""

from __future__ import annotations

import pytest

from tfdist.errors import ConfigError
from tfdist.spec.detect import choose

STEP = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
}


@pytest.fixture
def slurm_step(monkeypatch, tmp_path):
    for name, value in STEP.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as tf_slurm

    from tfdist.strategies import slurm

    return tf_slurm, slurm


def test_tensorflows_resolver_fails_without_gpus(slurm_step):
    tf_slurm, _ = slurm_step
    with pytest.raises((RuntimeError, OSError)):
        tf_slurm.SlurmClusterResolver(port_base=23000)
    with pytest.raises(ValueError, match="must not be zero"):
        tf_slurm.SlurmClusterResolver(port_base=23000, gpus_per_node=0).cluster_spec()


def test_tfdist_resolver_works_on_a_cpu_node(slurm_step):
    _, slurm = slurm_step
    resolver = slurm.SlurmClusterResolver(port_base=23000)
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost:23000", "localhost:23001"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.num_accelerators() == {}
    assert "CUDA_VISIBLE_DEVICES" not in __import__("os").environ


def test_tfdist_resolver_keeps_gpu_placement_on_gpu_nodes(slurm_step, monkeypatch):
    _, slurm = slurm_step
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    resolver = slurm.SlurmClusterResolver(port_base=23000)
    assert resolver.cluster_spec().as_dict() == {"worker": ["localhost:23000", "localhost:23001"]}
    assert resolver.num_accelerators() == {"GPU": 1}
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "1"  # task 1's GPU


def test_more_tasks_than_gpus_on_a_node_is_a_clear_error(slurm_step, monkeypatch):
    tf_slurm, slurm = slurm_step
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # 1 GPU, 2 tasks on the node.
    with pytest.raises(ValueError, match="must not be zero"):
        tf_slurm.SlurmClusterResolver(port_base=23000).cluster_spec()
    with pytest.raises(ConfigError) as error:
        slurm.SlurmClusterResolver(port_base=23000)
    assert error.value.field == "gpus_per_task"
    assert "2 tasks share a node with 1 GPU(s)" in str(error.value)
    assert "--ntasks-per-node" in str(error.value)


def test_default_port_base_depends_on_job_and_step(slurm_step):
    _, slurm = slurm_step
    base = slurm.default_port_base(STEP)
    other = slurm.default_port_base({**STEP, "SLURM_JOB_ID": "4243"})
    assert base != other
    for port in (base, other):
        # Below the ephemeral port ranges (Linux 32768-60999, IANA 49152-),
        # where srun and slurmstepd bind on the same node.
        assert port >= 20000 and port + 64 <= 32768, port
    bases = {
        slurm.default_port_base({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0"})
        for job in range(2000)
    }
    assert min(bases) >= 20000 and max(bases) + 64 <= 32768, (min(bases), max(bases))
    assert len(bases) > 1800, f"expected bases spread out, got {len(bases)} distinct"
    assert slurm.SlurmClusterResolver().cluster_spec().as_dict()["worker"][0] == (
        f"localhost:{base}"
    )


def test_auto_detection_picks_multi_worker_in_a_slurm_step(slurm_step):
    choice = choose(count_devices=lambda kind: 0)
    assert choice.name == "multi_worker_mirrored" and choice.slurm


def test_horovod_ranks_come_from_the_slurm_step(slurm_step, monkeypatch):
    import os

    from tfdist.strategies import topology as ranks

    monkeypatch.setenv("SLURM_LOCALID", "1")
    topo = ranks.discover(dict(os.environ))
    base = slurm_step[1].default_port_base()
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (1, 2, 1, 2)
    assert topo.source == "Slurm" and (topo.task_type, topo.task_id) == ("worker", 1)
    assert topo.cluster == {"worker": [f"localhost:{base}", f"localhost:{base + 1}"]}
    # Horovod scripts pick their GPU with local_rank(): no narrowing here.
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_horovod_ranks_refuse_a_local_id_that_contradicts_the_step(slurm_step, monkeypatch):
    import os

    from tfdist.strategies import topology as ranks

    monkeypatch.setenv("SLURM_LOCALID", "0")  # Task 1 of 2 on one node is local 1.
    with pytest.raises(ConfigError) as info:
        ranks.discover(dict(os.environ))
    assert info.value.field == "local_rank" and info.value.value == 0
