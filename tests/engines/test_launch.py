"""`tfdist launch` with real subprocesses.

Most tests launch a small plain-Python task script (tests/workers/task.py),
which is quick; the port and parameter-server tests start TensorFlow tasks.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tfdist
from conftest import REPO, subprocess_env
from tfdist.engines.launch import launch

TASK = str(REPO / "tests" / "workers" / "task.py")


def run(*args, **kwargs):
    out = io.StringIO()
    result = launch(
        TASK, [str(a) for a in args], output=out, handle_signals=False, stop_timeout=5, **kwargs
    )
    return result, out.getvalue().splitlines()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; only its parent can reap it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_output_is_prefixed_and_filtered_by_task():
    result, lines = run("ok")
    assert result.ok and result.restarts == 0
    assert "[worker:0] task worker:0 of 2 workers, attempt 0" in lines
    assert "[worker:0] WARNING: a warning" in lines
    assert any(line.startswith("[worker:0] I0000 ") for line in lines)
    # Worker 1: its warnings, not its ordinary lines, nor TensorFlow's INFO
    # lines with "error" in their text.
    assert "[worker:1] WARNING: a warning" in lines
    assert not any(line.startswith("[worker:1] task") for line in lines)
    assert not any(line.startswith("[worker:1] I0000 ") for line in lines), lines
    assert lines[-1] == "[tfdist launch] all tasks finished"

    result, lines = run("ok", show_all=True, chief=True)
    assert "[worker:1] task worker:1 of 2 workers, attempt 0" in lines
    assert "[chief:0] task chief:0 of 2 workers, attempt 0" in lines


def test_a_tasks_lines_stay_whole_while_its_stderr_logs_between_their_parts(tmp_path):
    # print() under PYTHONUNBUFFERED writes a line's text and its newline
    # apart; on one pipe for both streams, a log line written to stderr in
    # between was glued to it.
    result, lines = run("chatty", show_all=True, log_dir=tmp_path)
    assert result.ok, lines
    for task in ("worker:0", "worker:1"):
        shown = [line for line in lines if line.startswith(f"[{task}] line ")]
        assert shown == [f"[{task}] line {n} of {task}" for n in range(300)], shown[:5]
        logged = (tmp_path / "attempt-0" / f"{task.replace(':', '-')}.log").read_text()
        mine = [line for line in logged.splitlines() if line.startswith("line ")]
        assert mine == [f"line {n} of {task}" for n in range(300)]
        assert "a log line" in logged


def test_a_failing_task_stops_the_others_and_gives_its_code(tmp_path):
    result, lines = run("fail-1", tmp_path)
    assert result.exit_code == 3 and result.failure.task == "worker:1"
    assert "exited with code 3" in lines[-5] and "worker:1" in lines[-5]
    assert lines[-1].strip() == "worker 1 fails now"  # The failing task's last lines.
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 4  # Both workers and the grandchild each one started.
    assert wait_dead(pids) == []


def test_a_killed_task_is_reported_with_its_signal(tmp_path):
    result, lines = run("kill-1", tmp_path)
    assert result.exit_code == 128 + signal.SIGKILL
    assert result.failure.how == "was killed by SIGKILL"
    assert any("giving up: worker:1 was killed by SIGKILL" in line for line in lines)


def test_the_job_restarts_on_new_ports_after_a_failure(tmp_path):
    result, lines = run("fail-1-once", tmp_path, max_restarts=2)
    assert result.ok and result.restarts == 1 and result.port_relaunches == 0
    assert any("worker:1 exited with code 3; restart 1 of 2" in line for line in lines)
    ports = [set(p.read_text().split()) for p in sorted(tmp_path.glob("ports-*"))]
    assert len(ports) == 2 and not ports[0] & ports[1]  # Each attempt: new ports.
    # One scratch directory for the launch: the same for every attempt, gone after.
    job_dirs = {p.read_text() for p in tmp_path.glob("jobdir-*")}
    assert len(job_dirs) == 1 and job_dirs.pop().endswith(" 1"), job_dirs
    assert not Path((tmp_path / "jobdir-0").read_text().split()[0]).exists()


def test_sigterm_to_the_launcher_leaves_no_process_behind(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist", "launch", "--workers", "2", TASK, "sleep", str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 4
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM: every task was stopped" in out
    assert wait_dead(pids) == [], "orphans left behind"


def test_bad_arguments_and_remote_specs_are_refused():
    with pytest.raises(tfdist.ConfigError) as info:
        launch(TASK, workers=0)
    assert info.value.field == "workers" and "Received: 0" in str(info.value)
    with pytest.raises(tfdist.ConfigError) as info:
        launch(TASK, ps=1)
    assert info.value.field == "chief"
    remote = {"cluster": {"worker": ["10.1.2.3:2222", "127.0.0.1:2223"]}}
    with pytest.raises(tfdist.ConfigError) as info:
        launch(TASK, spec=remote)
    assert info.value.field == "spec" and "10.1.2.3" in str(info.value)
    assert "tfdist hosts" in str(info.value)


def test_the_cli_exits_with_the_task_code(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "--workers", "2", TASK, "fail-1", str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "giving up: worker:1 exited with code 3" in done.stdout


def _interfaces() -> set[str]:
    return {name for _, name in socket.if_nameindex()}


def test_netns_runs_the_job_in_a_private_network_namespace(tmp_path):
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0 and os.geteuid() == 0:
        pytest.fail(f"root cannot create a network namespace: {probe.stderr!r}")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--netns",
            "--show-all",
            "--workers",
            "2",
            TASK,
            "interfaces",
            str(tmp_path),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    inside = {
        line.split("interfaces: ")[1] for line in done.stdout.splitlines() if "interfaces: " in line
    }
    assert inside == {"lo"}  # Both workers saw loopback only.
    assert _interfaces() - {"lo"}, "the host itself has other interfaces"


TF_TASK = str(REPO / "tests" / "workers" / "launch_tf.py")


def _results(lines):
    import json

    return [
        json.loads(line.split("tfdist result: ", 1)[1])
        for line in lines
        if "tfdist result: " in line
    ]


@pytest.mark.slow
def test_a_port_taken_by_another_process_relaunches_on_new_ports():
    from tfdist.engines.net import free_ports

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        busy = taken.getsockname()[1]
        spec = {"cluster": {"worker": [f"127.0.0.1:{free_ports(1)[0]}", f"127.0.0.1:{busy}"]}}
        out = io.StringIO()
        result = launch(
            TF_TASK,
            spec=spec,
            show_all=True,
            output=out,
            handle_signals=False,
            env={"PYTHONPATH": str(REPO)},
            stop_timeout=5,
        )
    finally:
        taken.close()
    lines = out.getvalue().splitlines()
    assert result.ok, "\n".join(lines[-30:])
    assert result.port_relaunches == 1 and result.restarts == 0
    assert result.attempts[0].task == "worker:1"
    assert any("could not bind its port" in line for line in lines)
    assert [r["value"] for r in _results(lines)] == [2.0, 2.0]


@pytest.mark.slow
def test_a_parameter_server_job_serves_on_ps_and_workers_and_trains_on_the_chief():
    out = io.StringIO()
    result = launch(
        TF_TASK,
        workers=2,
        ps=1,
        chief=True,
        show_all=True,
        output=out,
        handle_signals=False,
        env={"PYTHONPATH": str(REPO)},
        stop_timeout=5,
    )
    lines = out.getvalue().splitlines()
    assert result.ok, "\n".join(lines[-30:])
    [chief] = _results(lines)
    assert chief == {"value": 10.0, "task": "chief:0", "kind": "parameter_server"}
    assert any(line.startswith("[ps:0]") and "serving" in line for line in lines)
    assert any(line.startswith("[worker:1]") and "serving" in line for line in lines)


@pytest.mark.slow
def test_a_killed_worker_restarts_and_resumes_from_the_last_backup(tmp_path):
    """SIGKILL worker 1 in epoch 3 of 4: the job restarts, both workers
    resume from the end-of-epoch-2 backup, and finish like an uninterrupted
    run."""
    script = str(REPO / "tests" / "workers" / "ft_fit.py")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "strategies")])}

    def job(mode, **kwargs):
        out = io.StringIO()
        result = launch(
            script,
            [str(tmp_path / mode), mode],
            workers=2,
            show_all=True,
            output=out,
            handle_signals=False,
            env=env,
            stop_timeout=5,
            **kwargs,
        )
        lines = out.getvalue().splitlines()
        assert result.ok, "\n".join(lines[-40:])
        return result, {r["task"]: r for r in _results(lines)}

    plain, clean = job("none")
    killed, resumed = job("kill", max_restarts=1)
    assert plain.restarts == 0 and clean["worker:0"]["epochs_run"] == [0, 1, 2, 3]
    assert killed.restarts == 1
    assert killed.attempts[0].task == "worker:1"
    assert killed.attempts[0].how == "was killed by SIGKILL"
    for task in ("worker:0", "worker:1"):
        run = resumed[task]
        assert run["attempt"] == 1 and run["resumed_epoch"] == 2
        assert run["epochs_run"] == [2, 3]  # The same 4 epochs in all.
        # As good as the uninterrupted run: resumed from an epoch-end backup
        # with the same data order, it ends with the same weights.
        np.testing.assert_allclose(run["weights"], clean[task]["weights"], rtol=1e-4, atol=1e-5)
        assert abs(run["accuracy"][-1] - clean[task]["accuracy"][-1]) <= 0.01
    assert resumed["worker:0"]["weights"] == resumed["worker:1"]["weights"]


def test_the_cli_prints_per_host_commands_for_a_spec_with_other_hosts(tmp_path):
    import json

    spec = {"cluster": {"worker": ["10.1.2.3:2222", "10.1.2.4:2222"]}}
    path = tmp_path / "remote.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "--spec", str(path), "train.py", "--epochs=3"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "10.1.2.3, 10.1.2.4" in done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("TF_CONFIG=")]
    assert len(lines) == 2
    import shlex

    words = shlex.split(lines[1])
    config = json.loads(words[0].split("=", 1)[1])
    assert config["task"] == {"type": "worker", "index": 1}
    assert words[-2:] == ["train.py", "--epochs=3"]


def test_an_evaluator_task_runs_the_script_outside_the_cluster():
    result, lines = run("ok", evaluator=True, show_all=True)
    assert result.ok
    # The evaluator has its own TF_CONFIG task and is not counted in the cluster.
    assert "[evaluator:0] task evaluator:0 of 2 workers, attempt 0" in lines


@pytest.mark.slow
def test_tensorflows_start_up_noise_is_in_the_logs_and_shown_only_with_verbose(tmp_path):
    # Two tasks that start TensorFlow (its start-up noise on a CPU machine),
    # log a real error, and worker 1 raises: as a user runs it, without
    # TF_CPP_MIN_LOG_LEVEL.
    from tfdist.engines.quiet import NoiseFilter

    def noise_in(lines):
        filters = {}  # One per task: the filter follows each process's stream.
        found = []
        for line in lines:
            task, _, text = line.partition("] ")
            if task.startswith("[worker:") and filters.setdefault(task, NoiseFilter()).is_noise(
                text
            ):
                found.append(line)
        return found

    script = str(REPO / "tests" / "workers" / "tf_start_task.py")
    env = subprocess_env(TF_CPP_MIN_LOG_LEVEL="0")
    quiet = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--log-dir",
            str(tmp_path),
            script,
            "fail",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = quiet.stdout.splitlines()
    context = quiet.stdout + quiet.stderr
    assert quiet.returncode == 1, context
    assert noise_in(lines) == [], context
    assert not any("cuInit" in line or "oneDNN" in line for line in lines), context
    # Real errors pass: an absl error line of each task, worker 1's traceback,
    # and its last lines in the launcher's report.
    # The chief's lines are all shown; worker 1 shows its error and traceback,
    # not its plain print. (Each task's stdout and stderr are two pipes, read
    # by two threads: their order against each other is the threads', so
    # only each stream's own order is asserted.)
    assert "[worker:0] task 0: 1 CPU" in lines, context
    assert "[worker:1] task 1: 1 CPU" not in lines, context
    first = next(line for line in lines if line.startswith("[worker:1]"))
    assert first == "[worker:1] ERROR:absl:a real error from task 1", context
    for index in (0, 1):
        assert f"[worker:{index}] ERROR:absl:a real error from task {index}" in lines
    assert "[worker:1] RuntimeError: task 1 fails on purpose" in lines, context
    report = lines.index("[tfdist launch] giving up: worker:1 exited with code 1. Its last lines:")
    tail = lines[report + 1 :]
    printed = ["    task 1: 1 CPU"]
    logged = [
        "    ERROR:absl:a real error from task 1",
        "    Traceback (most recent call last):",
        f'      File "{script}", line 20, in <module>',
        '        raise RuntimeError("task 1 fails on purpose")',
        "    RuntimeError: task 1 fails on purpose",
    ]
    assert sorted(tail) == sorted(printed + logged), context
    assert [line for line in tail if line in printed] == printed, context
    assert [line for line in tail if line in logged] == logged, context
    # The log files have everything, the noise included.
    for name in ("worker-0.log", "worker-1.log"):
        log = (tmp_path / "attempt-0" / name).read_text().splitlines()
        assert any("cuInit" in line for line in log), log
        assert any(
            line.startswith("WARNING: All log messages before absl::Init") for line in log
        ), log
    # --verbose shows the noise too, on every task's lines.
    verbose = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2",
            "--verbose",
            "--show-all",
            script,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = verbose.stdout.splitlines()
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    shown = noise_in(lines)
    for index in (0, 1):
        assert any(
            line.startswith(f"[worker:{index}] E0000") and "cuInit" in line for line in shown
        ), verbose.stdout
        assert f"[worker:{index}] task {index}: 1 CPU" in lines


def test_the_cli_runs_a_module_or_code_as_python_does():
    # `tfdist launch -m MODULE ARGS` / `-c CODE ARGS`: the arguments after
    # them are the task's, launcher options included.
    code = "import json, os, sys; print(json.loads(os.environ['TF_CONFIG'])['task'], sys.argv)"
    for words, shown in (
        (
            ["-c", code, "--workers", "3"],
            "[worker:1] {'type': 'worker', 'index': 1} ['-c', '--workers', '3']",
        ),
        (["-m", "json.tool", "--help"], "[worker:1] usage: python -m json.tool"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "tfdist", "launch", "--workers", "2", "--show-all", *words],
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert any(line.startswith(shown) for line in done.stdout.splitlines()), done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "-m"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "field 'script': expected '-m MODULE'. Received: '-m'" in done.stderr
