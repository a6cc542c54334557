"""Strategy auto-detection for each cluster shape, without TensorFlow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tfdist import spec as spec_lib
from tfdist.errors import ConfigError
from tfdist.spec.detect import choose
from tfdist.spec.options import make_options

WORKERS = {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}
CHIEF_WORKERS = {"chief": ["127.0.0.1:20000"], **WORKERS}
PS = {**CHIEF_WORKERS, "ps": ["127.0.0.1:20003"]}
SLURM = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}


def devices(gpus=0, tpus=0, logical_gpus=None, logical_cpus=1):
    """A device counter: physical GPUs and TPUs, and the logical devices
    TensorFlow runs on (by default one per GPU, and one CPU)."""
    counts = {
        "GPU": gpus,
        "TPU": tpus,
        "logical CPU": logical_cpus,
        "logical GPU": gpus if logical_gpus is None else logical_gpus,
    }
    return lambda kind: counts[kind]


def tf_config(jobs, task_type, index):
    return json.dumps({"cluster": jobs, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize(
    "env, options, gpus, tpus, name, role, reason",
    [
        ({}, {}, 0, 0, "one_device", "trainer", "one device (the CPU)"),
        ({}, {}, 1, 0, "one_device", "trainer", "one device (1 GPU)"),
        ({}, {}, 4, 0, "mirrored", "trainer", "4 local GPUs"),
        ({}, {"cpu_replicas": 2}, 0, 0, "mirrored", "trainer", "cpu_replicas=2"),
        ({}, {"cpu_replicas": 1}, 0, 0, "one_device", "trainer", "one device"),
        (
            {},
            {"devices": ["/gpu:0", "/gpu:1"]},
            2,
            0,
            "mirrored",
            "trainer",
            "2 devices were given",
        ),
        (
            {"TF_CONFIG": tf_config(WORKERS, "worker", 1)},
            {},
            0,
            0,
            "multi_worker_mirrored",
            "trainer",
            "2 worker",
        ),
        (
            {"TF_CONFIG": tf_config(CHIEF_WORKERS, "chief", 0)},
            {},
            0,
            0,
            "multi_worker_mirrored",
            "trainer",
            "3 worker task(s)",
        ),
        (
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
                )
            },
            {},
            4,
            0,
            "multi_worker_mirrored",
            "trainer",
            "1 worker",
        ),
        (
            {"TF_CONFIG": tf_config(PS, "chief", 0)},
            {},
            0,
            0,
            "parameter_server",
            "trainer",
            "'ps' job",
        ),
        (
            {"TF_CONFIG": tf_config(PS, "worker", 1)},
            {},
            0,
            0,
            "parameter_server",
            "server",
            "'ps' job",
        ),
        ({"TF_CONFIG": tf_config(PS, "ps", 0)}, {}, 0, 0, "parameter_server", "server", "'ps' job"),
        (
            {"TF_CONFIG": tf_config(PS, "evaluator", 0)},
            {},
            0,
            0,
            "parameter_server",
            "evaluator",
            "'ps' job",
        ),
        ({"TPU_NAME": "my-tpu"}, {}, 0, 0, "tpu", "trainer", "(tpu='my-tpu')"),
        ({}, {"tpu": "grpc://10.0.0.2:8470"}, 0, 0, "tpu", "trainer", "a TPU was given"),
        ({}, {}, 0, 8, "tpu", "trainer", "8 local TPU"),
        (SLURM, {}, 0, 0, "multi_worker_mirrored", "trainer", "Slurm job step of 2"),
        (
            {**SLURM, "SLURM_STEP_NUM_TASKS": "1"},
            {},
            0,
            0,
            "one_device",
            "trainer",
            "a Slurm step of 1 task",
        ),
        # TF_CONFIG wins over the Slurm environment it runs in.
        (
            {**SLURM, "TF_CONFIG": tf_config(PS, "chief", 0)},
            {},
            0,
            0,
            "parameter_server",
            "trainer",
            "'ps' job",
        ),
    ],
)
def test_auto_detection(env, options, gpus, tpus, name, role, reason):
    choice = choose(
        strategy="auto",
        options=make_options(env=env, **options),
        env=env,
        count_devices=devices(gpus, tpus),
    )
    assert (choice.name, choice.role) == (name, role)
    assert reason in choice.reason
    assert choice.slurm == (name == "multi_worker_mirrored" and "SLURM" in choice.reason.upper())


@pytest.mark.parametrize(
    "counts, name, reason",
    [
        # The CPU split by tf.config.set_logical_device_configuration, as TF's
        # input tutorial does before MirroredStrategy().
        (
            {"logical_cpus": 2},
            "mirrored",
            "2 logical CPUs, as tf.config."
            "set_logical_device_configuration split the CPU before this call",
        ),
        # One GPU split into two logical GPUs (two memory limits).
        (
            {"gpus": 1, "logical_gpus": 2},
            "mirrored",
            "2 logical GPUs, as tf.config set up the 1 local GPU(s)",
        ),
        # GPUs win over a split CPU, as in MirroredStrategy().
        ({"gpus": 1, "logical_cpus": 4}, "one_device", "one device (1 GPU)"),
        # Every GPU hidden with set_visible_devices: the (split) CPU is used.
        ({"gpus": 2, "logical_gpus": 0, "logical_cpus": 3}, "mirrored", "3 logical CPUs"),
        ({"gpus": 2, "logical_gpus": 0}, "one_device", "one device (the CPU)"),
    ],
)
def test_auto_detection_uses_configured_logical_devices(counts, name, reason):
    choice = choose(
        strategy="auto", options=make_options(env={}), env={}, count_devices=devices(**counts)
    )
    assert choice.name == name
    assert reason in choice.reason


def test_explicit_options_win_over_configured_logical_devices():
    choice = choose(
        options=make_options(env={}, cpu_replicas=1), env={}, count_devices=devices(logical_cpus=4)
    )
    assert choice.name == "one_device"  # cpu_replicas=1: one CPU replica
    assert "cpu_replicas=1" in choice.reason
    one = choose(
        options=make_options(env={}, devices=["/cpu:1"]),
        env={},
        count_devices=devices(gpus=2, logical_cpus=4),
    )
    assert (one.name, one.reason) == ("one_device", "1 device was given: /cpu:1")
    cluster_choice = choose(
        tf_config(WORKERS, "worker", 0), env={}, count_devices=devices(logical_cpus=4)
    )
    assert cluster_choice.name == "multi_worker_mirrored"


def test_tpu_setting_comes_from_tpu_name():
    options = make_options(env={"TPU_NAME": "my-tpu"})
    choice = choose(options=options, env={}, count_devices=devices())
    assert (choice.name, choice.tpu) == ("tpu", "my-tpu")


@pytest.mark.parametrize(
    "strategy", ["mirrored", "one_device", "default", "multi_worker_mirrored", "tpu"]
)
def test_explicit_name_overrides_detection(strategy):
    choice = choose(strategy=strategy, env={}, count_devices=devices(gpus=4))
    assert choice.name == strategy
    assert "was asked for" in choice.reason


def test_explicit_multi_worker_in_slurm_step_uses_slurm():
    choice = choose(strategy="multi_worker_mirrored", env=SLURM, count_devices=devices())
    assert choice.slurm and choice.name == "multi_worker_mirrored"


def test_config_argument_wins_over_environment():
    env = {"TF_CONFIG": tf_config(PS, "chief", 0)}
    choice = choose(json.loads(tf_config(WORKERS, "worker", 0)), env=env, count_devices=devices())
    assert choice.name == "multi_worker_mirrored"
    assert choice.tf_config.task_id == "worker:0"


@pytest.mark.parametrize(
    "strategy, config, field",
    [
        ("parameter_server", None, "cluster"),
        ("parameter_server", tf_config(WORKERS, "worker", 0), "cluster.ps"),
        ("mirrored", tf_config(WORKERS, "worker", 0), "cluster"),
        ("one_device", tf_config(WORKERS, "worker", 0), "cluster"),
        ("multi_worker_mirrored", tf_config(PS, "chief", 0), "cluster.ps"),
        ("mirored", None, "strategy"),
        (3, None, "strategy"),
    ],
)
def test_strategy_that_does_not_fit_the_cluster(strategy, config, field):
    with pytest.raises(ConfigError) as info:
        choose(config, strategy=strategy, env={}, count_devices=devices())
    assert info.value.field == field
    assert repr(strategy) in str(info.value) or field.startswith("cluster")


def test_parameter_server_cluster_without_chief_is_refused():
    config = {
        "cluster": {"worker": WORKERS["worker"], "ps": ["127.0.0.1:20009"]},
        "task": {"type": "worker", "index": 0},
    }
    with pytest.raises(ConfigError) as info:
        choose(config, env={}, count_devices=devices())
    assert info.value.field == "cluster.chief"


@pytest.mark.parametrize(
    "options, field",
    [
        ({"cpu_replicas": 0}, "cpu_replicas"),
        ({"cpu_replicas": "two"}, "cpu_replicas"),
        ({"cpu_replicas": True}, "cpu_replicas"),
        ({"communication": "FAST"}, "communication"),
        ({"bytes_per_pack": -1}, "bytes_per_pack"),
        ({"register_timeout": 0}, "register_timeout"),
        ({"register_timeout": "soon"}, "register_timeout"),
        ({"collective_timeout": -5}, "collective_timeout"),
        ({"devices": []}, "devices"),
        ({"devices": ["/cpu:0", "/cpu:0"]}, "devices"),
        ({"devices": ["/gpu:0"], "cpu_replicas": 2}, "cpu_replicas"),
        ({"variable_partitioner": "shards:2"}, "variable_partitioner"),
        ({"variable_partitioner": "fixed:0"}, "variable_partitioner"),
        ({"slurm_port_base": 80}, "slurm_port_base"),
        ({"cpu_replica": 2}, "cpu_replica"),  # a typo is an unknown option
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ConfigError) as info:
        make_options(env={}, **options)
    assert info.value.field == field
    assert "Received: " in str(info.value)
    assert repr(options[field])[:20] in str(info.value)


def test_every_option_is_checked_and_kept():
    # make_options keeps what its table of checks returns: an option of
    # StrategyOptions without a check would be dropped in silence.
    import dataclasses

    from tfdist.spec import options as options_lib

    given = {
        "devices": "/cpu:0, /cpu:1",
        "communication": "ring",
        "bytes_per_pack": 1024,
        "collective_timeout": None,
        "register_timeout": "7.5",
        "variable_partitioner": "fixed:2",
        "tpu": " local ",
        "slurm_port_base": 20000,
        "model_parallel": 2,
        "transport": "MPI",
    }
    made = make_options(env={}, **given)
    fields = {f.name for f in dataclasses.fields(options_lib.StrategyOptions)}
    assert set(options_lib._CHECKS) == fields
    assert (made.devices, made.communication, made.bytes_per_pack) == (
        ("/cpu:0", "/cpu:1"),
        "RING",
        1024,
    )
    assert (made.collective_timeout, made.register_timeout, made.tpu) == (None, 7.5, "local")
    assert (made.slurm_port_base, made.model_parallel, made.transport) == (20000, 2, "mpi")
    assert made.variable_partitioner is not None
    assert make_options(env={}, cpu_replicas="3").cpu_replicas == 3


def test_options_fall_back_to_environment_and_arguments_win():
    env = {"TFDIST_CPU_REPLICAS": "3", "TFDIST_REGISTER_TIMEOUT": "7.5"}
    assert make_options(env=env).cpu_replicas == 3
    assert make_options(env=env).register_timeout == 7.5
    assert make_options(env=env, cpu_replicas=2).cpu_replicas == 2
    with pytest.raises(ConfigError) as info:
        make_options(env={"TFDIST_CPU_REPLICAS": "many"})
    assert info.value.field == "cpu_replicas" and "'many'" in str(info.value)


@pytest.mark.parametrize(
    "setting, name, param",
    [
        (None, "none", None),
        ("none", "none", None),
        ("fp16", "fp16", None),
        ("BF16", "bf16", None),
        ("topk:0.01", "topk", 0.01),
        ("randomk:0.5", "randomk", 0.5),
        ("powersgd:4", "powersgd", 4),
        ("sign", "sign", None),
        ("qsgd:16", "qsgd", 16),
    ],
)
def test_compression_settings(setting, name, param):
    from tfdist.compression import parse_compression

    parsed = parse_compression(setting)
    assert (parsed.name, parsed.param) == (name, param)


@pytest.mark.parametrize("setting", ["zip", "topk:2", "topk:x", "powersgd:0", "fp16:3", 7])
def test_bad_compression_names_the_value(setting):
    from tfdist.compression import parse_compression

    with pytest.raises(ConfigError) as info:
        parse_compression(setting)
    assert info.value.field == "compression"
    assert repr(setting) in str(info.value)


def test_detection_does_not_import_tensorflow():
    code = (
        "import sys, tfdist.spec.detect as d, tfdist.cli.commands, tfdist.strategies.flags;"
        "d.choose({'cluster': {'worker': ['127.0.0.1:1', '127.0.0.1:2']},"
        " 'task': {'type': 'worker', 'index': 0}}, env={});"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=spec_lib.DEFAULT_SPEC_DIR.parent)


def test_a_collective_timeout_is_on_by_default_and_can_be_turned_off():
    from tfdist.spec.options import make_options

    assert make_options(env={}).collective_timeout == 600.0
    assert make_options(env={}, collective_timeout="none").collective_timeout is None
    assert make_options(env={"TFDIST_COLLECTIVE_TIMEOUT": "none"}).collective_timeout is None
    assert make_options(env={"TFDIST_COLLECTIVE_TIMEOUT": "30"}).collective_timeout == 30.0
