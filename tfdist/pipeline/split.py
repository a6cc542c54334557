"""A Keras model cut into pipeline stages at named layers.

:func:`split_model` replays a functional or Sequential model's graph (nested
functional models, such as a keras-hub backbone inside its task, are opened
up so their blocks can be split points), then cuts the replayed calls into
stages: stage ``k`` begins at the ``k``-th split point, in the model's
computing order, as PyTorch's ``SplitPoint.BEGINNING`` does. Each stage is an
ordinary functional ``keras.Model`` sharing the original model's layers, so
its weights are the model's weights.

A stage takes the model inputs it uses (every stage gets the batch's inputs,
as a keras-hub block takes the padding mask) and the tensors the previous
stage sends; it returns the tensors the next stage takes, or the model's
outputs. A tensor made in one stage and used two stages later would have to
cross two boundaries; :func:`split_model` refuses it, naming both layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfdist.compat.deferred import variables_read
from tfdist.compat.keras_private import functional_nodes
from tfdist.errors import ConfigError

__all__ = ["Stage", "split_model"]

SOURCE = "tfdist.pipeline.split_model"


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a split model.

    Attributes:
        index: The stage's place, from 0.
        model: A functional model of the stage's layers. Its inputs are the
            model inputs it uses (``model_inputs``) and then what the previous
            stage sends (``receives`` tensors, in the previous stage's output
            order); its outputs are what it sends on, or the model's outputs.
        layers: The names of the layers the stage calls, in order.
        model_inputs: Positions, in ``keras.tree.flatten(model.input)``, of
            the model inputs the stage takes.
        receives: How many tensors it takes from the previous stage.
        variables: The variables the stage owns (trains and saves): its
            layers' weights; of a layer called in two stages (a keras-hub
            embedding, also used reversed at the end), the ones each call reads.
    """

    index: int
    model: keras.Model
    layers: tuple[str, ...]
    model_inputs: tuple[int, ...]
    receives: int
    variables: tuple = ()


@dataclasses.dataclass
class Call:
    """One call of a layer in the replayed graph."""

    layer: keras.layers.Layer
    inputs: list  # Its input KerasTensors, flat.
    outputs: list  # Its output KerasTensors, flat.
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


def _is_graph(layer: Any) -> bool:
    """A nested model whose calls can be opened up: a functional model (or a
    built Sequential) that does not override ``call``."""
    if isinstance(layer, keras.Sequential):
        return layer.built
    return isinstance(layer, keras.Model) and _functional_call(layer)


def _functional_call(model: keras.Model) -> bool:
    """Whether ``model`` is a Keras functional model (a keras-hub task or
    backbone too) whose ``call`` is Functional's own: its graph is its call."""
    for cls in type(model).__mro__:
        if cls.__name__ == "Functional" and cls.__module__.startswith("keras"):
            return type(model).call is cls.call
    return False


def _graph_of(model: keras.Model) -> keras.Model:
    """A functional view of ``model`` (a Sequential's is its inputs to outputs)."""
    if isinstance(model, keras.Sequential):
        return keras.Model(model.inputs, model.outputs)
    return model


def _replay(model: keras.Model, inputs: Any, calls: list[Call]) -> Any:
    """Calls ``model``'s layers again on ``inputs``, opening nested graphs;
    appends each leaf call to ``calls`` and returns the outputs."""
    graph = _graph_of(model)
    made = {id(a): b for a, b in zip(keras.tree.flatten(graph.input), keras.tree.flatten(inputs))}
    for node in functional_nodes(graph):
        layer = node.operation
        if isinstance(layer, keras.layers.InputLayer):
            continue

        def swap(value: Any) -> Any:
            return made.get(id(value), value) if isinstance(value, keras.KerasTensor) else value

        args = keras.tree.map_structure(swap, node.arguments.args)
        kwargs = keras.tree.map_structure(swap, node.arguments.kwargs)
        if _is_graph(layer):
            # Keras passes a nested model the inputs' masks: None for inputs
            # without one, which the replayed layers compute again anyway.
            masks = [v for k, v in kwargs.items() if k not in ("mask", "training")]
            masks += [v for v in keras.tree.flatten(kwargs.get("mask")) if v is not None]
            (given,) = args if len(args) == 1 and not masks else (None,)
            if given is None:
                raise ConfigError(
                    "model",
                    layer.name,
                    "nested models called with one input structure",
                    source=SOURCE,
                )
            out = _replay(layer, given, calls)
        else:
            out = layer(*args, **kwargs)
            flat_in = [t for t in keras.tree.flatten((args, kwargs)) if symbolic(t)]
            calls.append(Call(layer, flat_in, keras.tree.flatten(out), args, kwargs))
        for old, new in zip(keras.tree.flatten(node.outputs), keras.tree.flatten(out)):
            made[id(old)] = new
    return keras.tree.map_structure(lambda t: made[id(t)], graph.output)


def symbolic(value: Any) -> bool:
    """Whether ``value`` is a tensor of the replayed graph (not a constant)."""
    return isinstance(value, keras.KerasTensor)


def check_model(model: Any) -> None:
    """Refuses a model without a graph of layers to cut, naming it."""
    if not isinstance(model, keras.Model):
        raise ConfigError("model", model, "a keras.Model", source=SOURCE)
    if not _is_graph(model):
        raise ConfigError(
            "model",
            type(model).__name__,
            "a functional or built Sequential model (a subclassed model has no graph of "
            "layers to cut; build a Sequential by giving it an Input)",
            source=SOURCE,
        )


def _starts(calls: list[Call], split_points: Sequence[str]) -> list[int]:
    """The call index each stage after the first begins at."""
    names = [c.layer.name for c in calls]
    starts = []
    for i, point in enumerate(split_points):
        field = f"split_points[{i}]"
        if not isinstance(point, str) or point not in names:
            raise ConfigError(
                field,
                point,
                f"the name of a layer the model calls ({_some(names)})",
                source=SOURCE,
            )
        start = names.index(point)
        if start == 0 or (starts and start <= starts[-1]):
            before = names[starts[-1]] if starts else None
            raise ConfigError(
                field,
                point,
                "a layer after the previous split point "
                + (f"{before!r}" if before else "and not the first layer")
                + f", so that no stage is empty (the model's order: {_some(names)})",
                source=SOURCE,
            )
        starts.append(start)
    return starts


def _some(names: Sequence[str], most: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _stage_of_tensors(calls: list[Call], starts: list[int]) -> dict[int, tuple[int, str]]:
    """id(tensor) -> (stage, name of the layer that made it)."""
    where: dict[int, tuple[int, str]] = {}
    stage = 0
    for i, call in enumerate(calls):
        while stage < len(starts) and i >= starts[stage]:
            stage += 1
        for t in call.outputs:
            where[id(t)] = (stage, call.layer.name)
    return where


def split_model(model: keras.Model, split_points: Sequence[str]) -> list[Stage]:
    """Cuts ``model`` into ``len(split_points) + 1`` stages.

    Args:
        model: A functional or built Sequential Keras model. Nested functional
            models (a keras-hub backbone in its task) are opened up.
        split_points: Names of the layers each stage after the first begins
            with, in the model's computing order (e.g. ``["dense_2"]``, or a
            keras-hub backbone's ``["transformer_layer_2"]``).

    Returns:
        The stages, first to last.

    Raises:
        ConfigError: ``model`` has no graph of layers; a split point is not a
            layer the model calls, leaves a stage empty, or is out of order; a
            tensor would cross two stage boundaries; a layer would run in two
            stages; the model's outputs are not all made in the last stage.
    """
    check_model(model)
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise ConfigError("split_points", split_points, "a list of layer names", source=SOURCE)
    if not split_points:
        raise ConfigError(
            "split_points", split_points, "at least one layer name (two stages)", source=SOURCE
        )
    inputs, calls, outputs = replayed(model)
    starts = _starts(calls, split_points)
    return _cut(calls, starts, inputs, outputs)


def replayed(model: keras.Model) -> tuple[Any, list[Call], Any]:
    """``model``'s graph called again on new inputs: the inputs, every leaf
    layer call in computing order, and the outputs."""
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse),
        _graph_of(model).input,
    )
    calls: list[Call] = []
    outputs = _replay(model, inputs, calls)
    return inputs, calls, outputs


def _cut(calls: list[Call], starts: list[int], inputs: Any, outputs: Any) -> list[Stage]:
    """The stages of the replayed ``calls``, each a functional model."""
    flat_inputs = keras.tree.flatten(inputs)
    input_position = {id(t): i for i, t in enumerate(flat_inputs)}
    where = _stage_of_tensors(calls, starts)
    bounds = [0, *starts, len(calls)]
    count = len(bounds) - 1
    sends: list[list] = [[] for _ in range(count)]  # What each stage passes on.
    uses: list[list[int]] = [[] for _ in range(count)]
    for stage in range(count):
        for call in calls[bounds[stage] : bounds[stage + 1]]:
            for t in call.inputs:
                _route(t, stage, call, where, input_position, sends, uses)
    owned = _variables(calls, bounds)
    flat_out = keras.tree.flatten(outputs)
    for t in flat_out:
        made = where.get(id(t))
        if made is not None and made[0] != count - 1:
            raise ConfigError(
                "split_points",
                made[1],
                f"a split after every layer that makes a model output (the output of layer "
                f"{made[1]!r} is made in stage {made[0]}, not in the last stage {count - 1})",
                source=SOURCE,
            )
    stages = []
    for stage in range(count):
        received = sends[stage - 1] if stage else []
        given = [flat_inputs[i] for i in uses[stage]]
        out = flat_out if stage == count - 1 else sends[stage]
        sub = keras.Model(given + received, out, name=f"stage_{stage}")
        names = tuple(c.layer.name for c in calls[bounds[stage] : bounds[stage + 1]])
        stages.append(
            Stage(stage, sub, names, tuple(uses[stage]), len(received), tuple(owned[stage]))
        )
    return stages


def _variables(calls: list[Call], bounds: list[int]) -> list[list]:
    """The variables each stage owns; refuses one read in two stages (tied
    weights), naming it."""
    stages_of: dict[int, set[int]] = {}
    for stage in range(len(bounds) - 1):
        for call in calls[bounds[stage] : bounds[stage + 1]]:
            stages_of.setdefault(id(call.layer), set()).add(stage)
    owned: list[list] = [[] for _ in range(len(bounds) - 1)]
    first_reader: dict[int, int] = {}
    for stage in range(len(bounds) - 1):
        for call in calls[bounds[stage] : bounds[stage + 1]]:
            shared = len(stages_of[id(call.layer)]) > 1
            for v in read_by(call) if shared else call.layer.weights:
                reader = first_reader.setdefault(id(v), stage)
                if reader != stage:
                    raise ConfigError(
                        "split_points",
                        call.layer.name,
                        f"splits that keep each weight in one stage (weight {v.path!r} of "
                        f"layer {call.layer.name!r} is used in stage {reader} and in stage "
                        f"{stage}: tied weights cannot be trained in two places; untie them "
                        "or keep both uses in one stage)",
                        source=SOURCE,
                    )
                if not any(v is w for w in owned[stage]):
                    owned[stage].append(v)
    return owned


def read_by(call: Call) -> list:
    """The variables one call of a layer reads (a layer called in two stages
    may use different weights in each, as a keras-hub embedding used
    reversed), found by tracing the call on zeros of its inputs' shapes in a
    graph: nothing runs, so no weight needs its value (a model built by
    stage has only its own) and no state changes."""
    import tensorflow as tf  # Only for a layer called in two stages.

    def zeros(value: Any) -> Any:
        if not symbolic(value):
            return value
        shape = [1 if d is None else d for d in value.shape]
        return tf.zeros(shape, dtype=value.dtype)

    def trace() -> None:
        args = keras.tree.map_structure(zeros, call.args)
        kwargs = keras.tree.map_structure(zeros, call.kwargs)
        call.layer(*args, **kwargs)

    with variables_read() as read:
        tf.function(trace, autograph=False).get_concrete_function()
    return [w for w in call.layer.weights if id(w) in read]


def _route(
    t: Any,
    stage: int,
    call: Call,
    where: dict[int, tuple[int, str]],
    input_position: dict[int, int],
    sends: list[list],
    uses: list[list[int]],
) -> None:
    """Records how tensor ``t``, an input of ``call`` in ``stage``, gets there."""
    if id(t) in input_position:
        if input_position[id(t)] not in uses[stage]:
            uses[stage].append(input_position[id(t)])
        return
    made, maker = where[id(t)]
    if made == stage:
        return
    if made != stage - 1:
        raise ConfigError(
            "split_points",
            maker,
            f"splits that each tensor crosses once (layer {call.layer.name!r} in stage "
            f"{stage} takes the output of layer {maker!r} from stage {made}: it would cross "
            f"{stage - made} stage boundaries)",
            source=SOURCE,
        )
    if not any(t is s for s in sends[made]):
        sends[made].append(t)
