"""`tfdist launch` on preemption and in elastic jobs, with real processes and signals.

The quick tests run tests/workers/preempt_task.py, a plain-Python trainer
that follows the status-record protocol (no TensorFlow). The end-to-end
tests (marked slow) run a real 2-worker Keras fit.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tfdist
from conftest import REPO, subprocess_env
from tfdist.engines.elastic import parse_slots, parse_workers
from tfdist.engines.launch import launch

TASK = str(REPO / "tests" / "workers" / "preempt_task.py")
SAVED = re.compile(
    r"preempted: saved at step (\d+) \(epoch (\d+), batch (\d+)\); "
    r"run the same command to resume"
)


def log_of(directory: Path) -> list[tuple[int, int, str, int, int, str]]:
    """DIR/log: (attempt, size, task, start, end, how) per task run."""
    if not (directory / "log").exists():
        return []
    rows = []
    for line in (directory / "log").read_text().splitlines():
        a, n, task, start, end, how = line.split()
        rows.append((int(a), int(n), task, int(start), int(end), how))
    return rows


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Launcher:
    """`tfdist launch ...` as a real process, to send it real signals."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tfdist", "launch", *map(str, args)],
            cwd=REPO,
            env=subprocess_env(**(env or {})),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait_for(self, path_glob: Path, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(list(path_glob.parent.glob(path_glob.name))) < count:
            assert time.monotonic() < deadline, f"no {count} x {path_glob}"
            assert self.proc.poll() is None, self.proc.communicate()[0]
            time.sleep(0.05)

    def stop(self, signum=signal.SIGTERM, timeout: float = 60) -> tuple[float, str]:
        """Sends ``signum``; seconds until the launcher exited, and its output."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        return self.finish(timeout, sent)

    def finish(self, timeout: float = 60, since: float | None = None) -> tuple[float, str]:
        since = time.monotonic() if since is None else since
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return time.monotonic() - since, out


def run(*args, **kwargs):
    out = io.StringIO()
    result = launch(
        TASK, [str(a) for a in args], output=out, handle_signals=False, stop_timeout=5, **kwargs
    )
    return result, out.getvalue().splitlines()


def test_sigterm_is_passed_on_the_save_is_reported_and_the_same_command_resumes(tmp_path):
    command = ["--workers", "2", "--grace", "10", TASK, "save", tmp_path, 40, 0.1]
    job = Launcher(*command)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    while not (tmp_path / "progress").exists() or int((tmp_path / "progress").read_text()) < 5:
        time.sleep(0.05)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    [match] = [m for m in map(SAVED.search, out.splitlines()) if m]
    step = int(match.group(1))
    rows = log_of(tmp_path)
    # Both workers saved at one agreed step, the one reported; far before the end.
    assert sorted(r[2:] for r in rows) == [
        ("worker:0", 0, step, "preempted"),
        ("worker:1", 0, step, "preempted"),
    ], rows
    assert 5 <= step < 20 and (int(match.group(2)), int(match.group(3))) == divmod(step, 10)
    assert took < 5, out  # The tasks saved in ~0.1 s; no wait for the grace period.
    # The same command resumes at that step and runs to the planned 40.
    again = Launcher(*command)
    _, out = again.finish()
    assert again.proc.returncode == 0, out
    assert "all tasks finished" in out
    assert sorted(r[2:] for r in log_of(tmp_path)[2:]) == [
        ("worker:0", step, 40, "done"),
        ("worker:1", step, 40, "done"),
    ]


def test_the_preempt_signal_is_what_the_tasks_get_and_what_they_are_told(tmp_path):
    # The workers save on $TFDIST_PREEMPT_SIGNAL only: a SIGTERM passed on
    # instead would kill them unsaved ("die" mode is SIGTERM's default).
    job = Launcher("--workers", "2", "--preempt-signal", "USR1", TASK, "save", tmp_path, 1000, 0.05)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    time.sleep(0.5)
    _, out = job.stop()
    assert job.proc.returncode == 143, out
    assert SAVED.search(out), out
    assert {r[5] for r in log_of(tmp_path)} == {"preempted"}


def test_sigterm_reaches_the_tasks_through_netns(tmp_path):
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0 and os.geteuid() != 0:
        pytest.skip(f"no network namespace for this user: {probe.stderr!r}")
    job = Launcher("--netns", "--workers", "2", TASK, "save", tmp_path, 1000, 0.05)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    time.sleep(0.3)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    assert SAVED.search(out) and took < 10, out
    assert {r[5] for r in log_of(tmp_path)} == {"preempted"}


def test_tasks_that_do_not_exit_are_killed_after_the_grace_period(tmp_path):
    job = Launcher("--workers", "2", "--grace", "2", TASK, "ignore", tmp_path)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    assert "killed after the grace period, nothing saved" in out
    assert "worker:0, worker:1 still running 2 s after SIGTERM" in out
    assert 2 <= took < 5, out
    assert not any(alive(p) for p in pids)
    assert log_of(tmp_path) == []  # Nobody saved or finished.


def test_a_task_that_lost_the_first_signal_gets_it_again_and_saves(tmp_path):
    # Like a TensorFlow task still starting: the first SIGTERM is swallowed;
    # the launcher sends it again until the task saved (or the grace ends).
    job = Launcher(
        "--workers", "2", "--grace", "20", TASK, "late", tmp_path, env={"PREEMPT_LATE": "3"}
    )
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    assert SAVED.search(out), out
    assert {r[5] for r in log_of(tmp_path)} == {"preempted"}
    assert took < 10, out


def test_tasks_that_finish_within_the_grace_period_are_reported_finished(tmp_path):
    # The tasks ignore the signal but end their 20 steps within the grace.
    job = Launcher("--workers", "2", "--grace", "20", TASK, "ignore", tmp_path, 20, 0.1)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    took, out = job.stop()
    assert job.proc.returncode == 0, out
    assert "finished: every training task completed" in out
    assert took < 10, out
    assert [r[4:] for r in log_of(tmp_path)] == [(20, "done"), (20, "done")]


def test_a_second_sigterm_kills_at_once(tmp_path):
    job = Launcher("--workers", "2", "--grace", "30", TASK, "ignore", tmp_path)
    job.wait_for(tmp_path / "worker-*-0.pid", 2)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    took, out = job.stop(signal.SIGINT)
    assert time.monotonic() - sent < 5, out
    assert "SIGINT again: killing every task now" in out
    assert "killed on a second signal (SIGINT), nothing saved (worker:0, worker:1" in out
    assert job.proc.returncode == 143, out  # The first signal's code.


def test_a_preempted_worker_makes_the_job_save_and_restart_at_that_step(tmp_path):
    result, lines = run("preempt-1", tmp_path, 12, 0.2, max_restarts=1)
    assert result.ok and result.restarts == 1, lines
    rows = log_of(tmp_path)
    first = [r for r in rows if r[0] == 0]
    # Worker 1 got the signal, worker 0 saved at the same step by itself:
    # the launcher did not stop it (that would not be a save).
    [step] = {r[4] for r in first}
    assert sorted((r[2], r[5]) for r in first) == [
        ("worker:0", "preempted"),
        ("worker:1", "preempted"),
    ]
    assert step == 4
    assert (
        f"[tfdist launch] worker:1 was preempted and the job saved at step {step} "
        f"(epoch 0, batch {step}); restart 1 of 1 on new ports, resuming at step "
        f"{step} (epoch 0, batch {step})"
    ) in lines
    assert sorted(r[2:] for r in rows if r[0] == 1) == [
        ("worker:0", step, 12, "done"),
        ("worker:1", step, 12, "done"),
    ]
    assert result.attempts[0].task == "worker:1" and result.attempts[0].returncode == 143


def test_a_preempted_worker_without_restarts_left_exits_143_saying_where(tmp_path):
    result, lines = run("preempt-1", tmp_path, 12, 0.2)
    assert result.exit_code == 143 and result.outcome == "preempted", lines
    assert result.saved["step"] == 4 and result.saved["task"] == "worker:0"
    assert lines[-1] == (
        "[tfdist launch] giving up: worker:1 was preempted and the job "
        "saved at step 4 (epoch 0, batch 4); run the same command to resume"
    )


def test_elastic_a_lost_worker_shrinks_the_job_when_restarts_are_spent(tmp_path):
    result, lines = run("kill-last", tmp_path, 10, 0.1, workers="1:2")
    assert result.ok, lines
    assert result.restarts == 0 and result.workers == 1
    assert result.resizes == [(2, 1, "worker:1 was killed by SIGKILL")]
    assert (
        "[tfdist launch] worker:1 was killed by SIGKILL; restarts spent: shrinking 2 -> 1 "
        "workers (MIN 1); the job resumes from its last backup; global batch kept by "
        "the script, see docs/guide/preemption.md, 'Elastic jobs'"
    ) in lines
    rows = log_of(tmp_path)
    [killed] = [r for r in rows if r[5] == "killed"]
    # Attempt 1: one worker, from worker 0's last progress ("backup").
    [(attempt, size, task, start, end, how)] = [r for r in rows if r[0] == 1]
    assert (attempt, size, task, end, how) == (1, 1, "worker:0", 10, "done")
    assert start >= killed[4] - 1


def test_elastic_restarts_come_first_unless_worker_failed_is_shrink(tmp_path):
    for name in "abc":
        (tmp_path / name).mkdir()
    result, lines = run("kill-last", tmp_path / "a", 8, 0.1, workers="1:2", max_restarts=1)
    assert result.ok and result.restarts == 1 and result.resizes == [], lines
    assert {r[1] for r in log_of(tmp_path / "a") if r[0] == 1} == {2}
    result, lines = run(
        "kill-last", tmp_path / "b", 8, 0.1, workers=(1, 2), max_restarts=1, worker_failed="shrink"
    )
    assert result.ok and result.restarts == 0 and result.workers == 1, lines
    assert any("--worker-failed shrink: shrinking 2 -> 1 workers" in line for line in lines)
    # At MIN a failure cannot shrink: it spends a restart, then gives up.
    result, lines = run("kill-last", tmp_path / "c", 8, 0.1, workers="1:1")
    assert result.exit_code == 128 + signal.SIGKILL and result.resizes == [], lines


def discovery_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_elastic_grows_back_when_the_discovery_script_reports_room(tmp_path):
    # Two slots all along: worker 1 is lost for good (restarts spent), the job
    # shrinks to 1, then discovery's room makes it save and grow back to 2.
    work = tmp_path / "w"
    work.mkdir()
    script = discovery_script(tmp_path / "discover.sh", "echo localhost:1\necho 127.0.0.1:1\n")
    result, lines = run(
        "kill-last",
        work,
        60,
        0.1,
        workers="1:2",
        host_discovery_script=script,
        discovery_interval=1.5,
    )
    assert result.ok, lines
    assert result.restarts == 0
    assert [r[:2] for r in result.resizes] == [(2, 1), (1, 2)]
    assert result.resizes[1][2] == "discovery"
    rows = log_of(work)
    [saved] = [r for r in rows if r[0] == 1]
    assert saved[1] == 1 and saved[5] == "preempted"  # Saved on the resize signal.
    assert any(
        f"grew 1 -> 2 workers (MIN 1, MAX 2): the workers saved at step {saved[4]}" in line
        for line in lines
    ), lines
    assert sorted(r[2:] for r in rows if r[0] == 2) == [
        ("worker:0", saved[4], 60, "done"),
        ("worker:1", saved[4], 60, "done"),
    ]


def test_a_resize_that_comes_as_training_ends_is_not_a_relaunch(tmp_path):
    # The tasks ignore the resize signal and finish their steps: training is
    # complete (a real job has deleted its backup), so a relaunch at the new
    # size would train it all again from step 0.
    work = tmp_path / "w"
    work.mkdir()
    script = discovery_script(
        tmp_path / "discover.sh",
        f'if [ -f "{tmp_path}/seen" ]; then echo 2; else touch "{tmp_path}/seen"; echo 1; fi\n',
    )
    result, lines = run(
        "ignore",
        work,
        15,
        0.1,
        workers="1:2",
        host_discovery_script=script,
        discovery_interval=0.5,
        grace=10,
    )
    assert result.ok and result.outcome == "finished", lines
    assert result.resizes == [] and result.workers == 1
    assert {r[0] for r in log_of(work)} == {0}  # One attempt only.
    assert any("resize came as training ended" in line for line in lines), lines


def test_elastic_starts_at_the_discovered_size(tmp_path):
    script = discovery_script(tmp_path / "one.sh", "echo 1\n")
    result, lines = run("save", tmp_path, 3, 0.05, workers="1:3", host_discovery_script=script)
    assert result.ok and result.workers == 1, lines
    assert (
        "[tfdist launch] elastic job: 1 to 3 workers; the discovery script reports 1 "
        "slot(s): starting 1 worker(s)"
    ) in lines


@pytest.mark.parametrize("value", ["2:x", "0:2", "3:2", "0", "1:2:3", (2, 1), 1.5, True, ""])
def test_bad_worker_ranges_name_the_field_and_value(value):
    with pytest.raises(tfdist.ConfigError) as info:
        launch(TASK, workers=value, handle_signals=False)
    assert info.value.field == "workers" and repr(value) in str(info.value)


def test_worker_ranges_and_slot_lines_parse():
    assert parse_workers("1:2") == (1, 2) and parse_workers(3) == (3, 3)
    assert parse_workers((2, 4)) == (2, 4) and parse_workers(" 2 ") == (2, 2)
    assert parse_slots("3\n") == 3
    assert parse_slots("# hosts\nhost1:2\nhost2\n\nhost3:4") == 7


def test_bad_elastic_and_preemption_settings_are_refused(tmp_path):
    def refused(field, value, **kwargs):
        with pytest.raises(tfdist.ConfigError) as info:
            launch(TASK, handle_signals=False, **kwargs)
        assert info.value.field == field, info.value
        assert repr(value) in str(info.value) or str(value) in str(info.value), info.value
        return str(info.value)

    refused("grace", 0, grace=0)
    refused("grace", "30", grace="30")
    refused("preempt_signal", "SIGFOO", preempt_signal="SIGFOO")
    assert "cannot be caught" in refused("preempt_signal", "SIGKILL", preempt_signal="SIGKILL")
    refused("worker_failed", "grow", worker_failed="grow")
    refused("ps", 1, workers="1:2", ps=1, chief=True)
    refused("chief", True, workers="1:2", chief=True)
    missing = tmp_path / "nope.sh"
    assert "no such file" in refused(
        "host_discovery_script", str(missing), workers="1:2", host_discovery_script=missing
    )
    plain = tmp_path / "plain.sh"
    plain.write_text("echo 2\n")
    assert "chmod +x" in refused(
        "host_discovery_script", str(plain), workers="1:2", host_discovery_script=plain
    )
    garbage = discovery_script(tmp_path / "garbage.sh", "echo 'two hosts please'\n")
    assert "printed 'two hosts please'" in refused(
        "host_discovery_script", str(garbage), workers="1:2", host_discovery_script=garbage
    )
    failing = discovery_script(tmp_path / "fail.sh", "echo broken >&2; exit 3\n")
    assert "exited with code 3" in refused(
        "host_discovery_script", str(failing), workers="1:2", host_discovery_script=failing
    )
    assert list(tmp_path.glob("*.pid")) == []  # Nothing was started.


def test_the_cli_refuses_a_bad_worker_range_naming_it():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdist",
            "launch",
            "--workers",
            "2:x",
            TASK,
            "save",
            "/nonexistent",
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "field 'workers'" in done.stderr and "Received: '2:x'" in done.stderr


# -- end to end: a real 2-worker Keras fit under tfdist's MultiWorkerMirrored --

FIT = str(REPO / "tests" / "workers" / "preempt_launch_fit.py")
EPOCHS, BATCHES = 3, 16
PLANNED = EPOCHS * BATCHES
SAVE_FREQ = 8  # The worker's BackupAndRestore(save_freq=8).


def trained(directory: Path, task: str = "worker-0") -> list[tuple[int, int]]:
    """(attempt, global step index) of every batch ``task`` trained, in order."""
    path = directory / f"progress-{task}"
    if not path.exists():
        return []
    rows = [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
    return [(attempt, epoch * BATCHES + batch) for attempt, epoch, batch in rows]


def wait_trained(
    job: Launcher, directory: Path, task: str, count: int, timeout: float = 90
) -> None:
    """Waits until ``task`` trained ``count`` batches in all (all runs)."""
    deadline = time.monotonic() + timeout
    while len(trained(directory, task)) < count:
        assert time.monotonic() < deadline, f"{task} trained {trained(directory, task)}"
        assert job.proc.poll() is None, job.proc.communicate()[0]
        time.sleep(0.02)


def training_attempt(directory: Path, task: str) -> int:
    """The attempt that trained ``task``'s latest batch: the running one
    (a port collision at start relaunches under the next attempt number)."""
    return trained(directory, task)[-1][0]


def results(directory: Path, attempt: int) -> dict:
    import json

    return {
        p.stem.split("-", 2)[2]: json.loads(p.read_text())
        for p in directory.glob(f"result-{attempt}-*.json")
    }


@pytest.mark.slow
def test_e2e_sigterm_to_the_launcher_then_to_one_worker_resumes_at_the_saved_steps(tmp_path):
    """(a) SIGTERM to the launcher mid-epoch: it exits within the grace
    period, saved; the same command resumes there. (b) In that run, SIGTERM
    to worker 1 mid-epoch with --max-restarts 1: the job saves, restarts and
    resumes at that step by itself. In all, every planned step is trained
    exactly once: none lost, none repeated."""
    command = ["--workers", "2", "--max-restarts", "1", FIT, tmp_path]
    env = {"TFDIST_TEST_BATCH_SLEEP": "0.1"}
    # (a) Epoch 0, after batch 6 on both workers.
    job = Launcher(*command, env=env)
    wait_trained(job, tmp_path, "worker-1", 7)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    [match] = [m for m in map(SAVED.search, out.splitlines()) if m]
    first = int(match.group(1))
    assert (int(match.group(2)), int(match.group(3))) == divmod(first, BATCHES)
    assert took < 30, out  # Within --grace's default.
    run_a = [step for _, step in trained(tmp_path)]
    # Stopped at the step boundary after the signal: nothing trained past it.
    assert run_a == list(range(first)) and 7 <= first < BATCHES, (run_a, out)

    # (b) The same command: it resumes at `first`; worker 1 is preempted in epoch 1.
    done = len(trained(tmp_path, "worker-1"))
    job = Launcher(*command, env=env)
    wait_trained(job, tmp_path, "worker-1", done + (BATCHES + 5 - first))
    running = training_attempt(tmp_path, "worker-1")
    pid = int((tmp_path / f"worker-1-{running}.pid").read_text())
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    _, out = job.finish(timeout=120)
    assert job.proc.returncode == 0, out
    [line] = [line for line in out.splitlines() if "restart 1 of 1" in line]
    second = int(re.search(r"resuming at step (\d+)", line).group(1))
    assert line == (
        f"[tfdist launch] worker:1 was preempted and the job saved at step {second} "
        f"(epoch 1, batch {second - BATCHES}); restart 1 of 1 on new ports, "
        f"resuming at step {second} (epoch 1, batch {second - BATCHES})"
    ), out
    final = results(tmp_path, training_attempt(tmp_path, "worker-1"))
    assert sorted(final) == ["worker-0", "worker-1"], out
    for result in final.values():
        assert result["start_iterations"] == second and result["iterations"] == PLANNED
        assert result["resumed_from"]["preempted"] is True
    steps = [step for _, step in trained(tmp_path)]
    assert steps == list(range(PLANNED)), steps  # No step lost or repeated.
    print(
        f"\nmeasured: launcher SIGTERM -> exit {took:.1f} s, saved at step {first}; "
        f"worker SIGTERM -> resumed at step {second}; whole run "
        f"{time.monotonic() - sent:.1f} s after it"
    )


@pytest.mark.slow
def test_e2e_sigterm_before_fit_is_sent_again_until_the_watcher_saves(tmp_path):
    """SIGTERM once both workers joined the cluster but before fit: TF's
    coordination service swallows it; the launcher sends it again until the
    workers save, so the job ends within seconds, saved, not at the SIGKILL."""
    job = Launcher(
        "--workers", "2", "--grace", "30", FIT, tmp_path, env={"TFDIST_TEST_BATCH_SLEEP": "0.1"}
    )
    job.wait_for(tmp_path / "worker-*-0.ready", 2, timeout=90)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    [match] = [m for m in map(SAVED.search, out.splitlines()) if m]
    assert [s for _, s in trained(tmp_path)] == list(range(int(match.group(1))))
    assert took < 15, out
    print(
        f"\nmeasured: SIGTERM before fit -> saved at step {match.group(1)}, exit after {took:.1f} s"
    )


@pytest.mark.slow
def test_e2e_elastic_a_lost_worker_shrinks_the_job_and_returning_room_grows_it_back(tmp_path):
    """``--workers 1:2`` with a discovery script reading DIR/slots: worker 1
    is SIGKILLed and its slot goes (slots 1): the job finishes the lost
    steps on one worker from the last backup. Then slots 2: the job saves at
    one step and grows back to 2 workers, resuming there. The planned steps
    are trained once each after the backup."""
    slots = tmp_path / "slots"
    slots.write_text("2\n")
    discover = discovery_script(tmp_path / "discover.sh", f"cat {slots}\n")
    job = Launcher(
        "--workers",
        "1:2",
        "--host-discovery-script",
        discover,
        "--discovery-interval",
        "1",
        FIT,
        tmp_path,
        env={"TFDIST_TEST_BATCH_SLEEP": "0.1"},
    )
    # Epoch 1, batch 2 done: the last backup was at the end of epoch 0.
    wait_trained(job, tmp_path, "worker-1", BATCHES + 3)
    first = training_attempt(tmp_path, "worker-1")
    os.kill(int((tmp_path / f"worker-1-{first}.pid").read_text()), signal.SIGKILL)
    time.sleep(0.5)  # The launcher sees the loss (it polls every 0.05 s)...
    slots.write_text("1\n")  # ...and its host is gone.
    before = [step for attempt, step in trained(tmp_path) if attempt == first]
    wait_trained(job, tmp_path, "worker-0", len(before) + 3)  # Attempt 1 trains...
    slots.write_text("2\n")  # ...and the host is back.
    _, out = job.finish(timeout=120)
    assert job.proc.returncode == 0, out
    lines = out.splitlines()
    assert (
        "[tfdist launch] worker:1 was killed by SIGKILL; restarts spent: shrinking 2 -> 1 "
        "workers (MIN 1); the job resumes from its last backup; global batch kept by "
        "the script, see docs/guide/preemption.md, 'Elastic jobs'"
    ) in lines, out
    [grew] = [line for line in lines if "grew 1 -> 2 workers" in line]
    saved = int(re.search(r"the workers saved at step (\d+)", grew).group(1))
    assert grew == (
        f"[tfdist launch] grew 1 -> 2 workers (MIN 1, MAX 2): the workers saved at "
        f"step {saved} (epoch {saved // BATCHES}, batch {saved % BATCHES}); "
        "relaunching at the new size (not counted as a restart)"
    ), out
    backup = (max(before) + 1) // SAVE_FREQ * SAVE_FREQ  # The last save_freq boundary.
    steps = trained(tmp_path)
    # The attempts that trained, in order (a port collision at a start adds
    # an attempt number that trains nothing): 2 workers, 1, then 2 again.
    attempts = sorted({a for a, _ in steps})
    assert attempts[0] == first and len(attempts) == 3, steps
    shrunk, grown = attempts[1:]
    # On one worker from the backup to the save, then on two to the end.
    assert [s for a, s in steps if a == shrunk] == list(range(backup, saved)), steps
    assert [s for a, s in steps if a == grown] == list(range(saved, PLANNED)), steps
    assert trained(tmp_path, "worker-1")[-1][0] == grown  # Worker 1 sat out the shrunk run.
    assert all(a != shrunk for a, _ in trained(tmp_path, "worker-1"))
    final = results(tmp_path, grown)
    assert sorted(final) == ["worker-0", "worker-1"], out
    for result in final.values():
        assert result["size"] == 2 and result["iterations"] == PLANNED, result
        assert result["start_iterations"] == saved == result["resumed_from"]["global_step"]
    print(
        f"\nmeasured: elastic 2 -> 1 after a SIGKILL lost {max(before) + 1 - backup} "
        f"step(s) (back to the last backup); 1 -> 2 on discovery lost none (saved at "
        f"{saved}, resumed at {saved})"
    )


def _answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_parameter_server_job_signals_the_chief_first_and_stops_the_servers_after(tmp_path):
    # ps and worker tasks are TensorFlow servers; the chief is the plain
    # trainer. It saves 2 s after the signal, checking that the servers still
    # answer then; once it exited they are stopped.
    import json

    job = Launcher(
        "--chief",
        "--workers",
        "1",
        "--ps",
        "1",
        TASK,
        "save",
        tmp_path,
        env={"PREEMPT_SAVE_DELAY": "2"},
    )
    job.wait_for(tmp_path / "cluster-0.json", 1)
    addresses = [
        a
        for job_name in ("ps", "worker")
        for a in json.loads((tmp_path / "cluster-0.json").read_text())[job_name]
    ]
    deadline = time.monotonic() + 60
    while not all(map(_answers, addresses)):
        assert time.monotonic() < deadline, "the servers never answered"
        time.sleep(0.2)
    took, out = job.stop()
    assert job.proc.returncode == 143, out
    [(task, how)] = [(r[2], r[5]) for r in log_of(tmp_path)]
    assert (task, how) == ("chief:0", "preempted"), out
    assert SAVED.search(out) and 2 <= took < 10, out
    assert not any(map(_answers, addresses))
