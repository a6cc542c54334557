"""Horovod's elastic states (``hvd.elastic.State`` and its TensorFlow/Keras kinds):
what a rank commits, restores after a failure and syncs from rank 0 when the
job changes size.
"""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import ConfigError, TfdistError
from tfdist.horovod import collectives, runtime
from tfdist.horovod.callbacks import model_state_variables
from tfdist.horovod.commits import CommitStore, commit_dir

log = logging.getLogger("tfdist.horovod")
_SOURCE = "tfdist.horovod.elastic"
#: Names of states in creation order: the commit file of each.
_state_numbers = itertools.count()


class State:
    """Training state that is committed, restored after a restart and synced.

    Subclasses say what the state is (:meth:`save`, :meth:`restore`,
    :meth:`sync`, and what a commit holds on disk).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._name = f"state-{next(_state_numbers)}"
        self._commits = 0
        self._entered = False
        self._wrote = False
        self._told_in_memory = False

    # Horovod's public API.

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Adds functions to call after a restart resumed from a commit.

        Typical use: set the learning rate for ``size()`` again. They run on
        every rank, before the state is synced from rank 0.
        """
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise ConfigError(
                    "callbacks",
                    callback,
                    "functions taking no argument",
                    source="State.register_reset_callbacks",
                )
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Runs :meth:`reset`, then the registered reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Saves the state in memory; rank 0 also writes it to disk atomically.

        Before the state first enters :func:`run`, a commit never replaces
        one this process did not write (a restarted job resumes from it).
        A commit per batch is fine for small models; for large ones commit
        every few batches: a failure loses what came after the last commit.
        """
        self.save()
        self._commits += 1
        if runtime.rank() == 0:
            store = self._store()
            # Before elastic.run has resumed, a commit must not overwrite the
            # one a restarted job is about to resume from.
            if store is not None and (self._entered or self._wrote or not store.path.exists()):
                store.write(dict(self._payload(), commit=self._commits))
                self._wrote = True
            elif not self._told_in_memory and runtime.size() > 1:
                log.warning(
                    "%s: commits stay in memory (no TFDIST_ELASTIC_DIR, not under "
                    "`tfdist launch`): a restarted job will start afresh",
                    _SOURCE,
                )
            self._told_in_memory = True
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Where a preemption takes effect (Horovod checks for new hosts here).

        Inside :func:`run`, a preemption signal to any rank makes every rank
        stop at the same commit, the one after the signal: that commit is
        written, and every process exits with code 143
        (:mod:`tfdist.training.fault_tolerance.preemption`). The restarted job resumes from it, with
        no step lost. Host changes themselves come from the launcher:
        ``tfdist launch --workers MIN:MAX`` restarts the job at a new size.
        """
        watcher = self.__dict__.get("_watcher")
        if watcher is not None and watcher.should_stop(self._commits):
            watcher.exit(
                {
                    "commit": self._commits,
                    "step": self._commits,
                    "backup": str(self._store().path) if self._store() else None,
                }
            )

    def save(self) -> None:
        """Snapshots the state in memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Puts back the last snapshot, undoing later changes."""
        raise NotImplementedError

    def sync(self) -> None:
        """Makes every rank's state rank 0's (a collective: every rank calls it)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Hook run after a restart, before the reset callbacks."""

    # What a commit holds on disk.

    def _payload(self) -> dict:
        raise NotImplementedError

    def _load(self, payload: dict, where: str) -> None:
        """Makes ``payload`` the snapshot (checked), then restores it."""
        raise NotImplementedError

    def _store(self) -> CommitStore | None:
        directory = commit_dir()
        return None if directory is None else CommitStore(directory, self._name)

    def _enter(self) -> None:
        """``elastic.run``'s entry: resume from a commit once, then sync."""
        if not self._entered:
            self._resume()
        self._entered = True
        self.sync()

    def _resume(self) -> None:
        status: tuple | None = None
        if runtime.rank() == 0:
            store = self._store()
            try:
                payload = store.read() if store is not None else None
                if payload is not None:
                    self._load(payload, str(store.path))
                    status = ("resumed", int(payload["commit"]), str(store.path))
            except Exception as error:  # Unreadable file too: no rank may wait.
                status = ("error", f"{type(error).__name__}: {error}")
                if runtime.size() == 1:
                    raise
                # Tell the others before raising, so that no rank waits.
                collectives.broadcast_object(status, root_rank=0)
                raise
        if runtime.size() > 1:
            status = collectives.broadcast_object(status, root_rank=0)
        if status is None:
            return
        if status[0] == "error":
            raise TfdistError(f"rank 0 could not resume: {status[1]}")
        self._commits = status[1]
        if runtime.rank() == 0:
            print(
                f"{_SOURCE}: resumed from commit {status[1]} in {status[2]}{self._describe()}",
                flush=True,
            )
        self.on_reset()

    def _describe(self) -> str:
        return ""


_RESERVED = frozenset({"model", "optimizer", "variables", "backend", "session"})


class ObjectState(State):
    """State made of Python attributes, given as keyword arguments.

    ``ObjectState(epoch=0, batch=0)`` makes ``state.epoch`` and ``state.batch``;
    they are saved by :meth:`save` (deep copies), restored, synced from rank 0
    (pickled) and written with every commit.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        for name in kwargs:
            if name.startswith("_") or name in _RESERVED:
                raise ConfigError(
                    name,
                    kwargs[name],
                    "an attribute name that does not start "
                    "with '_' and is not one of " + ", ".join(sorted(_RESERVED)),
                    source=type(self).__name__,
                )
            try:
                pickle.dumps(kwargs[name])
            except Exception as error:  # Any pickling failure: say which attribute.
                raise ConfigError(
                    name,
                    kwargs[name],
                    "a picklable value (commits and sync pickle the attributes)",
                    source=type(self).__name__,
                    hint=str(error),
                ) from error
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state and runtime.size() > 1:
            self._saved_state = collectives.broadcast_object(self._saved_state, root_rank=0)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def _payload(self) -> dict:
        return {"attrs": self._saved_state}

    def _load(self, payload: dict, where: str) -> None:
        attrs = payload.get("attrs", {})
        if set(attrs) != set(self._saved_state):
            raise ConfigError(
                "commit",
                where,
                f"a commit of the attributes {sorted(self._saved_state)}",
                source=_SOURCE,
                received=f"{where}: attributes {sorted(attrs)}",
                hint="Delete the commit or use another TFDIST_ELASTIC_DIR",
            )
        self._saved_state = attrs
        self.restore()

    def _describe(self) -> str:
        shown = ", ".join(
            f"{k}={v!r}"
            for k, v in sorted(self._saved_state.items())
            if isinstance(v, (int, float, str, bool))
        )
        return f": {shown}" if shown else ""


def _arrays(variables: list) -> list[np.ndarray]:
    # .numpy() is half the cost of keras.ops.convert_to_numpy here (MobileNetV2:
    # 9.5 vs 17.9 ms); the copy keeps the snapshot apart from TF's buffer.
    return [np.array(v.numpy()) for v in variables]


def _assign(variables: list, arrays: list) -> None:
    for var, value in zip(variables, arrays):
        var.assign(value)


def _check_arrays(what: str, variables: list, arrays: Any, where: str) -> None:
    """A commit must hold arrays of the variables' shapes, in order."""
    expected = [tuple(v.shape) for v in variables]
    got = [tuple(np.shape(a)) for a in arrays] if isinstance(arrays, list) else None
    if got != expected:
        raise ConfigError(
            "commit",
            where,
            f"a commit of {len(expected)} {what} variables with the same shapes as this script's",
            source=_SOURCE,
            received=f"{where}: {'no list' if got is None else len(got)} "
            f"{what} arrays, shapes {got if got is None else got[:6]}"
            f"{'...' if got and len(got) > 6 else ''} (expected "
            f"{expected[:6]}{'...' if len(expected) > 6 else ''})",
            hint="The model changed since the commit was written; delete it "
            "or use another TFDIST_ELASTIC_DIR",
        )


class _VariablesState(ObjectState):
    """ObjectState plus lists of variables (kept as numpy copies)."""

    def _groups(self) -> dict[str, list]:
        """Named lists of variables, e.g. ``{'model': [...], 'optimizer': [...]}``."""
        raise NotImplementedError

    def _save_variables(self) -> None:
        self._saved_variables = {k: _arrays(v) for k, v in self._groups().items()}

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        groups = self._groups()
        for name, arrays in self._saved_variables.items():
            _assign(groups[name], arrays)
        super().restore()

    def sync(self) -> None:
        if runtime.size() > 1:
            for variables in self._groups().values():
                if variables:
                    collectives.broadcast_variables(variables, root_rank=0)
        self._save_variables()
        super().sync()

    def _payload(self) -> dict:
        return dict(super()._payload(), variables=self._saved_variables)

    def _load(self, payload: dict, where: str) -> None:
        saved = payload.get("variables")
        groups = self._groups()
        for name, variables in groups.items():
            _check_arrays(name, variables, (saved or {}).get(name), where)
        self._saved_variables = {k: saved[k] for k in groups}
        super()._load(payload, where)


class TensorFlowKerasState(_VariablesState):
    """A Keras model and its optimizer, plus attributes.

    The model's variables (without random-seed states) and the optimizer's
    (slots, iterations, learning rate) are committed and synced.

    Args:
        model: A built Keras model.
        optimizer: Its optimizer; default: ``model.optimizer``. Built here
            with the model's trainable variables if it is not yet, so that
            its slots exist to be synced and committed.
        backend: Accepted for Horovod's signature; unused.
        **kwargs: Attributes to track, e.g. ``epoch=0, batch=0``.

    Raises:
        ConfigError: The model is not built, or there is no optimizer.
    """

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        source = type(self).__name__
        if not getattr(model, "built", False):
            raise ConfigError(
                "model",
                model,
                "a built model",
                source=source,
                hint="Call model.build(input_shape), or run one step first",
            )
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ConfigError("optimizer", None, "an optimizer, or a compiled model", source=source)
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self._save_variables()
        super().__init__(**kwargs)

    def _groups(self) -> dict[str, list]:
        return {
            "model": model_state_variables(self.model),
            "optimizer": list(self.optimizer.variables),
        }


class KerasState(TensorFlowKerasState):
    """``hvd.elastic.KerasState(model, optimizer=None, **kwargs)``: see TensorFlowKerasState."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class TensorFlowState(_VariablesState):
    """A list of variables (tf.Variable or Keras), plus attributes.

    Args:
        variables: The variables to track.
        session: Accepted for Horovod's signature; must be None (TF2).
        **kwargs: Attributes to track.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if (
            variables is None
            or isinstance(variables, (str, bytes))
            or not all(isinstance(v, (tf.Variable, keras.Variable)) for v in variables)
        ):
            raise ConfigError(
                "variables",
                variables,
                "a list of tf.Variable or Keras "
                "variables (TF2 has no global variables to default to)",
                source="TensorFlowState",
            )
        if session is not None:
            raise ConfigError(
                "session", session, "None (TensorFlow 2 runs eagerly)", source="TensorFlowState"
            )
        self.variables = list(variables)
        self.session = None
        self._save_variables()
        super().__init__(**kwargs)

    def _groups(self) -> dict[str, list]:
        return {"variables": self.variables}
