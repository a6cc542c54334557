"""Local ports for jobs on one machine. No TensorFlow."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` just now.

    The sockets stay open until all ports are picked, so the kernel does not
    hand out the same port twice. Another process may still take a port
    before TensorFlow binds it; callers that start servers must handle that.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def local_spec(workers: int, *, chief: bool = False, ps: int = 0, host: str = "127.0.0.1") -> dict:
    """A cluster spec on free local ports: ``{"cluster": {...}}``."""
    from tfdist import spec as spec_lib

    ports = free_ports(int(chief) + ps + workers, host)
    return spec_lib.spec_from_hosts([f"{host}:{p}" for p in ports], chief=chief, num_ps=ps)
