"""Horovod's launch spellings on tfdist's launcher. No TensorFlow.

``horovodrun -np 4 -H host1:2,host2:2 python train.py`` has three parts, each
handled here so that ``tfdist launch``, ``tfdist horovodrun`` and
:func:`tfdist.horovod.run` read them the same way:

* the hosts and their slots, from ``-H``/``--hosts`` (``host1:2,host2:2``)
  or ``--hostfile`` (lines ``host slots=2``): :func:`parse_hosts`,
  :func:`parse_hostfile`;
* which host each rank runs on: ranks fill the hosts in the order given, as
  horovodrun assigns them (:func:`rank_hosts`);
* the command: a leading ``python`` word is dropped, since tfdist starts
  every task with this interpreter (:func:`split_python`).

With every rank on this machine (``localhost``, ``127.0.0.1``) the job runs
through :func:`tfdist.engines.launch.launch`. With other hosts nothing is started:
:func:`format_commands` gives each host's ``TF_CONFIG=... python ...`` lines,
as ``tfdist hosts`` prints them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfdist import spec as spec_lib
from tfdist.errors import ConfigError

__all__ = [
    "HostSlots",
    "LOCAL_HOSTS",
    "parse_hosts",
    "parse_hostfile",
    "read_hosts",
    "rank_hosts",
    "is_local",
    "is_python_word",
    "split_python",
    "multi_host_spec",
    "format_commands",
    "multi_host_note",
    "DEFAULT_PORT",
]

#: Host names that mean this machine.
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: First port of the printed multi-host commands (then +1 per rank on a host).
DEFAULT_PORT = 2222

# horovodrun's host names: letters, digits, '_', '.', '-'.
_HOST_RE = re.compile(r"[\w.-]+")
_PYTHON_RE = re.compile(r"python(\d+(\.\d+)*)?")
# Interpreter options that take a value (``-W ignore``, ``-X dev``).
_VALUE_FLAGS = ("-W", "-X")
_PLAIN_FLAGS = {
    "-u",
    "-O",
    "-OO",
    "-B",
    "-E",
    "-s",
    "-S",
    "-I",
    "-b",
    "-bb",
    "-q",
    "-d",
    "-P",
    "-R",
    "-v",
}


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """One host and how many processes may run on it."""

    host: str
    slots: int

    def __str__(self) -> str:
        return f"{self.host}:{self.slots}"


def _host_entry(entry: str, field: str, source: str, line: int | None = None) -> HostSlots:
    """``"host:2"`` -> HostSlots("host", 2); a bare ``"host"`` has 1 slot."""
    expected = "'host:slots' with slots an integer >= 1, e.g. 'worker-0:2'"
    text = entry.strip()
    host, sep, slots = text.partition(":")
    if not _HOST_RE.fullmatch(host) or (sep and not slots.isdigit()):
        raise ConfigError(field, entry, expected, source=source, line=line)
    count = int(slots) if sep else 1
    if count < 1:
        raise ConfigError(
            field,
            entry,
            expected,
            source=source,
            line=line,
            hint="A host with no slots runs no process: leave it out.",
        )
    return HostSlots(host, count)


def _no_duplicates(hosts: list[HostSlots], field: str, source: str) -> list[HostSlots]:
    seen: set[str] = set()
    for entry in hosts:
        if entry.host.lower() in seen:
            raise ConfigError(
                field,
                ",".join(map(str, hosts)),
                "each host listed once",
                source=source,
                hint=f"{entry.host!r} appears twice; give it its total number of slots instead.",
            )
        seen.add(entry.host.lower())
    return hosts


def parse_hosts(
    hosts: str | Sequence[str], *, field: str = "hosts", source: str = "tfdist horovodrun"
) -> list[HostSlots]:
    """Reads horovodrun's ``-H`` value.

    Args:
        hosts: ``"host1:2,host2:2"`` (a host without ``:slots`` has one
            slot), or a list of such entries.
        field: The name shown in errors.
        source: Where the value came from, shown in errors.

    Returns:
        The hosts in the order given.

    Raises:
        ConfigError: An empty list, a malformed entry (``'host:x'``,
            ``'host:0'``, ``':2'``) or a host listed twice.
    """
    if isinstance(hosts, str):
        entries = hosts.split(",")
    elif isinstance(hosts, Sequence) and all(isinstance(h, str) for h in hosts):
        entries = list(hosts)
    else:
        raise ConfigError(field, hosts, "a string such as 'host1:2,host2:2'", source=source)
    if not entries or not any(e.strip() for e in entries):
        raise ConfigError(field, hosts, "at least one 'host:slots' entry", source=source)
    return _no_duplicates([_host_entry(e, field, source) for e in entries], field, source)


def parse_hostfile(
    path: str | os.PathLike, *, source: str = "tfdist horovodrun"
) -> list[HostSlots]:
    """Reads a horovodrun (Open MPI style) host file.

    Each line is ``host slots=N`` or a bare ``host`` (one slot); blank lines
    and ``#`` comments are skipped.

    Raises:
        ConfigError: The file cannot be read (field ``'hostfile'``), or a
            line is malformed (field ``'hostfile'`` with the line number).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(
            "hostfile",
            os.fspath(path),
            "a readable host file",
            source=source,
            received=f"{os.fspath(path)!r} ({error.strerror})",
        ) from None
    where = f"{source} (--hostfile {os.fspath(path)})"
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        slots = [w for w in words[1:] if w.startswith(("slots=", "max_slots="))]
        if len(words) > 2 or len(slots) != len(words) - 1 or ":" in words[0]:
            raise ConfigError(
                "hostfile",
                raw,
                "lines 'host slots=N' (or a bare host)",
                source=f"{where}, line {number}",
                line=number,
            )
        count = slots[0].split("=", 1)[1] if slots else "1"
        hosts.append(
            _host_entry(f"{words[0]}:{count}", "hostfile", f"{where}, line {number}", number)
        )
    if not hosts:
        raise ConfigError(
            "hostfile", os.fspath(path), "a host file with at least one host", source=source
        )
    return _no_duplicates(hosts, "hostfile", where)


def read_hosts(
    hosts: Any = None,
    hostfile: str | os.PathLike | None = None,
    *,
    source: str = "tfdist horovodrun",
) -> list[HostSlots] | None:
    """The hosts from ``hosts`` or ``hostfile`` (not both); None without either."""
    if hosts is not None and hostfile is not None:
        raise ConfigError(
            "hostfile",
            os.fspath(hostfile),
            "no host file when hosts are given",
            source=source,
            hint="Give -H/--hosts or --hostfile, not both.",
        )
    if hostfile is not None:
        return parse_hostfile(hostfile, source=source)
    if hosts is not None:
        return parse_hosts(hosts, source=source)
    return None


def rank_hosts(
    np: Any,
    hosts: Sequence[HostSlots] | None,
    *,
    source: str = "tfdist horovodrun",
    field: str = "np",
) -> list[str]:
    """The host of each rank: ranks fill the hosts in order, as horovodrun.

    Args:
        np: Number of processes (``-np``), an integer >= 1.
        hosts: The hosts and slots, or None for ``localhost:np``.
        source: Shown in errors.
        field: The name of ``np`` shown in errors.

    Returns:
        ``np`` host names, rank 0 first.

    Raises:
        ConfigError: ``np`` is not an integer >= 1 (field ``'np'``), or it
            is larger than the slots of the hosts.
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ConfigError(field, np, "an integer >= 1 (the number of processes)", source=source)
    if hosts is None:
        return ["localhost"] * np
    total = sum(h.slots for h in hosts)
    if np > total:
        raise ConfigError(
            field,
            np,
            f"at most {total}, the slots of the hosts ({','.join(map(str, hosts))})",
            source=source,
            hint="Lower -np or give the hosts more slots (host:slots).",
        )
    ranks: list[str] = []
    for entry in hosts:
        ranks.extend([entry.host] * min(entry.slots, np - len(ranks)))
    return ranks


def is_local(ranks: Sequence[str]) -> bool:
    """Whether every rank runs on this machine (``localhost``, ``127.0.0.1``)."""
    return all(host.lower() in LOCAL_HOSTS for host in ranks)


def is_python_word(word: str) -> bool:
    """Whether ``word`` names a Python interpreter (``python3``, a path, sys.executable)."""
    return word == sys.executable or bool(_PYTHON_RE.fullmatch(os.path.basename(word)))


def split_python(
    words: Sequence[str], *, field: str = "command", source: str = "tfdist horovodrun"
) -> tuple[str | None, list[str], list[str]]:
    """Splits a Horovod-style command into (interpreter, script, arguments).

    ``python train.py --lr 1`` -> ``(None, ["train.py"], ["--lr", "1"])``:
    ``python``, ``python3``, ``python3.11`` and ``sys.executable`` mean
    this interpreter (None). A path to another interpreter
    (``/opt/venv/bin/python``) is returned as the interpreter. The
    interpreter's own options stay in front of the script
    (``python -u -m pkg.train`` -> ``["-u", "-m", "pkg.train"]``). A
    command without a python word is a script run by this interpreter.

    Raises:
        ConfigError: No command, or ``python`` with no script, ``-m
            MODULE`` or ``-c CODE`` after it.
    """
    words = list(words)
    expected = "a command such as 'python train.py ARGS', 'python -m MODULE' or 'train.py'"
    if not words:
        raise ConfigError(field, words, expected, source=source)
    if not is_python_word(words[0]):
        return None, [words[0]], words[1:]
    python = words[0]
    same = (
        python == sys.executable
        or os.sep not in python
        or (os.path.exists(python) and os.path.samefile(python, sys.executable))
    )
    interpreter = None if same else python
    flags: list[str] = []
    i = 1
    while i < len(words):
        word = words[i]
        if word in ("-m", "-c"):
            if i + 1 >= len(words):
                break
            return interpreter, [*flags, word, words[i + 1]], words[i + 2 :]
        if word in _VALUE_FLAGS and i + 1 < len(words):
            flags += words[i : i + 2]
            i += 2
        elif word in _PLAIN_FLAGS or word.startswith(_VALUE_FLAGS):
            flags.append(word)
            i += 1
        elif word.startswith("-"):
            raise ConfigError(
                field,
                " ".join(words),
                expected,
                source=source,
                hint=f"{word!r} is not a Python option tfdist passes on "
                "(-u, -O, -B, -E, -s, -S, -I, -W ARG, -X OPT, -m, -c).",
            )
        else:
            return interpreter, [*flags, word], words[i + 1 :]
    raise ConfigError(
        field,
        " ".join(words),
        expected,
        source=source,
        hint=f"{python!r} is followed by no script, -m MODULE or -c CODE.",
    )


def multi_host_spec(ranks: Sequence[str], port: int = DEFAULT_PORT) -> dict:
    """A cluster spec with one worker per rank: ``port``, ``port + 1``... per host."""
    return spec_lib.spec_from_hosts(list(ranks), port=port)


def format_commands(
    ranks: Sequence[str],
    script: Sequence[str],
    args: Sequence[str],
    python: str | None = None,
    port: int = DEFAULT_PORT,
) -> str:
    """Each host's commands for a job whose ranks run on ``ranks``.

    The lines are those of ``tfdist hosts``: per task its ``TF_CONFIG``
    (worker ``i`` is rank ``i``) and ``python SCRIPT ARGS``.
    """
    from tfdist.engines.hosts import format_host_commands, host_commands

    script = list(script)
    commands = host_commands(
        multi_host_spec(ranks, port), script[0], [*script[1:], *args], python=python or "python"
    )
    return format_host_commands(commands)


def multi_host_note(ranks: Sequence[str], what: str) -> str:
    """The message printed before the per-host commands."""
    hosts = list(dict.fromkeys(ranks))
    note = (
        f"{what}: the ranks run on {len(hosts)} hosts ({', '.join(hosts)}); tfdist starts "
        "processes on this machine only. Run each line below on its host (tasks of one "
        "host in separate shells); worker i is rank i."
    )
    if any(h.lower() in LOCAL_HOSTS for h in hosts):
        note += (
            " Warning: 'localhost' in a job with other hosts cannot be reached from "
            "them: name this machine as the others see it."
        )
    return note
