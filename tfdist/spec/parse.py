"""Reading a cluster spec from wherever it is: ``$TF_CONFIG``, a dict, JSON text, a
file, a name in ``cluster_specs/``, standard input or a ClusterResolver.

:func:`parse` reads the source, rejects duplicated JSON keys with the line, and
hands the data to :func:`~tfdist.spec.tf_config.from_data`. No TensorFlow: a
ClusterResolver is recognised by its class names.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfdist.errors import ClusterSpecError
from tfdist.spec.names import DEFAULT_SPEC_DIR, RESOLVER_SOURCE, SPEC_DIR_ENV
from tfdist.spec.tf_config import TFConfig, from_data, validate

# Reading sources.
# --------------------------------------------------------------------------


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook refusing duplicated keys (JSON keeps the last)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _json_hint(text: str, error: json.JSONDecodeError) -> str:
    """A hint for a JSON syntax error: likely cause and the offending line."""
    hints = []
    if "double quotes" in error.msg and "'" in text:
        hints.append(
            "JSON needs double quotes, not single quotes (is this a Python dict? use json.dumps())."
        )
    elif re.search(r",\s*[}\]]", text):
        hints.append("JSON does not allow a trailing comma before '}' or ']'.")
    lines = text.splitlines()
    if 0 < error.lineno <= len(lines):
        line = lines[error.lineno - 1].strip()
        if len(line) > 120:
            line = line[:117] + "..."
        hints.append(f"Line {error.lineno}: {line}")
    return " ".join(hints)


def _loads(text: str, source: str) -> Any:
    """json.loads that raises ClusterSpecError (field '<json>')."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ClusterSpecError(
            "<json>",
            text,
            "valid JSON",
            source=source,
            line=error.lineno,
            column=error.colno,
            received=f"{error.msg} at line {error.lineno}, column {error.colno}",
            hint=_json_hint(text, error),
        ) from None
    except _DuplicateKey as duplicate:
        raise ClusterSpecError(
            "<json>",
            duplicate.key,
            "unique keys in each JSON object",
            source=source,
            received=f"the key {duplicate.key!r} twice",
            hint="JSON silently keeps only the last one; merge them.",
        ) from None
    except RecursionError:
        raise ClusterSpecError(
            "<json>", None, "valid JSON", source=source, received="JSON nested too deeply"
        ) from None


def _spec_dir(environ: Mapping[str, str]) -> Path:
    override = environ.get(SPEC_DIR_ENV)
    return Path(override).expanduser() if override else DEFAULT_SPEC_DIR


def _display_path(path: Path) -> str:
    """The path relative to the current directory when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _find_spec(source: str | os.PathLike, environ: Mapping[str, str]) -> Path:
    """Finds a spec file: the path as given, then in the spec directory."""
    given = Path(os.fsdecode(os.fspath(source))).expanduser()
    candidates = [given]
    if given.name and given.suffix != ".json":
        candidates.append(given.with_name(given.name + ".json"))
    spec_dir = _spec_dir(environ)
    if given.name and len(given.parts) == 1:  # A bare name such as 'two_workers'.
        candidates.append(spec_dir / given.name)
        if given.suffix != ".json":
            candidates.append(spec_dir / (given.name + ".json"))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    try:
        available = sorted(p.stem for p in spec_dir.glob("*.json"))
    except OSError:
        available = []
    listing = ", ".join(available) if available else "none"
    raise ClusterSpecError(
        "path",
        os.fsdecode(os.fspath(source)),
        f"a JSON string, a JSON file, or the name of a spec in {spec_dir}",
        source=_display_path(given),
        hint=f"Searched: {', '.join(str(c) for c in candidates)}. Specs in {spec_dir} "
        f"(override with ${SPEC_DIR_ENV}): {listing}.",
    )


def _read_spec(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ClusterSpecError(
            "path",
            str(path),
            "a readable UTF-8 JSON file",
            source=_display_path(path),
            received=f"{str(path)!r} ({error})",
        ) from None


def parse(
    source: Any = None,
    *,
    env: Mapping[str, str] | None = None,
    require_task: bool = True,
    strategy: str | None = None,
) -> TFConfig:
    """Reads and validates a ``TF_CONFIG`` or cluster spec.

    Args:
        source: Where to read it from:

            * None: the ``TF_CONFIG`` environment variable (of ``env``);
              unset or blank means local training.
            * a dict (TF_CONFIG shape) or a :class:`TFConfig` (re-validated);
            * a JSON string (starting with ``{`` or ``[``, or ``null``); a
              blank string means local training;
            * a ``tf.distribute.cluster_resolver.ClusterResolver``, as
              TensorFlow's strategies take one. A parameter-server cluster
              from a resolver needs no chief and no task: the caller is the
              coordinator, as in TensorFlow's tutorial;
            * a path (``str`` or ``os.PathLike``) to a JSON file, or a bare
              name such as ``'two_workers'`` / ``'two_workers.json'`` looked
              up in the spec directory: ``$TFDIST_SPEC_DIR`` if set, else the
              repository's ``cluster_specs/``.
        env: Environment to read ``TF_CONFIG`` and ``TFDIST_SPEC_DIR`` from;
            defaults to ``os.environ``.
        require_task: True for a process's TF_CONFIG (a cluster of more than
            one task needs a ``task``); False for spec files, whose ``task``
            is optional (but checked when present).
        strategy: None (or ``'auto'``) to infer the rules from the cluster, or one of
            :data:`STRATEGIES` to add that strategy's rules: no ``ps`` job for
            ``'multi_worker_mirrored'``; a chief, workers and ps for
            ``'parameter_server'`` (also applied when a ``ps`` job is
            present); at most one task for ``'mirrored'``, ``'one_device'``,
            ``'default'`` and ``'tpu'``.

    Returns:
        The validated :class:`TFConfig`.

    Raises:
        ClusterSpecError: Any problem (bad JSON, missing file, a rule broken);
            its ``field`` names the offending field, e.g. ``'task.index'``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if is_cluster_resolver(source):
        data = _resolver_data(source)
        # A parameter-server resolver is read by the coordinator, which need
        # not be one of the cluster's tasks.
        ps_job = "ps" in data.get("cluster", {})
        return from_data(
            data, RESOLVER_SOURCE, require_task=require_task and not ps_job, strategy=strategy
        )
    if source is None:
        text = environ.get("TF_CONFIG")
        data = {} if text is None or not str(text).strip() else _loads(str(text), "TF_CONFIG")
        return from_data(data, "TF_CONFIG", require_task=require_task, strategy=strategy)
    if isinstance(source, TFConfig):
        return validate(source, require_task=require_task, strategy=strategy)
    if isinstance(source, Mapping):
        return from_data(source, "<dict>", require_task=require_task, strategy=strategy)
    if isinstance(source, str):
        stripped = source.strip()
        if not stripped or stripped[0] in "{[" or stripped == "null":
            data = _loads(source, "<string>") if stripped else {}
            return from_data(data, "<string>", require_task=require_task, strategy=strategy)
    if isinstance(source, (str, os.PathLike)):
        path = _find_spec(source, environ)
        data = _loads(_read_spec(path), _display_path(path))
        return from_data(data, _display_path(path), require_task=require_task, strategy=strategy)
    raise ClusterSpecError(
        "<root>",
        source,
        "a TF_CONFIG dict, a JSON string, a TFConfig, or the path of a JSON file",
        source="parse()",
    )


def is_cluster_resolver(obj: Any) -> bool:
    """Whether ``obj`` is a ``tf.distribute.cluster_resolver.ClusterResolver``.

    Read from the class names, so that TensorFlow need not be imported.
    """
    return any(cls.__name__ == "ClusterResolver" for cls in type(obj).__mro__)


def _resolver_data(resolver: Any) -> dict[str, Any]:
    """The TF_CONFIG-shaped data of a ClusterResolver."""
    data: dict[str, Any] = {"cluster": dict(resolver.cluster_spec().as_dict())}
    if resolver.task_type is not None:
        data["task"] = {"type": resolver.task_type, "index": resolver.task_id}
    rpc_layer = getattr(resolver, "rpc_layer", None)
    if rpc_layer:
        data["rpc_layer"] = rpc_layer
    return data


# --------------------------------------------------------------------------
