"""Where ``tfdist.horovod.elastic`` keeps its commits, and how it writes them.

A commit is one file, ``<dir>/<name>.commit``, written by rank 0 only and
atomically: the bytes go to a hidden temporary file in the same directory,
which is flushed and fsync'ed, then renamed over the old commit, and the
directory is fsync'ed. A reader therefore sees the previous commit or the new
one, never a half-written file; a temporary file left by a crash is never read.

The directory, first match wins:

1. ``TFDIST_ELASTIC_DIR``: chosen by the user; kept. A job launched again
   with the same directory resumes from its commit (like a backup).
2. ``$TFDIST_JOB_DIR/elastic``: ``tfdist launch`` gives every task a scratch
   directory of the launch, the same across its restarts and removed when
   the launch ends. A restarted job resumes; a new launch starts afresh.
3. None: commits stay in memory (as in Horovod); nothing survives a restart.

This module imports no TensorFlow.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfdist.errors import ConfigError

__all__ = ["ELASTIC_DIR_ENV", "JOB_DIR_ENV", "FORMAT", "commit_dir", "CommitStore"]

ELASTIC_DIR_ENV = "TFDIST_ELASTIC_DIR"
JOB_DIR_ENV = "TFDIST_JOB_DIR"
#: Written into every commit; a file without it is refused.
FORMAT = "tfdist.horovod.elastic/1"


def commit_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The directory commits go to (see the module docstring), or None."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(ELASTIC_DIR_ENV)
    if chosen:
        return Path(chosen)
    job = environ.get(JOB_DIR_ENV)
    if job:
        return Path(job) / "elastic"
    return None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CommitStore:
    """One state's commit file in ``directory``.

    Args:
        directory: Where the file lives (created on the first write).
        name: The file's stem, e.g. ``'state-0'``.
    """

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = Path(directory)
        self.name = name

    @property
    def path(self) -> Path:
        return self.directory / f"{self.name}.commit"

    def write(self, payload: dict) -> None:
        """Replaces the commit with ``payload`` atomically (temp file, fsync, rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data = pickle.dumps(dict(payload, format=FORMAT), protocol=pickle.HIGHEST_PROTOCOL)
        temp = self.directory / f".{self.name}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path)
        finally:
            if temp.exists():
                temp.unlink()
        _fsync_dir(self.directory)

    def read(self) -> dict | None:
        """The last commit, or None if there is none.

        Raises:
            ConfigError: The file is not a commit of this format.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            payload: Any = pickle.loads(data)
        except Exception as error:  # Not ours: say which file, do not guess.
            raise ConfigError(
                ELASTIC_DIR_ENV,
                str(self.path),
                "a commit written by tfdist.horovod.elastic",
                source="tfdist.horovod.elastic",
                received=f"{self.path}: {error}",
            ) from error
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ConfigError(
                ELASTIC_DIR_ENV,
                str(self.path),
                f"a commit in the format {FORMAT!r}",
                source="tfdist.horovod.elastic",
                received=f"{self.path}: format "
                f"{payload.get('format') if isinstance(payload, dict) else None!r}",
            )
        return payload
