"""Per-host launch commands and Kubeflow TFJob manifests. No TensorFlow.

Two ways to start every task of a cluster spec:

* :func:`host_commands` gives, for each task (chief, workers, ps, and an
  evaluator when asked for), the host it runs on, its ``TF_CONFIG`` and a
  shell command line to paste on that host::

      TF_CONFIG='{"cluster":...,"task":{"type":"worker","index":1}}' python train.py --epochs 3

* :func:`tfjob_manifest` gives a Kubeflow ``TFJob`` (``kubeflow.org/v1``)
  with one replica spec per job of the cluster; :func:`to_yaml` prints it as
  YAML for ``kubectl apply -f -`` without needing PyYAML.

Typical use::

    from tfdist.engines import hosts

    for cmd in hosts.host_commands("two_workers", "train.py", ["--epochs", "3"]):
        print(cmd.host, cmd.command)
    print(hosts.to_yaml(hosts.tfjob_manifest(
        "parameter_server", name="mnist", image="registry/img:1",
        command=["python", "train.py"])))

This module must stay importable without TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tfdist import spec as spec_lib

# The manifests and their YAML, public here as before they had their own modules.
from tfdist.engines.tfjob import (
    DEFAULT_BACKUP_MOUNT,
    DEFAULT_GRACE_SECONDS,
    DEFAULT_RESTART_POLICY,
    REPLICA_TYPES,
    RESTART_POLICIES,
    command_word,
    fail,
    replica_counts,
    tfjob_manifest,
)
from tfdist.engines.yaml_text import to_yaml
from tfdist.errors import ClusterSpecError

__all__ = [
    "HostCommand",
    "host_commands",
    "group_by_host",
    "format_host_commands",
    "REPLICA_TYPES",
    "RESTART_POLICIES",
    "DEFAULT_RESTART_POLICY",
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_BACKUP_MOUNT",
    "replica_counts",
    "tfjob_manifest",
    "to_yaml",
]


# --------------------------------------------------------------------------
# Per-host commands.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostCommand:
    """How to start one task of a cluster on its host.

    Attributes:
        host: The host the task runs on: the host part of its address (an
            IPv6 host without brackets), or the evaluator's host.
        task_type: ``"chief"``, ``"worker"``, ``"ps"`` or ``"evaluator"``.
        task_index: The task's index within its job.
        address: The task's ``host:port``; None for the evaluator, which is
            not part of the cluster.
        tf_config: The task's ``TF_CONFIG`` as a dict.
        argv: The program to run: the python command, the script and its
            arguments.
    """

    host: str
    task_type: str
    task_index: int
    address: str | None
    tf_config: dict[str, Any] = dataclasses.field(hash=False)
    argv: tuple[str, ...]

    @property
    def task_id(self) -> str:
        """The task as ``"type:index"``, e.g. ``"worker:1"``."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def tf_config_json(self) -> str:
        """The ``TF_CONFIG`` value: compact JSON."""
        return json.dumps(self.tf_config, separators=(",", ":"))

    @property
    def env(self) -> dict[str, str]:
        """The environment variables to add: ``{"TF_CONFIG": ...}``."""
        return {"TF_CONFIG": self.tf_config_json}

    @property
    def command(self) -> str:
        """A POSIX shell line: ``TF_CONFIG='{...}' python script args...``.

        Every word is quoted with :func:`shlex.quote`, so ``shlex.split``
        gives back ``TF_CONFIG=<json>`` followed by :attr:`argv`.
        """
        return f"TF_CONFIG={shlex.quote(self.tf_config_json)} {shlex.join(self.argv)}"


def _python_argv(python: str | Sequence[str], source: str) -> tuple[str, ...]:
    """``"python3 -u"`` -> ``("python3", "-u")``; a sequence is kept as given."""
    expected = "a command such as 'python', '/usr/bin/python3 -u', or a list of words"
    if isinstance(python, (str, os.PathLike)):
        text = os.fspath(python)
        try:
            words = shlex.split(text)
        except ValueError as error:
            fail("python", python, expected, source, hint=f"It does not split into words: {error}.")
    elif isinstance(python, Sequence) and not isinstance(python, bytes):
        words = [command_word(word, f"python[{i}]", source) for i, word in enumerate(python)]
    else:
        fail("python", python, expected, source)
    if not words or not words[0]:
        fail("python", python, expected, source)
    return tuple(words)


def _script_args(args: Any, source: str) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        fail(
            "args",
            args,
            "a list of arguments",
            source,
            hint=f"Wrap a single argument in a list: [{os.fsdecode(os.fspath(args))!r}].",
        )
    if isinstance(args, Mapping) or not isinstance(args, Iterable):
        fail("args", args, "a list of arguments", source)
    return [command_word(arg, f"args[{i}]", source) for i, arg in enumerate(args)]


def host_commands(
    spec: Any,
    script: str | os.PathLike,
    args: Sequence[Any] = (),
    python: str | Sequence[str] = "python",
    *,
    evaluator: bool | None = None,
    evaluator_host: str | None = None,
) -> list[HostCommand]:
    """Returns the command that starts each task of a cluster spec on its host.

    Each task gets its own ``TF_CONFIG`` (the spec's cluster plus its
    ``task``, and the spec's ``rpc_layer`` / ``environment`` if set), and
    runs ``python script args...``.

    Args:
        spec: Anything :func:`tfdist.spec.parse` accepts, read with
            ``require_task=False``: a spec name such as ``'two_workers'``, a
            path, a JSON string, a dict or a ``TFConfig``.
        script: The training script, e.g. ``'train.py'``. To run a module,
            pass ``'-m'`` and put the module first in ``args``.
        args: The script's arguments (strings; paths and numbers are
            converted with ``str``).
        python: The interpreter: a string split with :func:`shlex.split`
            (``'python3 -u'``, ``'uv run python'``) or a list of words. Every word
            is quoted in :attr:`HostCommand.command`, so the shell expands no
            ``~`` or ``$VAR`` in it: give absolute paths.
        evaluator: Also start a side-car evaluator (``evaluator:0``). None
            (the default) starts one when the spec's ``task`` is the
            evaluator, as in ``cluster_specs/parameter_server_evaluator.json``.
        evaluator_host: Where the evaluator runs; defaults to the host of the
            chief (or of worker 0 without a chief).

    Returns:
        One :class:`HostCommand` per task, in the order chief, workers, ps,
        evaluator.

    Raises:
        ClusterSpecError: The spec is invalid or has no cluster.
        ConfigError: A bad ``script``, ``args``, ``python`` or
            ``evaluator_host``; the message names the field.
    """
    source = "host_commands()"
    config = spec_lib.parse(spec, require_task=False)
    if not config.cluster:
        raise ClusterSpecError(
            "cluster",
            config.to_dict()["cluster"],
            "a cluster with at least one task",
            source=config.source,
            hint="Each task of the cluster needs an address; see cluster_specs/.",
        )
    script_word = command_word(script, "script", source)
    if not script_word:
        fail("script", script, "a non-empty script path", source)
    argv = (*_python_argv(python, source), script_word, *_script_args(args, source))

    if evaluator is None:
        evaluator = config.task_type == "evaluator"
    elif not isinstance(evaluator, bool):
        fail("evaluator", evaluator, "True, False or None", source)

    commands = []
    for task_type, index, address in config.tasks():
        host, _ = spec_lib.parse_address(address)
        commands.append(
            HostCommand(
                host=host,
                task_type=task_type,
                task_index=index,
                address=address,
                tf_config=config.with_task(task_type, index).to_dict(),
                argv=argv,
            )
        )
    if evaluator:
        if evaluator_host is None:
            host = commands[0].host  # The chief, else worker 0 (tasks() order).
        elif (
            isinstance(evaluator_host, str)
            and evaluator_host.strip()
            and not any(char.isspace() for char in evaluator_host)
        ):
            host = evaluator_host
        else:
            fail("evaluator_host", evaluator_host, "a host name without spaces", source)
        commands.append(
            HostCommand(
                host=host,
                task_type="evaluator",
                task_index=0,
                address=None,
                tf_config=config.with_task("evaluator", 0).to_dict(),
                argv=argv,
            )
        )
    elif evaluator_host is not None:
        fail(
            "evaluator_host",
            evaluator_host,
            "None unless an evaluator is started",
            source,
            hint="Pass evaluator=True to start one.",
        )
    return commands


def group_by_host(commands: Iterable[HostCommand]) -> dict[str, list[HostCommand]]:
    """Groups commands by host, hosts in order of first appearance.

    Host names are compared case-insensitively (DNS names are); the first
    spelling met is the key.
    """
    groups: dict[str, list[HostCommand]] = {}
    spelling: dict[str, str] = {}
    for command in commands:
        key = spelling.setdefault(command.host.lower(), command.host)
        groups.setdefault(key, []).append(command)
    return groups


def format_host_commands(commands: Iterable[HostCommand]) -> str:
    """Formats commands grouped by host, as ``tfdist hosts`` prints them.

    Each host gets a ``# host ...`` comment line, then for each of its tasks
    a ``# task ...`` comment and the command line. Several tasks on one host
    must run at the same time (one shell each, or end the lines with ``&``).
    """
    blocks = []
    for host, group in group_by_host(commands).items():
        plural = "task" if len(group) == 1 else "tasks, each in its own shell"
        lines = [f"# host {host}: {len(group)} {plural}"]
        for command in group:
            where = f" at {command.address}" if command.address else " (outside the cluster)"
            lines.append(f"# {command.task_id}{where}")
            lines.append(command.command)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""
