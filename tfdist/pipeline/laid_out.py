"""A pipeline stage laid out over its process's devices by a
``keras.distribution`` (tfdist's ``ModelParallel`` or ``DataParallel``):
the third axis, beside the stages and the pipeline replicas.

The stage's weights are made under the distribution (:func:`build_stage`):
each is split over the mesh as the layout map says. Its passes run on the
distribution's strategy (:class:`MeshPasses`), each replica on its rows of
the micro-batch, with the layouts' collectives, as ``fit`` runs them under
the distribution; the outputs are joined whole before they go on.

The backward recomputes the stage's forward inside each replica, under a
tape there, as Keras's train step does under a strategy: TensorFlow then
builds each replica's backward, collectives included, in that replica's
context. A tape kept from the forward outside the replicas loses it (the
layers' gathers become identities, and TensorFlow's call-time collective
keys give gradients of None, both silently). The cost is one more forward of
the stage per micro-batch. Between the passes, only the stage's inputs are
kept, and its state before the forward (:meth:`MeshPasses.state`: each
device's copy of what a forward changes, :func:`forward_state`). The
recompute starts from that state, and its own changes are undone after it:
Dropout and noise layers draw the forward's numbers again (from their seed
generators' states), and BatchNormalization normalizes with the same batch
statistics and updates its moving averages once, in the forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfdist.compat.deferred import materialize
from tfdist.compat.keras_private import flatten_layers
from tfdist.errors import ConfigError

__all__ = [
    "MeshPasses",
    "apply_on",
    "build_stage",
    "components",
    "forward_state",
    "owners_of",
    "strategy_for",
    "sum_gradients",
]

SOURCE = "tfdist.pipeline.PipelineModel"


def strategy_for(distribution: keras.distribution.Distribution) -> tf.distribute.Strategy:
    """The strategy tfdist trains ``distribution`` on (made once).

    Raises:
        ConfigError: Not a distribution tfdist honours (a ``DataParallel``
            or ``ModelParallel``), or a mesh beyond this process's devices.
    """
    from tfdist.distribution import data_parallel

    if not data_parallel.honours(distribution):
        raise ConfigError(
            "distribution",
            distribution,
            "a keras.distribution.ModelParallel or DataParallel over this process's devices "
            "(each stage lays its own layers out over them)",
            source=SOURCE,
        )
    # The stage's mesh is its own process's, whatever job (TF_CONFIG) the
    # pipeline's processes form.
    return data_parallel.strategy_for(distribution, local=True)


def build_stage(
    distribution: keras.distribution.Distribution,
    variables: Sequence[keras.Variable],
    owners: dict[int, keras.layers.Layer],
) -> None:
    """Makes the deferred ``variables`` under ``distribution``: each takes
    its layout, as if its layer had made it under the distribution's scope.

    Args:
        owners: The layer that holds each variable, by ``id``: it is made
            inside that layer's name scope, as ``Layer.add_weight`` makes
            it, so tfdist covers the layer's call and saving for its split
            weights.
    """
    with distribution.scope():
        for variable in variables:
            layer = owners.get(id(variable))
            if layer is None:
                materialize(variable)
                continue
            with keras.name_scope(layer.name, caller=layer):
                materialize(variable)


def owners_of(model: keras.layers.Layer) -> dict[int, keras.layers.Layer]:
    """The innermost layer that holds each of ``model``'s variables, by ``id``."""
    found: dict[int, keras.layers.Layer] = {}
    # Outer layers come before the layers nested in them: the last holder wins.
    for layer in flatten_layers(model, include_self=True):
        for variable in layer.weights:
            found[id(variable)] = layer
    return found


def forward_state(model: keras.layers.Layer) -> list:
    """The variables a training forward of ``model`` changes: its seed
    generators' states (Dropout, noise layers) and BatchNormalization's
    statistics. Not frozen weights (a LoRA's base), which it only reads."""
    weights = {id(w) for w in model.non_trainable_weights}
    found = [v for v in model.non_trainable_variables if id(v) not in weights]
    for layer in flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            found += layer.non_trainable_weights
    return found


def _replica() -> int:
    context = tf.distribute.get_replica_context()
    return int(tf.get_static_value(context.replica_id_in_sync_group))


def _rows(tensors: Sequence[Any], replica: int, count: int) -> list:
    """Each tensor's ``replica``-th of ``count`` row blocks."""
    return [None if t is None else tf.split(t, count, axis=0)[replica] for t in tensors]


def _model_input(inputs: list) -> Any:
    return inputs[0] if len(inputs) == 1 else inputs


def _as_list(out: Any) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


class MeshPasses:
    """A stage's passes on ``strategy``'s replicas, each on its rows.

    Args:
        model: The stage's model (its weights made by :func:`build_stage`).
        strategy: The distribution's strategy (:func:`strategy_for`).
        variables: The stage's trainable variables.
        head: On the last stage, ``head(outputs, targets)``: the
            micro-batch's loss, as the runner scales it.
    """

    def __init__(
        self,
        model: keras.Model,
        strategy: tf.distribute.Strategy,
        variables: Sequence[keras.Variable],
        head: Callable[[Any, list], tf.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.strategy = strategy
        self.count = strategy.num_replicas_in_sync
        self.devices = list(strategy.extended.worker_devices)
        self.variables = list(variables)
        self.head = head
        #: What a training forward changes besides its outputs.
        self.states = forward_state(model)
        self._read = tf.function(lambda: [tf.identity(c) for c in self._components()])
        self._forward = {
            training: tf.function(
                lambda inputs, targets, training=training: self._forward_fn(
                    inputs, targets, training
                ),
                reduce_retracing=True,
            )
            for training in (True, False)
        }
        self._backward = tf.function(self._backward_fn, reduce_retracing=True)

    def check_rows(self, rows: int, field: str = "batch") -> None:
        """Raises ConfigError: ``rows`` does not split over the replicas."""
        if rows % self.count:
            raise ConfigError(
                field,
                rows,
                f"micro-batches of a multiple of {self.count} rows: the stage's mesh has "
                f"{self.count} devices, each taking its rows of every micro-batch",
                source=SOURCE,
            )

    def forward(self, inputs: list, targets: list | None, training: bool) -> tuple:
        """``(outputs, loss, upstream)``: the stage's outputs (whole); with
        ``targets`` (last stage), the micro-batch's loss and its gradient
        with respect to the outputs (the backward's upstream), else None."""
        self.check_rows(int(inputs[0].shape[0]))
        return self._forward[training](list(inputs), targets)

    def inference(self, inputs: list, targets: list | None) -> list:
        """As the runner's pass for inference: ``[loss, *outputs]`` with
        ``targets``, else the outputs."""
        outs, loss, _ = self.forward(inputs, targets, training=False)
        return outs if targets is None else [loss, *outs]

    def _forward_fn(self, inputs: list, targets: list | None, training: bool) -> tuple:
        def replica(inputs: list) -> list:
            mine = _rows(inputs, _replica(), self.count)
            return _as_list(self.model(_model_input(mine), training=training))

        outs = self._joined(self.strategy.run(replica, args=(inputs,)))
        if targets is None or self.head is None:
            return outs, None, None
        # The loss of the whole micro-batch, outside the replicas: its
        # gradient is the stage's upstream, as a middle stage receives it.
        with tf.GradientTape() as tape:
            tape.watch(outs)
            loss = self.head(_model_input(outs), targets)
        upstream = tape.gradient(loss, outs)
        return outs, loss, [tf.zeros_like(o) if u is None else u for o, u in zip(outs, upstream)]

    def _joined(self, per_replica: Any) -> list:
        local = self.strategy.experimental_local_results
        return [tf.concat(local(t), 0) for t in per_replica]

    def state(self) -> list:
        """Each device's copy of :func:`forward_state`'s variables, now:
        take it before a forward, and give it to that forward's backward."""
        return self._read() if self.states else []

    def _components(self) -> list:
        return components(self.strategy, self.states)

    def backward(
        self, given: list, received: list, upstream: list, state: Sequence[Any] = ()
    ) -> tuple[list, list]:
        """``(dx, grads)``: the gradients of the received inputs (whole), and
        of each variable, a list of its per-device components.

        Args:
            state: :meth:`state` before this micro-batch's forward: the
                recompute starts from it (the same dropout masks), and the
                state is as it was before the backward after it.
        """
        return self._backward(list(given), list(received), list(upstream), list(state))

    def _backward_fn(
        self, given: list, received: list, upstream: list, state: list
    ) -> tuple[list, list]:
        variables = [v.value for v in self.variables]
        n = len(received)
        parts = self._components() if state else []
        now = [tf.identity(c) for c in parts]  # Put back after the recompute.
        for part, value in zip(parts, state):
            part.assign(value)

        def replica(given: list, received: list, upstream: list) -> tuple[list, list]:
            r = _replica()
            fixed, mine, dys = (_rows(t, r, self.count) for t in (given, received, upstream))
            with tf.GradientTape() as tape:
                tape.watch(mine)
                outs = _as_list(self.model(_model_input(fixed + mine), training=True))
            sources = mine + variables
            got = tape.gradient(outs, sources, output_gradients=dys)
            got = [tf.zeros_like(s) if g is None else g for g, s in zip(got, sources)]
            return got[:n], got[n:]

        dx, grads = self.strategy.run(replica, args=(given, received, upstream))
        with tf.control_dependencies(tf.nest.flatten((dx, grads))):
            for part, value in zip(parts, now):
                part.assign(value)
        local = self.strategy.experimental_local_results
        return self._joined(dx), [list(local(g)) for g in grads]

    def add(self, a: list, b: list) -> list:
        """Two micro-batches' per-device gradients, summed on each device."""
        summed = []
        for device, x, y in zip(self.devices, a, b):
            with tf.device(device):
                summed.append(sum_gradients(x, y))
        return summed


def components(strategy: tf.distribute.Strategy, variables: Sequence[keras.Variable]) -> list:
    """Each variable's per-device components, in order: what each device
    holds (a block of a split weight, a copy of a replicated one)."""
    return [c for v in variables for c in strategy.experimental_local_results(v.value)]


def apply_on(
    strategy: tf.distribute.Strategy,
    optimizer: keras.optimizers.Optimizer,
    grads: list,
    variables: list,
) -> None:
    """Applies per-device gradients inside ``strategy``'s replicas, where
    tfdist's gradient hook reduces them as ``fit`` does under the
    distribution (replicated weights summed over every replica, split
    weights over the replicas that hold the same block)."""

    def replica() -> None:
        r = _replica()
        # Made inside the replica, on its device: captured from outside, a
        # one-device mesh's gradients name no device to reduce to.
        mine = [tf.nest.map_structure(tf.identity, g[r], expand_composites=True) for g in grads]
        optimizer.apply(mine, variables)

    strategy.run(replica)


def sum_gradients(a: Any, b: Any) -> Any:
    """Sums two micro-batches' gradients. An embedding's IndexedSlices are
    joined, not densified: the whole batch's gradient holds every lookup's
    row too, and the optimizer sums the duplicates as it would (a dense sum
    would make Keras's optimizers update every row, the untouched ones too)."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
        )
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
