"""Tests for tfdist.engines.hosts: per-host commands, TFJob manifests (checked against
Kubeflow's TFJob structure; there is no Kubernetes cluster here), the YAML
writer, and a Slurm step of 2 tasks on localhost without Slurm.

Everything but the Slurm test is pure Python (no TensorFlow). Expected values
are computed from the spec files themselves, or by parsing what tfdist wrote
(``shlex.split``, ``tfdist.spec.parse``, PyYAML when installed).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, finish, result_line, start, subprocess_env
from tfdist import spec as spec_lib
from tfdist.engines import hosts
from tfdist.engines.net import free_ports
from tfdist.errors import ClusterSpecError, ConfigError

SPECS = sorted((REPO / "cluster_specs").glob("*.json"))
JOB_ORDER = ("chief", "worker", "ps")  # TF_CONFIG's job order, written out again here.
REPLICA = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}


def _expected_tasks(raw: dict) -> list[tuple[str, int, str | None]]:
    """(type, index, address) of every task of a raw spec, evaluator last."""
    tasks = [
        (job, i, address)
        for job in JOB_ORDER
        for i, address in enumerate(raw["cluster"].get(job, []))
    ]
    if raw.get("task", {}).get("type") == "evaluator":
        tasks.append(("evaluator", 0, None))
    return tasks


def _split_command(line: str) -> tuple[dict, list[str]]:
    """``TF_CONFIG='...' argv...`` -> (TF_CONFIG as a dict, argv)."""
    words = shlex.split(line)
    assert words[0].startswith("TF_CONFIG="), line
    return json.loads(words[0][len("TF_CONFIG=") :]), words[1:]


# --------------------------------------------------------------------------
# host_commands
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_task_of_every_spec_gets_its_own_command(path):
    raw = json.loads(path.read_text())
    commands = hosts.host_commands(path, "train.py", ["--epochs", "3"])
    expected = _expected_tasks(raw)
    assert [(c.task_type, c.task_index, c.address) for c in commands] == expected
    for command, (task_type, index, address) in zip(commands, expected):
        host = address or raw["cluster"].get("chief", raw["cluster"].get("worker"))[0]
        assert command.host == host.rsplit(":", 1)[0]
        tf_config, argv = _split_command(command.command)
        assert tf_config == {"cluster": raw["cluster"], "task": {"type": task_type, "index": index}}
        assert argv == ["python", "train.py", "--epochs", "3"]
        assert command.env == {"TF_CONFIG": command.tf_config_json}
        # What the process will read is a valid TF_CONFIG naming this task.
        parsed = spec_lib.parse(command.tf_config_json)
        assert parsed.task_id == f"{task_type}:{index}" == command.task_id
        assert "evaluator" not in parsed.cluster


def test_the_lines_run_in_a_real_shell_with_every_word_intact(tmp_path):
    show = tmp_path / "show args.py"  # A space in the script's path, too.
    show.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'tf_config': os.environ['TF_CONFIG'], "
        "'argv': sys.argv[1:]}))\n"
    )
    args = [
        "it's",
        'say "hi"',
        "$HOME",
        "; echo pwned",
        "*",
        "",
        "two  spaces",
        "ünïcødé",
        "--flag=1",
        "a\nb",
        "`id`",
        "\\",
    ]
    spec = {
        "cluster": {"worker": ["127.0.0.1:2", "localhost:3"]},
        "environment": "it's $cloud",
    }  # A quote inside TF_CONFIG as well.
    commands = hosts.host_commands(spec, show, args, python=[sys.executable])
    assert len(commands) == 2
    for index, command in enumerate(commands):
        proc = subprocess.run(
            ["/bin/sh", "-c", command.command],
            capture_output=True,
            text=True,
            timeout=60,
            env=subprocess_env(),
        )
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert seen["argv"] == args
        assert json.loads(seen["tf_config"]) == {
            "cluster": spec["cluster"],
            "environment": "it's $cloud",
            "task": {"type": "worker", "index": index},
        }


def test_python_command_module_and_argument_types():
    (command,) = hosts.host_commands(
        "single_worker", "-m", ["pkg.train", 3, Path("d/x")], python="python3 -u"
    )
    assert command.argv == ("python3", "-u", "-m", "pkg.train", "3", "d/x")
    _, argv = _split_command(command.command)
    assert argv == ["python3", "-u", "-m", "pkg.train", "3", "d/x"]
    (command,) = hosts.host_commands("single_worker", "t.py", python=["/opt/my env/python"])
    assert _split_command(command.command)[1] == ["/opt/my env/python", "t.py"]


def test_evaluator_is_added_when_the_spec_or_caller_asks():
    with_eval = hosts.host_commands("parameter_server_evaluator", "t.py")
    without = hosts.host_commands("parameter_server_evaluator", "t.py", evaluator=False)
    assert [c.task_id for c in with_eval] == [c.task_id for c in without] + ["evaluator:0"]
    evaluator = with_eval[-1]
    assert evaluator.address is None and evaluator.host == "127.0.0.1"
    tf_config, _ = _split_command(evaluator.command)
    assert tf_config["task"] == {"type": "evaluator", "index": 0}
    assert set(tf_config["cluster"]) == {"chief", "worker", "ps"}

    two = hosts.host_commands("two_workers", "t.py", evaluator=True, evaluator_host="evalbox")
    assert [(c.task_id, c.host) for c in two] == [
        ("worker:0", "127.0.0.1"),
        ("worker:1", "127.0.0.1"),
        ("evaluator:0", "evalbox"),
    ]
    assert "evaluator" not in [c.task_type for c in hosts.host_commands("two_workers", "t.py")]


def test_grouping_by_host_keeps_first_appearance_order_and_ignores_case():
    spec = {
        "cluster": {
            "chief": ["HostB:1"],
            "worker": ["hosta:1", "hostb:2", "[::1]:5"],
            "ps": ["hosta:2"],
        }
    }
    groups = hosts.group_by_host(hosts.host_commands(spec, "t.py"))
    assert {host: [c.task_id for c in group] for host, group in groups.items()} == {
        "HostB": ["chief:0", "worker:1"],
        "hosta": ["worker:0", "ps:0"],
        "::1": ["worker:2"],
    }

    text = hosts.format_host_commands(hosts.host_commands(spec, "t.py", ["x"]))
    by_host: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# host "):
            current = line[len("# host ") :].rsplit(": ", 1)[0]
            by_host[current] = []
        elif line and not line.startswith("#"):
            tf_config, argv = _split_command(line)
            assert argv == ["python", "t.py", "x"]
            by_host[current].append("{type}:{index}".format(**tf_config["task"]))
    assert by_host == {
        "HostB": ["chief:0", "worker:1"],
        "hosta": ["worker:0", "ps:0"],
        "::1": ["worker:2"],
    }
    assert "# host hosta: 2 tasks, each in its own shell" in text
    assert "# host ::1: 1 task\n# worker:2 at [::1]:5\n" in text


def test_a_bad_spec_raises_the_cluster_error_unchanged(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cluster": {"worker": ["h:1", "h:1"]}}))
    with pytest.raises(ClusterSpecError) as expected:
        spec_lib.parse(bad, require_task=False)
    with pytest.raises(ClusterSpecError) as got:
        hosts.host_commands(bad, "t.py")
    assert got.value.field == expected.value.field == "cluster.worker[1]"
    assert str(got.value) == str(expected.value)
    with pytest.raises(ClusterSpecError) as empty:
        hosts.host_commands({}, "t.py")
    assert empty.value.field == "cluster"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"script": ""}, "script"),
        ({"script": None}, "script"),
        ({"args": "--epochs"}, "args"),
        ({"args": {"a": 1}}, "args"),
        ({"args": ["ok", object()]}, "args[1]"),
        ({"args": [True]}, "args[0]"),
        ({"python": ""}, "python"),
        ({"python": "'unbalanced"}, "python"),
        ({"python": 3}, "python"),
        ({"evaluator": "yes"}, "evaluator"),
        ({"evaluator_host": "box"}, "evaluator_host"),
        ({"evaluator": True, "evaluator_host": "two words"}, "evaluator_host"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    call = {"spec": "two_workers", "script": "t.py", **kwargs}
    with pytest.raises(ConfigError) as error:
        hosts.host_commands(**call)
    assert error.value.field == field
    assert f"field '{field}'" in str(error.value)
    assert not isinstance(error.value, ClusterSpecError)


# --------------------------------------------------------------------------
# tfjob_manifest
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_tfjob_has_one_replica_spec_per_job_sized_like_the_spec(path):
    raw = json.loads(path.read_text())
    manifest = hosts.tfjob_manifest(
        path, name="job", image="reg.example/img:1", command=["python", "train.py"]
    )
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "job"}
    expected = {REPLICA[job]: len(addresses) for job, addresses in raw["cluster"].items()}
    if raw.get("task", {}).get("type") == "evaluator":
        expected["Evaluator"] = 1
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {kind: spec["replicas"] for kind, spec in specs.items()} == expected
    for spec in specs.values():
        assert spec["restartPolicy"] == hosts.DEFAULT_RESTART_POLICY == "ExitCode"
        grace = hosts.DEFAULT_GRACE_SECONDS
        assert spec["template"] == {
            "spec": {
                "terminationGracePeriodSeconds": grace,
                "containers": [
                    {
                        "name": "tensorflow",
                        "image": "reg.example/img:1",
                        "command": ["python", "train.py"],
                        "env": [{"name": "TFDIST_GRACE", "value": str(grace)}],
                    }
                ],
            }
        }


def test_tfjob_from_counts_with_every_option():
    manifest = hosts.tfjob_manifest(
        {"ps": 2, "worker": 3, "chief": 1, "evaluator": 0},
        name="mnist-1",
        image="img",
        command=["python"],
        args=["train.py", "--epochs", 3],
        namespace="team-a",
        restart_policy="OnFailure",
        cpu=0.5,
        memory="4Gi",
        grace=45,
    )
    assert manifest["metadata"] == {"name": "mnist-1", "namespace": "team-a"}
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert list(specs) == ["Chief", "Worker", "PS"]  # Conventional order; no Evaluator.
    assert [specs[k]["replicas"] for k in specs] == [1, 3, 2]
    container = specs["PS"]["template"]["spec"]["containers"][0]
    assert container == {
        "name": "tensorflow",
        "image": "img",
        "command": ["python"],
        "args": ["train.py", "--epochs", "3"],
        "env": [{"name": "TFDIST_GRACE", "value": "45"}],
        "resources": {
            "requests": {"cpu": "0.5", "memory": "4Gi"},
            "limits": {"cpu": "0.5", "memory": "4Gi"},
        },
    }
    assert {specs[k]["restartPolicy"] for k in specs} == {"OnFailure"}
    assert {specs[k]["template"]["spec"]["terminationGracePeriodSeconds"] for k in specs} == {45}
    assert hosts.replica_counts({"worker": 2, "chief": 0}) == {"worker": 2}


@pytest.mark.parametrize(
    "change, field, says",
    [
        ({"name": "My_Job"}, "name", "Try 'my-job'"),
        ({"name": "1job"}, "name", "starting with a letter"),
        ({"name": "job-"}, "name", "'job-'"),
        ({"name": ""}, "name", "DNS-1035"),
        ({"name": None}, "name", "None"),
        ({"name": "a" * 64}, "name", "at most 63"),
        # 55 + len("-worker-1") = 64: the operator's Service name would be too long.
        ({"name": "a" * 55}, "name", "Use at most 54 characters"),
        ({"image": ""}, "image", "non-empty"),
        ({"image": "img latest"}, "image", "without spaces"),
        ({"image": None}, "image", "None"),
        ({"command": "python train.py"}, "command", "['python', 'train.py']"),
        ({"command": []}, "command", "not empty"),
        ({"command": ["python", None]}, "command[1]", "None"),
        ({"args": "--x"}, "args", "['--x']"),
        ({"namespace": "Team_A"}, "namespace", "Try 'team-a'"),
        ({"namespace": "-x"}, "namespace", "DNS-1123"),
        ({"restart_policy": "onfailure"}, "restart_policy", "Did you mean 'OnFailure'?"),
        ({"restart_policy": "Sometimes"}, "restart_policy", "'ExitCode'"),
        ({"cpu": "0"}, "cpu", "positive"),
        ({"cpu": "two"}, "cpu", "'two'"),
        ({"cpu": math.inf}, "cpu", "inf"),
        ({"memory": -1}, "memory", "-1"),
        ({"memory": "4 Gi"}, "memory", "'4 Gi'"),
        ({"spec": {"chief": 2, "worker": 1}}, "counts.chief", "at most one chief"),
        ({"spec": {"evaluator": 2, "worker": 1}}, "counts.evaluator", "at most one"),
        ({"spec": {"worker": -1}}, "counts.worker", "-1"),
        ({"spec": {"worker": True}}, "counts.worker", "True"),
        ({"spec": {"worker": 1.5}}, "counts.worker", "1.5"),
        ({"spec": {"evaluator": 1}}, "counts", "at least one chief or worker"),
        ({"spec": {"ps": 1, "worker": 2}}, "counts.chief", "parameter servers"),
        ({"spec": {"ps": 1, "chief": 1}}, "counts.worker", "parameter servers"),
        ({"spec": {}}, "cluster", "at least one chief or worker"),
    ],
)
def test_tfjob_rejects_bad_arguments_naming_the_field(change, field, says):
    call = {"spec": {"worker": 2}, "name": "job", "image": "img", "command": ["python"]}
    call.update(change)
    spec = call.pop("spec")
    with pytest.raises(ConfigError) as error:
        hosts.tfjob_manifest(spec, **call)
    assert error.value.field == field
    assert says in str(error.value)


def test_tfjob_name_limit_is_exact_and_a_bad_spec_is_a_cluster_error():
    hosts.tfjob_manifest({"worker": 2}, name="a" * 54, image="i", command=["c"])  # 63: fine.
    with pytest.raises(ClusterSpecError) as error:
        hosts.tfjob_manifest(
            {"cluster": {"worker": ["a:1", "a:1"]}}, name="j", image="i", command=["c"]
        )
    assert error.value.field == "cluster.worker[1]"


# --------------------------------------------------------------------------
# The TFJob structure, as Kubeflow's training operator defines it. There is
# no Kubernetes cluster here, so manifests are checked against the structure
# only: the kubeflow.org/v1 types (tensorflow_types.go, common_types.go) and
# the operator's ValidateV1TFJob (tensorflow_validation.go) in
# github.com/kubeflow/training-operator, pkg/apis/kubeflow.org/v1.
# --------------------------------------------------------------------------

#: TFReplicaType values; "Master" is the operator's old name for "Chief".
KUBEFLOW_REPLICA_TYPES = {"Chief", "Master", "Worker", "PS", "Evaluator"}
#: RestartPolicy values of a ReplicaSpec.
KUBEFLOW_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}
#: The container the operator sets TF_CONFIG in (TFJobDefaultContainerName).
KUBEFLOW_CONTAINER = "tensorflow"
_TFJOB_KEYS = {"apiVersion", "kind", "metadata", "spec"}
_TFJOB_SPEC_KEYS = {"runPolicy", "successPolicy", "tfReplicaSpecs", "enableDynamicWorker"}
_REPLICA_SPEC_KEYS = {"replicas", "template", "restartPolicy"}
_POD_TEMPLATE_KEYS = {"metadata", "spec"}
# Fields of a Kubernetes core/v1 Container that a TFJob container may use.
_CONTAINER_KEYS = {
    "name",
    "image",
    "command",
    "args",
    "workingDir",
    "ports",
    "env",
    "envFrom",
    "resources",
    "volumeMounts",
    "imagePullPolicy",
}
_DNS1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"


def tfjob_structure_problems(manifest: object) -> list[str]:
    """What in ``manifest`` deviates from a Kubeflow ``kubeflow.org/v1`` TFJob.

    Returns:
        One sentence per problem, saying what was expected and what was
        found; empty when the manifest has the TFJob structure.
    """
    import re

    problems = []

    def expect(ok: bool, where: str, expected: str, got: object) -> bool:
        if not ok:
            problems.append(f"{where}: expected {expected}, got {got!r}")
        return ok

    if not expect(isinstance(manifest, dict), "manifest", "a mapping", manifest):
        return problems
    expect(
        set(manifest) <= _TFJOB_KEYS,
        "top-level keys",
        f"a subset of {sorted(_TFJOB_KEYS)}",
        sorted(manifest),
    )
    expect(
        manifest.get("apiVersion") == "kubeflow.org/v1",
        "apiVersion",
        "'kubeflow.org/v1'",
        manifest.get("apiVersion"),
    )
    expect(manifest.get("kind") == "TFJob", "kind", "'TFJob'", manifest.get("kind"))
    name = (manifest.get("metadata") or {}).get("name")
    expect(
        isinstance(name, str) and len(name) <= 63 and bool(re.fullmatch(_DNS1035, name)),
        "metadata.name",
        "a DNS-1035 label (ValidateV1TFJob)",
        name,
    )
    spec = manifest.get("spec")
    if not expect(isinstance(spec, dict), "spec", "a mapping", spec):
        return problems
    expect(
        set(spec) <= _TFJOB_SPEC_KEYS,
        "spec keys",
        f"a subset of {sorted(_TFJOB_SPEC_KEYS)}",
        sorted(spec),
    )
    replica_specs = spec.get("tfReplicaSpecs")
    if not expect(
        isinstance(replica_specs, dict) and bool(replica_specs),
        "spec.tfReplicaSpecs",
        "a non-empty mapping",
        replica_specs,
    ):
        return problems
    chiefs = [t for t in replica_specs if t in ("Chief", "Master")]
    expect(len(chiefs) <= 1, "spec.tfReplicaSpecs", "at most one Chief/Master", chiefs)
    expect(
        "Chief" in replica_specs or "Worker" in replica_specs,
        "spec.tfReplicaSpecs",
        "a Chief or a Worker replica spec",
        sorted(replica_specs),
    )
    for replica_type, replica in replica_specs.items():
        where = f"spec.tfReplicaSpecs.{replica_type}"
        expect(
            replica_type in KUBEFLOW_REPLICA_TYPES,
            f"{where} (key)",
            f"one of {sorted(KUBEFLOW_REPLICA_TYPES)}, capitalised",
            replica_type,
        )
        if not expect(isinstance(replica, dict), where, "a mapping", replica):
            continue
        expect(
            set(replica) <= _REPLICA_SPEC_KEYS,
            f"{where} keys",
            f"a subset of {sorted(_REPLICA_SPEC_KEYS)}",
            sorted(replica),
        )
        count = replica.get("replicas")
        expect(
            type(count) is int and 1 <= count < 2**31,
            f"{where}.replicas",
            "a positive int32",
            count,
        )
        if replica_type in ("Chief", "Master", "Evaluator"):
            expect(count == 1, f"{where}.replicas", "1 (TensorFlow has one of each)", count)
        expect(
            replica.get("restartPolicy") in KUBEFLOW_RESTART_POLICIES,
            f"{where}.restartPolicy",
            f"one of {sorted(KUBEFLOW_RESTART_POLICIES)}",
            replica.get("restartPolicy"),
        )
        template = replica.get("template")
        if not expect(
            isinstance(template, dict) and set(template) <= _POD_TEMPLATE_KEYS,
            f"{where}.template",
            "a PodTemplateSpec (metadata, spec)",
            template,
        ):
            continue
        containers = (template.get("spec") or {}).get("containers")
        if not expect(
            isinstance(containers, list) and bool(containers),
            f"{where}.template.spec.containers",
            "a non-empty list",
            containers,
        ):
            continue
        first = containers[0]
        expect(
            isinstance(first, dict) and first.get("name") == KUBEFLOW_CONTAINER,
            f"{where}.template.spec.containers[0].name",
            repr(KUBEFLOW_CONTAINER),
            first.get("name") if isinstance(first, dict) else first,
        )
        for i, container in enumerate(containers):
            at = f"{where}.template.spec.containers[{i}]"
            if not expect(isinstance(container, dict), at, "a mapping", container):
                continue
            expect(
                set(container) <= _CONTAINER_KEYS,
                f"{at} keys",
                f"Kubernetes Container fields ({sorted(_CONTAINER_KEYS)})",
                sorted(container),
            )
            expect(
                isinstance(container.get("image"), str) and bool(container.get("image")),
                f"{at}.image",
                "a non-empty image",
                container.get("image"),
            )
            for field in ("command", "args"):
                if field in container:
                    value = container[field]
                    expect(
                        isinstance(value, list) and all(isinstance(w, str) for w in value),
                        f"{at}.{field}",
                        "a list of strings",
                        value,
                    )
            resources = container.get("resources", {})
            expect(
                isinstance(resources, dict) and set(resources) <= {"requests", "limits"},
                f"{at}.resources",
                "requests and/or limits",
                resources,
            )
    return problems


def test_tfdist_names_the_kubeflow_replica_types_and_restart_policies():
    assert set(hosts.REPLICA_TYPES.values()) <= KUBEFLOW_REPLICA_TYPES
    assert hosts.REPLICA_TYPES == {
        "chief": "Chief",
        "worker": "Worker",
        "ps": "PS",
        "evaluator": "Evaluator",
    }
    assert set(hosts.RESTART_POLICIES) == KUBEFLOW_RESTART_POLICIES


@pytest.mark.parametrize("policy", sorted(KUBEFLOW_RESTART_POLICIES))
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_spec_gives_a_manifest_with_the_tfjob_structure(path, policy):
    import yaml  # A test dependency (pyproject [test]).

    manifest = hosts.tfjob_manifest(
        path,
        name="train",
        image="reg.example/train:1",
        command=["python", "train.py"],
        args=["--epochs=3"],
        restart_policy=policy,
        cpu="500m",
        memory="1Gi",
    )
    # What kubectl reads is the YAML text, so check the text's structure.
    loaded = yaml.safe_load(hosts.to_yaml(manifest))
    assert tfjob_structure_problems(loaded) == []
    raw = json.loads(path.read_text())
    jobs = {REPLICA[job]: len(addresses) for job, addresses in raw["cluster"].items()}
    if raw.get("task", {}).get("type") == "evaluator":
        jobs["Evaluator"] = 1
    replica_specs = loaded["spec"]["tfReplicaSpecs"]
    assert {kind: spec["replicas"] for kind, spec in replica_specs.items()} == jobs
    assert {spec["restartPolicy"] for spec in replica_specs.values()} == {policy}


def test_tfjob_command_output_has_the_tfjob_structure():
    # The Kubernetes page's command: the console script, its comment header, the YAML.
    import yaml  # A test dependency (pyproject [test]).

    exe = shutil.which("tfdist", path=str(Path(sys.executable).parent)) or shutil.which("tfdist")
    assert exe, "expected the 'tfdist' console command; install the package with pip"
    proc = subprocess.run(
        [
            exe,
            "tfjob",
            "parameter_server_evaluator",
            "--name",
            "mnist",
            "--image",
            "registry.example.com/train:1",
            "--restart-policy",
            "ExitCode",
            "--",
            "python",
            "strategies/multi_worker_mirrored.py",
            "--epochs=3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    assert tfjob_structure_problems(manifest) == []
    assert list(manifest["spec"]["tfReplicaSpecs"]) == ["Chief", "Worker", "PS", "Evaluator"]


def _deviations() -> list[tuple[str, object, str]]:
    """(what changes, how, the problem it must cause) for the checker's own test."""

    def drop(key):
        return lambda m: m["spec"]["tfReplicaSpecs"]["Worker"].pop(key)

    def worker(key, value):
        return lambda m: m["spec"]["tfReplicaSpecs"]["Worker"].__setitem__(key, value)

    def container(key, value):
        return lambda m: m["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
            0
        ].__setitem__(key, value)

    def rename(old, new):
        return lambda m: m["spec"]["tfReplicaSpecs"].__setitem__(
            new, m["spec"]["tfReplicaSpecs"].pop(old)
        )

    return [
        (
            "apiVersion v1beta2",
            lambda m: m.__setitem__("apiVersion", "kubeflow.org/v1beta2"),
            "apiVersion: expected 'kubeflow.org/v1', got 'kubeflow.org/v1beta2'",
        ),
        ("kind", lambda m: m.__setitem__("kind", "TfJob"), "kind: expected 'TFJob'"),
        ("lowercase type", rename("Worker", "worker"), "(key): expected one of"),
        ("upper-case type", rename("PS", "Ps"), "got 'Ps'"),
        (
            "Master and Chief",
            lambda m: m["spec"]["tfReplicaSpecs"].__setitem__(
                "Master", m["spec"]["tfReplicaSpecs"]["Chief"]
            ),
            "at most one Chief/Master",
        ),
        (
            "two chiefs",
            lambda m: m["spec"]["tfReplicaSpecs"]["Chief"].__setitem__("replicas", 2),
            "Chief.replicas: expected 1",
        ),
        ("replicas as text", worker("replicas", "2"), "a positive int32, got '2'"),
        ("no restartPolicy", drop("restartPolicy"), "restartPolicy: expected one of"),
        ("lowercase policy", worker("restartPolicy", "onFailure"), "got 'onFailure'"),
        ("pod-level key", worker("containers", []), "Worker keys: expected a subset"),
        (
            "container name",
            container("name", "tf"),
            "containers[0].name: expected 'tensorflow', got 'tf'",
        ),
        ("no image", container("image", ""), "image: expected a non-empty image"),
        ("command as text", container("command", "python train.py"), "a list of strings"),
        ("snake_case field", container("working_dir", "/x"), "Kubernetes Container fields"),
        ("name", lambda m: m["metadata"].__setitem__("name", "My_Job"), "DNS-1035"),
    ]


@pytest.mark.parametrize(
    "what, change, problem", [pytest.param(*case, id=case[0]) for case in _deviations()]
)
def test_the_tfjob_structure_check_finds_each_deviation(what, change, problem):
    manifest = hosts.tfjob_manifest(
        "parameter_server", name="job", image="img:1", command=["python", "train.py"]
    )
    assert tfjob_structure_problems(manifest) == []
    change(manifest)
    problems = tfjob_structure_problems(manifest)
    assert any(problem in p for p in problems), (
        f"{what}: expected a problem containing {problem!r}, got {problems}"
    )


# --------------------------------------------------------------------------
# to_yaml
# --------------------------------------------------------------------------


def test_yaml_text_of_a_small_document():
    document = {
        "a": 1,
        "b": [{"c": "yes", "d": []}, ["x", 2]],
        "e": {},
        "f": "--flag",
        "g": None,
        "h": True,
        "i": 1.5,
        "j": "reg.io/img:1",
        "k": "a: b",
    }
    assert hosts.to_yaml(document) == (
        "a: 1\n"
        "b:\n"
        '  - c: "yes"\n'
        "    d: []\n"
        "  - - x\n"
        "    - 2\n"
        "e: {}\n"
        'f: "--flag"\n'
        "g: null\n"
        "h: true\n"
        "i: 1.5\n"
        "j: reg.io/img:1\n"
        'k: "a: b"\n'
    )
    assert hosts.to_yaml([]) == "[]\n"
    assert hosts.to_yaml("on") == '"on"\n'
    with pytest.raises(TypeError):
        hosts.to_yaml({"a": {1, 2}})
    with pytest.raises(TypeError):
        hosts.to_yaml({("tuple", "key"): 1})


TRICKY = [
    "",
    " ",
    " lead",
    "trail ",
    "yes",
    "No",
    "ON",
    "off",
    "y",
    "N",
    "true",
    "False",
    "null",
    "Null",
    "~",
    "-",
    "--flag",
    "-1",
    "+1",
    "1",
    "0.5",
    "1e3",
    "1_000",
    "0x1F",
    "0o17",
    "017",
    "1:20",
    "2001-12-14",
    ".inf",
    "-.inf",
    ".NaN",
    "@at",
    "`tick`",
    "!tag",
    "&anchor",
    "*alias",
    "|",
    ">",
    "'single'",
    '"double"',
    "a: b",
    "a:",
    "a #b",
    "#c",
    "- x",
    "[x]",
    "{x}",
    "a,b",
    "%x",
    "=",
    "<<",
    "?",
    "http://x.io/a?b=c",
    "line\nbreak",
    "tab\there",
    "nul\x00",
    "bell\x07",
    "del\x7f",
    "nel\x85",
    "ls\u2028ps\u2029",
    "bom\ufeff",
    "ünï",
    "😀",
    "\\back\\slash",
    "CamelCase",
    "snake_case",
    "/abs/path",
    "reg.io/i:1",
]


@pytest.mark.parametrize("text", TRICKY, ids=repr)
def test_tricky_strings_round_trip_through_pyyaml(text):
    import yaml  # A test dependency (pyproject [test]).

    document = {text: text, "list": [text, [text], {text: [text]}]}
    assert yaml.safe_load(hosts.to_yaml(document)) == document


def test_numbers_and_manifests_round_trip_through_pyyaml():
    import yaml  # A test dependency (pyproject [test]).

    values = {
        "int": -7,
        "big": 10**20,
        "float": 0.1,
        "exp": 1e20,
        "small": 1e-7,
        "neg": -2.5e-300,
        "inf": math.inf,
        "-inf": -math.inf,
        "t": True,
        "f": False,
        "none": None,
        "empty_list": [],
        "empty_map": {},
        "tuple": (1, "2"),
    }
    loaded = yaml.safe_load(hosts.to_yaml(values))
    assert loaded == {**values, "tuple": [1, "2"]}
    assert all(type(loaded[k]) is type(values[k]) for k in values if k != "tuple")
    assert math.isnan(yaml.safe_load(hosts.to_yaml({"nan": math.nan}))["nan"])
    for path in SPECS:
        manifest = hosts.tfjob_manifest(
            path,
            name="j",
            image="img:1",
            command=["python", "-m", "x"],
            args=["--lr=0.1", "yes", "1"],
            namespace="ns",
            cpu=2,
            memory=2**30,
        )
        assert yaml.safe_load(hosts.to_yaml(manifest)) == manifest


def test_hosts_and_cli_do_not_import_tensorflow():
    code = (
        "import sys, tfdist.engines.hosts, tfdist.cli.commands; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------
# A Slurm step of 2 tasks on localhost, without Slurm.
# --------------------------------------------------------------------------

SLURM_WORKER = """
import json, tfdist, _common
strategy = tfdist.strategy_from_config(register_timeout=60)
result = _common.train(strategy, epochs=2, per_replica_batch_size=16, examples=512,
                       learning_rate=0.01, seed=5)
result.update(task=strategy.task, is_chief=strategy.is_chief,
              slurm=strategy.choice.slurm, reason=strategy.choice.reason,
              cluster=strategy.cluster_resolver.cluster_spec().as_dict())
print("tfdist result: " + json.dumps(result), flush=True)
"""


def _free_port_pair() -> int:
    """A port P such that P and P + 1 are both free on 127.0.0.1 just now."""
    for _ in range(200):
        base = free_ports(1)[0]
        if not 1024 <= base < 65000:
            continue
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", base))
                second.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports found")


@pytest.mark.slow
def test_a_slurm_step_of_two_tasks_trains_as_two_workers():
    # What `srun -n2` on one node sets (see tfdist/strategies/slurm.py and DESIGN.md), by hand.
    base = _free_port_pair()
    step = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "777",
        "SLURM_STEP_ID": "0",
        "TFDIST_SLURM_PORT_BASE": str(base),
    }
    procs = [start(["-c", SLURM_WORKER], SLURM_PROCID=str(rank), **step) for rank in range(2)]
    results = finish(procs, timeout=240)
    for code, _out, err in results:
        assert code == 0, f"task failed ({code}):\n{err[-4000:]}"
    first, second = (result_line(out) for _, out, _ in results)

    cluster_seen = {"worker": [f"localhost:{base}", f"localhost:{base + 1}"]}
    for rank, result in enumerate((first, second)):
        assert result["cluster"] == cluster_seen
        assert result["task"] == f"worker:{rank}"
        assert result["is_chief"] is (rank == 0)
        assert result["replicas"] == 2
        assert result["slurm"] is True
        assert "Slurm job step of 2 tasks" in result["reason"]
    # Synchronous training: identical weights and losses, and it learned.
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first["loss"] == second["loss"]
    assert first["loss"][-1] < first["loss"][0]
