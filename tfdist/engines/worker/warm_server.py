"""The server of a warm pool (:mod:`tfdist.engines.warm`): it imports the
preloaded modules, then forks one process per request from a client
(:mod:`tfdist.engines.worker.warm_client`) and runs the client's ``python ARGV`` in it.

Run as a script (``python -u warm_server.py DIRECTORY MODULE...``), so that
it imports nothing of tfdist: ``import tfdist`` installs its Keras import hook,
and a job imports tfdist, or not, in its own order. Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import threading
from pathlib import Path

if __package__:
    from tfdist.engines.worker import warm_client
else:  # Run as a script: its directory is sys.path[0].
    import warm_client

#: Environment variables read while those modules are imported (TensorFlow's
#: logging and oneDNN, Keras's backend, XLA, thread pools, the interpreter,
#: coverage's start-up hook): a job that sets any of them differently from
#: the server is declined and runs in a fresh interpreter.
IMPORT_TIME_PREFIXES = (
    "TF_", "KERAS_", "XLA_", "CUDA_", "OMP_", "MKL_", "KMP_", "LD_", "PYTHON", "COVERAGE_",
    "TFDIST_SKIP_VERSION_CHECK",
)  # fmt: skip
#: Read when a job runs, not at import (PYTHONPATH becomes the job's sys.path;
#: keras.distribution.initialize() reads KERAS_DISTRIBUTION_*).
RUN_TIME = frozenset({"TF_CONFIG", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
RUN_TIME_PREFIXES = ("KERAS_DISTRIBUTION_",)


def import_time_env(env: dict) -> dict:
    """The variables of ``env`` that the preloaded modules read at import."""
    return {
        key: value
        for key, value in env.items()
        if key.startswith(IMPORT_TIME_PREFIXES)
        and key not in RUN_TIME
        and not key.startswith(RUN_TIME_PREFIXES)
    }


#: Seconds between two looks at the running jobs' clients (a stopped client
#: stops its job within this).
STOP_POLL = 0.02


def _state(pid: int) -> str:
    """A process's state letter (R, S, T...), or "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return ""


def _pythonpath(env: dict) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _script_argv(argv: list[str]) -> list[str]:
    """``argv`` without ``-u``: the server's output is unbuffered already."""
    return argv[1:] if argv[:1] == ["-u"] else argv


def _differing(theirs: dict, ours: dict) -> str:
    return ", ".join(sorted(key for key in {*theirs, *ours} if theirs.get(key) != ours.get(key)))


def _decline(request: dict, base_env: dict) -> str | None:
    """Why the server cannot run ``request`` in a fork, or None."""
    argv = _script_argv(request["argv"])
    if not argv:
        return "no script (an interactive interpreter)"
    if argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        return f"interpreter option {argv[0]!r}"
    if argv[0] in ("-m", "-c") and len(argv) < 2:
        return f"{argv[0]} without its argument"
    differ = _differing(request["context"], warm_client.context())
    if differ:
        return f"another context: {differ}"
    differ = _differing(import_time_env(request["env"]), import_time_env(base_env))
    if differ:
        return f"variables read at import differ: {differ}"
    return None


class Server:
    """The forking loop: one request per connection, one fork per request."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.base_env = dict(os.environ)
        # The interpreter's own paths: a job's sys.path is its script's
        # directory, its PYTHONPATH, then these.
        self.base_path = [p for p in sys.path if p not in _pythonpath(self.base_env)]
        self.jobs: dict[int, socket.socket] = {}
        self.clients: dict[int, int] = {}  # Job -> its client's pid.
        self.stopped: set[int] = set()
        self.parent = os.getppid()

    def serve(self) -> None:
        if sys.platform.startswith("linux"):  # Ends with whoever started it.
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under another name and renamed: a client finds the socket
        # only once the server listens (else it runs a fresh interpreter).
        pending = self.directory / f"socket.{os.getpid()}"
        listener.bind(str(pending))
        listener.listen(64)
        os.replace(pending, self.directory / "socket")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, "accept")
        selector.register(wake_r, selectors.EVENT_READ, "child")
        while True:
            # While jobs run, their clients are watched for a stop (SIGSTOP).
            for key, _ in selector.select(timeout=STOP_POLL if self.jobs else 5.0):
                if key.data == "accept":
                    conn, _ = listener.accept()
                    self._start(conn, listener, selector, wake_r, wake_w)
                elif key.data == "child":
                    os.read(wake_r, 4096)
                else:
                    self._client_gone(key.data, selector)
            self._reap(selector)
            self._mirror_stops()
            if os.getppid() != self.parent:  # Whoever started the pool is gone.
                return

    def _mirror_stops(self) -> None:
        """Stops a job's group while its client is stopped, and continues it
        after: SIGSTOP cannot be caught and passed on (a test stops a worker
        to play a hung peer)."""
        for pid, client in list(self.clients.items()):
            stopped = _state(client) == "T"
            if stopped != (pid in self.stopped):
                try:
                    os.killpg(pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                except ProcessLookupError:
                    continue
                (self.stopped.add if stopped else self.stopped.discard)(pid)

    def _client_gone(self, pid: int, selector) -> None:
        """A job's client closed its socket while the job runs: it was killed
        (a SIGKILL cannot be passed on), so the job's process group is too,
        even a stopped one that cannot run its own watch (_watch_client)."""
        conn = self.jobs.get(pid)
        try:
            data = conn.recv(1024, socket.MSG_DONTWAIT) if conn is not None else b""
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # A client sends nothing after its request.
        selector.unregister(conn)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self, selector) -> None:
        while self.jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.clients.pop(pid, None)
            self.stopped.discard(pid)
            try:  # What the job left in its group goes with it.
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            conn = self.jobs.pop(pid, None)
            if conn is not None:
                if conn.fileno() in selector.get_map():
                    selector.unregister(conn)
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _start(self, conn, listener, selector, wake_r, wake_w) -> None:
        conn.settimeout(30.0)  # A client that stalls mid-request stalls no one else.
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as e:
            print(f"tfdist warm pool: a bad request: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        why = _decline(request, self.base_env)
        if why is not None:
            print(f"tfdist warm pool: declined {request['argv'][:2]}: {why}", flush=True)
            for fd in fds:
                os.close(fd)
            _send(conn, {"declined": why})
            conn.close()
            return
        conn.settimeout(None)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            selector.close()
            for fd in (listener.fileno(), wake_r, wake_w):
                os.close(fd)
            for other in self.jobs.values():
                other.close()
            self.jobs.clear()
            _run_job(request, fds, conn, self.base_path)  # Never returns.
        for fd in fds:
            os.close(fd)
        print(f"tfdist warm pool: forked {pid} for {request['argv'][:2]}", flush=True)
        self.jobs[pid] = conn
        self.clients[pid] = request["client"]
        _send(conn, {"pid": pid})  # A client gone by now: _client_gone ends the job.
        selector.register(conn, selectors.EVENT_READ, pid)


def _send(conn: socket.socket, message: dict) -> None:
    """One JSON line to a client; nothing if it is gone (killed)."""
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length, its JSON, and the client's open files."""
    fds: list[int] = []
    data = b""
    size = None
    while size is None or len(data) < size + 4:
        chunk, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(256 * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if not chunk:
            raise ValueError("the client closed the connection mid-request")
        data += chunk
        if size is None and len(data) >= 4:
            size = struct.unpack("!I", data[:4])[0]
    request = json.loads(data[4 : size + 4])
    if len(fds) != len(request["fds"]):
        raise ValueError(f"expected {len(request['fds'])} files, received {len(fds)}")
    return request, fds


def _watch_client(conn: socket.socket) -> None:
    """Kills this job's process group when its client's socket closes (the
    client was killed: SIGKILL cannot be passed on)."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def _run_job(request: dict, fds: list[int], conn: socket.socket, base_path: list[str]) -> None:
    """In the forked process: becomes the client's ``python ARGV`` and exits."""
    for name in ("SIGCHLD", "SIGTERM", "SIGINT", "SIGHUP", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    os.setsid()
    try:  # Before any thread starts: Linux's niceness is per thread.
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    except OSError:
        pass
    # The client's files at their numbers, through numbers above all of them.
    targets = request["fds"]
    above = max([2, *targets]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    conn_fd = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, above)
    for fd in fds:
        os.close(fd)
    conn.close()
    for target, fd in zip(targets, high):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    conn = socket.socket(fileno=conn_fd)
    threading.Thread(target=_watch_client, args=(conn,), daemon=True).start()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _reseed()
    argv = _script_argv(request["argv"])
    pythonpath = _pythonpath(request["env"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets sys.argv[0] to the file.
        first = os.getcwd()
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        first = ""
    else:
        sys.argv = list(argv)
        first = os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *pythonpath, *base_path]
    _exit(_run(argv))


def _exit(code: int) -> None:
    """Ends the job as the interpreter's exit would, up to its teardown:
    waits for non-daemon threads, runs the ``atexit`` functions, flushes the
    files still open, then leaves without tearing down the modules.

    The teardown is what a fork must not run. It took 1.7 s per job (each
    object the server imported is touched, so each of its pages is copied),
    against 0.14 s without it; and it runs the C++ destructors of libraries
    that started threads in the server before the fork (pyarrow's jemalloc
    and thread pools, imported by Keras), whose threads the fork does not have.
    """
    try:
        threading._shutdown()  # noqa: SLF001 - Py_FinalizeEx's first step, as at exit
    except Exception:  # noqa: BLE001 - the exit goes on, as the interpreter's
        pass
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter's exit runs next
    _flush_open_files()
    os._exit(code & 0xFF)


def _flush_open_files() -> None:
    """Flushes what the teardown would have: buffered files the job left
    open (their ``__del__`` flushes them when the modules are torn down)."""
    import gc
    import io

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    # The server's own objects are frozen (main()): only the job's are listed.
    for obj in gc.get_objects():
        if isinstance(obj, (io.TextIOBase, io.BufferedIOBase)):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass


def _run(argv: list[str]) -> int:
    import runpy
    import traceback
    import types

    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            main = types.ModuleType("__main__")  # As python -c: the code is __main__.
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - python -c
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - as the interpreter: a traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


def _reseed() -> None:
    """Fresh seeds: a fork copies the server's random state (Python's own
    ``random`` reseeds itself after a fork; NumPy's global one does not)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: list[str]) -> None:
    """``warm_server.py DIRECTORY MODULE...``: imports the modules, serves."""
    directory, modules = Path(argv[0]), argv[1:]
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # This directory's modules (net, spark...) must not shadow others.
    for name in modules:
        __import__(name)
    # Kept out of every job's garbage collections (and so out of its copied
    # pages): the imported modules live as long as the server.
    import gc

    gc.collect()
    gc.freeze()
    Server(directory).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
