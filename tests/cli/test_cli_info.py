"""``tfdist info``, run as users run it: each call starts TensorFlow (about
4 s of CPU), so these tests are apart from tests/cli/test_cli.py's, which
start only Python."""

from __future__ import annotations

import re

import pytest

from test_cli import tfdist


@pytest.mark.parametrize(
    "spec, task, says",
    [
        (
            "parameter_server",
            "chief:0",
            [
                "strategy: parameter_server",
                "why:      TF_CONFIG lists 1 chief, 2 worker, 2 ps",
                "task:     chief:0 (chief)",
            ],
        ),
        (
            "parameter_server",
            "ps:1",
            ["strategy: parameter_server", "role:     server", "task:     ps:1 (not chief)"],
        ),
        (
            "two_workers",
            "worker:1",
            [
                "strategy: multi_worker_mirrored",
                "cluster:  worker: 127.0.0.1:20010, 127.0.0.1:20011",
                "task:     worker:1 (not chief)",
            ],
        ),
    ],
)
def test_info_explains_its_choice(spec, task, says):
    config = tfdist("tf-config", spec, "--task", task).stdout.strip()
    proc = tfdist("info", TF_CONFIG=config)
    assert proc.returncode == 0, proc.stderr
    for line in says:
        assert line in proc.stdout
    assert "cpus:     1" in proc.stdout and "versions: tensorflow 2." in proc.stdout


def test_info_without_cluster_and_with_cpu_replicas():
    proc = tfdist("info", "--cpu-replicas", "2", "--patches")
    assert proc.returncode == 0, proc.stderr
    assert "strategy: mirrored" in proc.stdout
    assert "cpu_replicas=2" in proc.stdout
    assert "cluster:  none" in proc.stdout
    # The versions with the supported range, and every patch of the registry
    # with its state on them.
    from tfdist.compat import registry, versions

    low, high = versions.SUPPORTED["keras"]
    assert f"keras >={low},<{high})" in proc.stdout
    states = re.findall(r"^  (ok|not needed|MISMATCH) +(\S+) ", proc.stdout, re.M)
    assert [name for _, name in states] == [p.name for p in registry.PATCHES]
    applying = sum(state == "ok" for state, _ in states)
    assert f"patches:  {applying} apply on these versions" in proc.stdout
    assert "MISMATCH" not in proc.stdout


def test_info_reports_a_bad_tf_config_instead_of_a_traceback():
    proc = tfdist(
        "info",
        TF_CONFIG='{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}',
    )
    assert proc.returncode == 2
    assert "field 'task.index'" in proc.stderr and "-1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_info_inside_a_slurm_step_shows_the_cluster_it_found():
    step = {
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "TFDIST_SLURM_PORT_BASE": "23100",
    }
    proc = tfdist("info", **step)
    assert proc.returncode == 0, proc.stderr
    assert "strategy: multi_worker_mirrored" in proc.stdout
    assert "Slurm job step of 2 tasks" in proc.stdout
    assert "cluster:  worker: localhost:23100, localhost:23101" in proc.stdout
    assert "task:     worker:0 (chief)" in proc.stdout


def _noise_lines(text):
    from tfdist.engines.quiet import NoiseFilter

    noise = NoiseFilter()
    return [line for line in text.splitlines() if noise.is_noise(line)]


def test_info_hides_tensorflows_start_up_noise_unless_verbose():
    # As a user runs it: TF_CPP_MIN_LOG_LEVEL unset (0).
    quiet = tfdist("info", TF_CPP_MIN_LOG_LEVEL="0")
    verbose = tfdist("info", "--verbose", TF_CPP_MIN_LOG_LEVEL="0")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert _noise_lines(quiet.stdout + quiet.stderr) == []
    assert quiet.stderr == ""
    assert quiet.stdout.startswith("strategy: ")  # The first line is useful.
    # With --verbose, everything TensorFlow said, on stderr; the same report.
    shown = _noise_lines(verbose.stderr)
    assert any("absl::InitializeLog()" in line for line in shown), verbose.stderr
    assert any("cuInit" in line for line in shown), verbose.stderr
    assert verbose.stdout == quiet.stdout
