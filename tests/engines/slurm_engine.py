"""A real single-node Slurm cluster on 127.0.0.1, for the Slurm engine tests.

:func:`start_cluster` runs Debian's ``slurmctld`` and ``slurmd`` (package
``slurm-wlm``) by hand, as root, with ``AuthType=auth/none``, fresh state
directories and free ports, and waits until the node is idle.
:meth:`SlurmCluster.stop` cancels what is still queued, shuts the daemons
down with ``scontrol shutdown`` and waits for the PIDs in their pid files;
if one lingers, it kills that PID (and only the daemons it started).

Every call to Slurm has a time limit. When a call fails or runs out of time,
:class:`SlurmCluster` raises an AssertionError that carries the call's output
and the tails of the slurmctld and slurmd logs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env
from tfdist.engines.net import free_ports

#: The daemons the fixture starts; clients are found next to them on PATH.
DAEMONS = ("slurmctld", "slurmd")
#: Slurm's client commands the tests call.
CLIENTS = ("srun", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
INSTALL_HINT = "install Debian's Slurm as root: apt-get install -y slurm-wlm (.ci/run does this)"
#: Job states after which a job does not run again.
FINAL_STATES = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)

_CONF = """\
ClusterName=tfdisttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/d
SlurmctldPidFile={root}/ctld.pid
SlurmdPidFile={root}/d.pid
SlurmctldLogFile={root}/ctld.log
SlurmdLogFile={root}/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName=localhost NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""  # noqa: E501 - slurm.conf takes one node per line


def require_slurm() -> None:
    """Skips the calling test when Slurm is not installed (fails in CI).

    With ``TFDIST_REQUIRE_ENGINES=1`` (set by ``.ci/run``) a missing Slurm
    fails the test instead, so that CI cannot pass without running it.
    """
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if not missing:
        if os.geteuid() == 0:
            return
        message = (
            "the Slurm engine tests run slurmctld and slurmd as root "
            f"(SlurmUser=root); running as uid {os.geteuid()}"
        )
    else:
        message = f"Slurm is not installed (missing {', '.join(missing)}); {INSTALL_HINT}"
    if os.environ.get("TFDIST_REQUIRE_ENGINES") == "1":
        pytest.fail(message + " (TFDIST_REQUIRE_ENGINES=1 requires it)", pytrace=False)
    pytest.skip(message)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        return f"({error})"
    return text[-chars:] if text else "(empty)"


def _pid_alive(pid: int) -> bool:
    """Whether PID runs (a zombie, waiting for its parent to reap it, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@dataclasses.dataclass
class SlurmCluster:
    """A running single-node Slurm cluster that the tests started.

    Attributes:
        root: Directory of the configuration, state, logs and pid files.
        conf: The ``slurm.conf``; clients find it through ``SLURM_CONF``.
        ports: The daemons' ports: ``{"slurmctld": p1, "slurmd": p2}``.
        pids: The daemons' PIDs, from their pid files, once they run.
    """

    root: Path
    conf: Path
    ports: dict[str, int]
    pids: dict[str, int] = dataclasses.field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client: the repo importable, ``SLURM_CONF`` set."""
        env = subprocess_env(**extra)
        # Nothing from an outer Slurm job (CI may run inside one) or an outer
        # port choice may reach this cluster's clients.
        for name in list(env):
            if name not in extra and (
                name.startswith("SLURM_")
                or name in ("TFDIST_SLURM_PORT_BASE", "CUDA_VISIBLE_DEVICES")
            ):
                del env[name]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def logs(self) -> str:
        """The tails of both daemons' logs, for failure messages."""
        return (
            f"--- slurmctld log ({self.root / 'ctld.log'}):\n{_tail(self.root / 'ctld.log')}\n"
            f"--- slurmd log ({self.root / 'd.log'}):\n{_tail(self.root / 'd.log')}"
        )

    def failure(self, what: str, *, code: int | None = None, out: str = "", err: str = "") -> str:
        """A failure message: what went wrong, the output, the daemons' logs."""
        return (
            f"{what} (exit code {code})\n--- stdout:\n{out[-6000:]}\n"
            f"--- stderr:\n{err[-6000:]}\n{self.logs()}"
        )

    def run(
        self, args: Sequence[str], *, timeout: float, check: bool = True, **extra_env: str
    ) -> subprocess.CompletedProcess:
        """Runs a Slurm client command (``srun``, ``sinfo``...) to completion.

        Args:
            args: The command and its arguments.
            timeout: Seconds the command may take. When it runs out, the
                command is interrupted, this cluster's jobs are cancelled,
                and an AssertionError with the output and logs is raised.
            check: Raise an AssertionError when the exit code is not 0.
            **extra_env: Extra environment variables.

        Returns:
            The finished process, with text stdout and stderr.
        """
        started = time.monotonic()
        proc = subprocess.Popen(
            list(args),
            cwd=REPO,
            env=self.env(**extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = self._interrupt(proc)
            raise AssertionError(
                self.failure(
                    f"{' '.join(args)!r} did not finish within {timeout:.0f} s; "
                    "its jobs were cancelled",
                    code=proc.returncode,
                    out=out,
                    err=err,
                )
            ) from None
        result = subprocess.CompletedProcess(list(args), proc.returncode, out, err)
        result.seconds = time.monotonic() - started  # type: ignore[attr-defined]
        if check and proc.returncode != 0:
            raise AssertionError(
                self.failure(
                    f"{' '.join(args)!r} failed: expected exit code 0",
                    code=proc.returncode,
                    out=out,
                    err=err,
                )
            )
        return result

    def _interrupt(self, proc: subprocess.Popen) -> tuple[str, str]:
        """Stops a client that ran out of time, and every job of this cluster."""
        # srun forwards SIGTERM to its tasks and ends the step.
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # The group that Popen started.
            out, err = proc.communicate()
        self.cancel_all()
        return out, err

    def job_ids(self) -> list[str]:
        """The ids of this cluster's jobs that squeue still lists."""
        result = self.run(["squeue", "-h", "-o", "%i"], timeout=20)
        return result.stdout.split()

    def cancel_all(self, wait: float = 30) -> None:
        """Cancels this cluster's jobs and waits until squeue lists none."""
        deadline = time.monotonic() + wait
        jobs = self.job_ids()
        if jobs:
            self.run(["scancel", *jobs], timeout=20, check=False)
        while jobs and time.monotonic() < deadline:
            time.sleep(0.5)
            jobs = self.job_ids()

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of one job, as a dict of its fields."""
        result = self.run(["scontrol", "show", "job", "-o", job_id], timeout=20)
        fields = {}
        for item in result.stdout.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, *, timeout: float, output: Path) -> dict[str, str]:
        """Waits until a batch job ends; cancels it and fails if it does not.

        Args:
            job_id: The id ``sbatch --parsable`` printed.
            timeout: Seconds the job may take.
            output: The job's output file, shown when it runs out of time.

        Returns:
            The job's fields from ``scontrol show job``.
        """
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_state(job_id)
            if fields.get("JobState") in FINAL_STATES:
                return fields
            if time.monotonic() > deadline:
                self.cancel_all()
                raise AssertionError(
                    self.failure(
                        f"batch job {job_id} did not end within {timeout:.0f} s "
                        f"(state {fields.get('JobState')}); it was cancelled",
                        out=_tail(output, 6000),
                    )
                )
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> list[str]:
        """Cancels jobs, shuts the daemons down and waits for their PIDs.

        A daemon still running after ``timeout`` seconds is killed by PID,
        if that PID still runs this cluster's daemon.

        Returns:
            Notes on what had to be forced (empty when the stop was clean).
        """
        notes = []
        # Also without pid files: a daemon may run without having written one.
        if not self.pids or any(_pid_alive(pid) for pid in self.pids.values()):
            try:
                self.cancel_all()
                self.run(["scontrol", "shutdown"], timeout=20)
            except AssertionError as error:
                notes.append(f"clean shutdown failed: {error}")
        deadline = time.monotonic() + timeout
        while any(_pid_alive(pid) for pid in self.pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for name, pid in self.pids.items():
            if _pid_alive(pid) and str(self.conf) in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
                notes.append(
                    f"{name} (pid {pid}) outlived 'scontrol shutdown' "
                    f"by {timeout:.0f} s and was killed"
                )
        return notes


def _wait_for_pid_file(path: Path, deadline: float) -> int | None:
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            time.sleep(0.1)
    return None


def start_cluster(root: Path, *, cpus: int = 2, timeout: float = 60) -> SlurmCluster:
    """Starts slurmctld and slurmd under ``root`` and waits until the node is idle.

    Args:
        root: An empty directory for the configuration, state and logs.
        cpus: CPUs the node offers (the tasks of a step share them).
        timeout: Seconds the daemons have to start and the node to be idle.

    Returns:
        The running cluster. The caller must call :meth:`SlurmCluster.stop`.
    """
    require_slurm()
    (root / "ctld").mkdir(parents=True)
    (root / "d").mkdir()
    ctld_port, slurmd_port = free_ports(2)
    conf = root / "slurm.conf"
    conf.write_text(
        _CONF.format(
            root=root,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            hostname=socket.gethostname(),
            cpus=cpus,
        )
    )
    cluster = SlurmCluster(root, conf, {"slurmctld": ctld_port, "slurmd": slurmd_port})
    deadline = time.monotonic() + timeout
    try:
        # Both daemons fork into the background and write their pid files.
        cluster.run(["slurmctld", "-f", str(conf), "-i"], timeout=timeout)
        pid = _wait_for_pid_file(root / "ctld.pid", deadline)
        if pid is not None:
            cluster.pids["slurmctld"] = pid
        cluster.run(["slurmd", "-f", str(conf), "-N", "localhost"], timeout=timeout)
        pid = _wait_for_pid_file(root / "d.pid", deadline)
        if pid is not None:
            cluster.pids["slurmd"] = pid
        state = ""
        while time.monotonic() < deadline:
            state = cluster.run(["sinfo", "-h", "-o", "%t"], timeout=20, check=False).stdout.strip()
            if state == "idle" and len(cluster.pids) == 2:
                return cluster
            time.sleep(0.2)
        raise AssertionError(
            cluster.failure(
                f"Slurm did not start within {timeout:.0f} s: expected sinfo to print "
                f"'idle' and pid files for both daemons; got state {state!r}, "
                f"pids {cluster.pids}"
            )
        )
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """One running Slurm cluster for the module; stopped cleanly at the end."""
    require_slurm()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        notes = cluster.stop()
    assert not notes, "the Slurm daemons did not stop cleanly:\n" + "\n".join(notes)
