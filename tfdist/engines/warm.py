"""A warm pool: Python processes that start with TensorFlow already imported.

Importing TensorFlow, Keras and tfdist costs about 3.7 s of CPU in every
process, and a job of 2-4 local workers pays it in each. A warm pool pays it
once: its server process (:mod:`tfdist.engines.worker.warm_server`) imports
TensorFlow and Keras (no TensorFlow runtime starts: no device, no eager
context) and then forks one process per job, which runs
the job's script as ``python`` would, from a copy of that clean state::

    with warm.WarmPool() as pool:
        subprocess.run([pool.python, "train.py"], env={**os.environ, **pool.env})

``pool.python`` is an executable (:mod:`tfdist.engines.worker.warm_client`) that any
launcher can run in place of the interpreter; ``tfdist launch`` and
:func:`tfdist.local_cluster` use it by themselves when ``TFDIST_WARM_POOL``
names a pool (:func:`interpreter`). Every job is a fresh fork, so no job
sees another's state (TensorFlow's collectives included); a job that
crashes or hangs ends only its own process, and a pool whose server died is
started again by :meth:`WarmPool.ensure`. The same idea as TensorFlow's
``multi_process_runner.MultiProcessPoolRunner``, for scripts run as users
run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tfdist.engines.worker import warm_server
from tfdist.engines.worker.warm_server import IMPORT_TIME_PREFIXES, import_time_env

__all__ = ["ENV", "IMPORT_TIME_PREFIXES", "PRELOAD", "WarmPool", "import_time_env", "interpreter"]

#: The variable naming a pool's directory (its ``socket`` and ``python``).
ENV = "TFDIST_WARM_POOL"

#: What the server imports before it forks.
#: Not tfdist: what it does at import depends on whether Keras was imported
#: before it, and a job imports them in its own order.
PRELOAD = ("tensorflow", "keras")


def interpreter(env: dict | None = None) -> str:
    """The interpreter a launcher runs tasks with: the pool's ``python`` when
    ``env`` (default: this process's) names a pool, else this one."""
    pool = (os.environ if env is None else env).get(ENV, "")
    client = Path(pool, "python") if pool else None
    if client is not None and os.access(client, os.X_OK):
        return str(client)
    return sys.executable


class WarmPool:
    """A warm pool's server process and directory.

    Args:
        env: The server's environment (what a job must match to be forked;
            default: this process's). Jobs get their own environment.
        preload: Modules the server imports before it forks.
        directory: Where the socket and the ``python`` executable go
            (default: a new temporary directory, removed by :meth:`close`).
    """

    def __init__(
        self,
        env: dict | None = None,
        preload: tuple[str, ...] = PRELOAD,
        directory: str | os.PathLike | None = None,
    ) -> None:
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="tfdist-warm-"))
        self._env = dict(os.environ if env is None else env)
        self._preload = tuple(preload)
        self._log = self.directory / "server.log"
        client = (Path(__file__).parent / "worker" / "warm_client.py").read_text()
        self.python = str(self.directory / "python")
        Path(self.python).write_text(f"#!{sys.executable} -S\n{client}")
        os.chmod(self.python, 0o755)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.ensure()

    @property
    def env(self) -> dict:
        """What a job's environment needs to run in the pool."""
        return {ENV: str(self.directory)}

    def ensure(self) -> None:
        """Starts the server if it is not running (never started, or died)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        (self.directory / "socket").unlink(missing_ok=True)
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", warm_server.__file__, str(self.directory), *self._preload],
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1

    def log(self) -> str:
        """The server's output: TensorFlow's start-up lines, then one line per
        job forked or declined (with the reason)."""
        try:
            return self._log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Waits until the server listens; raises with its log if it died."""
        deadline = time.monotonic() + timeout
        while not (self.directory / "socket").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"tfdist warm pool: the server did not start (exit {self.proc.poll()}); "
                    f"its log:\n{self.log()[-3000:]}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Stops the server (running jobs go on) and removes its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
