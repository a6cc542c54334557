"""One save of a multi-worker job, written by the chief only: the chief writes into a
staging directory and moves it into place, each other worker saves into scratch
and waits for the chief's matching save, agreed through TensorFlow's
coordination service. Used by the Keras wrappers of :mod:`tfdist.training.saving`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from absl import logging

from tfdist.errors import TfdistError
from tfdist.training.atomic import fsync

#: Seconds a non-chief worker waits for the chief's matching save, on top of
#: twice the time its own save took.
WAIT_SECONDS = 120.0

_KEY_PREFIX = "tfdist/keras_saving"
TMP_PREFIX = ".tfdist-save-"
STATE = threading.local()
_COUNTS: dict[str, int] = {}
_COUNTS_LOCK = threading.Lock()


class ChiefSaveError(TfdistError, RuntimeError):
    """The chief's save failed, so this worker's matching save fails too."""


# --------------------------------------------------------------------------
# When the patch acts.


@contextlib.contextmanager
def unsynchronized():
    """Saves inside run as Keras runs them (for callers that coordinate
    their writers themselves, e.g. :class:`tfdist.BackupAndRestore`)."""
    previous = getattr(STATE, "off", False)
    STATE.off = True
    try:
        yield
    finally:
        STATE.off = previous


def multi_worker(strategy: Any) -> tuple[bool, bool]:
    """(tfdist multi-worker strategy of >= 2 workers, this task is the chief)."""
    from tfdist.strategies import MultiWorkerMirroredStrategy

    if not isinstance(strategy, MultiWorkerMirroredStrategy):
        return False, True
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return False, True
    spec = resolver.cluster_spec().as_dict()
    workers = len(spec.get("chief", ())) + len(spec.get("worker", ()))
    return workers > 1, bool(strategy.is_chief)


def active(model: Any = None) -> tuple[bool, bool]:
    """Whether saves of ``model`` are coordinated here, and whether this
    task is the chief: (False, True) outside a tfdist multi-worker job."""
    if getattr(STATE, "off", False):
        return False, True
    import tensorflow as tf

    strategy = getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()
    return multi_worker(strategy)


def local(path: str) -> bool:
    """Whether ``path`` is on a local (or mounted) filesystem."""
    from tfdist.compat.keras_src import file_utils

    return not (file_utils.is_remote_path(path) or path.startswith("hf://"))


# --------------------------------------------------------------------------
# Coordination: the chief publishes each save, the others wait for it.


def next_key(path: str) -> str:
    """The coordination-service key of the next save to ``path``."""
    name = os.path.basename(path.rstrip("/")) or path
    with _COUNTS_LOCK:
        count = _COUNTS.get(name, 0) + 1
        _COUNTS[name] = count
    return f"{_KEY_PREFIX}/{name}/{count}"


def _coordination():
    from tfdist.compat.tf_python import eager_context as context

    ctx = context.context()
    return ctx if ctx.coordination_service is not None else None


def publish(key: str, record: dict) -> None:
    """Sets ``key`` to ``record`` (JSON) in the coordination service, if any."""
    ctx = _coordination()
    if ctx is not None:
        ctx.set_config_key_value(key, json.dumps(record))


@contextlib.contextmanager
def publishing(key: str, record: dict) -> Iterator[None]:
    """Publishes ``record`` under ``key`` once the block ends: ``"ok": True``,
    or the error that ended it (which still propagates)."""
    record = {**record, "ok": False}
    try:
        yield
        record["ok"] = True
    except BaseException as error:
        record["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        publish(key, record)


def wait(key: str, path: str, own_seconds: float) -> dict | None:
    """The chief's record for ``key``; None if it did not come in time."""
    ctx = _coordination()
    if ctx is None:
        logging.warning(
            "tfdist: no coordination service; %s may be read before the "
            "chief has finished writing it",
            path,
        )
        return None
    import tensorflow as tf

    timeout = WAIT_SECONDS + 2 * own_seconds
    try:
        return json.loads(ctx.get_config_key_value(key, int(timeout * 1000)))
    except tf.errors.DeadlineExceededError:
        logging.warning(
            "tfdist: the chief made no save matching this worker's save of %s within "
            "%.0f s; going on without it. Call model.save (and save_weights) on every "
            "worker with the same file name, or on the chief only.",
            path,
            timeout,
        )
    except tf.errors.OpError as error:
        # The service lives in the chief's process: the chief has exited (it
        # may be ahead: it waits for nobody). Its files are complete anyway.
        logging.warning(
            "tfdist: cannot ask the chief about its save of %s (%s); going on without it.",
            path,
            str(error).splitlines()[0],
        )
    return None


# --------------------------------------------------------------------------
# Files.


def _sweep(directory: str) -> None:
    """Removes temporary directories of earlier saves killed on this host."""
    mark = f"{TMP_PREFIX}{socket.gethostname()}-"
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(mark):
            continue
        pid = name[len(mark) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into(staging: str, name: str, directory: str) -> None:
    """Moves what a save wrote in ``staging`` into ``directory``: the files
    other than ``name`` (shards) first, ``name`` itself last."""
    entries = sorted(os.listdir(staging), key=lambda entry: entry == name)
    for entry in entries:
        source, target = os.path.join(staging, entry), os.path.join(directory, entry)
        if os.path.isdir(source) and os.path.isdir(target):
            old = os.path.join(staging, f"{entry}.old")
            os.replace(target, old)  # An unzipped model directory.
            os.replace(source, target)
            shutil.rmtree(old, ignore_errors=True)
        elif os.stat(staging).st_dev == os.stat(directory).st_dev:
            os.replace(source, target)
        else:
            tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
            shutil.move(source, tmp)
            os.replace(tmp, target)
    fsync(directory)


def _staged(path: str, save: Callable[[str], Any], directory: str) -> Any:
    """Runs ``save(staged_path)`` in a fresh directory inside ``directory``."""
    staging = os.path.join(
        directory, f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
    )
    os.mkdir(staging)
    name = os.path.basename(path)
    try:
        value = save(os.path.join(staging, name))
        for entry in os.listdir(staging):
            fsync(os.path.join(staging, entry))
        _move_into(staging, name, os.path.dirname(path) or ".")
        return value
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _chief_save(path: str, save: Callable[[str], Any]) -> Any:
    key = next_key(path)
    directory = os.path.dirname(os.path.abspath(path))
    with publishing(key, {"path": os.path.abspath(path) if local(path) else path}):
        if local(path) and os.path.isdir(directory):
            _sweep(directory)
            return _staged(os.path.abspath(path), save, directory)
        # Remote (object stores replace whole objects), or Keras's own error.
        return save(path)


def _worker_save(path: str, save: Callable[[str], Any]) -> Any:
    key = next_key(path)
    if local(path) and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        # The chief fails on this path before any collective: fail alike,
        # rather than wait in one (scratch would have let the save start).
        return save(path)
    scratch = tempfile.mkdtemp(prefix="tfdist-save-")
    try:
        started = time.monotonic()
        value = save(os.path.join(scratch, os.path.basename(path.rstrip("/"))))
        record = wait(key, path, time.monotonic() - started)
        if record is not None and not record["ok"]:
            raise ChiefSaveError(
                f"The chief failed to save {record['path']} ({record.get('error')}); "
                f"this worker's save of {path} fails with it."
            )
        mine = os.path.abspath(path) if local(path) else path
        if record is None:
            # The chief's path is unknown: write only where nothing is yet.
            own = local(path) and not os.path.exists(mine)
        else:
            own = local(path) and record["path"] != mine
        if own:
            # Its own path (e.g. the tutorial's workertemp_<id>/): as asked.
            _move_into(scratch, os.path.basename(path), os.path.dirname(mine))
        return value
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def holds_split_weights(model: Any) -> bool:
    """Whether ``model`` has weights split over devices (tensor parallelism,
    keras.distribution layouts): its saves take long enough to be killed
    midway, so one process alone writes them atomically too."""
    if model is None or not hasattr(model, "weights"):
        return False
    from tfdist.parallel import sharding

    return any(sharding.is_sharded(v) for v in model.weights)


def coordinated(path: Any, model: Any, save: Callable[[str], Any]) -> Any:
    """Runs ``save(path)``, on the chief and workers coordinated when active;
    one process alone writes atomically when the model has split weights."""
    on, chief = active(model)
    if not isinstance(path, (str, os.PathLike)) or not (on or holds_split_weights(model)):
        return save(path)  # File objects are private to the caller.
    path = os.fspath(path)
    return (_chief_save if chief else _worker_save)(path, save)
