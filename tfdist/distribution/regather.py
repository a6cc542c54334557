"""Laid-out weights gathered again for the backward pass, not kept from the forward.

A weight gathered whole for a layer's call (:mod:`~tfdist.distribution.layouts`)
would otherwise stay alive from the forward pass to the backward one (the
matmul's gradient needs it): at the end of the forward pass every layer's
full weights would be in memory at once, as many bytes as the replicated
model's weights. FSDP's answer is to gather them again for the backward pass,
and that is what happens here.

The call of a leaf layer (one that calls no layer with weights) owning
split weights runs inside a ``tf.custom_gradient`` whose inputs are the
call's tensors and the weights' blocks. Its forward pass gathers the
weights, calls the layer and lets the full weights go. Its backward pass
gathers them again, recomputes the call under a tape, and takes the
gradients: the inputs' as they are, the variables' that stay whole as
they are, and each split weight's summed over every replica with its block
kept. The gradients are the plain gather's; the cost is the second gather
and the leaf's forward computed twice.

A Dense or EinsumDense kernel, or an embedding table, whose layout matches
Megatron's keeps its block over the model axis and computes with it
(:mod:`~tfdist.distribution.megatron`); only its batch-axis split is
gathered, the same way.

A layer with sublayers that have weights, or a layer called under Keras's
stateless or symbolic scopes, is left to the plain gather of
:mod:`~tfdist.distribution.layouts`, which keeps its full weights for the
backward pass (the report says which).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any

import tensorflow as tf

from tfdist.compat import keras_private
from tfdist.parallel import collectives, sharding
from tfdist.record import attach, slot

__all__ = ["override", "overriding", "regathers", "wrap", "own_split", "is_leaf"]

_local = threading.local()


class _Regathers:
    """Marks a layer whose ``call`` regathers its laid-out weights (a
    :mod:`tfdist.record` slot)."""


def override(variable: Any) -> Any:
    """The full value this thread's regathered call gives ``variable``, or None."""
    return getattr(_local, "values", {}).get(id(variable))


@contextlib.contextmanager
def overriding(variables: list, values: list):
    """While a regathered call runs: ``variables`` read as ``values``."""
    saved = getattr(_local, "values", {})
    _local.values = {**saved, **{id(v): x for v, x in zip(variables, values)}}
    try:
        yield
    finally:
        _local.values = saved


def regathers(layer: Any) -> bool:
    """Whether ``layer``'s call gathers its split weights again for backward."""
    return slot(layer, _Regathers) is not None


def own_split(layer: Any) -> list:
    """The split weights ``layer`` owns (not its sublayers')."""
    own = list(getattr(layer, "_trainable_variables", [])) + list(
        getattr(layer, "_non_trainable_variables", [])
    )
    return [v for v in own if sharding.spec_of(v) is not None]


def is_leaf(layer: Any) -> bool:
    """No sublayer of ``layer`` has weights of its own."""
    for sub in keras_private.flatten_layers(layer, include_self=False):
        if list(getattr(sub, "_trainable_variables", [])) or list(
            getattr(sub, "_non_trainable_variables", [])
        ):
            return False
    return True


def wrap(layer: Any) -> None:
    """Makes ``layer``'s call regather its split weights (once per layer)."""
    if regathers(layer):
        return
    original = layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        return _call(layer, original, args, kwargs)

    # An instance attribute: Keras's Layer.__call__ calls self.call.
    object.__setattr__(layer, "call", call)
    attach(layer, _Regathers())


def _call(layer: Any, original: Any, args: tuple, kwargs: dict) -> Any:
    from tfdist.compat.keras_src import global_state, in_stateless_scope, in_symbolic_scope

    p = collectives.current()
    split = own_split(layer)
    if p is None or not split or in_symbolic_scope() or in_stateless_scope() or not is_leaf(layer):
        return original(*args, **kwargs)
    autocast = global_state.get_global_attribute("autocast_scope")
    leaves = tf.nest.flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]
    tensors = [tf.convert_to_tensor(leaves[i]) for i in where]
    blocks = [keras_private.autocast_value(v) for v in split]
    specs = [sharding.spec_of(v) for v in split]
    trainable = [bool(v.trainable) for v in split]
    shapes = [tuple(b.shape) for b in blocks]
    n = len(tensors)
    from tfdist.distribution import megatron

    the_plan = megatron.call_plan(layer, args, kwargs) if p.tp > 1 else None
    gathers = _gathers(split, specs, the_plan)

    def gathered(own):
        return [
            None if g is None else tf.stop_gradient(collectives.gather_blocks(b, g, p))
            for b, g in zip(own, gathers)
        ]

    def rebuild(values):
        out = list(leaves)
        for i, value in zip(where, values):
            out[i] = value
        return tf.nest.pack_sequence_as((args, kwargs), out)

    def run(values, fulls):
        call_args, call_kwargs = rebuild(values)
        if the_plan is None or not megatron.uses_block(layer, the_plan, call_args, call_kwargs):
            with overriding(split, fulls):
                return original(*call_args, **call_kwargs)
        at = next(i for i, v in enumerate(split) if v is the_plan.kernel)
        others = [(v, f) for i, (v, f) in enumerate(zip(split, fulls)) if i != at and f is not None]
        with overriding([v for v, _ in others], [f for _, f in others]):
            return megatron.call(layer, the_plan, call_args, call_kwargs, fulls[at], p)

    structure = []

    @tf.custom_gradient
    def regathered(*flat):
        values, own = list(flat[:n]), list(flat[n:])
        # Gathered once the call's inputs exist, not as soon as the step
        # starts: otherwise every layer's full weights could be alive at once.
        with tf.control_dependencies(values):
            fulls = gathered(own)
        out = run(values, fulls)
        structure.append(out)
        flat_out = tf.nest.flatten(out)

        def grad(*dys, variables=None):
            return _backward(
                _Backward(values, own, gathered, run, autocast, trainable, gathers, specs, shapes),
                p,
                dys,
                variables,
            )

        return flat_out, grad

    flat_out = regathered(*tensors, *blocks)
    return tf.nest.pack_sequence_as(structure[-1], flat_out)


@dataclasses.dataclass
class _Backward:
    """What the gradient of one regathered call needs of its forward pass."""

    values: list
    own: list
    gathered: Any
    run: Any
    autocast: Any
    trainable: list
    gathers: list
    specs: list
    shapes: list


def _gathers(split: list, specs: list, the_plan: Any) -> list:
    """What each weight is gathered over: a tensor-parallel kernel keeps its
    tensor block (gathered over the batch axis alone), the rest are whole;
    a weight this call does not read is not gathered (None)."""
    unused = {id(v) for v in the_plan.unused} if the_plan is not None else set()
    return [
        None
        if id(v) in unused
        else tuple((d, k) for d, k in s.splits if k == sharding.DATA)
        if the_plan is not None and v is the_plan.kernel
        else s.splits
        for v, s in zip(split, specs)
    ]


def _backward(call: _Backward, p: Any, dys: tuple, variables: Any) -> tuple:
    """The gradients of a regathered call: the call runs again on the weights
    gathered anew, and each weight's gradient goes back to its block."""
    variables = list(variables or [])
    values, autocast = call.values, call.autocast
    with tf.GradientTape() as tape:
        # Likewise once the output's gradient exists.
        with tf.control_dependencies([d for d in dys if d is not None]):
            fulls = call.gathered(call.own)
        floats = [v for v in values if v.dtype.is_floating]
        tape.watch(floats + [f for f in fulls if f is not None])
        scope = type(autocast)(autocast.dtype) if autocast is not None else contextlib.nullcontext()
        with scope:
            again = tf.nest.flatten(call.run(values, fulls))
    # A frozen weight (LoRA's base kernel) takes no gradient: none
    # is computed, and none is summed over the replicas.
    # Nor does one this call does not read (unused: not gathered).
    learns = [t and f is not None for f, t in zip(fulls, call.trainable)]
    learnt = [f for f, t in zip(fulls, learns) if t]
    sources = floats + learnt + variables
    grads = tape.gradient(
        again,
        sources,
        output_gradients=list(dys),
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    )
    by_float = dict(zip([id(v) for v in floats], grads[: len(floats)]))
    inputs = [by_float.get(id(v)) for v in values]
    of_learnt = iter(grads[len(floats) : len(floats) + len(learnt)])
    weights = []
    for t, gather, s, shape in zip(learns, call.gathers, call.specs, call.shapes):
        g = next(of_learnt) if t else None
        weights.append(
            None
            if g is None
            else collectives.block_gradient(
                g, gather, p, shape, summed_over_tensor=gather != s.splits
            )
        )
    return inputs + weights, grads[len(floats) + len(learnt) :]
