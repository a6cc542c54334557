"""``compile(jit_compile=True)`` under Mirrored and MultiWorkerMirrored.

Keras 3 compiles the function that calls ``strategy.run`` with XLA, so one
XLA cluster holds every replica's step and the cross-replica all-reduce.
Measured on TF 2.21 + Keras 3.15, 2 logical CPUs, a keras-hub GPT-2:

* under Mirrored (TensorFlow's and a plain tfdist one) the fit fails with
  ``Trying to access resource .../replica_1/... located in device CPU:1
  from device CPU:0``;
* under MultiWorkerMirrored the workers abort (exit 134): ``Collectives
  are not yet implemented for CPU devices when compiling with XLA``;
* ``jit_compile="auto"`` resolves to False whenever a strategy is set
  (``Trainer._resolve_auto_jit_compile``).

tfdist compiles each replica's step instead, and keeps the collectives out
of XLA (:func:`wrap_make_function`):

* **train**: the replica's forward and backward pass, the loss scaling and
  the metrics run in one XLA function per replica, on that replica's
  device. The optimizer's ``apply_gradients`` inside it is not run but
  recorded (:func:`capturing`); the XLA function returns the gradients,
  and the recorded apply runs after it, outside XLA, where the all-reduce,
  compression, gradient accumulation and the loss-scale check happen as
  without XLA.
* **evaluate**: the whole replica step in XLA (it has no collective);
  Keras >= 3.12 compiles ``predict`` per replica itself; on older Keras
  ``predict`` runs without XLA (:func:`wrap_make_predict_function`).

A ``train_step`` must therefore apply gradients once, after its forward
pass, as Keras's does; one that applies twice (a GAN's two optimizers,
where the second forward pass reads the first update) is refused at its
first trace.

Refused at ``compile`` (:func:`check_compile`), with the alternative: the
parameter-server strategy (workers step asynchronously against remote
variables), TPU (every step is XLA already), layers that declare
``supports_jit = False``, and layers whose forward pass holds a collective
(synchronized BatchNormalization, tfdist.parallel's sharded layers), which
cannot sit inside one replica's compiled step. An op with no XLA kernel is named at the first step
(:func:`name_unsupported_op`).

``jit_compile="auto"`` under a tfdist Mirrored or MultiWorkerMirrored
strategy resolves as Keras resolves it without a strategy: on when a GPU
is visible and every layer supports XLA (:func:`wrap_resolve_auto`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from absl import logging

from tfdist import compat
from tfdist.compat import keras_private
from tfdist.errors import ConfigError
from tfdist.record import attach, slot

__all__ = [
    "XLA_KINDS",
    "capturing",
    "check_compile",
    "describe_line",
    "install",
    "name_unsupported_op",
    "replica_step",
    "uses_replica_xla",
    "wrap_apply",
    "wrap_apply_gradients",
    "wrap_compile",
    "wrap_make_function",
    "wrap_make_predict_function",
    "wrap_resolve_auto",
]

#: The strategy kinds whose replica steps tfdist compiles with XLA.
XLA_KINDS = ("mirrored", "multi_worker_mirrored")

_local = threading.local()


# --- which models ----------------------------------------------------------------


def _strategy(model: Any) -> Any:
    return getattr(model, "_distribute_strategy", None) or tf.distribute.get_strategy()


def _kind_of(strategy: Any) -> str | None:
    from tfdist.strategies import TfdistStrategy

    return strategy.kind if isinstance(strategy, TfdistStrategy) else None


def uses_replica_xla(model: Any) -> bool:
    """Whether tfdist compiles ``model``'s replica steps with XLA."""
    return (
        _kind_of(_strategy(model)) in XLA_KINDS
        and bool(getattr(model, "_jit_compile", False))
        and not getattr(model, "run_eagerly", False)
    )


# --- compile: refusals and "auto" -------------------------------------------------


def _devices_are_cpus(strategy: Any) -> bool:
    devices = getattr(strategy.extended, "worker_devices", ()) or ()
    return all("GPU" not in d.upper() and "TPU" not in d.upper() for d in devices)


def _collective_layers(model: Any, strategy: Any) -> list[str]:
    """Layers whose forward pass all-reduces across replicas."""
    import keras

    sharded = (getattr(strategy, "model_parallel", 1) or 1) > 1  # Else they are dense.
    found = []
    for layer in keras_private.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(
            layer, "synchronized", False
        ):
            found.append(f"{layer.name} (BatchNormalization(synchronized=True))")
        elif sharded and type(layer).__module__.startswith("tfdist.parallel"):
            found.append(f"{layer.name} ({type(layer).__name__}, sharded by tfdist.parallel)")
    return found


def check_compile(model: Any, strategy: Any) -> None:
    """Refuses ``jit_compile=True`` where tfdist cannot compile the step.

    Raises:
        ConfigError: The strategy, a layer or the devices rule XLA out; the
            message names which and what to do instead.
    """
    kind = _kind_of(strategy)
    if kind == "parameter_server":
        raise ConfigError(
            "jit_compile",
            True,
            "False or 'auto' under ParameterServerStrategy",
            source="compile",
            hint="Its workers run each step against variables on the parameter servers, "
            "which XLA cannot compile into one cluster. Use jit_compile=False, or a "
            "Mirrored or MultiWorkerMirrored strategy (a cluster without ps tasks) "
            "for XLA",
        )
    if kind == "tpu":
        raise ConfigError(
            "jit_compile",
            True,
            "False or 'auto' under TPUStrategy",
            source="compile",
            hint="TPUStrategy compiles every step with XLA already; leave jit_compile unset",
        )
    if kind not in XLA_KINDS:
        return
    unsupported = [
        f"{layer.name} ({type(layer).__name__})"
        for layer in keras_private.flatten_layers(model, include_self=False)
        if not getattr(layer, "supports_jit", True)
    ]
    if unsupported:
        raise ConfigError(
            "jit_compile",
            True,
            "layers that XLA can compile",
            source="compile",
            hint=f"These declare supports_jit=False: {', '.join(unsupported)}. Move them "
            "into the tf.data input pipeline (dataset.map), or use jit_compile=False",
        )
    collective = _collective_layers(model, strategy)
    if collective:
        raise ConfigError(
            "jit_compile",
            True,
            "no cross-replica collective in the forward pass",
            source="compile",
            hint=f"These layers all-reduce across replicas: {', '.join(collective)}. tfdist "
            "compiles each replica's step alone, and a collective cannot sit inside it "
            "(on CPU TensorFlow has none under XLA: 'Collectives are not yet implemented "
            "for CPU devices when compiling with XLA'). Use jit_compile=False, or "
            "BatchNormalization(synchronized=False)",
        )


@dataclasses.dataclass
class XlaNote:
    """What ``compile`` asked of XLA, for ``fit``'s log line (a :mod:`tfdist.record` slot).

    Attributes:
        requested: ``compile``'s ``jit_compile``.
        logged: The line was logged since that ``compile``.
    """

    requested: bool | str = "auto"
    logged: bool = False


def xla_note(model: object) -> XlaNote:
    """``model``'s note (``"auto"``, not logged, before its first ``compile``)."""
    found = slot(model, XlaNote)
    return found if found is not None else attach(model, XlaNote())


def wrap_compile(original):
    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # noqa: A001 - wraps Keras's Model.compile
        jit = kwargs.get("jit_compile", "auto")
        if jit is True and not kwargs.get("run_eagerly", False):
            check_compile(self, _strategy(self))
        attach(self, XlaNote(requested=jit))  # For the fit's log line.
        return original(self, *args, **kwargs)

    return compile


def wrap_resolve_auto(original):
    @functools.wraps(original)
    def _resolve_auto_jit_compile(self):
        strategy = getattr(self, "_distribute_strategy", None)
        if _kind_of(strategy) not in XLA_KINDS:
            return original(self)
        # As without a strategy: Keras turns XLA on where a GPU is visible.
        self._distribute_strategy = None
        try:
            resolved = original(self)
        finally:
            self._distribute_strategy = strategy
        if resolved and (_devices_are_cpus(strategy) or _collective_layers(self, strategy)):
            return False  # CPU replicas (a GPU is visible), or a collective inside.
        return resolved

    return _resolve_auto_jit_compile


def describe_line(strategy: Any) -> str | None:
    """``describe()``'s line: what ``jit_compile="auto"`` resolves to here."""
    kind = _kind_of(strategy)
    if kind in XLA_KINDS:
        if _devices_are_cpus(strategy):
            return (
                "  xla: jit_compile='auto' resolves to off (CPU replicas, as Keras "
                "without a strategy); jit_compile=True compiles each replica's step"
            )
        return (
            "  xla: jit_compile='auto' resolves to on (GPU replicas) where every "
            "layer supports XLA; each replica's step is compiled, the all-reduce is not"
        )
    if kind == "parameter_server":
        return "  xla: off (jit_compile=True is refused under parameter servers)"
    return None


# --- the replica step -------------------------------------------------------------


@dataclasses.dataclass
class _Apply:
    optimizer: Any
    grads: list
    variables: list


@contextlib.contextmanager
def capturing() -> Iterator[list[_Apply]]:
    """Records, instead of running, the optimizer applies this thread makes
    meanwhile (MirroredStrategy traces each replica in its own thread)."""
    calls: list[_Apply] = []
    previous = getattr(_local, "calls", None)
    _local.calls = calls
    try:
        yield calls
    finally:
        _local.calls = previous


def _record(optimizer: Any, grads, variables) -> Any:
    _local.calls.append(_Apply(optimizer, list(grads), list(variables)))
    return optimizer.iterations


def wrap_apply_gradients(original):
    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars):
        if getattr(_local, "calls", None) is None:
            return original(self, grads_and_vars)
        grads, variables = zip(*grads_and_vars)
        return _record(self, grads, variables)

    return apply_gradients


def wrap_apply(original):
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if getattr(_local, "calls", None) is None:
            return original(self, grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        return _record(self, grads, trainable_variables)

    return apply


def replica_step(step_function, kind: str):
    """``step_function`` as one replica runs it with XLA.

    Args:
        step_function: Keras's ``train_step`` or ``test_step`` (bound).
        kind: ``"train"`` (the optimizer's apply runs outside XLA) or
            ``"test"``.
    """
    if kind == "test":
        compiled_test = tf.function(
            tf.autograph.experimental.do_not_convert(step_function),
            jit_compile=True,
            reduce_retracing=True,
        )
        # A plain function: strategy.run given a tf.function itself re-wraps
        # it around every replica (one XLA cluster over all devices).
        return lambda data: compiled_test(data)
    applies: list[_Apply] = []

    @tf.autograph.experimental.do_not_convert  # As Keras's own step functions.
    def forward_backward(data):
        with capturing() as calls:
            logs = step_function(data)
        if len(calls) > 1:
            raise ConfigError(
                "jit_compile",
                True,
                "a train_step that applies gradients once",
                source="fit",
                received=f"True, and train_step applied gradients {len(calls)} times",
                hint="tfdist compiles a replica's forward and backward pass with XLA and "
                "applies the gradients after it, outside XLA, so a step whose second "
                "forward pass reads the first update (a GAN's two optimizers) cannot "
                "be split. Use jit_compile=False",
            )
        applies[:] = calls
        return logs, [c.grads for c in calls]

    compiled = tf.function(forward_backward, jit_compile=True, reduce_retracing=True)

    def step(data):
        logs, grads = compiled(data)
        for call, call_grads in zip(applies, grads):
            call.optimizer.apply_gradients(zip(call_grads, call.variables))
        return logs

    return step


_UNSUPPORTED = re.compile(
    r"No registered '(\w+)' OpKernel for XLA_\w+ devices compatible "
    r"with node \{\{node ([^}]+)\}\}"
)


def name_unsupported_op(error: Exception) -> ConfigError | None:
    """A ConfigError naming the op and graph node XLA could not compile, or None."""
    match = _UNSUPPORTED.search(str(error))
    if match is None:
        return None
    op, node = match.groups()
    return ConfigError(
        "jit_compile",
        True,
        "ops that XLA can compile",
        source="fit",
        hint=f"XLA has no kernel for the op {op} (node {node}). Move the layer that makes "
        "it into the tf.data input pipeline (dataset.map), or use jit_compile=False",
    )


def _named_errors(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
            named = name_unsupported_op(error)
            if named is None:
                raise
            raise named from error

    return call


def wrap_make_function(original):
    @functools.wraps(original)
    def _make_function(self, step_function):
        name = getattr(step_function, "__name__", "")
        kind = "train" if name == "train_step" else "test"
        if not uses_replica_xla(self):
            if kind == "train" and _kind_of(_strategy(self)) in XLA_KINDS:
                _log_without_xla(self)
            return original(self, step_function)
        note = xla_note(self)
        if not note.logged and kind == "train":
            logging.info(
                "tfdist: %s fits with XLA: each replica's forward and backward "
                "pass is compiled; the all-reduce and the optimizer run outside XLA",
                self.name,
            )
            note.logged = True
        # Keras must not compile the function around strategy.run.
        self._jit_compile = False
        try:
            return _named_errors(original(self, replica_step(step_function, kind)))
        finally:
            self._jit_compile = True

    return _make_function


def _log_without_xla(model: Any) -> None:
    """The fit's line when its step is not compiled: why, once per compile."""
    note = xla_note(model)
    if note.logged:
        return
    note.logged = True
    requested = note.requested
    if getattr(model, "run_eagerly", False):
        why = "run_eagerly=True"
    elif requested == "auto":
        why = (
            "jit_compile='auto' resolves to off: CPU replicas, as Keras without a strategy"
            if _devices_are_cpus(_strategy(model))
            else "jit_compile='auto' resolves to off: a layer without XLA support or a "
            "collective in the forward pass"
        )
    else:
        why = f"jit_compile={requested!r}"
    logging.info("tfdist: %s fits without XLA (%s)", model.name, why)


def wrap_make_predict_function(original):
    @functools.wraps(original)
    def make_predict_function(self, force=False):
        from tfdist.compat.keras_src import TensorFlowTrainer

        # Keras >= 3.12 wraps its per-replica XLA predict step in a plain
        # function (_autoconvert_optionals). Keras 3.10 hands strategy.run the
        # tf.function itself, which strategy.run re-wraps around every replica
        # ('Trying to access resource .../replica_1/...'): there predict runs
        # without XLA.
        if not uses_replica_xla(self) or hasattr(TensorFlowTrainer, "_autoconvert_optionals"):
            return original(self, force)
        self._jit_compile = False
        try:
            return original(self, force)
        finally:
            self._jit_compile = True

    return make_predict_function


def install() -> None:
    """Installs the registry's ``xla`` patches; idempotent.

    Raises:
        tfdist.compat.PatchError: A target changed in this Keras.
    """
    compat.install("xla")
