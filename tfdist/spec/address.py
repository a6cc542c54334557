"""``host:port`` addresses and ``type:index`` task names: parsing and formatting.

IPv6 hosts are bracketed; a bad address names the field, the value and what was
expected. No TensorFlow.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from tfdist.errors import ClusterSpecError
from tfdist.spec.names import TASK_TYPES, did_you_mean, quoted, short

_ADDRESS_EXPECTED = "a 'host:port' address with a non-empty host and an integer port in 1..65535"
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_TASK_RE = re.compile(r"\s*([A-Za-z_]+)\s*:\s*(-?[0-9]+)\s*")


# Addresses.
# --------------------------------------------------------------------------


class BadAddress(Exception):
    """Internal: why an address is wrong (turned into a ClusterSpecError)."""

    def __init__(self, hint: str | None = None, expected: str = _ADDRESS_EXPECTED) -> None:
        super().__init__(hint)
        self.hint = hint
        self.expected = expected


def check_host(host: str) -> None:
    """Raises BadAddress unless ``host`` is a plausible host name or IPv4."""
    if not host:
        raise BadAddress("Add the host before the port, e.g. 'localhost:2222'.")
    if "://" in host:
        raise BadAddress(
            "Remove the scheme (e.g. 'grpc://'): cluster addresses are plain host:port; "
            'set "rpc_layer": "grpc" instead.'
        )
    if not _HOST_RE.fullmatch(host):
        raise BadAddress(
            f"The host {short(repr(host))} is not a valid name or IP address "
            "(letters, digits, '.', '-' and '_' only)."
        )


def check_ipv6(host: str) -> None:
    """Raises BadAddress unless ``host`` is an IPv6 address."""
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise BadAddress(f"{short(repr(host))} in brackets is not an IPv6 address.") from None


def split_address(addr: Any) -> tuple[str, int]:
    """Splits ``"host:port"`` / ``"[v6]:port"`` or raises BadAddress."""
    if not isinstance(addr, str):
        raise BadAddress(
            'Write the address as a quoted string with a host, e.g. "localhost:2222".',
            expected=_ADDRESS_EXPECTED + " as a string",
        )
    if addr != addr.strip() or any(char.isspace() for char in addr):
        raise BadAddress("Remove the spaces.")
    if "://" in addr:
        check_host(addr)  # Raises the scheme hint.
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0:
            raise BadAddress("Close the bracket of the IPv6 address, e.g. '[::1]:2222'.")
        host, rest = addr[1:end], addr[end + 1 :]
        check_ipv6(host)
        if not rest.startswith(":"):
            raise BadAddress(f"Add a port after the bracket, e.g. '[{short(host)}]:2222'.")
        port_text = rest[1:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep:
            raise BadAddress(f"Add a port, e.g. '{short(addr)}:2222'.")
        if ":" in host:
            raise BadAddress("Write IPv6 addresses in brackets, e.g. '[::1]:2222'.")
        check_host(host)
    if not port_text:
        raise BadAddress("Add the port after the colon, e.g. 'localhost:2222'.")
    if not (port_text.isascii() and port_text.isdigit()):
        raise BadAddress(f"The port {short(repr(port_text))} is not a number.")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise BadAddress(f"Port {port} is out of range; use one in 1..65535 (e.g. 2222).")
    return host, port


def format_address(host: str, port: int) -> str:
    """Joins host and port, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(addr: str) -> tuple[str, int]:
    """Splits a ``"host:port"`` address.

    Args:
        addr: ``"host:port"``; IPv6 hosts go in brackets (``"[::1]:2222"``).

    Returns:
        ``(host, port)``; an IPv6 host is returned without brackets.

    Raises:
        ClusterSpecError: ``field='address'`` for a malformed address.
    """
    try:
        return split_address(addr)
    except BadAddress as bad:
        raise ClusterSpecError(
            "address", addr, bad.expected, source="parse_address()", hint=bad.hint
        ) from None


def parse_task(text: str) -> tuple[str, int]:
    """Parses a task written ``"type:index"``.

    Args:
        text: E.g. ``"worker:1"`` or ``"chief:0"``.

    Returns:
        ``(task_type, task_index)``, e.g. ``("worker", 1)``.

    Raises:
        ClusterSpecError: ``field='task'`` for malformed text or an unknown
            type.
    """
    expected = (
        f"'TYPE:INDEX' with TYPE one of {quoted(TASK_TYPES)} and INDEX a "
        "non-negative integer, e.g. 'worker:1'"
    )
    match = _TASK_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ClusterSpecError("task", text, expected, source="parse_task()")
    task_type, index = match.group(1), int(match.group(2))
    if task_type not in TASK_TYPES:
        raise ClusterSpecError(
            "task",
            text,
            expected,
            source="parse_task()",
            hint=did_you_mean(task_type, TASK_TYPES),
        )
    if index < 0:
        raise ClusterSpecError(
            "task", text, expected, source="parse_task()", hint="Task indices start at 0."
        )
    return task_type, index


# --------------------------------------------------------------------------
# Validation.
