"""``tfdist launch --transport mpi``: the job's workers started by ``mpiexec``.

MPI joins only processes that its own launcher started (MPICH's singletons
cannot connect to each other), so with ``--transport mpi`` the launcher runs
``mpiexec -n N python SCRIPT ARGS`` instead of starting the tasks itself.
Each rank finds ``TFDIST_TRANSPORT=mpi`` and no TF_CONFIG, and
``strategy_from_config()`` agrees on one over MPI
(:func:`tfdist.transport.tf_config_from_mpi`).

What stays as in ``tfdist launch``: ``--max-restarts`` (the whole job runs
again), SIGTERM/SIGINT passed on to every rank (each runs in ``mpiexec``'s
process group, which gets the signal), ``--grace`` seconds before SIGKILL,
``TFDIST_LAUNCH_ATTEMPT`` and ``TFDIST_JOB_DIR``. What does not apply, and is
refused: elastic sizes, parameter servers, a chief or evaluator task, and a
spec's ports (MPI ranks are all workers).

This module does not import TensorFlow or MPI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tfdist.engines import forwarding
from tfdist.errors import ConfigError, require_int

__all__ = ["find_mpiexec", "launch_mpi"]

_SOURCE = "tfdist launch"


def find_mpiexec(python: str = sys.executable) -> str:
    """The ``mpiexec`` beside ``python`` (MPICH's wheel puts it there), or on PATH.

    Raises:
        ConfigError: None is found. Field ``'transport'``.
    """
    found = shutil.which("mpiexec", path=str(Path(python).parent)) or shutil.which("mpiexec")
    if found is None:
        raise ConfigError(
            "transport",
            "mpi",
            "an MPI launcher (mpiexec) beside Python or on PATH",
            received="no mpiexec found",
            source=_SOURCE,
            hint="pip install 'tfdist[mpi]' installs mpi4py and MPICH, whose mpiexec lands "
            "beside Python.",
        )
    return found


def launch_mpi(
    script: Sequence[str],
    args: Sequence[str] = (),
    *,
    workers: int,
    max_restarts: int = 0,
    grace: float = 30.0,
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
    mpiexec: str | None = None,
) -> int:
    """Runs ``python SCRIPT ARGS`` as ``workers`` MPI ranks; returns the exit code.

    Args:
        script: ``[path]``, ``["-m", module]`` or ``["-c", code]``.
        args: The script's arguments.
        workers: The number of ranks (at least 2).
        max_restarts: Runs of the whole job again after a failed one.
        grace: Seconds the ranks get after a passed-on SIGTERM/SIGINT.
        env: Extra environment for the ranks.
        python: The interpreter of the ranks.
        mpiexec: The MPI launcher (default: :func:`find_mpiexec`).

    Raises:
        ConfigError: A bad count, or no ``mpiexec``.
    """
    require_int("workers", workers, 2, _SOURCE)
    require_int("max_restarts", max_restarts, 0, _SOURCE)
    mpiexec = mpiexec or find_mpiexec(python)
    command = [mpiexec, "-n", str(workers), python, *script, *args]
    job_dir = tempfile.mkdtemp(prefix="tfdist-job-")
    base = dict(os.environ)
    base.pop("TF_CONFIG", None)  # The ranks agree on theirs over MPI.
    base.update(env or {}, TFDIST_TRANSPORT="mpi", TFDIST_JOB_DIR=job_dir)
    code = 1
    try:
        for attempt in range(max_restarts + 1):
            code = _run_once(command, dict(base, TFDIST_LAUNCH_ATTEMPT=str(attempt)), grace)
            if code == 0:
                break
            if attempt < max_restarts:
                print(
                    f"tfdist launch: the MPI job exited with {code}; restart "
                    f"{attempt + 1} of {max_restarts}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return code


def _run_once(command: list[str], env: dict, grace: float) -> int:
    # Its own session: one killpg reaches mpiexec, its proxies and the ranks.
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    deadline: list[float] = []  # Set by the first passed-on signal.

    def start_grace(signum: int) -> None:
        if not deadline:
            deadline.append(time.monotonic() + grace)

    try:
        with forwarding.passing_on(proc.pid, (signal.SIGTERM, signal.SIGINT), start_grace):
            while True:
                try:
                    return proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    if deadline and time.monotonic() > deadline[0]:
                        # The grace period after a passed-on signal is over.
                        _kill_tree(proc.pid)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()


def _kill_tree(pid: int) -> None:
    """SIGKILLs ``pid`` and every process below it.

    Hydra's proxies and the ranks run in process groups of their own, so a
    killpg of mpiexec's group would leave them running; they are found
    through their parents in /proc.
    """
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # Gone meanwhile.
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
