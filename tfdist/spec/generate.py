"""Generating TF_CONFIGs: one per task of a spec, or a spec from a list of hosts.

What a launcher hands to each process it starts. No TensorFlow.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from tfdist.errors import ClusterSpecError
from tfdist.spec.address import BadAddress, check_host, check_ipv6, format_address, split_address
from tfdist.spec.parse import parse

# Generation.
# --------------------------------------------------------------------------


def tf_config_for_task(spec: Any, task_type: str, task_index: int) -> dict[str, Any]:
    """Returns the ``TF_CONFIG`` dict of one task of a cluster spec.

    Args:
        spec: Anything :func:`parse` accepts (read with ``require_task=False``),
            e.g. ``'two_workers'``.
        task_type: ``'chief'``, ``'worker'``, ``'ps'`` or ``'evaluator'``.
        task_index: Index of the task within its job.

    Returns:
        ``{"cluster": {...}, "task": {"type": ..., "index": ...}}`` (plus
        ``rpc_layer`` / ``environment`` when the spec sets them).

    Raises:
        ClusterSpecError: The spec is invalid or has no such task.
    """
    return parse(spec, require_task=False).with_task(task_type, task_index).to_dict()


def all_task_configs(spec: Any) -> list[tuple[str, int, dict[str, Any]]]:
    """Returns the ``TF_CONFIG`` of every task in a cluster spec.

    An evaluator is not in the cluster, so none is generated for it (use
    ``tf_config_for_task(spec, 'evaluator', 0)``).

    Args:
        spec: Anything :func:`parse` accepts (read with ``require_task=False``).

    Returns:
        ``(task_type, task_index, tf_config_dict)`` per task, in the order
        chief, worker, ps.
    """
    config = parse(spec, require_task=False)
    return [
        (task_type, index, config.with_task(task_type, index).to_dict())
        for task_type, index, _ in config.tasks()
    ]


def _split_host(entry: str) -> tuple[str, int | None]:
    """``"name"`` -> (name, None); ``"name:port"`` / ``"[v6]:port"`` -> (host, port)."""
    text = entry.strip()
    if text.startswith("[") and text.endswith("]"):
        host = text[1:-1]
        check_ipv6(host)
        return host, None
    if ":" in text or text.startswith("["):
        return split_address(text)
    check_host(text)
    return text, None


def spec_from_hosts(
    hosts: Sequence[str], *, chief: bool = False, num_ps: int = 0, port: int = 2222
) -> dict[str, Any]:
    """Builds a cluster spec from a list of hosts.

    Roles are given in order: the first host is the chief if ``chief``, the
    next ``num_ps`` hosts are parameter servers, the rest are workers.

    Args:
        hosts: ``"name"`` or ``"name:port"`` entries (``"[::1]:2222"`` for
            IPv6). A host without a port gets ``port``; a name repeated
            without ports gets successive ports (``port``, ``port + 1``, ...)
            so ``['localhost'] * 4`` gives four local tasks.
        chief: Make the first host the chief.
        num_ps: Number of parameter servers (needs ``chief=True`` and at
            least one worker).
        port: Port for hosts given without one.

    Returns:
        ``{"cluster": {...}}`` with jobs in the order chief, worker, ps.

    Raises:
        ClusterSpecError: Bad hosts or arguments (fields ``'hosts'``,
            ``'hosts[i]'``, ``'chief'``, ``'num_ps'``, ``'port'``).
    """
    entries, num_ps, port = _checked_arguments(hosts, chief, num_ps, port)
    parsed, explicit = _parsed_entries(entries)
    addresses = _addresses(entries, parsed, explicit, port)

    cluster: dict[str, list[str]] = {}
    start = 0
    if chief:
        cluster["chief"] = addresses[:1]
        start = 1
    ps = addresses[start : start + num_ps]
    workers = addresses[start + num_ps :]
    if workers:
        cluster["worker"] = workers
    if ps:
        cluster["ps"] = ps
    spec = {"cluster": cluster}
    parse(spec, require_task=False)  # Double-check with the full rules.
    return spec


_SOURCE = "spec_from_hosts()"


def _fail(field: str, value: object, expected: str, hint: str | None = None) -> NoReturn:
    raise ClusterSpecError(field, value, expected, source=_SOURCE, hint=hint)


def _checked_arguments(
    hosts: object, chief: object, num_ps: object, port: object
) -> tuple[list, int, int]:
    """(the host entries, num_ps, port) once every argument is checked."""
    hosts_expected = "a list of 'host' or 'host:port' strings"
    if isinstance(hosts, (str, bytes, Mapping)):
        _fail("hosts", hosts, hosts_expected, hint='Wrap a single host in a list: ["host"].')
    try:
        entries = list(hosts)
    except TypeError:
        _fail("hosts", hosts, hosts_expected)
    if not isinstance(chief, bool):
        _fail("chief", chief, "True or False")
    if isinstance(num_ps, bool) or not isinstance(num_ps, numbers.Integral) or num_ps < 0:
        _fail("num_ps", num_ps, "a non-negative integer")
    if isinstance(port, bool) or not isinstance(port, numbers.Integral) or not 1 <= port <= 65535:
        _fail("port", port, "an integer port in 1..65535")
    num_ps, port = int(num_ps), int(port)
    if num_ps > 0 and not chief:
        _fail(
            "chief",
            chief,
            "True when num_ps > 0 (parameter-server training needs a chief)",
            hint="Pass chief=True; the first host becomes the chief.",
        )
    num_workers = len(entries) - int(chief) - num_ps
    if num_ps > 0 and num_workers < 1:
        _fail(
            "hosts",
            entries,
            f"at least {num_ps + 2} hosts (1 chief, {num_ps} ps and at least 1 worker)",
        )
    if not entries:
        _fail("hosts", entries, "at least one host")
    return entries, num_ps, port


def _parsed_entries(
    entries: list,
) -> tuple[list[tuple[str, int | None]], dict[tuple[str, int], int]]:
    """Each entry's (host, port or None), and the position of each explicit
    (host, port), none given twice."""
    parsed: list[tuple[str, int | None]] = []
    explicit: dict[tuple[str, int], int] = {}  # (host, port) -> position in hosts
    for position, entry in enumerate(entries):
        field = f"hosts[{position}]"
        if not isinstance(entry, str):
            _fail(field, entry, "a 'host' or 'host:port' string")
        try:
            host, host_port = _split_host(entry)
        except BadAddress as bad:
            _fail(
                field, entry, "a 'host' or 'host:port' string with a valid host and port", bad.hint
            )
        if host_port is not None:
            key = (host.lower(), host_port)
            if key in explicit:
                _fail(
                    field,
                    entry,
                    f"an address used once (it is also hosts[{explicit[key]}])",
                    hint="Each task needs its own host:port.",
                )
            explicit[key] = position
        parsed.append((host, host_port))
    return parsed, explicit


def _addresses(
    entries: list,
    parsed: list[tuple[str, int | None]],
    explicit: dict[tuple[str, int], int],
    port: int,
) -> list[str]:
    """Every entry's 'host:port'; hosts without a port get successive free
    ports per host name, from ``port``."""
    next_port: dict[str, int] = {}
    addresses = []
    for position, (host, host_port) in enumerate(parsed):
        if host_port is None:
            candidate = next_port.get(host.lower(), port)
            while (host.lower(), candidate) in explicit:
                candidate += 1
            if candidate > 65535:
                _fail(
                    f"hosts[{position}]",
                    entries[position],
                    "a free port <= 65535",
                    hint="Pass a lower port= or give the ports explicitly.",
                )
            next_port[host.lower()] = candidate + 1
            host_port = candidate
        addresses.append(format_address(host, host_port))
    return addresses
