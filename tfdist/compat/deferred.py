"""Building a Keras model without its weights' values: :func:`deferred_build`.

A pipeline stage needs only its own weights, but its worker runs the user's
model-building code, which would make every weight of the model. Keras 3
already knows how to make a variable without its value: inside a
``StatelessScope`` a variable with an initializer keeps the initializer,
and a symbolic call reads an uninitialized variable as its initializer's
op, so a functional model (a keras-hub backbone too) builds with no weight
in memory. Its values are made later, one variable at a time
(``_deferred_initialize``). The seed of a Keras initializer is drawn when the
initializer is made (in the layer's constructor), so a variable made later
gets the value it would have had.

Two things of Keras's scope stand in the way, and this module works around
them for the duration of the build only (Keras 3.10 to 3.15, and 3.16's
nightly: ``keras/src/backend/common/variables.py``, ``stateless_scope.py``):

* A variable given a value rather than an initializer (an optimizer's
  iteration counter, made by keras-hub's ``Task.__init__`` through
  ``compile()``) is refused inside the scope: it is made at once, outside
  it.
* When the outermost scope exits, Keras makes every deferred variable
  (``initialize_all_variables``), and any later outermost scope (Keras's
  shape inference) would too. The scope here does not, and the build's
  deferred variables leave Keras's global list: they are the caller's to
  make (:func:`materialize`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["deferred_build", "is_materialized", "materialize", "borrowed", "variables_read"]

_REGISTRY = "uninitialized_variables"
_SCOPE = "stateless_scope"


def deferred_build(builder: Callable[[], Any]) -> tuple[Any, list[Any]]:
    """Runs ``builder()`` with its variables' values deferred.

    Returns:
        What ``builder`` returned, and the variables it made without a value
        (in the order made): :func:`materialize` makes each one's value.
    """
    from tfdist.compat.keras_src import StatelessScope, global_state

    before = {id(v) for v in global_state.get_global_attribute(_REGISTRY, []) or []}
    with _values_made_at_once(), StatelessScope(initialize_variables=False):
        built = builder()
    registry = global_state.get_global_attribute(_REGISTRY, []) or []
    deferred = [v for v in registry if id(v) not in before]
    global_state.set_global_attribute(_REGISTRY, [v for v in registry if id(v) in before])
    return built, deferred


@contextlib.contextmanager
def _values_made_at_once() -> Iterator[None]:
    """Variables given a value are made outside the stateless scope."""
    from tfdist.compat.keras_src import KerasVariable, global_state

    original = KerasVariable.__init__

    def init(self: Any, initializer: Any, *args: Any, **kwargs: Any) -> None:
        if callable(initializer) or isinstance(initializer, str):
            return original(self, initializer, *args, **kwargs)
        scope = global_state.get_global_attribute(_SCOPE)
        global_state.set_global_attribute(_SCOPE, None)
        try:
            return original(self, initializer, *args, **kwargs)
        finally:
            global_state.set_global_attribute(_SCOPE, scope)

    KerasVariable.__init__ = init
    try:
        yield
    finally:
        KerasVariable.__init__ = original


def is_materialized(variable: Any) -> bool:
    """Whether ``variable`` has its value."""
    return variable._value is not None


def materialize(variable: Any, value: Any = None) -> None:
    """Makes a deferred variable's value: its initializer's, or ``value``.
    A variable that has its value is assigned ``value`` (if given)."""
    if is_materialized(variable):
        if value is not None:
            variable.assign(value)
        return
    if value is not None:
        variable._initializer = lambda shape, dtype=None: value
    variable._deferred_initialize()


@contextlib.contextmanager
def borrowed(variables: Sequence[Any], values: Sequence[Any] | None = None) -> Iterator[None]:
    """Gives ``variables`` values for the duration: :func:`materialize` with
    ``values`` (by position) or their initializers'. Those that were deferred
    are deferred again after, with their initializers (Keras drops a
    variable's initializer once it has a value), so a pipeline stage that
    saves or reads another stage's weight does not keep it."""
    lent = [(v, v._initializer) for v in variables if not is_materialized(v)]
    for k, variable in enumerate(variables):
        materialize(variable, None if values is None else values[k])
    try:
        yield
    finally:
        for variable, initializer in lent:
            variable._value = None
            variable._initializer = initializer


@contextlib.contextmanager
def variables_read() -> Iterator[set[int]]:
    """Yields the ids of the Keras variables read inside (their values made
    or not): a stateless scope that notes each variable Keras asks it for.
    Assignments inside are not applied (a stateless scope keeps them)."""
    from tfdist.compat.keras_src import StatelessScope

    read: set[int] = set()

    class Noting(StatelessScope):
        def get_current_value(self, variable: Any) -> Any:
            read.add(id(variable))
            return super().get_current_value(variable)

    with Noting(initialize_variables=False):
        yield read
