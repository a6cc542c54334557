"""Preemption on Kubernetes: what the TFJob manifest of ``tfdist tfjob`` sets.

There is no Kubernetes cluster here. The tests parse the YAML that the
``tfdist tfjob`` command prints (PyYAML, as kubectl would read it) and check
the fields that make a preempted pod save and come back:

- ``terminationGracePeriodSeconds`` on every pod (``--grace``, default 60):
  the time from SIGTERM to SIGKILL in which tfdist saves its backup;
- ``TFDIST_GRACE`` in the container, so that a save that overruns is logged;
- the restart policy, ``ExitCode`` by default. The rule it follows is the
  training operator's (kubeflow/training-operator, pkg/controller.v1/common/
  pod.go ``ReconcilePods`` and pkg/util/train ``IsRetryableExitCode``): a
  failed pod whose ``tensorflow`` container exited with 128 or more is
  deleted and re-created; 1-127 fails the job. The tests apply that rule to
  exit codes real processes produced.

Pure Python, no TensorFlow in this process.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from tfdist.engines import hosts
from tfdist.errors import ConfigError

yaml = pytest.importorskip("yaml")  # A test dependency (pyproject [test]).

SPECS = sorted((REPO / "cluster_specs").glob("*.json"))
#: Fields of a Kubernetes core/v1 PodSpec a TFJob pod template may use.
POD_SPEC_FIELDS = {
    "containers",
    "initContainers",
    "volumes",
    "restartPolicy",
    "terminationGracePeriodSeconds",
    "activeDeadlineSeconds",
    "nodeSelector",
    "affinity",
    "tolerations",
    "serviceAccountName",
    "schedulerName",
    "priorityClassName",
    "securityContext",
}


def operator_restarts(policy: str, exit_code: int) -> bool:
    """Whether the training operator re-creates a failed pod (its ReconcilePods).

    ``ExitCode``: only for a retryable code, 128 or more (IsRetryableExitCode).
    ``OnFailure`` and ``Always``: always. ``Never``: never.
    """
    if policy == "ExitCode":
        return exit_code >= 128
    return policy in ("OnFailure", "Always")


def tfjob_command(*args: str) -> subprocess.CompletedProcess:
    """Runs the installed ``tfdist`` console command (what users type)."""
    exe = shutil.which("tfdist", path=str(Path(sys.executable).parent)) or shutil.which("tfdist")
    assert exe, "expected the 'tfdist' console command; install the package with pip"
    return subprocess.run(
        [exe, "tfjob", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=120,
    )


def pod_specs(manifest: dict) -> dict[str, dict]:
    return {
        kind: replica["template"]["spec"]
        for kind, replica in manifest["spec"]["tfReplicaSpecs"].items()
    }


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_every_pod_gets_the_grace_period_and_a_restart_policy_that_resumes(path):
    proc = tfjob_command(
        path.stem,
        "--name",
        "train",
        "--image",
        "reg.example/train:1",
        "--grace",
        "90",
        "--",
        "python",
        "train.py",
    )
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    replicas = manifest["spec"]["tfReplicaSpecs"]
    assert replicas, proc.stdout
    for kind, replica in replicas.items():
        assert replica["restartPolicy"] == "ExitCode", kind
        spec = replica["template"]["spec"]
        assert set(spec) <= POD_SPEC_FIELDS, f"{kind}: {sorted(spec)}"
        # An int in the YAML text, as the int64 field needs (not "90").
        assert spec["terminationGracePeriodSeconds"] == 90
        assert type(spec["terminationGracePeriodSeconds"]) is int
        [container] = spec["containers"]
        assert {"name": "TFDIST_GRACE", "value": "90"} in container["env"], kind
    # The header tells the reader where the backup has to live.
    assert "volume every pod mounts" in proc.stdout.split("apiVersion:")[0]


def test_the_default_grace_and_policy_and_the_ones_given():
    default = yaml.safe_load(
        tfjob_command("two_workers", "--name", "t", "--image", "i", "--", "python").stdout
    )
    assert {s["terminationGracePeriodSeconds"] for s in pod_specs(default).values()} == {
        hosts.DEFAULT_GRACE_SECONDS
    }
    assert hosts.DEFAULT_GRACE_SECONDS >= 30  # At least Kubernetes' own default.
    given = yaml.safe_load(
        tfjob_command(
            "chief_and_workers",
            "--name",
            "t",
            "--image",
            "i",
            "--grace",
            "300",
            "--restart-policy",
            "OnFailure",
            "--",
            "python",
        ).stdout
    )
    assert {s["terminationGracePeriodSeconds"] for s in pod_specs(given).values()} == {300}
    assert {r["restartPolicy"] for r in given["spec"]["tfReplicaSpecs"].values()} == {"OnFailure"}


def test_the_default_policy_restarts_a_preemption_and_fails_a_crash():
    # The exit codes of real processes: a Python error, and a process that
    # exits as tfdist does after saving on preemption.
    crash = subprocess.run(
        [sys.executable, "-c", "raise RuntimeError('bug')"], capture_output=True, timeout=60
    ).returncode
    from tfdist.training.fault_tolerance import preemption

    preempted = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.exit({preemption.PREEMPTED_EXIT_CODE})"],
        timeout=60,
    ).returncode
    policy = hosts.DEFAULT_RESTART_POLICY
    assert operator_restarts(policy, preempted), (policy, preempted)
    assert not operator_restarts(policy, crash), (policy, crash)
    # OnFailure restarts both: a bug would loop until backoffLimit.
    assert operator_restarts("OnFailure", crash)


@pytest.mark.parametrize(
    "grace, shown, hint",
    [
        ("0", "'0'", None),
        ("-5", "'-5'", None),
        ("1.5", "'1.5'", "use 2"),
        ("abc", "'abc'", None),
        ("", "''", None),
    ],
)
def test_a_bad_grace_on_the_command_line_names_the_field_and_exits_2(grace, shown, hint):
    proc = tfjob_command(
        "two_workers", "--name", "job", "--image", "i", "--grace", grace, "--", "python"
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "field 'grace'" in proc.stderr and f"Received: {shown}" in proc.stderr
    assert "terminationGracePeriodSeconds" in proc.stderr
    if hint:
        assert hint in proc.stderr


@pytest.mark.parametrize(
    "grace, shown",
    [
        (0, "0"),
        (True, "True"),
        (None, "None"),
        (2.0, "2.0"),
        (math.inf, "inf"),
        (2**63, str(2**63)),
    ],
)
def test_a_bad_grace_in_python_names_the_field(grace, shown):
    with pytest.raises(ConfigError) as error:
        hosts.tfjob_manifest({"worker": 2}, name="job", image="i", command=["python"], grace=grace)
    assert error.value.field == "grace"
    assert f"Received: {shown}" in str(error.value)


def test_the_backup_claim_is_mounted_in_every_pod():
    proc = tfjob_command(
        "parameter_server",
        "--name",
        "t",
        "--image",
        "i",
        "--backup-claim",
        "team.backups-1",
        "--backup-mount",
        "/mnt/b",
        "--",
        "python",
        "train.py",
        "--backup_dir=/mnt/b/run",
    )
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    for kind, spec in pod_specs(manifest).items():
        [volume] = spec["volumes"]
        assert volume["persistentVolumeClaim"] == {"claimName": "team.backups-1"}, kind
        [container] = spec["containers"]
        # The container mounts the pod's volume, by its name.
        assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/mnt/b"}]
    default = hosts.tfjob_manifest(
        {"worker": 2}, name="t", image="i", command=["python"], backup_claim="b"
    )
    [container] = pod_specs(default)["Worker"]["containers"]
    assert container["volumeMounts"][0]["mountPath"] == hosts.DEFAULT_BACKUP_MOUNT
    none = hosts.tfjob_manifest({"worker": 2}, name="t", image="i", command=["python"])
    assert "volumes" not in pod_specs(none)["Worker"]
    assert "volumeMounts" not in pod_specs(none)["Worker"]["containers"][0]


@pytest.mark.parametrize(
    "claim, mount, field, says",
    [
        ("Team_Backups", None, "backup_claim", "Try 'team-backups'"),
        ("-b", None, "backup_claim", "'-b'"),
        ("b" * 254, None, "backup_claim", "PersistentVolumeClaim"),
        (7, None, "backup_claim", "7"),
        ("b", "backup", "backup_mount", "absolute path"),
        ("b", "/a:b", "backup_mount", "'/a:b'"),
        ("b", "/my backups", "backup_mount", "spaces"),
        (None, "/backup", "backup_mount", "no backup_claim"),
    ],
)
def test_a_bad_backup_volume_names_the_field(claim, mount, field, says):
    with pytest.raises(ConfigError) as error:
        hosts.tfjob_manifest(
            {"worker": 2},
            name="job",
            image="i",
            command=["python"],
            backup_claim=claim,
            backup_mount=mount,
        )
    assert error.value.field == field
    assert says in str(error.value)
