"""Atomic, checked files: fsync, SHA-256, the JSON pointer naming the latest good backup."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

from tfdist.errors import ConfigError, TfdistError
from tfdist.training.atomic import fsync as fsync_dir, replacing


class BackupError(TfdistError, RuntimeError):
    """A backup cannot be resumed from (damaged, or workers disagree)."""


# --------------------------------------------------------------------------
# Atomic file writes.


def fsync_file(path: str) -> None:
    """Flushes the file at ``path`` to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256(path: str) -> str:
    """The SHA-256 hex digest of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json_atomically(path: str, data: dict) -> None:
    """Writes ``data`` to ``path`` as JSON through a temporary file and a rename."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.json")
    with replacing(path, tmp, open(tmp, "w")) as f:
        json.dump(data, f, indent=1, sort_keys=True)
    fsync_dir(directory)


# --------------------------------------------------------------------------
# BackupAndRestore.

#: Name of the pointer file in a backup directory.
POINTER = "checkpoint.json"
TMP_PREFIX = ".tmp-"
CKPT_PREFIX = "ckpt-"
CKPT_SUFFIX = ".weights.h5"
_POINTER_KEYS = ("file", "sha256", "size", "epoch", "step", "save_count")


def read_backup_pointer(backup_dir: str | os.PathLike) -> dict | None:
    """Reads the pointer of a :class:`BackupAndRestore` directory.

    Returns:
        The pointer's fields (``file``, ``sha256``, ``size``, ``epoch`` = the
        epoch to resume at, ``step`` = batches of that epoch already trained,
        ``save_count``, ``writer``...), or None when there is no backup.

    Raises:
        BackupError: The pointer exists but cannot be read.
    """
    path = os.path.join(os.fspath(backup_dir), POINTER)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise BackupError(
            f"{path}: cannot read the backup pointer ({error}). "
            "Remove the backup directory to start over."
        ) from None
    missing = (
        [k for k in _POINTER_KEYS if k not in meta]
        if isinstance(meta, dict)
        else list(_POINTER_KEYS)
    )
    if missing:
        raise BackupError(f"{path}: the backup pointer lacks {missing}.")
    return meta


def check_backup_dir(value: Any) -> str:
    """``value`` as a local directory path, or raises ConfigError."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            "backup_dir", value, "a non-empty directory path", source="BackupAndRestore"
        )
    if "://" in value:
        raise ConfigError(
            "backup_dir",
            value,
            "a local or mounted directory (the backup relies on an atomic rename)",
            source="BackupAndRestore",
            hint="Mount the bucket (e.g. gcsfuse) or back up to a shared POSIX filesystem.",
        )
    return value
