"""tfdist.strategies.topology: where a process sits, from each launcher's variables."""

import json

import pytest

from tfdist.errors import ConfigError
from tfdist.strategies import topology as ranks


def _tf_config(cluster, task_type, index):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_no_launcher_is_one_process():
    topo = ranks.discover({})
    assert (topo.rank, topo.size, topo.local_size, topo.cross_size) == (0, 1, 1, 1)
    assert topo.source == "single process"


def test_tf_config_chief_is_rank_zero_then_workers():
    cluster = {"chief": ["a:1000"], "worker": ["b:1000", "a:1001", "b:1001"]}
    got = [
        ranks.discover(_tf_config(cluster, t, i))
        for t, i in [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
    ]
    assert [t.rank for t in got] == [0, 1, 2, 3]
    assert all(t.size == 4 for t in got)
    # Hosts a: ranks 0, 2; b: ranks 1, 3.
    assert [(t.local_rank, t.local_size) for t in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [(t.cross_rank, t.cross_size) for t in got] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert got[2].task_type == "worker" and got[2].task_id == 1
    assert got[0].leader == "/job:chief/replica:0/task:0"


def test_tf_config_localhost_names_are_one_host():
    cluster = {"worker": ["localhost:1", "127.0.0.1:2"]}
    topo = ranks.discover(_tf_config(cluster, "worker", 1))
    assert (topo.local_rank, topo.local_size, topo.cross_size) == (1, 2, 1)


def test_tf_config_with_ps_is_refused_by_name():
    cluster = {"chief": ["a:1"], "worker": ["a:2"], "ps": ["a:3"]}
    with pytest.raises(ConfigError, match="'ps'") as info:
        ranks.discover(_tf_config(cluster, "worker", 0))
    assert info.value.field == "cluster"


def test_horovod_variables_on_one_host_get_loopback_ports():
    env = {
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "TFDIST_PORT_BASE": "23000",
    }
    topo = ranks.discover(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.source) == (1, 2, 1, "HOROVOD_*")
    assert topo.cluster == {"worker": ["127.0.0.1:23000", "127.0.0.1:23001"]}
    assert topo.task_id == 1


def test_open_mpi_variables_with_hosts():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "TFDIST_HOSTS": "n1:2,n2:2",
        "TFDIST_PORT_BASE": "24000",
    }
    topo = ranks.discover(env)
    assert topo.cluster["worker"] == ["n1:24000", "n1:24001", "n2:24000", "n2:24001"]
    assert (topo.local_rank, topo.cross_rank, topo.cross_size) == (0, 1, 2)


def test_open_mpi_on_several_hosts_without_hosts_says_what_is_missing():
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(ConfigError, match="TFDIST_HOSTS") as info:
        ranks.discover(env)
    assert "OMPI_COMM_WORLD_LOCAL_SIZE='2'" in str(info.value)


@pytest.mark.parametrize(
    "env, field",
    [
        ({"HOROVOD_RANK": "x", "HOROVOD_SIZE": "2"}, "HOROVOD_RANK"),
        ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2"}, "HOROVOD_RANK"),
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "0"}, "HOROVOD_SIZE"),
        (
            {
                "HOROVOD_RANK": "0",
                "HOROVOD_SIZE": "2",
                "HOROVOD_LOCAL_SIZE": "2",
                "TFDIST_PORT_BASE": "70000",
            },
            "TFDIST_PORT_BASE",
        ),
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "TFDIST_HOSTS": "n1:0"}, "TFDIST_HOSTS"),
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "3", "TFDIST_HOSTS": "n1:2"}, "TFDIST_HOSTS"),
        (
            {
                "HOROVOD_RANK": "1",
                "HOROVOD_SIZE": "2",
                "HOROVOD_LOCAL_RANK": "0",
                "HOROVOD_LOCAL_SIZE": "2",
            },
            "local_rank",
        ),
    ],
)
def test_bad_variables_name_the_variable_and_value(env, field):
    with pytest.raises(ConfigError) as info:
        ranks.discover(env)
    assert info.value.field == field
    assert "Received" in str(info.value)


def test_port_base_from_a_job_id_is_stable_and_in_range():
    a = ranks.port_base({}, "job-7", "test")
    assert a == ranks.port_base({}, "job-7", "test")
    assert 20000 <= a < 32768 and a != ranks.port_base({}, "job-8", "test")
