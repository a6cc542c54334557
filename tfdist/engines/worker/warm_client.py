"""The interpreter a warm pool hands out: ``python ARGS``, forked from the pool.

This file is copied, after a ``#!`` line naming this interpreter with ``-S``,
into the pool's directory as ``python`` (:mod:`tfdist.engines.warm`), so it
starts in milliseconds and imports the standard library only. Run as
``python SCRIPT ARGS``, ``python -m MODULE ARGS`` or ``python -c CODE ARGS``,
it asks the pool (``$TFDIST_WARM_POOL/socket``) to fork a process that
already imported TensorFlow and Keras, hands it this process's open files,
environment, working directory and niceness, passes on every stop signal it
receives (to its process group, when this one leads its own), and exits as the
forked process did (its code, or the same signal). The pool stops the forked
process while this one is stopped (SIGSTOP cannot be caught), and kills it if
this one is killed.

When there is no pool, or the pool declines (another interpreter option, an
environment variable that TensorFlow reads at import), it becomes the real
interpreter with the same arguments (``exec``): the job runs as it would
without a pool, only slower.
"""

import json
import os
import signal
import socket
import struct
import sys

#: Signals passed on to the forked process (SIGKILL cannot be caught: the
#: forked process watches this one's socket instead).
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCONT")


def _signals() -> set:
    return {getattr(signal, name) for name in FORWARDED}


def _fallback(real: str, argv: list) -> None:
    # An exec keeps the signal mask: the real interpreter gets what came in.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _signals())
    os.execv(real, [real, *argv])


def _open_fds(skip: int) -> list:
    """This process's open file descriptors (all inherited: it opened none
    but the pool's socket, ``skip``)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != skip:
            try:
                os.fstat(fd)
            except OSError:  # The listing's own descriptor, closed by now.
                continue
            fds.append(fd)
    return sorted(fds)


def context() -> dict:
    """What a process inherits besides its files and environment: its
    namespaces (``unshare -n``, ``ip netns exec``), control groups (memory
    limits), resource limits and user. A fork has the pool's: the pool runs
    only a job whose context equals its own."""
    import resource

    found = {"uid": os.getuid(), "gid": os.getgid()}
    for name in ("net", "mnt", "pid", "uts", "ipc", "user", "cgroup"):
        try:
            found[f"ns:{name}"] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            pass
    try:
        with open("/proc/self/cgroup") as f:
            found["cgroup"] = f.read()
    except OSError:
        pass
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            found[name] = list(resource.getrlimit(getattr(resource, name)))
    return found


class _Lines:
    """The pool's answers, one JSON object per line. A job that ends at once
    sends its exit right after its pid: both may come in one read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def read(self) -> dict | None:
        """The next answer, or None if the pool closed the connection first."""
        while b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(4096)
            except InterruptedError:
                continue
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


def main(real: str, argv: list) -> None:
    # A stop signal that comes before the forked process's pid is known waits
    # (blocked) and is then passed on: with the default action it would end
    # this process and leave the job running unsignalled (a launcher that
    # signals its tasks just after they start).
    signal.pthread_sigmask(signal.SIG_BLOCK, _signals())
    pool = os.environ.get("TFDIST_WARM_POOL", "")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.path.join(pool, "socket"))
    except OSError:
        sock.close()
        _fallback(real, argv)
    fds = _open_fds(sock.fileno())
    request = json.dumps(
        {
            "argv": argv,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "fds": fds,
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "client": os.getpid(),
            "context": context(),
        }
    ).encode()
    message = struct.pack("!I", len(request)) + request
    sent = sock.sendmsg(
        [message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    )
    if sent < len(message):  # A long environment may not go in one call.
        sock.sendall(message[sent:])  # (Not b"": the pool may have answered and closed.)
    answers = _Lines(sock)
    reply = answers.read()
    if reply is None or "pid" not in reply:
        sock.close()
        _fallback(real, argv)
    pid = reply["pid"]

    # A client started as a process group's leader (a launcher's
    # start_new_session) stands for the job's group: the job's children would
    # have been in the client's group, and a launcher signals the group.
    group = os.getpgrp() == os.getpid()

    def forward(signum, frame):
        try:
            if group:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _signals())
    status = answers.read()
    # The job is gone: a stop signal has no one to go to. Blocked for the
    # exit, as the interpreter's finalization puts the default action back
    # on every signal with a Python handler, and a SIGTERM there would end
    # this process as "killed by SIGTERM" after the job exited 0 (tfdist
    # launch resends its SIGTERM to the tasks still running every 2 s).
    signal.pthread_sigmask(signal.SIG_BLOCK, _signals())
    code = 1 if status is None else status["exit"]
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # Those have no handler.
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.executable, sys.argv[1:])
