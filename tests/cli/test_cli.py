"""The ``tfdist`` command, run as users run it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env


def tfdist(*args, stdin=None, **env):
    """Runs the ``tfdist`` console command that ``pip install`` provides."""
    exe = shutil.which("tfdist", path=str(Path(sys.executable).parent)) or (shutil.which("tfdist"))
    assert exe, "no 'tfdist' command: install the package with pip first"
    return subprocess.run(
        [exe, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(**env),
        timeout=120,
    )


def test_validate_accepts_every_example_spec():
    for path in sorted((REPO / "cluster_specs").glob("*.json")):
        proc = tfdist("validate", str(path))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("OK: ")


def test_validate_reports_the_field_and_exits_non_zero(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"cluster": {"worker": ["127.0.0.1:2222"], "chief": ["127.0.0.1:2222"]}})
    )
    proc = tfdist("validate", str(bad))
    assert proc.returncode == 2
    assert "field 'cluster.chief[0]'" in proc.stderr
    assert "'cluster.worker[0]'" in proc.stderr
    assert "'127.0.0.1:2222'" in proc.stderr
    assert proc.stdout == ""


def test_validate_reads_stdin_and_locates_json_errors():
    proc = tfdist("validate", "-", stdin='{"cluster": {"worker": [\n  "a:1",,]}}')
    assert proc.returncode == 2
    assert "line 2, column 9" in proc.stderr
    proc = tfdist("validate", "-", stdin="null")
    assert proc.returncode == 2
    assert "field '<root>'" in proc.stderr and "Received: null" in proc.stderr
    proc = tfdist(
        "validate",
        "-",
        "--require-task",
        stdin=json.dumps(
            {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "1"}}
        ),
    )
    assert proc.returncode == 2
    assert "field 'task.index'" in proc.stderr and "'1'" in proc.stderr


def test_tf_config_prints_one_tasks_config():
    proc = tfdist("tf-config", "chief_and_workers", "--task", "worker:1")
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    spec = json.loads((REPO / "cluster_specs/chief_and_workers.json").read_text())
    assert config == {**spec, "task": {"type": "worker", "index": 1}}
    proc = tfdist("tf-config", "two_workers", "--task", "worker:2")
    assert proc.returncode == 2 and "task.index" in proc.stderr
    proc = tfdist("tf-config", "two_workers", "--task", "worker-1")
    assert proc.returncode == 2 and "'worker-1'" in proc.stderr


# --- tfdist hosts / tfdist tfjob -------------------------------------------


def _host_lines(stdout):
    """{host: [(TF_CONFIG dict, argv), ...]} from `tfdist hosts` output."""
    import shlex

    groups, host = {}, None
    for line in stdout.splitlines():
        if line.startswith("# host "):
            host = line[len("# host ") :].rsplit(": ", 1)[0]
            groups[host] = []
        elif line and not line.startswith("#"):
            words = shlex.split(line)
            assert words[0].startswith("TF_CONFIG="), line
            groups[host].append((json.loads(words[0][len("TF_CONFIG=") :]), words[1:]))
    return groups


def test_hosts_prints_every_tasks_command_grouped_by_host():
    from tfdist import spec as spec_lib

    proc = tfdist(
        "hosts",
        "chief_and_workers",
        "--python",
        "python3 -u",
        "--",
        "train.py",
        "--epochs",
        "3",
        "--name",
        "a b",
        "--",
    )
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((REPO / "cluster_specs/chief_and_workers.json").read_text())
    groups = _host_lines(proc.stdout)
    assert list(groups) == ["127.0.0.1"]
    tasks = []
    for tf_config, argv in groups["127.0.0.1"]:
        assert argv == ["python3", "-u", "train.py", "--epochs", "3", "--name", "a b", "--"]
        parsed = spec_lib.parse(tf_config)
        assert tf_config["cluster"] == spec["cluster"]
        tasks.append(parsed.task_id)
    assert tasks == ["chief:0", "worker:0", "worker:1"]
    # Options may also come before the spec; the output is the same.
    again = tfdist(
        "hosts",
        "--python",
        "python3 -u",
        "chief_and_workers",
        "--",
        "train.py",
        "--epochs",
        "3",
        "--name",
        "a b",
        "--",
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == proc.stdout


def test_hosts_reads_stdin_and_adds_the_evaluator_on_its_host():
    spec = {"cluster": {"chief": ["c1:2222"], "worker": ["w1:2222", "w2:2222"], "ps": ["c1:2223"]}}
    proc = tfdist(
        "hosts", "-", "--evaluator", "--evaluator-host", "e1", "--", "t.py", stdin=json.dumps(spec)
    )
    assert proc.returncode == 0, proc.stderr
    groups = _host_lines(proc.stdout)
    assert {
        host: ["{type}:{index}".format(**tf["task"]) for tf, _ in lines]
        for host, lines in groups.items()
    } == {"c1": ["chief:0", "ps:0"], "w1": ["worker:0"], "w2": ["worker:1"], "e1": ["evaluator:0"]}


def test_hosts_errors_exit_2_with_the_cluster_message(tmp_path):
    from tfdist import spec as spec_lib
    from tfdist.errors import ClusterSpecError

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"]}}))
    with pytest.raises(ClusterSpecError) as expected:
        spec_lib.parse(str(bad), require_task=False)
    proc = tfdist("hosts", str(bad), "--", "t.py")
    assert proc.returncode == 2
    assert str(expected.value) in proc.stderr
    assert "field 'cluster.worker[1]'" in proc.stderr and proc.stdout == ""
    proc = tfdist("hosts", "two_workers", "t.py")  # No '--'.
    assert proc.returncode == 2 and "after '--'" in proc.stderr
    proc = tfdist("hosts", "two_workers", "--")  # No script.
    assert proc.returncode == 2 and "SCRIPT is missing" in proc.stderr
    proc = tfdist("hosts", "--", "t.py")  # No spec.
    assert proc.returncode == 2 and "spec" in proc.stderr


def test_tfjob_prints_a_manifest_kubectl_can_read():
    yaml = pytest.importorskip("yaml")
    proc = tfdist(
        "tfjob",
        "parameter_server",
        "--name",
        "mnist",
        "--image",
        "reg.io/t:1",
        "--namespace",
        "team",
        "--cpu",
        "2",
        "--memory",
        "4Gi",
        "--",
        "python",
        "train.py",
        "--epochs",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# TFJob for parameter_server (1 chief, 2 worker, 2 ps)")
    container = {
        "name": "tensorflow",
        "image": "reg.io/t:1",
        "command": ["python", "train.py", "--epochs", "3"],
        "env": [{"name": "TFDIST_GRACE", "value": "60"}],
        "resources": {
            "requests": {"cpu": "2", "memory": "4Gi"},
            "limits": {"cpu": "2", "memory": "4Gi"},
        },
    }

    def replica(count):
        return {
            "replicas": count,
            "restartPolicy": "ExitCode",
            "template": {"spec": {"terminationGracePeriodSeconds": 60, "containers": [container]}},
        }

    assert yaml.safe_load(proc.stdout) == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "mnist", "namespace": "team"},
        "spec": {"tfReplicaSpecs": {"Chief": replica(1), "Worker": replica(2), "PS": replica(2)}},
    }


def test_tfjob_errors_name_the_field_and_exit_2():
    proc = tfdist("tfjob", "two_workers", "--name", "My_Job", "--image", "i", "--", "python")
    assert proc.returncode == 2
    assert "field 'name'" in proc.stderr and "'My_Job'" in proc.stderr
    assert proc.stdout == ""
    proc = tfdist("tfjob", "two_workers", "--name", "job", "--", "python")
    assert proc.returncode == 2 and "--image" in proc.stderr
    proc = tfdist(
        "tfjob",
        "two_workers",
        "--name",
        "job",
        "--image",
        "i",
        "--restart-policy",
        "never",
        "--",
        "python",
    )
    assert proc.returncode == 2
    assert "field 'restart_policy'" in proc.stderr and "'Never'" in proc.stderr


# --- TensorFlow's start-up noise (tfdist/engines/quiet.py) --------------------------

#: Lines TensorFlow 2.21 printed here, on a CPU machine, in `tfdist info`.
OBSERVED_NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795432475.557413    8183 port.cc:153] oneDNN custom operations are on. "
    "You may see slightly different numerical results due to floating-point round-off "
    "errors from different computation orders. To turn them off, set the environment "
    "variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795432475.557731    8183 cudart_stub.cc:31] Could not find cuda drivers "
    "on your machine, GPU will not be used.",
    "I0000 00:00:1795432475.771975    8183 cpu_feature_guard.cc:227] This TensorFlow "
    "binary is optimized to use available CPU instructions in performance-critical "
    "operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 "
    "AVX512_FP16 AVX_VNNI AMX_TILE AMX_INT8 AMX_BF16 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1795432477.875512    8183 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    # A multi-worker task's start-up without TF_CPP_MIN_LOG_LEVEL (tfdist launch).
    "I0000 00:00:1795432498.078979    9908 coordination_service.cc:221] Initializing "
    "CoordinationService",
    "I0000 00:00:1795432498.079733    9908 grpc_server_lib.cc:467] Started server with "
    "target: grpc://127.0.0.1:46853",
    "I0000 00:00:1795432498.223736   10426 coordination_service.cc:1472] "
    "Barrier([Init]Wait_for_all_tasks_to_register::0) has passed with status: OK",
    "I0000 00:00:1795432498.223883   10426 coordination_service.h:529] "
    "/job:worker/replica:0/task:1 has connected to coordination service. "
    "Incarnation: 8136992695137471704",
    "I0000 00:00:1795432498.224083    9908 coordination_service_agent.cc:245] "
    "Coordination agent has successfully connected.",
]

#: Lines TensorFlow 2.16 and 2.19 printed on the same machine (their own log
#: format besides glog's; CUDA plugins registered twice).
OBSERVED_OLDER_NOISE = [
    "2026-11-26 16:13:36.141490: I tensorflow/core/util/port.cc:113] oneDNN custom "
    "operations are on. You may see slightly different numerical results due to "
    "floating-point round-off errors from different computation orders. To turn them off, "
    "set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "2026-11-26 16:13:36.141490: I external/local_tsl/tsl/cuda/cudart_stub.cc:32] Could not "
    "find cuda drivers on your machine, GPU will not be used.",
    "2026-11-26 16:13:36.991078: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:467]"
    " Unable to register cuFFT factory: Attempting to register factory for plugin cuFFT when "
    "one has already been registered",
    "E0000 00:00:1795709616.153805   11991 cuda_dnn.cc:8579] Unable to register cuDNN "
    "factory: Attempting to register factory for plugin cuDNN when one has already been "
    "registered",
    "2026-11-26 16:13:36.991078: E external/local_xla/xla/stream_executor/cuda/"
    "cuda_blas.cc:1442] Unable to register cuBLAS factory: Attempting to register factory "
    "for plugin cuBLAS when one has already been registered",
    "W0000 00:00:1795709616.168312   11991 computation_placer.cc:177] computation placer "
    "already registered. Please check linkage and avoid linking the same target more than "
    "once.",
    "2026-11-26 16:13:36.991078: I tensorflow/core/platform/cpu_feature_guard.cc:210] This "
    "TensorFlow binary is optimized to use available CPU instructions in "
    "performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "2026-11-26 16:13:36.991078: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
    "TF-TRT Warning: Could not find TensorRT",
    "2026-11-26 16:13:37.991078: E external/local_xla/xla/stream_executor/cuda/"
    "cuda_platform.cc:51] failed call to cuInit: INTERNAL: CUDA error: Failed call to "
    "cuInit: UNKNOWN ERROR (303)",
]

#: Real problems that look alike; the filter keeps every one.
REAL_ERRORS = [
    "E0000 00:00:1795432477.875512    8183 cuda_platform.cc:52] failed call to cuInit: "
    "CUDA_ERROR_OUT_OF_MEMORY",  # No "Could not find cuda drivers" before it.
    "E1123 11:16:40.123456    8183 collective_ops.cc:12] Collective ops timed out",
    "W0000 00:00:1795432475.557413    8183 port.cc:153] oneDNN custom operations are on.",
    "F0000 00:00:1795432475.557413    8183 cudart_stub.cc:31] Check failed: driver",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",  # Not after its first line.
    "Traceback (most recent call last):",
    "RuntimeError: Could not find cuda drivers on your machine, GPU will not be used.",
    "ERROR:absl:Started server with target: grpc://127.0.0.1:1",
    "2026-11-26 16:13:36.991078: E tensorflow/core/kernels/collective_ops.cc:12] Collective "
    "ops timed out",
    "E0000 00:00:1795709616.153805   11991 cuda_dnn.cc:8579] Unable to register cuDNN "
    "factory: Attempting to register factory for plugin cuBLAS when one has already been "
    "registered",  # Two different plugins: not the known duplicate.
]


def test_the_noise_filter_drops_the_observed_lines_and_keeps_real_errors():
    from tfdist.engines.quiet import NoiseFilter

    assert [line for line in REAL_ERRORS if NoiseFilter().is_noise(line)] == []
    noise = NoiseFilter()
    assert [line for line in OBSERVED_NOISE if not noise.is_noise(line)] == []
    older = NoiseFilter()
    assert [line for line in OBSERVED_OLDER_NOISE if not older.is_noise(line)] == []
    # One stream, real lines among the noise: exactly the real lines come out.
    real = iter(REAL_ERRORS[1:])
    mixed = []
    for index, line in enumerate(OBSERVED_NOISE):
        mixed.append(line)
        if index != 3:  # The CPU-instructions notice's two lines stay together.
            mixed.append(next(real, None))
    mixed = [line for line in mixed if line is not None]
    assert list(NoiseFilter().keep(mixed)) == REAL_ERRORS[1:]


def test_filtered_stderr_passes_real_errors_even_when_the_process_aborts():
    # fd 2 is written as TensorFlow's C++ code writes it; the process then
    # aborts, as on a fatal "Check failed": the filter process still shows
    # every line that is not noise.
    lines = OBSERVED_NOISE[:3] + [REAL_ERRORS[1]] + OBSERVED_NOISE[3:] + [REAL_ERRORS[3]]
    code = (
        "import os, sys, traceback\n"
        "from tfdist.engines.quiet import filtered_stderr\n"
        "lines = sys.argv[1:]\n"
        "with filtered_stderr():\n"
        "    os.write(2, ''.join(l + '\\n' for l in lines[:-1]).encode())\n"
        "    try:\n"
        "        raise ValueError('a Python error')\n"
        "    except ValueError:\n"
        "        traceback.print_exc()\n"
        "    sys.stderr.flush()\n"
        "    os.write(2, (lines[-1] + '\\n').encode())\n"
        "    os.abort()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *lines],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=60,
    )
    assert proc.returncode < 0  # SIGABRT.
    shown = proc.stderr.splitlines()
    assert shown[0] == REAL_ERRORS[1]
    assert shown[1] == "Traceback (most recent call last):"
    assert shown[-2:] == ["ValueError: a Python error", REAL_ERRORS[3]]
    assert not set(shown) & set(OBSERVED_NOISE)
