"""Full weights outside: every way out of a model sees whole weights.

A sharded weight (:mod:`tfdist.parallel.sharding`) is a MirroredVariable
whose components hold different shards. Keras and TensorFlow read a
MirroredVariable from its first component, so without this module
``get_weights()``, ``model.save`` and ``tf.train.Checkpoint`` keep shard 0
alone, silently. :func:`install` (called by
:func:`tfdist.parallel.attach.attach` for T > 1) makes each of them use full
values:

* ``Layer.get_weights()`` / ``set_weights()`` (``Model``'s too) give and take
  full shapes; ``set_weights`` checks a value against the full shape.
* ``model.save`` / ``save_weights`` / ``keras.models.load_model``: while a
  layer or an optimizer saves its own variables (``save_own_variables``), its
  sharded variables are written whole: into an HDF5 store block by block,
  never gathered whole in one process (the blocks other processes hold
  come one at a time); while it loads them (``load_own_variables``), a full value assigned to a
  sharded variable goes to each component as that replica's shard
  (``assign_full``). A layer class is covered when it first creates a
  sharded weight (:func:`tfdist.parallel.sharding.cover`, from
  ``add_sharded_weight``).
* The legacy HDF5 format (``model.save("m.h5")``, ``load_model``,
  ``load_weights``) writes full values of weights and optimizer variables
  and checks loaded ones against the full shape; so does
  ``optimizer.set_weights``.
* Optimizer slots created from a sharded weight
  (``add_variable_from_reference``: Adam's moments, SGD's momentum) are
  registered as sharded like it, so they are saved whole too, and load
  into whatever layout the loading model has.
* ``tf.train.Checkpoint``: a sharded Keras variable serializes its full
  value and restores a full value into its shards (Keras's TensorFlow
  ``Variable._serialize_to_tensors`` / ``_restore_from_tensors``, wrapped
  once). A slot restored before it is registered (a deferred restore, in
  the optimizer's build) keeps the full value until it is.

Files and checkpoints thus hold only full weights: a model saved at T = 2
loads with no strategy, at T = 1 or at any T that divides its widths.

Under MultiWorkerMirrored a full value may be a collective
(:func:`tfdist.parallel.sharding.full_value`): every worker must save at the
same point, as Keras's and tfdist's multi-worker saving already require.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist import record as kept
from tfdist.parallel import sharding

__all__ = [
    "install",
    "creating_slot",
    "full_weights",
    "wrap_get_weights",
    "wrap_set_weights",
    "wrap_save",
    "wrap_load",
    "wrap_legacy_subset",
    "wrap_legacy_optimizer",
    "wrap_legacy_set",
    "wrap_optimizer_set",
    "wrap_slot",
    "wrap_serialize",
    "wrap_restore",
]


class _FullIO:
    """Marks a sharded variable that reads and takes full values for now."""


@dataclasses.dataclass
class _PendingRestore:
    """A restored full value waiting for its slot variable to be registered."""

    value: Any


_VALUE_KEY = "VARIABLE_VALUE"

#: The spec of the sharded weight whose slot is being created (per thread).
_creating = threading.local()


def full_weights(variables: Iterable[Any]) -> list[np.ndarray]:
    """Full values of ``variables`` (sharded or not), as numpy arrays."""
    return [
        sharding.full_value(v) if sharding.is_sharded(v) else np.asarray(v.numpy())
        for v in variables
    ]


# --- get_weights / set_weights -------------------------------------------------


def wrap_get_weights(original):
    @functools.wraps(original)
    def get_weights(self):
        weights = self.weights
        if not any(sharding.is_sharded(v) for v in weights):
            return original(self)
        return full_weights(weights)

    return get_weights


def wrap_set_weights(original):
    @functools.wraps(original)
    def set_weights(self, weights):
        variables = self.weights
        if not any(sharding.is_sharded(v) for v in variables):
            return original(self, weights)
        weights = list(weights)
        if len(variables) != len(weights):
            raise ValueError(
                f"You called `set_weights(weights)` on layer '{self.name}' with a weight "
                f"list of length {len(weights)}, but the layer was expecting "
                f"{len(variables)} weights."
            )
        for variable, value in zip(variables, weights):
            spec = sharding.spec_of(variable)
            expected = spec.full_shape if spec else tuple(variable.shape)
            if tuple(np.shape(value)) != tuple(expected):
                raise ValueError(
                    f"Layer {self.name} weight shape {tuple(expected)} "
                    f"{'(the full shape of a sharded weight) ' if spec else ''}is not "
                    f"compatible with provided weight shape {tuple(np.shape(value))}."
                )
        for variable, value in zip(variables, weights):
            if sharding.is_sharded(variable):
                sharding.assign_full(variable, value)
            else:
                variable.assign(value)

    return set_weights


# --- model.save / load_model ---------------------------------------------------


class _FullStore:
    """A weights store that writes sharded variables whole, block by block.

    Layers store the variable itself (``store["0"] = v``); the store would
    read it with ``np.array(v)``, which is shard 0. Where the store is an
    HDF5 file (``.weights.h5``, ``.keras``, keras-hub presets), the full-shape
    dataset is created empty and each block written into its slice as it
    comes (:func:`tfdist.parallel.sharding.write_blocks`), so no process
    holds a whole split weight; elsewhere the full value is gathered.
    """

    def __init__(self, store: Any) -> None:
        self._store = store

    def __setitem__(self, key, value):
        if isinstance(value, _Blocks):  # The optimizer stores ``v.numpy()``.
            value = value.variable
        if sharding.is_sharded(value):
            from tfdist.compat.h5_store import new_dataset

            spec = sharding.spec_of(value)
            dtype = sharding.inner_variable(value).dtype.as_numpy_dtype
            dataset = new_dataset(self._store, key, spec.full_shape, dtype)
            if dataset is not None:
                sharding.write_blocks(value, dataset.__setitem__)
                return
            value = sharding.full_value(value)
        self._store[key] = value

    def __getitem__(self, key):
        return self._store[key]

    def __contains__(self, key):
        return key in self._store

    def __len__(self):
        return len(self._store)

    def keys(self):
        return self._store.keys()

    def __getattr__(self, name):
        return getattr(self._store, name)


class _Blocks:
    """What a sharded variable's ``numpy()`` gives while its owner saves: the
    variable, which :class:`_FullStore` writes block by block; read whole
    (``np.asarray``) by anything else."""

    def __init__(self, variable: Any) -> None:
        self.variable = variable
        spec = sharding.spec_of(variable)
        self.shape = spec.full_shape
        self.dtype = np.dtype(sharding.inner_variable(variable).dtype.as_numpy_dtype)

    def __array__(self, dtype=None, copy=None):
        value = sharding.full_value(self.variable)
        return value if dtype is None else value.astype(dtype)


def _assign_loaded(variable: Any, value: Any) -> None:
    spec = sharding.spec_of(variable)
    shape = tuple(np.shape(value))
    if shape != spec.full_shape:
        raise ValueError(
            f"tfdist.parallel: the saved value of {getattr(variable, 'path', variable.name)} "
            f"has shape {shape}; expected the full shape {spec.full_shape} (files hold full "
            f"weights; this variable is a shard of shape {spec.shard_shape}: "
            f"{spec.describe_weight()})"
        )
    # A _Sliced value is read block by block: never whole in this process.
    sharding.assign_full(variable, value if isinstance(value, _Sliced) else np.asarray(value))


@contextlib.contextmanager
def _full_io(variables: Iterable[Any]):
    """While a layer or optimizer saves or loads its own variables, its
    sharded ones read (``numpy()``) and take (``assign``) full values.

    Instance attributes, removed afterwards: training keeps the plain
    per-replica ``assign``.
    """
    patched = []
    for v in variables:
        if sharding.is_sharded(v) and kept.slot(v, _FullIO) is None:
            kept.attach(v, _FullIO())
            vars(v)["numpy"] = functools.partial(_Blocks, v)
            vars(v)["assign"] = functools.partial(_assign_loaded, v)
            patched.append(v)
    try:
        yield
    finally:
        for v in patched:
            kept.detach(v, _FullIO)
            for name in ("numpy", "assign"):
                vars(v).pop(name, None)


def _own_variables(obj: Any) -> list:
    """The variables a saveable writes in its own ``save_own_variables``."""
    from tfdist.compat.keras_src import BaseOptimizer

    if isinstance(obj, BaseOptimizer):
        return list(obj.variables)
    return list(getattr(obj, "_trainable_variables", [])) + list(
        getattr(obj, "_non_trainable_variables", [])
    )


def wrap_save(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        variables = _own_variables(self)
        if not any(sharding.is_sharded(v) for v in variables):
            return original(self, store)
        with _full_io(variables):
            return original(self, _FullStore(store))

    return save_own_variables


class _Sliced:
    """A dataset of the weights file, read only where indexed: a split
    weight's blocks (:func:`tfdist.parallel.sharding.assign_full` indexes
    its value once per local block). Read whole (``np.asarray``) by
    anything else."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self.shape = tuple(dataset.shape)
        self.dtype = dataset.dtype

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._dataset[index]

    def __array__(self, dtype=None, copy=None):
        value = np.asarray(self._dataset[()])
        return value if dtype is None else value.astype(dtype)


class _BlockStore:
    """Keras's weights store, whose datasets are read by block (:class:`_Sliced`)
    where the file allows it, so that a process loads only the blocks its
    devices hold."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getitem__(self, key: str) -> Any:
        from tfdist.compat.h5_store import lazy_dataset

        dataset = lazy_dataset(self._store, key)
        # A scalar (the optimizer's step count) is read as Keras reads it.
        if dataset is None or dataset.ndim == 0:
            return self._store[key]
        return _Sliced(dataset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __contains__(self, key: str) -> bool:
        return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def __iter__(self):
        return iter(self._store)


def wrap_load(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        variables = _own_variables(self)
        if not any(sharding.is_sharded(v) for v in variables):
            return original(self, store)
        with _full_io(variables):
            return original(self, _BlockStore(store))

    return load_own_variables


# --- legacy HDF5 (model.save("m.h5")) ------------------------------------------


class _Full:
    """A sharded variable's full value under its name, for the legacy HDF5
    writer (it reads ``path`` and converts with ``np.array``)."""

    def __init__(self, variable: Any) -> None:
        self.path = variable.path
        self._value = sharding.full_value(variable)

    def __array__(self, dtype=None, copy=None):
        return self._value if dtype is None else self._value.astype(dtype)


def _full_or_same(variables: Iterable[Any]) -> list:
    return [_Full(v) if sharding.is_sharded(v) else v for v in variables]


def wrap_legacy_subset(original):
    @functools.wraps(original)
    def save_subset_weights_to_hdf5_group(group, weights):
        return original(group, _full_or_same(weights))

    return save_subset_weights_to_hdf5_group


class _Weights:
    """What the legacy writer reads from an optimizer that is not a Keras 3
    one: ``weights``."""

    def __init__(self, weights: list) -> None:
        self.weights = weights


def wrap_legacy_optimizer(original):
    @functools.wraps(original)
    def save_optimizer_weights_to_hdf5_group(group, optimizer):
        variables = list(getattr(optimizer, "variables", []))
        if not any(sharding.is_sharded(v) for v in variables):
            return original(group, optimizer)
        return original(group, _Weights(_full_or_same(variables)))

    return save_optimizer_weights_to_hdf5_group


def _assign_checked(variables: list, values: list, what: str, skip_mismatch: bool = False):
    """Assigns full values to the sharded ones among ``variables``; returns
    the other (variable, value) pairs."""
    rest = []
    for variable, value in zip(variables, values):
        spec = sharding.spec_of(variable)
        if spec is None:
            rest.append((variable, value))
            continue
        if tuple(np.shape(value)) != spec.full_shape:
            message = (
                f"Shape mismatch in {what} for weight {variable.path}. Weight "
                f"expects the full shape {spec.full_shape} (a sharded weight). "
                f"Received saved weight with shape {tuple(np.shape(value))}"
            )
            if skip_mismatch:
                warnings.warn(message, stacklevel=3)
                continue
            raise ValueError(message)
        sharding.assign_full(variable, value)
    return rest


def wrap_legacy_set(original):
    @functools.wraps(original)
    def _set_weights(instance, symbolic_weights, weight_values, name, skip_mismatch=False):
        if not any(sharding.is_sharded(v) for v in symbolic_weights):
            return original(instance, symbolic_weights, weight_values, name, skip_mismatch)
        rest = _assign_checked(list(symbolic_weights), list(weight_values), name, skip_mismatch)
        if rest:
            return original(
                instance, [v for v, _ in rest], [w for _, w in rest], name, skip_mismatch
            )
        if hasattr(instance, "finalize_state"):
            instance.finalize_state()

    return _set_weights


def wrap_optimizer_set(original):
    @functools.wraps(original)
    def set_weights(self, weights):
        variables = list(getattr(self, "_variables", []))
        if not self.built or not any(sharding.is_sharded(v) for v in variables):
            return original(self, weights)
        weights = list(weights)
        rest = _assign_checked(variables[: len(weights)], weights, f"optimizer '{self.name}'")
        for variable, value in rest:
            if tuple(variable.shape) != tuple(np.shape(value)):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape "
                    f"{tuple(variable.shape)} not compatible with provided "
                    f"weight shape {tuple(np.shape(value))}."
                )
            variable.assign(value)

    return set_weights


# --- optimizer slots -------------------------------------------------------------


def creating_slot() -> bool:
    """Whether this thread is creating an optimizer slot of a sharded weight
    (the slot is sharded like it when it exists)."""
    return getattr(_creating, "spec", None) is not None


def wrap_slot(original):
    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        spec = sharding.spec_of(reference_variable)
        if spec is None:
            return original(self, reference_variable, *args, **kwargs)
        outer = getattr(_creating, "spec", None)
        _creating.spec = spec
        try:
            slot = original(self, reference_variable, *args, **kwargs)
        finally:
            _creating.spec = outer
        if not sharding.is_sharded(slot):
            sharding.register_like(slot, reference_variable)
            pending = kept.slot(slot, _PendingRestore)
            if pending is not None:
                kept.detach(slot, _PendingRestore)
                _assign_full_tensor(slot, pending.value)
        return slot

    return add_variable_from_reference


# --- tf.train.Checkpoint ------------------------------------------------------


def _full_tensor(variable: Any) -> tf.Tensor:
    """The full value as a tensor; graph-safe (a multi-task checkpoint saves
    inside a tf.function). A collective when the blocks span processes."""
    return sharding.full_tensor(variable)


def _assign_full_tensor(variable: Any, value: Any) -> Any:
    """Writes a full value (a tensor) into the shards; graph-safe."""
    spec = sharding.spec_of(variable)
    value = tf.convert_to_tensor(value)
    if value.shape.is_fully_defined() and tuple(value.shape) != spec.full_shape:
        raise ValueError(
            f"tfdist.parallel: the checkpoint's value of "
            f"{getattr(variable, 'path', variable.name)} has shape {tuple(value.shape)}; "
            f"expected the full shape {spec.full_shape}"
        )
    components = spec.strategy.experimental_local_results(sharding.inner_variable(variable))
    ops = []
    for i, component in enumerate(components):
        block = spec.block(value, spec.runtime.first + i)
        ops.append(component.assign(tf.cast(block, component.dtype)))
    return tf.group(ops) if not tf.executing_eagerly() else None


def wrap_serialize(original):
    @functools.wraps(original)
    def _serialize_to_tensors(self):
        if sharding.is_sharded(self):
            return {_VALUE_KEY: _full_tensor(self)}
        return original(self)

    return _serialize_to_tensors


def wrap_restore(original):
    @functools.wraps(original)
    def _restore_from_tensors(self, restored_tensors):
        if sharding.is_sharded(self):
            return _assign_full_tensor(self, restored_tensors[_VALUE_KEY])
        spec = getattr(_creating, "spec", None)
        value = restored_tensors.get(_VALUE_KEY)
        if (
            spec is not None
            and tuple(self.shape) == spec.shard_shape
            and tuple(getattr(value, "shape", ())) == spec.full_shape
        ):
            # A deferred restore of a slot being created from a sharded
            # weight, before it is registered: the slot wrapper applies it.
            kept.attach(self, _PendingRestore(value))
            return None
        return original(self, restored_tensors)

    return _restore_from_tensors


# --- install ----------------------------------------------------------------------


def install() -> None:
    """Wraps Keras's weight access, saving and checkpointing once: the
    registry's ``tensor_parallel``, with :mod:`tfdist.parallel.grads`;
    idempotent.

    Raises:
        tfdist.ConfigError: A target changed in this Keras and tensor
            parallelism was switched off (with a warning).
    """
    from tfdist import compat
    from tfdist.compression import keras_hook

    # Compression's wrappers of the optimizer's save/load go inside ours
    # (the registry's order).
    keras_hook.install()
    compat.install("tensor_parallel")
    compat.require("tensor_parallel", "model_parallel")
