"""The ``model_parallel`` option: argument, environment, flag, CLI, strategies."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

import tfdist
from conftest import REPO, subprocess_env
from tfdist.errors import ConfigError
from tfdist.spec.options import ENV_VARS, make_options


@pytest.fixture(autouse=True)
def no_model_parallel_env(monkeypatch):
    monkeypatch.delenv("TFDIST_MODEL_PARALLEL", raising=False)


def test_default_argument_and_environment():
    assert make_options().model_parallel == 1
    assert make_options(model_parallel=4).model_parallel == 4
    assert make_options(model_parallel=" 2 ").model_parallel == 2
    assert ENV_VARS["model_parallel"] == "TFDIST_MODEL_PARALLEL"
    assert make_options(env={"TFDIST_MODEL_PARALLEL": "8"}).model_parallel == 8
    # An explicit argument wins over the environment.
    assert make_options(env={"TFDIST_MODEL_PARALLEL": "8"}, model_parallel=2).model_parallel == 2


@pytest.mark.parametrize(
    "value, shown",
    [
        (0, "Received: 0"),
        (-2, "Received: -2"),
        ("two", "Received: 'two'"),
        (True, "Received: True"),
        (1.5, "Received: 1.5"),
        ("", "Received: ''"),
    ],
)
def test_bad_values_name_the_field_and_the_value(value, shown):
    with pytest.raises(ConfigError) as info:
        make_options(model_parallel=value)
    assert info.value.field == "model_parallel" and info.value.value == value
    assert "field 'model_parallel'" in str(info.value) and shown in str(info.value)
    assert "an integer >= 1" in str(info.value)


def test_a_bad_environment_value_is_named_too():
    with pytest.raises(ConfigError) as info:
        make_options(env={"TFDIST_MODEL_PARALLEL": "x2"})
    assert info.value.field == "model_parallel"
    assert "Received: 'x2'" in str(info.value)


def test_flag_is_passed_through_and_builds_the_mesh(tf_cpus):
    from absl import flags

    from tfdist.parallel.mesh import mesh_of
    from tfdist.strategies.flags import options_from_flags

    values = flags.FlagValues()
    tfdist.define_flags(values)
    values(["prog", "--cpu_replicas=4", "--model_parallel=2"])
    kwargs = options_from_flags(values)
    assert kwargs["model_parallel"] == 2 and kwargs["cpu_replicas"] == 4
    strategy = tfdist.strategy_from_flags(values)
    mesh = mesh_of(strategy)
    assert (strategy.num_replicas_in_sync, mesh.dp, mesh.tp) == (4, 2, 2)
    # Without the flag nothing is passed: the default (or the environment) holds.
    values = flags.FlagValues()
    tfdist.define_flags(values)
    values(["prog"])
    assert "model_parallel" not in options_from_flags(values)


def test_describe_and_repr_show_the_mesh(tf_cpus):
    strategy = tfdist.strategy_from_config(cpu_replicas=4, model_parallel=2)
    # Tensor groups innermost: replica r at data r // 2, tensor r % 2.
    lines = strategy.describe().splitlines()
    assert "  mesh: data 2 x tensor 2; tensor groups [0, 1] [2, 3]" in lines
    assert "model_parallel=2" in repr(strategy) and strategy.model_parallel == 2
    # T = 4 on 4 replicas: one group, no data parallelism.
    whole = tfdist.strategy_from_config(cpu_replicas=4, model_parallel=4)
    assert "  mesh: data 1 x tensor 4; tensor groups [0, 1, 2, 3]" in whole.describe()
    # T = 1 (the default): no mesh, nothing said about it.
    plain = tfdist.strategy_from_config(cpu_replicas=4)
    assert plain.model_parallel == 1
    assert "mesh" not in plain.describe() and "model_parallel" not in repr(plain)


def test_environment_reaches_the_strategy(tf_cpus, monkeypatch):
    monkeypatch.setenv("TFDIST_MODEL_PARALLEL", "2")
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    assert "  mesh: data 1 x tensor 2; tensor groups [0, 1]" in strategy.describe()


def test_a_t_that_does_not_divide_the_replicas_names_both(tf_cpus):
    with pytest.raises(ConfigError) as info:
        tfdist.strategy_from_config(strategy="mirrored", cpu_replicas=4, model_parallel=3)
    assert info.value.field == "model_parallel" and info.value.value == 3
    assert "a divisor of the 4 replicas" in str(info.value)
    assert "Received: 3" in str(info.value)


def test_multi_worker_mirrored_attaches_the_mesh_too(tf_cpus):
    # A local MultiWorkerMirrored strategy (no cluster) has 1 replica, so
    # T = 2 must be refused by the mesh, which it only is if it is attached.
    with pytest.raises(ConfigError) as info:
        tfdist.strategy_from_config(strategy="multi_worker_mirrored", model_parallel=2)
    assert info.value.field == "model_parallel"
    assert "a divisor of the 1 replicas" in str(info.value)


def _outcome_within(fn, seconds):
    """Runs ``fn`` in a thread; fails if it has not returned in time."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds}s: a hang"
    return outcome


#: A parameter-server chief whose ps and worker do not exist: building the
#: strategy would wait for them.
PS_CONFIG = {
    "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
    "task": {"type": "chief", "index": 0},
}


@pytest.mark.parametrize(
    "config, kwargs, kind",
    [
        # Building would wait for the missing ps and worker.
        (PS_CONFIG, {}, "parameter_server"),
        # Building would fail with TPUNotFoundError: there is no TPU here.
        (None, {"strategy": "tpu"}, "tpu"),
        (None, {"strategy": "default"}, "default"),
    ],
)
def test_refused_before_building_where_there_is_no_mesh(tf_cpus, config, kwargs, kind):
    outcome = _outcome_within(
        lambda: tfdist.strategy_from_config(config, model_parallel=2, **kwargs), 30
    )
    error = outcome.get("error")
    assert isinstance(error, ConfigError), outcome
    assert error.field == "model_parallel" and error.value == 2
    assert f"expected 1 under the {kind} strategy" in str(error)
    assert "Received: 2" in str(error)
    # What strategy_from_config would do is refused the same way.
    with pytest.raises(ConfigError) as info:
        tfdist.explain(config, model_parallel=2, **kwargs)
    assert info.value.field == "model_parallel"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "one_device"},
        {"cpu_replicas": 1},  # auto-detected: one device
    ],
)
def test_one_device_has_one_replica_so_t_must_be_1(tf_cpus, kwargs):
    assert tfdist.explain(**kwargs).name == "one_device"
    with pytest.raises(ConfigError) as info:
        tfdist.strategy_from_config(model_parallel=2, **kwargs)
    assert info.value.field == "model_parallel" and info.value.value == 2
    assert "1 under the one_device strategy" in str(info.value)
    assert "1 replica" in str(info.value) and "cpu_replicas" in str(info.value)


def test_an_evaluator_evaluates_the_full_model_on_one_device(tf_cpus):
    config = {
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
        "task": {"type": "evaluator", "index": 0},
    }
    strategy = tfdist.strategy_from_config(config, model_parallel=2)
    assert isinstance(strategy, tfdist.OneDeviceStrategy)
    assert strategy.model_parallel == 1 and "mesh" not in strategy.describe()


def _info(*args):
    return subprocess.run(
        [sys.executable, "-m", "tfdist", "info", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=120,
    )


def test_cli_info_shows_the_mesh_and_refuses_a_bad_t():
    proc = _info("--cpu-replicas", "4", "--model-parallel", "2")
    assert proc.returncode == 0, proc.stderr
    assert "mesh:     data 2 x tensor 2; tensor groups [0, 1] [2, 3]" in proc.stdout
    proc = _info("--cpu-replicas", "4", "--model-parallel", "3")
    assert proc.returncode == 2 and not proc.stdout
    assert "field 'model_parallel'" in proc.stderr
    assert "a divisor of the 4 replicas" in proc.stderr and "Received: 3" in proc.stderr
