"""Interleaved arms, worker jobs and the Mirrored subprocess.

Shared by the benchmarks that compare two arms (``overhead.py``: tfdist
against TensorFlow; ``xla.py``: XLA against none) on 2 logical CPUs and on
2 worker processes on 127.0.0.1, and by those whose workers each print one
``tfdist result:`` line (``keras_distribution.py``, ``preset_memory.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def pair_order(arms: Sequence[str], i: int) -> tuple[str, ...]:
    """Which arm runs first in pair ``i``: ABBA order cancels a first-run effect."""
    return tuple(arms) if i % 2 == 0 else tuple(arms)[::-1]


def worker_job(
    script: str,
    args: Sequence[str],
    work_dir: Path,
    prefix: str,
    timeout: float = 600,
    every: bool = False,
) -> tuple[list[int], Any, list[str]]:
    """Runs ``script --mode=worker ARGS --out=...`` as a 2-worker job on 127.0.0.1.

    Each worker gets its own TF_CONFIG and writes its step times (JSON) to
    its ``--out`` file. Only the processes started here are stopped.

    Returns:
        The exit codes, worker 0's step times (None if it wrote none; with
        ``every``, each worker's JSON, or None) and each worker's whole log.
    """
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs, outs, logs = [], [], []
    for rank, (_, _, config) in enumerate(spec_lib.all_task_configs(local_spec(2))):
        out = work_dir / f".{prefix}_worker{rank}.json"
        log = work_dir / f".{prefix}_worker{rank}.log"
        outs.append(out)
        logs.append(log)
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps(config),
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        with open(log, "w") as stream:
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, "--mode=worker", *args, f"--out={out}"],
                    env=env,
                    stdout=stream,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    written = [json.loads(out.read_text()) if out.exists() else None for out in outs]
    times = written if every else written[0]
    for path in outs + logs:
        path.unlink(missing_ok=True)
    return codes, times, texts


def mirrored_rows(script: str, args: Sequence[str], results_dir: Path, name: str) -> list[dict]:
    """Runs ``script --mode=mirrored ARGS`` in a subprocess; returns its rows.

    Logical devices are fixed once TensorFlow starts, and the workers mode
    needs none: the Mirrored half of a benchmark runs in a process of its own.
    """
    hidden = f".{name}_mirrored"
    subprocess.run(
        [
            sys.executable,
            script,
            "--mode=mirrored",
            *args,
            f"--results_dir={results_dir}",
            f"--name={hidden}",
        ],
        check=True,
    )
    rows = json.loads((results_dir / f"{hidden}.json").read_text())["rows"]
    for suffix in (".json", ".md"):
        (results_dir / f"{hidden}{suffix}").unlink()
    return rows


RESULT = "tfdist result: "


def outcome_job(
    command: Sequence[str],
    workers: int,
    *,
    env: Mapping[str, str] | None = None,
    path: Sequence[str] = (),
    cwd: Path = REPO,
    timeout: float = 900,
    limit_bytes: int | None = None,
    tag: str = "job",
) -> list[dict]:
    """Runs ``python COMMAND`` as every worker of a job on 127.0.0.1; a
    failure is an outcome, not an error.

    Each worker gets its own TF_CONFIG, ``env`` and ``path`` (before the
    repository) on its PYTHONPATH; its output goes to a file, so that a
    worker that prints much cannot block on a full pipe while another is
    waited for. With ``limit_bytes``, each worker runs in a memory cgroup of
    its own with that limit (:mod:`benchlib.cgroups`). A worker still running
    ``timeout`` seconds after the start (one whose peer died, waiting in a
    collective) is killed. Only the processes started here are stopped.

    Returns:
        Per worker, by rank: ``returncode``, ``result`` (its last ``tfdist
        result:`` line, parsed, or None), ``stderr_tail``, ``timed_out``
        and, under a limit, ``memory`` (:func:`benchlib.cgroups.usage`).
    """
    import time

    from benchlib import cgroups
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs, groups = [], []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for rank, (_, _, config) in enumerate(spec_lib.all_task_configs(local_spec(workers))):
                full_env = dict(
                    os.environ,
                    TF_CONFIG=json.dumps(config),
                    TF_CPP_MIN_LOG_LEVEL="2",
                    PYTHONPATH=os.pathsep.join(
                        [*path, str(REPO), os.environ.get("PYTHONPATH", "")]
                    ),
                    **(env or {}),
                )
                group = None
                if limit_bytes is not None:
                    group = cgroups.make(f"tfdist_{tag}_{os.getpid()}_{rank}", limit_bytes)
                groups.append(group)
                out, err = (Path(scratch) / f"{rank}.{kind}" for kind in ("out", "err"))
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(
                        (
                            subprocess.Popen(
                                cgroups.joined(group, [sys.executable, *command]),
                                cwd=cwd,
                                env=full_env,
                                stdout=stdout,
                                stderr=stderr,
                                text=True,
                            ),
                            out,
                            err,
                        )
                    )
            deadline = time.monotonic() + timeout
            outcomes = []
            for (proc, out, err), group in zip(procs, groups):
                timed_out = False
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code, timed_out = proc.wait(), True
                lines = [t for t in out.read_text().splitlines() if t.startswith(RESULT)]
                outcomes.append(
                    {
                        "returncode": code,
                        "timed_out": timed_out,
                        "result": json.loads(lines[-1][len(RESULT) :]) if lines else None,
                        "stderr_tail": err.read_text(errors="replace")[-3000:],
                        **({"memory": cgroups.usage(group)} if group is not None else {}),
                    }
                )
            return outcomes
        finally:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for group in groups:
                if group is not None:
                    cgroups.remove(group)


def result_job(
    command: Sequence[str],
    workers: int,
    *,
    env: Mapping[str, str] | None = None,
    path: Sequence[str] = (),
    cwd: Path = REPO,
    timeout: float = 900,
    what: str = "worker",
) -> list[dict]:
    """Runs ``python COMMAND`` as every worker of a job on 127.0.0.1
    (:func:`outcome_job`), each of which must succeed.

    Returns:
        Each worker's last ``tfdist result:`` line, parsed, by task.

    Raises:
        RuntimeError: A worker failed or printed no result; its stderr's end.
    """
    outcomes = outcome_job(command, workers, env=env, path=path, cwd=cwd, timeout=timeout)
    for outcome in outcomes:
        if outcome["returncode"] != 0 or outcome["result"] is None:
            raise RuntimeError(
                f"{what} failed ({outcome['returncode']}):\n{outcome['stderr_tail']}"
            )
    return sorted((o["result"] for o in outcomes), key=lambda r: r["task"])


@contextlib.contextmanager
def flocked(path: str) -> Iterator[None]:
    """Holds an exclusive flock on ``path`` (the lock flock(1) takes), so one
    measurement never shares the machine with another; ``""``: no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
