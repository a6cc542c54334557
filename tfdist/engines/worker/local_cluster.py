"""A parameter-server cluster on this machine, for notebooks and tests.

``local_cluster(workers=2, ps=1)`` starts the worker and ps servers of a
parameter-server job on 127.0.0.1 and hands back the TF_CONFIG of the chief
(the coordinator), which is this process::

    with tfdist.local_cluster(workers=2, ps=1) as cluster:
        strategy = tfdist.strategy_from_config(cluster.tf_config)
        ...

Two modes:

* ``"process"`` (default): one subprocess per server. They are stopped when
  the ``with`` block ends, and single tasks can be killed and restarted
  (``cluster.kill("worker:1")``, ``cluster.restart("worker:1")``) to try out
  failures. Each costs a Python process with TensorFlow (about 4 s and
  600 MB here).
* ``"in_process"``: the servers run as threads of this process. Cheap, but
  TensorFlow cannot stop an in-process server: they live until the process
  exits. The inter-op thread pool must then have at least ``workers + 1``
  threads, or the job hangs on a 2-core machine; this sets it, so call it
  before any other TensorFlow work.

Nothing in the ``"process"`` path imports TensorFlow in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tfdist.engines import net, warm

# What each server runs and how a taken port shows: as in ``tfdist launch``.
from tfdist.engines.launch_results import PORT_TAKEN, SERVER_CODE
from tfdist.errors import ConfigError, TfdistError, require_int
from tfdist.spec.tf_config import ClusterSource
from tfdist.strategies.coordinator import disconnect_coordinator as _disconnect_coordinator

__all__ = ["LocalCluster", "LocalClusterError", "local_cluster"]

_MODES = ("process", "in_process")


class LocalClusterError(TfdistError, RuntimeError):
    """A server of the local cluster did not start, or died."""


def _die_with_parent() -> None:
    """Runs in the child: SIGKILL it when the thread that started it dies,
    so that a killed chief leaves no orphan servers (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


class _Server:
    """One server subprocess and its log file."""

    def __init__(
        self, task: str, argv: Sequence[str], env: Mapping[str, str], log_path: str
    ) -> None:
        self.task = task
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - the server's log, open for its lifetime
        # A session of its own: stopping it also stops anything it started.
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read()[-20000:].decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 5.0) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(5.0)
        self.log.close()


class LocalCluster(ClusterSource):
    """Worker and ps servers on 127.0.0.1; this process is the chief.

    Use :func:`local_cluster` to make one.

    Attributes:
        cluster: The cluster dict, e.g. ``{"chief": [...], "worker": [...],
            "ps": [...]}``.
        tf_config: The chief's TF_CONFIG, for ``strategy_from_config``.
        mode: ``"process"`` or ``"in_process"``.
        log_dir: Where the server subprocesses write their output.
    """

    def __init__(
        self,
        workers: int,
        ps: int,
        mode: str,
        *,
        start_timeout: float,
        python: str,
        env: Mapping[str, str] | None,
        log_dir: str | None,
    ) -> None:
        self.workers, self.ps, self.mode = workers, ps, mode
        self.start_timeout = start_timeout
        self.python = python
        self._env = dict(os.environ if env is None else env)
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tfdist-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        self._servers: dict[str, _Server] = {}
        self._in_process: list[Any] = []
        self.cluster: dict[str, list[str]] = {}
        self._stopped = False

    # -- what strategy_from_config needs -------------------------------------

    @property
    def tf_config(self) -> dict:
        return {"cluster": self.cluster, "task": {"type": "chief", "index": 0}}

    def task_config(self, task: str) -> dict:
        """The TF_CONFIG of one task, e.g. ``"worker:1"``."""
        task_type, index = self._split(task)
        return {"cluster": self.cluster, "task": {"type": task_type, "index": index}}

    @property
    def tasks(self) -> list[str]:
        """The server tasks (workers, then ps), e.g. ``["worker:0", "ps:0"]``."""
        return [f"worker:{i}" for i in range(self.workers)] + [f"ps:{i}" for i in range(self.ps)]

    def _split(self, task: str) -> tuple[str, int]:
        task_type, _, index = str(task).partition(":")
        if task not in self.tasks:
            raise ConfigError("task", task, f"one of {self.tasks}", source="LocalCluster")
        return task_type, int(index)

    # -- start ---------------------------------------------------------------

    def start(self) -> LocalCluster:
        for attempt in range(3):
            ports = net.free_ports(1 + self.workers + self.ps)
            addrs = [f"127.0.0.1:{p}" for p in ports]
            self.cluster = {
                "chief": addrs[:1],
                "worker": addrs[1 : 1 + self.workers],
                "ps": addrs[1 + self.workers :],
            }
            if self.mode == "in_process":
                self._start_in_process()
                return self
            for task in self.tasks:
                self._spawn(task)
            try:
                self._wait_listening(self.tasks)
                return self
            except _PortTaken:
                self._stop_servers()  # Someone took a port: new ports.
                if attempt == 2:
                    raise LocalClusterError(
                        f"the servers could not bind their ports in 3 tries; logs in {self.log_dir}"
                    ) from None
        raise AssertionError("unreachable")

    def _spawn(self, task: str) -> None:
        env = dict(
            self._env,
            TF_CONFIG=json.dumps(self.task_config(task)),
            TF_CPP_MIN_LOG_LEVEL=self._env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        )
        env.pop("TFDIST_LAUNCH_ATTEMPT", None)
        log = os.path.join(self.log_dir, task.replace(":", "-") + ".log")
        self._servers[task] = _Server(task, [self.python, "-c", SERVER_CODE], env, log)

    def _wait_listening(self, tasks: Sequence[str]) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = list(tasks)
        while waiting:
            for task in list(waiting):
                server = self._servers[task]
                port = int(self.address(task).rsplit(":", 1)[1])
                code = server.proc.poll()
                if code is not None:
                    tail = server.tail()
                    if PORT_TAKEN.search(tail):
                        raise _PortTaken(task)
                    raise LocalClusterError(
                        f"{task} exited with code {code} while starting; its last lines:\n{tail}"
                    )
                if _listening(port):
                    waiting.remove(task)
            if waiting and time.monotonic() > deadline:
                raise LocalClusterError(
                    f"{', '.join(waiting)} did not listen within "
                    f"start_timeout={self.start_timeout:g}s; logs in {self.log_dir}"
                )
            if waiting:
                time.sleep(0.1)

    def _start_in_process(self) -> None:
        import tensorflow as tf

        threads = self.workers + 1
        try:
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:
            have = tf.config.threading.get_inter_op_parallelism_threads()
            if 0 < have < threads:
                raise LocalClusterError(
                    f"an in-process cluster of {self.workers} workers needs at "
                    f"least {threads} inter-op threads (TensorFlow has {have} "
                    "and is already running). Call local_cluster() before any "
                    "other TensorFlow work, or use mode='process'."
                ) from None
        spec = tf.train.ClusterSpec(self.cluster)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads)
        for task in self.tasks:
            task_type, index = task.split(":")
            self._in_process.append(
                tf.distribute.Server(
                    spec,
                    job_name=task_type,
                    task_index=int(index),
                    protocol="grpc",
                    config=config,
                    start=True,
                )
            )

    # -- failures ------------------------------------------------------------

    def address(self, task: str) -> str:
        task_type, index = self._split(task)
        return self.cluster[task_type][index]

    def pid(self, task: str) -> int:
        """The process id of a server (``"process"`` mode)."""
        return self._server(task).proc.pid

    def alive(self, task: str) -> bool:
        return self._server(task).proc.poll() is None

    def _server(self, task: str) -> _Server:
        self._split(task)
        if self.mode != "process":
            raise LocalClusterError(
                f"{task}: in-process servers cannot be killed or restarted; "
                "use local_cluster(mode='process')"
            )
        return self._servers[task]

    def kill(self, task: str, sig: int = signal.SIGKILL) -> None:
        """Kills one server (default SIGKILL) and waits until it is gone."""
        server = self._server(task)
        server.signal(sig)
        server.proc.wait(10.0)

    def restart(self, task: str) -> None:
        """Starts a killed server again, on the same address."""
        server = self._server(task)
        if server.proc.poll() is None:
            raise LocalClusterError(
                f"{task} is still running (pid {server.proc.pid}); kill it first"
            )
        server.log.close()
        self._spawn(task)
        self._wait_listening([task])

    # -- stop ----------------------------------------------------------------

    def _stop_servers(self) -> None:
        if self._servers:
            _disconnect_coordinator(self.cluster)
        for server in self._servers.values():
            server.stop()
        self._servers.clear()

    def stop(self) -> None:
        """Stops every server subprocess (idempotent).

        In-process servers cannot be stopped: TensorFlow has no way to; they
        end with the process.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stop_servers()
        if self._own_log_dir:
            import shutil

            shutil.rmtree(self.log_dir, ignore_errors=True)

    def logs(self) -> str:
        """The last lines of every server's log, for error messages."""
        return "\n".join(
            f"--- {task} ---\n{server.tail()}" for task, server in self._servers.items()
        )

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"LocalCluster(workers={self.workers}, ps={self.ps}, "
            f"mode={self.mode!r}, cluster={self.cluster})"
        )


class _PortTaken(Exception):
    pass


def local_cluster(
    workers: int = 2,
    ps: int = 1,
    *,
    mode: str = "process",
    start_timeout: float = 60.0,
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: str | None = None,
) -> LocalCluster:
    """Starts a parameter-server cluster on 127.0.0.1; this process is its chief.

    Args:
        workers: Worker servers, >= 1.
        ps: Parameter servers, >= 1.
        mode: ``"process"`` (a subprocess per server; stoppable, killable)
            or ``"in_process"`` (threads of this process; cheap, but they
            run until the process exits).
        start_timeout: Seconds for every server to listen on its port.
        python: The interpreter for server subprocesses (default: this one).
        env: Environment of the server subprocesses (default: this one's).
        log_dir: Keep the servers' logs here (default: a temporary
            directory removed on stop).

    Returns:
        A started :class:`LocalCluster`, also a context manager that stops
        it. ``cluster.tf_config`` goes to ``strategy_from_config``.

    Raises:
        ConfigError: A bad argument; the message names it and its value.
        LocalClusterError: A server did not start.
    """
    workers = require_int("workers", workers, minimum=1, source="local_cluster")
    ps = require_int("ps", ps, minimum=1, source="local_cluster")
    if mode not in _MODES:
        raise ConfigError(
            "mode", mode, " or ".join(repr(m) for m in _MODES), source="local_cluster"
        )
    if (
        not isinstance(start_timeout, (int, float))
        or isinstance(start_timeout, bool)
        or start_timeout <= 0
    ):
        raise ConfigError(
            "start_timeout", start_timeout, "a number of seconds > 0", source="local_cluster"
        )
    cluster = LocalCluster(
        workers,
        ps,
        mode,
        start_timeout=float(start_timeout),
        python=python or warm.interpreter(None if env is None else dict(env)),
        env=env,
        log_dir=log_dir,
    )
    with contextlib.ExitStack() as undo:
        undo.callback(cluster.stop)
        cluster.start()
        undo.pop_all()
    return cluster
