"""Tests for tfdist.spec (TF_CONFIG parsing, validation and generation).

Pure Python: no TensorFlow is imported, so the whole file runs in well under
a second (one short subprocess checks the no-TensorFlow promise).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist import spec as spec_lib
from tfdist.errors import ClusterSpecError, ConfigError, TfdistError
from tfdist.spec import TFConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = REPO_ROOT / "cluster_specs"

W2 = ["127.0.0.1:1111", "127.0.0.1:1112"]  # Two valid worker addresses.
PS_CLUSTER = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"]}


def _tf_config(cluster_: object = None, task: object = None, **extra: object) -> dict:
    data: dict = {} if cluster_ is None else {"cluster": cluster_}
    if task is not None:
        data["task"] = task
    data.update(extra)
    return data


def _worker_task(index: object = 0) -> dict:
    return {"type": "worker", "index": index}


# (id, source passed to parse, parse kwargs, expected .field, text the message must contain)
BAD_CASES = [
    # --- JSON / top level -------------------------------------------------
    ("json-syntax", '{"cluster": {"worker": ["a:1" "b:2"]}}', {}, "<json>", "Expecting ','"),
    ("json-single-quotes", "{'cluster': {}}", {}, "<json>", "line 1, column 2"),
    (
        "json-duplicate-key",
        '{"cluster": {"worker": ["a:1"], "worker": ["b:1"]}}',
        {},
        "<json>",
        "'worker'",
    ),
    ("root-null", "null", {}, "<root>", "Received: null"),
    ("root-list", '["a:1"]', {}, "<root>", "['a:1']"),
    ("root-int", 42, {}, "<root>", "42"),
    ("unknown-top-level-key", {"clsuter": {"worker": W2}}, {}, "clsuter", "'clsuter'"),
    ("missing-file", "no_such_spec", {}, "path", "'no_such_spec'"),
    # --- cluster ----------------------------------------------------------
    ("cluster-not-object", _tf_config(["a:1"]), {}, "cluster", "['a:1']"),
    ("cluster-null", {"cluster": None}, {}, "cluster", "None"),
    ("cluster-missing-with-task", _tf_config(task=_worker_task()), {}, "cluster", "no 'cluster'"),
    ("cluster-empty-with-task", _tf_config({}, _worker_task()), {}, "cluster", "{}"),
    ("unknown-job", _tf_config({"workers": W2}), {}, "cluster.workers", "'workers'"),
    ("master-job", _tf_config({"master": ["a:1"]}), {}, "cluster.master", "'master'"),
    ("job-empty-list", _tf_config({"worker": []}), {}, "cluster.worker", "Received: []"),
    ("job-string", _tf_config({"worker": "a:1"}), {}, "cluster.worker", "'a:1'"),
    ("job-sparse-dict", _tf_config({"worker": {"1": "a:1"}}), {}, "cluster.worker", "{'1': 'a:1'}"),
    ("job-int", _tf_config({"worker": 5}), {}, "cluster.worker", "Received: 5"),
    (
        "job-evaluator",
        _tf_config({"worker": W2, "evaluator": ["e:1"]}),
        {},
        "cluster.evaluator",
        "['e:1']",
    ),
    (
        "two-chiefs",
        _tf_config({"chief": ["a:1", "b:1"], "worker": W2}),
        {"require_task": False},
        "cluster.chief",
        "['a:1', 'b:1']",
    ),
    ("ps-alone", _tf_config({"ps": ["p:1", "p:2"]}), {"require_task": False}, "cluster.ps", "'ps'"),
    (
        "duplicate-address",
        _tf_config({"worker": ["a:1", "b:1", "a:1"]}),
        {"require_task": False},
        "cluster.worker[2]",
        "cluster.worker[0]",
    ),
    (
        "duplicate-address-across-jobs",
        _tf_config({"chief": ["a:1"], "worker": ["a:1"]}),
        {"require_task": False},
        "cluster.worker[0]",
        "cluster.chief[0]",
    ),
    (
        "duplicate-address-host-case",
        _tf_config({"worker": ["Host:1", "host:1"]}),
        {"require_task": False},
        "cluster.worker[1]",
        "'host:1'",
    ),
    # --- task -------------------------------------------------------------
    ("task-missing", _tf_config({"worker": W2}), {}, "task", "no 'task'"),
    ("task-not-object", _tf_config({"worker": W2}, "worker:1"), {}, "task", "'worker:1'"),
    ("task-null", {"cluster": {"worker": W2}, "task": None}, {}, "task", "None"),
    ("task-no-type", _tf_config({"worker": W2}, {"index": 0}), {}, "task.type", "{'index': 0}"),
    (
        "task-no-index",
        _tf_config({"worker": W2}, {"type": "worker"}),
        {},
        "task.index",
        "{'type': 'worker'}",
    ),
    (
        "task-unknown-key",
        _tf_config({"worker": W2}, {"type": "worker", "idx": 0}),
        {},
        "task.idx",
        "'idx'",
    ),
    (
        "task-type-unknown",
        _tf_config({"worker": W2}, {"type": "workers", "index": 0}),
        {},
        "task.type",
        "'workers'",
    ),
    (
        "task-type-not-string",
        _tf_config({"worker": W2}, {"type": 1, "index": 0}),
        {},
        "task.type",
        "Received: 1",
    ),
    (
        "task-type-not-in-cluster",
        _tf_config({"worker": W2}, {"type": "chief", "index": 0}),
        {},
        "task.type",
        "'chief'",
    ),
    ("task-index-string", _tf_config({"worker": W2}, _worker_task("1")), {}, "task.index", "'1'"),
    ("task-index-bool", _tf_config({"worker": W2}, _worker_task(True)), {}, "task.index", "True"),
    ("task-index-float", _tf_config({"worker": W2}, _worker_task(1.0)), {}, "task.index", "1.0"),
    ("task-index-null", _tf_config({"worker": W2}, _worker_task(None)), {}, "task.index", "None"),
    ("task-index-negative", _tf_config({"worker": W2}, _worker_task(-1)), {}, "task.index", "-1"),
    (
        "task-index-out-of-range",
        _tf_config({"worker": W2}, _worker_task(5)),
        {},
        "task.index",
        "[0, 1]",
    ),
    (
        "evaluator-index",
        _tf_config({"worker": W2}, {"type": "evaluator", "index": 1}),
        {},
        "task.index",
        "Received: 1",
    ),
    (
        "task-in-spec-checked",
        _tf_config({"worker": W2}, _worker_task(2)),
        {"require_task": False},
        "task.index",
        "Received: 2",
    ),
    # --- rpc_layer / environment ------------------------------------------
    (
        "rpc-layer-unknown",
        _tf_config({"worker": W2}, _worker_task(), rpc_layer="grpc+verbs"),
        {},
        "rpc_layer",
        "'grpc+verbs'",
    ),
    (
        "rpc-layer-not-string",
        _tf_config({"worker": W2}, _worker_task(), rpc_layer=1),
        {},
        "rpc_layer",
        "Received: 1",
    ),
    (
        "environment-not-string",
        _tf_config({"worker": W2}, _worker_task(), environment=5),
        {},
        "environment",
        "Received: 5",
    ),
    # --- strategy rules ---------------------------------------------------
    (
        "mwms-with-ps",
        _tf_config(PS_CLUSTER),
        {"require_task": False, "strategy": "multi_worker_mirrored"},
        "cluster.ps",
        "['p:1']",
    ),
    (
        "ps-strategy-no-ps",
        _tf_config({"chief": ["c:1"], "worker": W2}),
        {"require_task": False, "strategy": "parameter_server"},
        "cluster.ps",
        "jobs ['chief', 'worker']",
    ),
    ("ps-strategy-no-cluster", {}, {"strategy": "parameter_server"}, "cluster", "no cluster"),
    (
        "ps-no-worker",
        _tf_config({"chief": ["c:1"], "ps": ["p:1"]}),
        {"require_task": False},
        "cluster.worker",
        "jobs ['chief', 'ps']",
    ),
    (
        "ps-no-chief-inferred",
        _tf_config({"worker": W2, "ps": ["p:1"]}),
        {"require_task": False},
        "cluster.chief",
        "jobs ['worker', 'ps']",
    ),
    (
        "ps-no-chief-explicit",
        _tf_config({"worker": W2, "ps": ["p:1"]}),
        {"require_task": False, "strategy": "parameter_server"},
        "cluster.chief",
        "jobs ['worker', 'ps']",
    ),
    (
        "mirrored-multi-task",
        _tf_config({"worker": W2}, _worker_task()),
        {"strategy": "mirrored"},
        "cluster",
        "'127.0.0.1:1112'",
    ),
    (
        "one-device-multi-task",
        _tf_config({"worker": W2}),
        {"require_task": False, "strategy": "one_device"},
        "cluster",
        "'127.0.0.1:1111'",
    ),
    (
        "default-multi-task",
        _tf_config({"worker": W2}),
        {"require_task": False, "strategy": "default"},
        "cluster",
        "'127.0.0.1:1111'",
    ),
    (
        "tpu-multi-task",
        _tf_config({"worker": W2}),
        {"require_task": False, "strategy": "tpu"},
        "cluster",
        "'127.0.0.1:1111'",
    ),
    ("unknown-strategy", {}, {"strategy": "mirored"}, "strategy", "'mirored'"),
]

BAD_ADDRESSES = [
    "localhost",
    "localhost:",
    ":2222",
    "localhost:abc",
    "localhost:0",
    "localhost:70000",
    "localhost:-1",
    2222,
    None,
    "grpc://h:1",
    "local host:1",
    " localhost:1",
    "::1:2222",
    "[::1",
    "[::1]",
    "[nope]:1",
    "h/x:1",
]


def _assert_cluster_error(excinfo: pytest.ExceptionInfo, field: str, fragment: str) -> None:
    error = excinfo.value
    assert type(error) is ClusterSpecError
    assert isinstance(error, ValueError) and isinstance(error, ConfigError)
    assert isinstance(error, TfdistError)
    assert error.field == field, str(error)
    message = str(error)
    assert f"field '{field}'" in message
    assert "expected " in message and "Received: " in message
    assert fragment in message, message


@pytest.mark.parametrize(
    "source, kwargs, field, fragment",
    [case[1:] for case in BAD_CASES],
    ids=[case[0] for case in BAD_CASES],
)
def test_bad_input(source, kwargs, field, fragment):
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(source, env={}, **kwargs)
    _assert_cluster_error(excinfo, field, fragment)
    if isinstance(source, dict) and source:
        # The same TF_CONFIG as a JSON string fails on the same field.
        with pytest.raises(ClusterSpecError) as excinfo:
            spec_lib.parse(json.dumps(source), env={}, **kwargs)
        assert excinfo.value.field == field


@pytest.mark.parametrize("address", BAD_ADDRESSES, ids=repr)
def test_bad_address_in_cluster(address):
    data = _tf_config({"worker": ["ok:1", address]})
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(data, require_task=False)
    _assert_cluster_error(excinfo, "cluster.worker[1]", repr(address))


@pytest.mark.parametrize("address", BAD_ADDRESSES, ids=repr)
def test_parse_address_bad(address):
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse_address(address)
    _assert_cluster_error(excinfo, "address", repr(address))


def test_bad_input_from_json_string_same_field():
    # The same rules apply whatever the source is (dict, JSON string, env).
    text = json.dumps(_tf_config({"worker": W2}, _worker_task("1")))
    for source, env in ((text, None), (None, {"TF_CONFIG": text})):
        with pytest.raises(ClusterSpecError) as excinfo:
            spec_lib.parse(source, env=env)
        _assert_cluster_error(excinfo, "task.index", "'1'")


def test_message_format():
    data = _tf_config({"worker": W2}, _worker_task(5))
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(json.dumps(data))
    assert str(excinfo.value) == (
        "TF_CONFIG (<string>): field 'task.index': expected an integer in [0, 1] "
        "(the 'worker' job has 2 tasks). Received: 5"
    )
    assert excinfo.value.value == 5
    assert excinfo.value.source == "<string>"


def test_json_syntax_error_line_and_column():
    text = '{\n  "cluster": {\n    "worker": ["a:1" "b:2"]\n  }\n}'
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(text)
    error = excinfo.value
    assert error.field == "<json>"
    assert (error.line, error.column) == (3, 22)
    assert "at line 3, column 22" in str(error)
    assert '"worker": ["a:1" "b:2"]' in str(error)  # The offending line is shown.


def test_json_error_from_env_names_tf_config():
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(env={"TF_CONFIG": "{"})
    assert str(excinfo.value).startswith("TF_CONFIG: field '<json>'")
    assert excinfo.value.line == 1


def test_long_values_are_truncated():
    data = _tf_config({"worker": ["a" * 1000]})
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(data, require_task=False)
    assert len(str(excinfo.value)) < 600
    assert "..." in str(excinfo.value)


def test_error_pickles():
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(_tf_config({"worker": W2}, _worker_task("1")))
    copy = pickle.loads(pickle.dumps(excinfo.value))
    assert type(copy) is ClusterSpecError
    assert (copy.field, copy.value, str(copy)) == ("task.index", "1", str(excinfo.value))


def test_config_error_is_generic():
    error = ConfigError("strategy", "mirored", "one of 'mirrored'", source="strategy_from_config")
    assert str(error) == (
        "strategy_from_config: field 'strategy': expected one of 'mirrored'. Received: 'mirored'"
    )
    assert isinstance(error, ValueError) and not isinstance(error, ClusterSpecError)


# --------------------------------------------------------------------------
# Environment variable and valid inputs.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("env", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}])
def test_env_absent_or_empty_is_local(env):
    config = spec_lib.parse(env=env)
    assert config == TFConfig(cluster={}, task_type=None, task_index=None, source="TF_CONFIG")
    assert config.kind == "local"
    assert config.is_chief
    assert config.num_workers == 0 and config.num_tasks == 0
    assert config.task_id is None and config.task_address is None
    assert config.to_dict() == {"cluster": {}}


def test_env_default_is_os_environ(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert spec_lib.parse().kind == "local"
    monkeypatch.setenv("TF_CONFIG", json.dumps(_tf_config({"worker": W2}, _worker_task(1))))
    assert spec_lib.parse().task_id == "worker:1"


def test_env_tf_config():
    text = json.dumps(_tf_config({"worker": W2}, _worker_task(1)))
    config = spec_lib.parse(env={"TF_CONFIG": text})
    assert config.source == "TF_CONFIG"
    assert config.kind == "multi_worker"
    assert (config.task_type, config.task_index) == ("worker", 1)
    assert config.task_id == "worker:1"
    assert config.task_address == W2[1]
    assert not config.is_chief
    assert config.num_workers == 2 and config.num_tasks == 2
    assert json.loads(config.to_json()) == json.loads(text)


def test_valid_variants():
    # One task needs no 'task'; a single-task cluster is local.
    single = spec_lib.parse(_tf_config({"worker": ["a:1"]}), strategy="mirrored")
    assert single.kind == "local" and single.is_chief
    # Vertex AI / AI Platform extra keys are accepted and dropped.
    vertex = spec_lib.parse(
        {
            "cluster": {"chief": ["c:2222"], "worker": ["w:2222"]},
            "task": {"type": "chief", "index": 0, "trial": ""},
            "job": {"worker_pool_specs": []},
            "environment": "cloud",
            "rpc_layer": "grpc",
        }
    )
    assert vertex.environment == "cloud" and vertex.rpc_layer == "grpc"
    assert vertex.is_chief
    assert set(vertex.to_dict()) == {"cluster", "task", "rpc_layer", "environment"}
    # IPv6 and host names.
    ipv6 = spec_lib.parse(
        _tf_config({"worker": ["[::1]:1", "[::1]:2", "my-host.example_1:3"]}), require_task=False
    )
    assert ipv6.num_tasks == 3
    assert (
        spec_lib.parse(_tf_config(PS_CLUSTER), require_task=False, strategy="auto").kind
        == "parameter_server"
    )
    # TF class names are accepted as strategy names.
    spec_lib.parse(_tf_config(PS_CLUSTER), require_task=False, strategy="ParameterServerStrategy")
    with pytest.raises(ClusterSpecError):
        spec_lib.parse(
            _tf_config(PS_CLUSTER), require_task=False, strategy="MultiWorkerMirroredStrategy"
        )


def test_jobs_are_normalized():
    config = spec_lib.parse(
        {
            "cluster": {"ps": ["p:1"], "worker": ["w:1"], "chief": ["c:1"]},
            "task": {"type": "ps", "index": 0},
        }
    )
    assert list(config.cluster) == ["chief", "worker", "ps"]
    assert config.cluster["worker"] == ("w:1",)
    assert config.tasks() == [("chief", 0, "c:1"), ("worker", 0, "w:1"), ("ps", 0, "p:1")]
    assert config.kind == "parameter_server" and not config.is_chief
    hash(config)  # Frozen and hashable despite the dict field.


def test_tfconfig_validate_and_with_task():
    config = TFConfig(cluster={"worker": ["a:1", "b:1"]}, task_type="worker", task_index=0)
    assert spec_lib.validate(config) == config
    assert spec_lib.parse(config).is_chief
    assert config.with_task("worker", 1).task_address == "b:1"
    with pytest.raises(ClusterSpecError) as excinfo:
        config.with_task("worker", 2)
    _assert_cluster_error(excinfo, "task.index", "Received: 2")
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.validate(
            TFConfig(
                cluster={"worker": ("a:1", "a:1")}, task_type=None, task_index=None, source="mine"
            )
        )
    assert str(excinfo.value).startswith("TF_CONFIG (mine): field 'cluster.worker[1]'")
    assert config.with_task(None, None).task_type is None


def test_evaluator_config():
    config = spec_lib.parse(_tf_config(PS_CLUSTER, {"type": "evaluator", "index": 0}))
    assert config.task_type == "evaluator" and config.task_address is None
    assert not config.is_chief
    assert config.kind == "parameter_server"


# --------------------------------------------------------------------------
# Spec files.
# --------------------------------------------------------------------------

SPEC_FILES = sorted(SPEC_DIR.glob("*.json"))


def test_spec_dir_is_populated():
    assert len(SPEC_FILES) >= 6, f"expected example specs in {SPEC_DIR}"
    names = {path.stem for path in SPEC_FILES}
    assert {
        "single_worker",
        "two_workers",
        "four_workers",
        "chief_and_workers",
        "parameter_server",
        "parameter_server_one_ps",
        "parameter_server_evaluator",
    } <= names


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda path: path.stem)
def test_spec_file_is_valid(path):
    config = spec_lib.parse(path, require_task=False)
    assert config.source.endswith(path.name)
    assert spec_lib.parse(str(path), require_task=False) == config
    # Bare names are looked up in cluster_specs/.
    assert spec_lib.parse(path.stem, require_task=False, env={}).cluster == config.cluster
    assert spec_lib.parse(path.name, require_task=False, env={}).cluster == config.cluster
    addresses = [address for _, _, address in config.tasks()]
    assert all(address.startswith("127.0.0.1:") for address in addresses)
    if path.stem.startswith("parameter_server"):
        assert config.kind == "parameter_server"
    if path.stem == "parameter_server_evaluator":
        assert (config.task_type, config.task_index) == ("evaluator", 0)
        assert spec_lib.parse(path).task_type == "evaluator"  # A full TF_CONFIG.
        assert config.cluster == spec_lib.parse("parameter_server", require_task=False).cluster
    else:
        assert config.task_type is None
    if path.stem == "single_worker":
        assert config.kind == "local"
    if path.stem in ("two_workers", "four_workers", "chief_and_workers"):
        assert config.kind == "multi_worker"


def test_spec_dir_env_override(tmp_path):
    (tmp_path / "mine.json").write_text(json.dumps(_tf_config({"worker": ["x:1", "x:2"]})))
    config = spec_lib.parse("mine", require_task=False, env={spec_lib.SPEC_DIR_ENV: str(tmp_path)})
    assert config.cluster == {"worker": ("x:1", "x:2")}
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse("two_workers", env={spec_lib.SPEC_DIR_ENV: str(tmp_path)})
    _assert_cluster_error(excinfo, "path", "'two_workers'")
    assert str(tmp_path) in str(excinfo.value) and "mine" in str(excinfo.value)


def test_bad_spec_file_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_tf_config({"worker": W2}, _worker_task(5))))
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(path)
    assert str(excinfo.value).startswith(f"TF_CONFIG ({path}): field 'task.index'")
    path.write_text("{\n\n  oops\n}")
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.parse(path)
    assert (excinfo.value.field, excinfo.value.line, excinfo.value.column) == ("<json>", 3, 3)


# --------------------------------------------------------------------------
# Generation.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda path: path.stem)
def test_all_task_configs_round_trip(path):
    spec = spec_lib.parse(path, require_task=False)
    configs = spec_lib.all_task_configs(path)
    assert [(t, i) for t, i, _ in configs] == [(t, i) for t, i, _ in spec.tasks()]
    assert len(configs) == spec.num_tasks
    addresses = set()
    for task_type, index, tf_config in configs:
        assert tf_config["task"] == {"type": task_type, "index": index}
        parsed = spec_lib.parse(json.dumps(tf_config), require_task=True)
        assert (parsed.task_type, parsed.task_index) == (task_type, index)
        assert parsed.cluster == spec.cluster
        expected_chief = task_type == "chief" or (
            task_type == "worker" and index == 0 and "chief" not in spec.cluster
        )
        assert parsed.is_chief == expected_chief
        addresses.add(parsed.task_address)
    assert len(addresses) == len(configs)
    assert sum(parsed.is_chief for parsed in (spec_lib.parse(c) for _, _, c in configs)) == 1


def test_tf_config_for_task():
    tf_config = spec_lib.tf_config_for_task("two_workers", "worker", 1)
    assert tf_config["task"] == {"type": "worker", "index": 1}
    evaluator = spec_lib.tf_config_for_task("parameter_server", "evaluator", 0)
    assert evaluator == json.loads((SPEC_DIR / "parameter_server_evaluator.json").read_text())
    for task_type, index, field in [
        ("worker", 2, "task.index"),
        ("chief", 0, "task.type"),
        ("ps", 0, "task.type"),
        ("evaluator", 1, "task.index"),
        ("boss", 0, "task.type"),
    ]:
        with pytest.raises(ClusterSpecError) as excinfo:
            spec_lib.tf_config_for_task("two_workers", task_type, index)
        _assert_cluster_error(excinfo, field, repr(task_type if field == "task.type" else index))


def test_spec_from_hosts_workers():
    assert spec_lib.spec_from_hosts(["a", "b"]) == {"cluster": {"worker": ["a:2222", "b:2222"]}}
    local = spec_lib.spec_from_hosts(["localhost"] * 4, port=3000)
    assert local == {"cluster": {"worker": [f"localhost:{3000 + i}" for i in range(4)]}}
    spec_lib.parse(local, require_task=False)
    # Ports already given explicitly are skipped for the same host.
    mixed = spec_lib.spec_from_hosts(["h:2222", "h", "[::1]", "[::1]:5"])
    assert mixed["cluster"]["worker"] == ["h:2222", "h:2223", "[::1]:2222", "[::1]:5"]


def test_spec_from_hosts_chief_and_ps():
    spec = spec_lib.spec_from_hosts(["c", "w1", "w2"], chief=True)
    assert spec == {"cluster": {"chief": ["c:2222"], "worker": ["w1:2222", "w2:2222"]}}
    spec = spec_lib.spec_from_hosts(["localhost"] * 5, chief=True, num_ps=2)
    assert spec == {
        "cluster": {
            "chief": ["localhost:2222"],
            "worker": ["localhost:2225", "localhost:2226"],
            "ps": ["localhost:2223", "localhost:2224"],
        }
    }
    assert spec_lib.parse(spec, require_task=False).kind == "parameter_server"
    assert spec_lib.spec_from_hosts(["c"], chief=True) == {"cluster": {"chief": ["c:2222"]}}


@pytest.mark.parametrize(
    "hosts, kwargs, field, fragment",
    [
        ([], {}, "hosts", "[]"),
        ("localhost", {}, "hosts", "'localhost'"),
        (5, {}, "hosts", "5"),
        (["a", 3], {}, "hosts[1]", "3"),
        (["a", ""], {}, "hosts[1]", "''"),
        (["a", "b:"], {}, "hosts[1]", "'b:'"),
        (["a", "b:0"], {}, "hosts[1]", "'b:0'"),
        (["a", "b:x"], {}, "hosts[1]", "'b:x'"),
        (["a", "grpc://b:1"], {}, "hosts[1]", "'grpc://b:1'"),
        (["a", "b c"], {}, "hosts[1]", "'b c'"),
        (["::1"], {}, "hosts[0]", "'::1'"),
        (["a:1", "a:1"], {}, "hosts[1]", "hosts[0]"),
        (["a", "b", "c"], {"num_ps": 1}, "chief", "False"),
        (["a", "b"], {"chief": True, "num_ps": 1}, "hosts", "['a', 'b']"),
        (["a"], {"num_ps": -1}, "num_ps", "-1"),
        (["a"], {"chief": 1}, "chief", "1"),
        (["a"], {"port": 0}, "port", "0"),
        (["a"], {"port": "2222"}, "port", "'2222'"),
        (["a", "a"], {"port": 65535}, "hosts[1]", "'a'"),
    ],
)
def test_spec_from_hosts_bad(hosts, kwargs, field, fragment):
    with pytest.raises(ClusterSpecError) as excinfo:
        spec_lib.spec_from_hosts(hosts, **kwargs)
    _assert_cluster_error(excinfo, field, fragment)
    assert str(excinfo.value).startswith("spec_from_hosts(): ")


def test_parse_task_and_address():
    assert spec_lib.parse_task("worker:1") == ("worker", 1)
    assert spec_lib.parse_task(" chief:0 ") == ("chief", 0)
    assert spec_lib.parse_task("evaluator:0") == ("evaluator", 0)
    for text in ["worker", "worker:", "worker:x", "worker:-1", "workers:1", ":1", "", 1, None]:
        with pytest.raises(ClusterSpecError) as excinfo:
            spec_lib.parse_task(text)
        _assert_cluster_error(excinfo, "task", repr(text))
    assert spec_lib.parse_address("localhost:2222") == ("localhost", 2222)
    assert spec_lib.parse_address("10.0.0.1:1") == ("10.0.0.1", 1)
    assert spec_lib.parse_address("[::1]:2222") == ("::1", 2222)
    assert spec_lib.parse_address("[fe80::1%eth0]:65535") == ("fe80::1%eth0", 65535)


def test_import_does_not_load_tensorflow():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", "import tfdist.spec, sys; assert 'tensorflow' not in sys.modules"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
