"""The MPI transport (tfdist.transport.mpi): options, timeouts, and real
``mpiexec`` jobs whose fits over MPI equal the same fits over TensorFlow's
collectives."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, result_line, subprocess_env
from tfdist.errors import ConfigError

JOB = REPO / "tests" / "workers" / "mpi_job.py"
HAS_MPI = importlib.util.find_spec("mpi4py") is not None


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not HAS_MPI or found is None:
        message = "needs mpi4py and mpiexec (pip install 'tfdist[mpi]')"
        if os.environ.get("TFDIST_REQUIRE_TOOLS"):
            pytest.fail(message + " (TFDIST_REQUIRE_TOOLS=1 requires it)", pytrace=False)
        pytest.skip(message)
    return found


def _run_job(ranks: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [_mpiexec(), "-n", str(ranks), sys.executable, str(JOB), *args]
    return subprocess.run(
        command,
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "options,field,received",
    [
        ({"transport": "gloo"}, "transport", "'gloo'"),
        ({"transport": "mpi", "strategy": "mirrored"}, "transport", "strategy='mirrored'"),
        ({"transport": "mpi", "compression": "auto"}, "compression", "'auto'"),
    ],
)
def test_bad_settings_name_the_field(options, field, received):
    import tfdist

    with pytest.raises(ConfigError) as caught:
        tfdist.strategy_from_config(**options)
    assert caught.value.field == field
    assert f"Received: {received}" in str(caught.value)


def test_a_single_rank_without_tf_config_is_refused():
    _mpiexec()
    code = (
        "import tfdist\n"
        "try:\n"
        "    tfdist.strategy_from_config(transport='mpi')\n"
        "except tfdist.ConfigError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "refused: " in out.stdout, out.stderr[-2000:]
    assert "field 'transport'" in out.stdout
    assert "an MPI world of 1 rank and no TF_CONFIG" in out.stdout


def test_a_collective_that_does_not_finish_fails_within_the_timeout_and_stays_failed():
    from tfdist.transport.mpi import TransportError, _Caller

    caller = _Caller(0.3)
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"did not finish within collective_timeout=0.3 s"):
        caller.call(lambda: time.sleep(3), "MPI_Allreduce of 4 bytes")
    assert time.monotonic() - start < 2
    with pytest.raises(TransportError, match="was not started: an earlier collective failed"):
        caller.call(lambda: 1, "MPI_Allreduce of 8 bytes")
    failing = _Caller(5)

    def fail():
        raise RuntimeError("connection reset by peer")

    with pytest.raises(TransportError, match="failed: connection reset by peer"):
        failing.call(fail, "MPI_Allgather of 2 bytes")
    assert "connection reset" in failing.broken


def _dense_params() -> int:
    # The job's model: Dense(24 -> 32) and Dense(32 -> 2) beside a 40 x 8 Embedding.
    return 24 * 32 + 32 + 32 * 2 + 2


@pytest.mark.slow
@pytest.mark.parametrize("ranks,settings", [(2, ("none", "bf16", "powersgd:2")), (4, ("none",))])
def test_fit_over_mpi_equals_the_fit_over_tf_collectives(ranks, settings):
    out = _run_job(ranks, "compare", *settings, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = result_line(out.stdout)
    steps = 2 * 6
    for setting in settings:
        r = result[setting]
        assert r["changed"] > 1e-3, r  # Training moved the weights.
        assert r["max_diff"] < 1e-6, (setting, r)
        assert r["loss_mpi"] == pytest.approx(r["loss_tf"], rel=1e-6, abs=1e-7)
        assert "transport: mpi (MPICH" in r["describe"] or "transport: mpi (" in r["describe"]
        # The Embedding's sparse gradient went through MPI_Allgatherv
        # (values and indices each step).
        assert r["calls"]["allgatherv"] == 2 * steps, r
    none = result["none"]
    # One MPI_Allreduce per dense gradient (2 kernels, 2 biases) per step.
    assert none["calls"]["allreduce"] == steps * 4
    assert none["sent"]["allreduce"] == steps * 4 * _dense_params()
    if "bf16" in result:
        # MPI has no 16-bit sum: the bf16 payloads are gathered, at 2 bytes each.
        assert result["bf16"]["calls"] == {
            "allreduce": 0,
            "allgather": steps,
            "allgatherv": 2 * steps,
        }
        assert result["bf16"]["sent"]["allgather"] == steps * 2 * _dense_params()
    if "powersgd:2" in result:
        assert result["powersgd:2"]["calls"]["allreduce"] > steps


@pytest.mark.slow
def test_a_dead_rank_ends_the_job():
    start = time.monotonic()
    out = _run_job(2, "die", timeout=180)
    elapsed = time.monotonic() - start
    text = out.stdout + out.stderr
    assert "rank 1 dies" in text, text[-3000:]
    # mpiexec saw rank 1 exit with 3 and ended the job, rank 0 included,
    # with that exit code.
    assert out.returncode == 3, text[-3000:]
    assert "rank 0 finished" not in text
    assert elapsed < 120, elapsed


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_collective_timeout():
    start = time.monotonic()
    out = _run_job(2, "hang", timeout=180)
    elapsed = time.monotonic() - start
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "rank 1 stops itself" in text
    assert "collective_timeout=5" in text, text[-3000:]
    assert "rank 0 finished" not in text
    # The job ended: mpiexec returned (it waits for every rank), with the
    # stopped rank killed by MPI_Abort of the failed one, or by mpiexec.
    assert elapsed < 120, elapsed


def rank_results(stdout: str) -> dict[int, dict]:
    """Each rank's ``rank R result: {...}`` line of mpi_job.py's ``plain`` mode, by rank."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("rank ") and " result: " in line:
            result = json.loads(line.split(" result: ", 1)[1])
            found[result["rank"]] = result
    return found


def _launch_command(*args: str) -> list[str]:
    """``tfdist launch --transport mpi --workers 2 ARGS``."""
    return [sys.executable, "-m", "tfdist", "launch", "--transport", "mpi", "--workers", "2", *args]


@pytest.mark.slow
def test_tfdist_launch_starts_the_ranks_with_mpiexec():
    _mpiexec()
    out = subprocess.run(
        _launch_command(str(JOB), "plain"),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = rank_results(out.stdout)
    assert sorted(ranks) == [0, 1], out.stdout[-3000:]
    for r in ranks.values():
        assert r["replicas"] == 2
        assert r["allreduce_calls"] == 2 * 6 * 4  # Every step's 4 dense gradients, over MPI.
        assert r["attempt"] == "0"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


@pytest.mark.parametrize(
    "flags,field",
    [(["--ps", "1"], "ps"), (["--workers", "1:3"], "workers"), (["--chief"], "chief")],
)
def test_tfdist_launch_refuses_what_mpi_jobs_do_not_have(flags, field, capsys):
    from tfdist.cli.commands import main

    assert main(["launch", "--transport", "mpi", *flags, "train.py"]) == 2
    error = capsys.readouterr().err
    assert f"field '{field}'" in error
    assert "--transport mpi" in error


@pytest.mark.slow
def test_tfdist_launch_passes_sigterm_on_and_leaves_no_rank_behind(tmp_path):
    _mpiexec()
    # Ranks that ignore SIGTERM, so only the kill after --grace ends them;
    # each writes its PID once the signal is ignored.
    script = tmp_path / "stubborn.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open(os.path.join({str(tmp_path)!r}, f'rank.{{os.getpid()}}'), 'w').close()\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen(
        _launch_command("--grace", "2", str(script)),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def pids() -> list[int]:
        return [int(f.name.split(".")[1]) for f in tmp_path.glob("rank.*")]

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"

    try:
        deadline = time.monotonic() + 60
        while len(pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids()) == 2, "the ranks did not start"
        start = time.monotonic()
        launcher.send_signal(15)
        launcher.wait(timeout=60)
        assert time.monotonic() - start < 30
        time.sleep(1)
        assert [pid for pid in pids() if alive(pid)] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids():  # Only this test's ranks, which wrote their PIDs.
            if alive(pid):
                os.kill(pid, 9)
