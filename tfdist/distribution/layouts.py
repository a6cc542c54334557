"""A ``keras.distribution`` layout, applied to a weight on TensorFlow.

Under a ``ModelParallel`` distribution (:mod:`~tfdist.distribution.model_parallel`)
each weight Keras creates asks the distribution for its layout
(``get_variable_layout``, the call Keras's JAX backend makes when it creates
a variable; the TensorFlow backend never makes it). A layout that splits the
weight gives a :class:`~tfdist.parallel.sharding.ShardSpec`: each dimension
named by the mesh's model axis is split over the tensor group, each named by
its batch axis over the data-parallel group. The weight is then a
MirroredVariable of the block's shape whose components hold different
blocks of the one full initial value, and its optimizer slots are blocks too
(:mod:`tfdist.parallel.saving` registers them).

Read inside a layer's call, in a replica, the weight is gathered whole
(:func:`tfdist.parallel.collectives.gather_blocks`): its gradient comes back
summed over every replica, block by block, as FSDP does. A leaf layer's
call gathers again for the backward pass (:mod:`~tfdist.distribution.regather`),
and a Dense or EinsumDense kernel whose layout matches Megatron's computes
with its block over the model axis (:mod:`~tfdist.distribution.megatron`). Read in a layer
call outside the replicas (``model(x)`` in the scope, Keras's symbolic
build) it is the full value from the local blocks, or zeros of the full
shape while Keras only infers shapes. Everything else (the optimizer's
update, Keras's bookkeeping) sees the block, as Keras sees any
MirroredVariable.

A layout tfdist cannot honour raises :class:`~tfdist.errors.ConfigError`
naming the weight's path, its shape and the layout, before anything is
created.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import numpy as np
import tensorflow as tf

from tfdist.compat import tf_private
from tfdist.distribution import model_parallel
from tfdist.errors import ConfigError
from tfdist.parallel import collectives, sharding

__all__ = ["plan", "laid_out", "wrap_initialize", "install"]

_SOURCE = "keras.distribution"


def _layout_axes(distribution: Any, variable: Any) -> tuple | None:
    layout = distribution.get_variable_layout(variable)
    axes = getattr(layout, "axes", layout)
    return None if axes is None else tuple(axes)


def plan(variable: Any, distribution: Any, strategy: Any) -> sharding.ShardSpec | None:
    """How ``distribution`` lays out ``variable`` (its shape is the full
    one); None when the layout replicates it.

    Raises:
        ConfigError: The layout names an axis the mesh lacks, or one axis
            twice, has a length other than the weight's rank, or splits a
            dimension its axis does not divide. The message names the
            weight's path, shape and layout.
    """
    axes = _layout_axes(distribution, variable)
    if axes is None or all(a is None for a in axes):
        return None
    shape = tuple(int(s) for s in variable.shape)
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    batch, model = model_parallel.mesh_axes(distribution)
    path = variable.path

    def refuse(expected: str) -> ConfigError:
        return ConfigError(
            f"layout of {path}",
            axes,
            expected,
            source=_SOURCE,
            hint=f"The weight {path} has shape {shape}; the mesh is {dict(sizes)}.",
        )

    if len(axes) != len(shape):
        raise refuse(f"one entry per dimension of the weight ({len(shape)})")
    named = [a for a in axes if a is not None]
    unknown = [a for a in named if a not in sizes]
    if unknown:
        raise refuse(
            f"mesh axis names ({', '.join(map(repr, sizes))}) or None; "
            f"{unknown[0]!r} is not an axis of the mesh"
        )
    if len(set(named)) != len(named):
        raise refuse("each mesh axis at most once")
    splits = []
    for dim, axis in enumerate(axes):
        if axis is None or sizes[axis] == 1:
            continue
        if shape[dim] % sizes[axis]:
            raise refuse(
                f"dimensions the named axes divide: dimension {dim} has {shape[dim]}, "
                f"which the {axis!r} axis ({sizes[axis]} devices) does not divide"
            )
        splits.append((dim, sharding.TENSOR if axis == model else sharding.DATA))
    if not splits:
        return None
    if any(kind == sharding.DATA for _, kind in splits):
        _check_compression(strategy, path, shape, axes)
    runtime = collectives.runtime_of(strategy)
    return sharding.ShardSpec(shape, runtime, strategy, tuple(splits), path=path, layout=axes)


def _check_compression(strategy: Any, path: str, shape: tuple, axes: tuple) -> None:
    """A weight split over the batch axis has its gradient reduce-scattered:
    only a cast (fp16, bf16) without error feedback applies to that.

    Raises:
        ConfigError: Any other compression, naming the weight.
    """

    setting = getattr(strategy, "compression", None)
    if setting is None or not setting.enabled or collectives.cast_aggregator(strategy) is not None:
        return
    if strategy.num_replicas_in_sync < 2:
        return
    raise ConfigError(
        "compression",
        str(setting),
        f"one of {', '.join(collectives.CAST_COMPRESSORS)} (without "
        f"error feedback) with a layout that splits a weight over the batch axis",
        source=_SOURCE,
        hint=f"The layout {axes} splits {path} (shape {shape}) over the batch axis, so its "
        "gradient is reduce-scattered, each device summing only its block: top-k, "
        "random-k, sign, QSGD, PowerSGD and error feedback need the whole gradient. "
        "Use compression='bf16' or 'fp16', or a layout without the batch axis.",
    )


# --- the laid-out variable -------------------------------------------------------


def _in_layer_call() -> bool:
    from tfdist.compat.keras_src import global_state

    return global_state.get_global_attribute("current_call_ctx") is not None


class _LaidOut:
    """Mixed into a laid-out Keras variable's class (:func:`laid_out`).

    ``value`` is the full weight inside a layer's call and the block
    elsewhere (the optimizer's update, Keras's bookkeeping), as for any
    MirroredVariable; the members that read ``value`` in Keras read the
    block. ``numpy()`` and ``__array__`` give the full weight, and a
    regularizer or constraint is refused.
    """

    @property
    def value(self):
        from tfdist.distribution import regather

        given = regather.override(self)
        if given is not None:  # Inside a regathered call: gathered already.
            return given
        spec = sharding.spec_of(self)
        if spec is None or self._value is None or not _in_layer_call():
            return super().value
        from tfdist.compat.keras_src import in_stateless_scope, in_symbolic_scope

        if in_symbolic_scope() or in_stateless_scope():
            # Keras infers shapes: the values are never read.
            return self._maybe_autocast(tf.zeros(spec.full_shape, self._dtype))
        p = collectives.current()
        if p is None:
            return self._maybe_autocast(sharding.local_full_tensor(self))
        local = self._maybe_autocast(tf.convert_to_tensor(self._value))
        return collectives.gather_blocks(local, spec.splits, p)

    @property
    def shape(self):
        from tfdist.distribution import lora

        if lora.full_shapes():  # Inside enable_lora: size the adapters whole.
            return sharding.spec_of(self).full_shape
        return super().shape

    @property
    def handle(self):
        return self._value.handle

    @property
    def _shared_name(self):
        return tf_private.shared_name(self._value)  # TF's checkpointing reads it: forwarded.

    # A regularizer or constraint would see one block, not the weight.
    @property
    def regularizer(self):
        return None

    @regularizer.setter
    def regularizer(self, value):
        _refuse_per_weight(self, "regularizer", value)

    @property
    def constraint(self):
        return None

    @constraint.setter
    def constraint(self, value):
        _refuse_per_weight(self, "constraint", value)

    def numpy(self):
        return sharding.full_value(self)

    def __array__(self, dtype=None, copy=None):
        value = sharding.full_value(self)
        return value if dtype is None else value.astype(dtype)


def _refuse_per_weight(variable: Any, what: str, value: Any) -> None:
    if value is None:
        return
    spec = sharding.spec_of(variable)
    raise ConfigError(
        f"{what} of {variable.path}",
        value,
        f"no {what} on a weight a layout splits",
        source=_SOURCE,
        hint=f"The layout {spec.layout} splits {variable.path} (shape {spec.full_shape}), "
        f"and a {what} would see one block. Drop it, or lay the weight out "
        "replicated (None on every dimension).",
    )


@functools.cache
def _class_for(base: type) -> type:
    return type(f"LaidOut{base.__name__}", (_LaidOut, base), {"__module__": __name__})


def laid_out(variable: Any, spec: sharding.ShardSpec, full: np.ndarray | None) -> None:
    """Makes ``variable`` (created with a block's shape) a laid-out weight:
    marked with ``spec``, its components given their blocks of ``full``
    (None: they keep their values, which a weights file overwrites next)."""
    sharding.mark(variable, spec)
    variable.__class__ = _class_for(type(variable))
    if full is not None:
        sharding.assign_full(variable, full)


def wrap_initialize(original):
    @functools.wraps(original)
    def _initialize(self, value):
        from tfdist.distribution import local_values
        from tfdist.parallel import saving

        found = model_parallel.current()
        # A slot of a split weight is a block already (Keras < 3.15 also hands
        # it the weight's layout): saving registers it like its weight.
        if found is None or isinstance(value, tf.Variable) or saving.creating_slot():
            return original(self, value)
        distribution, strategy = found
        if self._shape is None:  # Created from a value, not an initializer.
            self._shape = tuple(int(s) for s in tf.convert_to_tensor(value).shape)
        _cover_keras_hub()
        spec = plan(self, distribution, strategy)
        if spec is None:
            _warn_if_large(self.path, self._shape, self._dtype)
            if loading_next() and callable(value):
                # Overwritten next: zeros cost no initializer's temporaries,
                # and no worker needs worker 0's.
                shape, dtype = tuple(self._shape), self._dtype
                with local_values.created_locally(strategy):
                    return original(self, lambda: tf.zeros(shape, dtype))
            return original(self, value)
        if loading_next():
            # The weights file overwrites the value: only the block is made,
            # zeros (an initializer's temporaries would cost more), each
            # worker its own (worker 0's broadcast would cost buffers).
            self._shape = spec.shard_shape
            with tf.init_scope(), tf.device("/cpu:0"):
                block = (
                    tf.zeros(spec.shard_shape, self._dtype)
                    if callable(value)
                    else spec.block(value, spec.runtime.first)
                )
            with local_values.created_locally(strategy):
                original(self, block)
            del block
            laid_out(self, spec, None)
            _wrap_layer()
            return None
        with tf.init_scope(), tf.device("/cpu:0"):
            full = value() if callable(value) else value
            full = tf.convert_to_tensor(full, dtype=self._dtype).numpy()
        if getattr(strategy, "kind", "") != "multi_worker_mirrored":
            original(self, spec.block(full, spec.runtime.first))
            self._shape = spec.shard_shape
            laid_out(self, spec, full)
        else:
            # Worker 0's value (the workers' initializers may draw
            # differently), each process receiving its blocks only.
            with tf.init_scope():
                blocks = sharding.first_workers_blocks(spec, full)
            del full
            original(self, blocks[spec.index(spec.runtime.first)])
            self._shape = spec.shard_shape
            laid_out(self, spec, None)
            sharding.assign_blocks(self, blocks)
        _wrap_layer()

    return _initialize


#: A weight the layout map leaves whole is named in a warning from this size on.
LARGE_REPLICATED_BYTES = 32 * 2**20


class LayoutWarning(UserWarning):
    """A large weight that no rule of the layout map splits."""


def _warn_if_large(path: str, shape: Any, dtype: Any) -> None:
    """Warns, before it is allocated, of a large weight every device holds
    whole: a renamed weight (keras-hub#2806) or a map without a rule for it
    would otherwise load replicated and run out of memory with no word."""
    import warnings

    shape = tuple(int(s) for s in shape)
    size = int(np.prod(shape)) * tf.as_dtype(dtype).size
    if size < LARGE_REPLICATED_BYTES:
        return
    warnings.warn(
        f"keras.distribution: {path} (shape {shape}, {size / 2**20:,.1f} MiB) "
        "matches no rule of the layout map that splits it, so every device holds it whole. "
        f"If it should be split, add a rule for it, e.g. layout_map[{path!r}] = "
        f"{(None,) * (len(shape) - 1) + ('model',)}.",
        LayoutWarning,
        stacklevel=2,
    )


def _wrap_layer() -> None:
    """The creating layer's save/load, call and enable_lora, for its laid-out weight."""
    layer = _creating_layer()
    if layer is None:
        return
    from tfdist.distribution import lora, regather

    sharding.cover(type(layer))  # Its own save/load write and read full values.
    regather.wrap(layer)
    lora.wrap(layer)


# --- weights loaded next: blocks only ----------------------------------------------

_loading = threading.local()


@contextlib.contextmanager
def blocks_only():
    """While it is open, laid-out weights are created as their blocks only,
    with no full initial value: a weights file is loaded into them next."""
    _loading.depth = getattr(_loading, "depth", 0) + 1
    try:
        yield
    finally:
        _loading.depth -= 1


def loading_next() -> bool:
    return getattr(_loading, "depth", 0) > 0


def wrap_load_backbone(original):
    """keras-hub's preset loader: a backbone whose weights it loads next is
    built as blocks (keras-hub builds every weight whole first,
    keras-team/keras#21634)."""

    @functools.wraps(original)
    def load_backbone(self, cls, load_weights, **kwargs):
        if not load_weights:
            return original(self, cls, load_weights, **kwargs)
        with blocks_only():
            return original(self, cls, load_weights, **kwargs)

    return load_backbone


def wrap_load_model(original):
    """Keras's ``load_model`` of a ``.keras`` file: under a ``ModelParallel``,
    the model is built as blocks, the file's weights loaded next."""

    @functools.wraps(original)
    def load_model(filepath, *args, **kwargs):
        from tfdist.compat.keras_src import distribution_lib

        if not model_parallel.honours(distribution_lib.distribution()):
            return original(filepath, *args, **kwargs)
        with blocks_only():
            return original(filepath, *args, **kwargs)

    return load_model


#: keras-hub's module, owner and method that each of the registry's dynamic
#: ``layouts.*`` patches wraps once keras-hub is imported.
_KERAS_HUB = (
    (
        "keras_hub.src.utils.preset_utils",
        "KerasPresetLoader",
        "load_backbone",
        "layouts.preset_loader",
    ),
    (
        "keras_hub.src.models.causal_lm",
        "CausalLM",
        "make_generate_function",
        "layouts.generate_function",
    ),
)


def _cover_keras_hub() -> None:
    """Wraps keras-hub's preset loader and ``CausalLM.make_generate_function``
    once keras-hub is imported."""
    import sys

    from tfdist import compat

    for module, name, attribute, patch in _KERAS_HUB:
        owner = getattr(sys.modules.get(module), name, None)
        if owner is None or owner in _covered:
            continue
        if compat.apply_to(patch, owner, attribute):
            _covered.append(owner)


_covered: list[type] = []


def _creating_layer() -> Any:
    """The layer whose ``add_weight`` runs now: the innermost caller of
    Keras's name scopes (``Layer.add_weight`` opens one with the layer)."""
    import keras

    from tfdist.compat.keras_src import global_state

    for scope in reversed(global_state.get_global_attribute("name_scope_stack") or []):
        caller = getattr(scope, "caller", None)
        if isinstance(caller, keras.layers.Layer):
            return caller
    return None


def install() -> None:
    """Wraps Keras's TensorFlow variable creation (the registry's
    ``layouts``), with tensor parallelism's gradient and saving hooks;
    idempotent.

    Raises:
        tfdist.ConfigError: A target changed in this Keras.
    """
    from tfdist import compat
    from tfdist.parallel import grads, saving

    grads.install()
    saving.install()
    compat.install("layouts")
    compat.require("layouts", "keras.distribution.ModelParallel")
    # Before from_preset is called (a weight's creation is too late for it).
    _cover_keras_hub()
