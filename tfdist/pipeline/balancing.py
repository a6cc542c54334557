"""Split points that give a pipeline's stages equal cost.

A pipeline runs at the pace of its slowest stage. The bubble formula
``(p - 1) / (m + p - 1)`` holds only for stages of equal cost: with two
stages and four micro-batches, a stage 3 % cheaper than the other idles
about 2.4 points more than the formula says. Cutting a model into equal
numbers of blocks rarely gives equal costs: the first stage's backward makes
no gradient for the batch, and the last computes the head and the loss (a
language model's logits over its whole vocabulary, often its costliest layer).

:func:`balance` measures what each layer call of the model costs, then picks
the split points that make the costliest stage as cheap as it can be, among
the cuts :func:`~tfdist.pipeline.split.split_model` accepts (no tensor
crossing two boundaries, tied weights in one stage, the outputs in the last):

- ``by="time"`` (torchgpipe's ``balance_by_time``): each call's forward and
  backward on a sample micro-batch, as the stage will run them: with the
  gradients of its weights and of the inputs it receives (none for the
  batch's own inputs).
- ``by="parameters"`` (DeepSpeed's ``partition_method="parameters"``): the
  size of the weights each call reads. It reads no value, so a function that
  builds the model may stand for the model: its weights are never made,
  and a model too large for one process can be balanced. A lookup table
  counts in full though a lookup computes little.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import keras

from tfdist.compat.deferred import deferred_build
from tfdist.errors import ConfigError
from tfdist.pipeline.split import Call, check_model, read_by, replayed, split_model, symbolic

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["BY", "Balance", "balance"]

SOURCE = "tfdist.pipeline.balance"

#: What a layer call's cost can be measured by.
BY = ("time", "parameters")


@dataclasses.dataclass(frozen=True)
class Balance:
    """The split points :func:`balance` chose, and what each stage costs.

    Attributes:
        split_points: The layer each stage after the first begins with
            (``PipelineModel(..., split_points=...)``).
        costs: Per stage, its measured cost: seconds of one micro-batch's
            forward and backward (``by="time"``), or the number of weight
            values it reads (``by="parameters"``).
        by: What was measured.
        layers: Per stage, the names of the layers it calls.
    """

    split_points: tuple[str, ...]
    costs: tuple[float, ...]
    by: str
    layers: tuple[tuple[str, ...], ...]

    @property
    def imbalance(self) -> float:
        """How much the costliest stage exceeds the mean stage (0 is equal)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean - 1 if mean > 0 else 0.0


def balance(
    model: keras.Model | Callable[[], keras.Model],
    stages: int,
    *,
    by: str = "time",
    x: object = None,
    y: object = None,
    loss: object = None,
    repeats: int = 3,
) -> Balance:
    """Chooses split points that give ``stages`` stages of equal cost.

    Args:
        model: A functional or built Sequential Keras model, as
            :func:`~tfdist.pipeline.split.split_model` takes; or a function
            that builds one (with ``by="parameters"`` its weights get no value).
        stages: How many stages (at least 2).
        by: ``"time"`` or ``"parameters"`` (see the module's docstring).
        x: With ``by="time"``: one micro-batch of the model's inputs, of the
            size the pipeline will run.
        y: With ``by="time"`` and ``loss``: that micro-batch's targets; the
            loss's cost counts in the last stage.
        loss: A Keras loss (name, function or object), or None.
        repeats: With ``by="time"``: timed runs of each call (the median counts).

    Returns:
        A :class:`Balance`. Its ``split_points`` are accepted by ``split_model``.

    Raises:
        ConfigError: Naming the argument: ``stages`` not an integer >= 2 or
            more than the model has places to cut; ``by`` unknown; ``x``
            missing for ``by="time"``; ``y`` without ``loss`` or the other
            way round; ``repeats`` < 1.
    """
    _check_args(stages, by, x, y, loss, repeats)
    if callable(model) and not isinstance(model, keras.Model):
        model = deferred_build(model)[0] if by == "parameters" else model()
    check_model(model)
    inputs, calls, outputs = replayed(model)
    cuts = _Cuts.of(calls, inputs, outputs)
    if by == "time":
        costs, tail = _timed(calls, inputs, outputs, x, y, loss, repeats)
    else:
        costs, tail = [float(_parameters(call, cuts.shared)) for call in calls], 0.0
    starts, stage_costs = cuts.best(costs, tail, stages)
    names = [calls[c].layer.name for c in starts]
    split_model(model, names)  # The same checks as the pipeline's, with its errors.
    bounds = [0, *starts, len(calls)]
    return Balance(
        split_points=tuple(names),
        costs=stage_costs,
        by=by,
        layers=tuple(tuple(c.layer.name for c in calls[a:b]) for a, b in zip(bounds, bounds[1:])),
    )


def _check_args(
    stages: object, by: object, x: object, y: object, loss: object, repeats: object
) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ConfigError("stages", stages, "an integer >= 2", source=SOURCE)
    if by not in BY:
        raise ConfigError("by", by, f"one of {BY}", source=SOURCE)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "an integer >= 1", source=SOURCE)
    if by == "time" and x is None:
        raise ConfigError(
            "x", None, 'one micro-batch of the model\'s inputs to time (by="time")', source=SOURCE
        )
    if (y is None) != (loss is None):
        field, value = ("loss", loss) if y is None else ("y", y)
        raise ConfigError(
            field,
            type(value).__name__,
            "y and loss together (the loss's cost counts in the last stage), or neither",
            source=SOURCE,
        )
    if by == "parameters" and (x is not None or y is not None):
        raise ConfigError(
            "x" if x is not None else "y",
            "a batch",
            'None with by="parameters" (only by="time" runs the model)',
            source=SOURCE,
        )


@dataclasses.dataclass
class _Cuts:
    """Where the replayed calls may be cut, and which cuts may follow which.

    Attributes:
        legal: Call indices a stage may begin at, on their own: the first
            call of its layer's name, not after a model output is made, and
            not between two calls of a layer that read the same weight.
        reach: ``reach[c]``: the last call that uses a tensor made before
            call ``c`` (the batch's inputs aside). A cut at ``c`` may be
            followed by one at ``d`` only if ``d > reach[c]``: else that
            tensor would cross both.
        shared: id(call) -> the weights it reads, for layers called twice.
    """

    legal: list[int]
    reach: list[int]
    shared: dict[int, list]

    @classmethod
    def of(cls, calls: list[Call], inputs: object, outputs: object) -> _Cuts:
        given = {id(t) for t in keras.tree.flatten(inputs)}
        made = {id(t): i for i, call in enumerate(calls) for t in call.outputs}
        last_use: dict[int, int] = {}
        for j, call in enumerate(calls):
            for t in call.inputs:
                if id(t) not in given:
                    last_use[made[id(t)]] = j
        reach, farthest = [], -1
        for i in range(len(calls)):
            reach.append(farthest)  # Over the tensors made before call i.
            farthest = max(farthest, last_use.get(i, -1))
        outputs_from = min(made[id(t)] for t in keras.tree.flatten(outputs) if id(t) in made)
        names = [c.layer.name for c in calls]
        shared = cls._shared(calls)
        tied = set()
        twice = [(i, c) for i, c in enumerate(calls) if id(c) in shared]
        for (i, a), (j, b) in itertools.combinations(twice, 2):
            if b.layer is a.layer and _overlap(shared[id(a)], shared[id(b)]):
                tied.update(range(i + 1, j + 1))
        legal = [
            c
            for c in range(1, len(calls))
            if c <= outputs_from and names.index(names[c]) == c and c not in tied
        ]
        return cls(legal, reach, shared)

    @staticmethod
    def _shared(calls: list[Call]) -> dict[int, list]:
        counts: dict[int, int] = {}
        for call in calls:
            counts[id(call.layer)] = counts.get(id(call.layer), 0) + 1
        return {id(c): read_by(c) for c in calls if counts[id(c.layer)] > 1}

    def best(
        self, costs: Sequence[float], tail: float, stages: int
    ) -> tuple[list[int], tuple[float, ...]]:
        """The stage starts that minimize the costliest stage (a dynamic
        programme over the legal cuts, in order), and each stage's cost."""
        n = len(costs)
        if stages - 1 > len(self.legal):
            raise ConfigError(
                "stages",
                stages,
                f"at most {len(self.legal) + 1}: the model has {len(self.legal)} places to cut",
                source=SOURCE,
            )
        prefix = [0.0, *itertools.accumulate(costs)]

        def cost(a: int, b: int) -> float:
            return prefix[b] - prefix[a] + (tail if b == n else 0.0)

        # best[c] = (the costliest of the stages before call c, the cuts).
        best = {c: (cost(0, c), (c,)) for c in self.legal}
        for _ in range(stages - 2):
            step: dict[int, tuple[float, tuple[int, ...]]] = {}
            for d in self.legal:
                options = [
                    (max(worst, cost(c, d)), cuts + (d,))
                    for c, (worst, cuts) in best.items()
                    if c < d and d > self.reach[c]
                ]
                if options:
                    step[d] = min(options)
            best = step
        finals = [(max(worst, cost(c, n)), cuts) for c, (worst, cuts) in best.items()]
        if not finals:
            raise ConfigError(
                "stages",
                stages,
                "fewer stages: no cuts of this model into that many leave every tensor "
                "crossing one boundary at most",
                source=SOURCE,
            )
        starts = list(min(finals)[1])
        bounds = [0, *starts, n]
        return starts, tuple(cost(a, b) for a, b in zip(bounds, bounds[1:]))


def _overlap(a: list, b: list) -> bool:
    return any(v is w for v in a for w in b)


def _parameters(call: Call, shared: dict[int, list]) -> int:
    weights = shared.get(id(call), call.layer.weights)
    return sum(math.prod(w.shape) for w in weights)


def _timed(
    calls: list[Call],
    inputs: object,
    outputs: object,
    x: object,
    y: object,
    loss: object,
    repeats: int,
) -> tuple[list[float], float]:
    """Each call's seconds of forward and backward on ``x``, and the loss's."""
    import tensorflow as tf

    flat_inputs = keras.tree.flatten(inputs)
    given = {id(t) for t in flat_inputs}
    wanted = list(
        {
            id(t): t
            for t in [*(t for c in calls for t in c.inputs), *keras.tree.flatten(outputs)]
            if id(t) not in given
        }.values()
    )
    # Flat inputs: a dict of Inputs keyed by other names than theirs makes Keras warn.
    probe = keras.Model(flat_inputs, wanted)
    try:
        values = probe(keras.tree.flatten(x))
    except Exception as err:  # Keras's own message names the mismatch.
        raise ConfigError(
            "x", type(x).__name__, f"a batch of the model's inputs ({err})", source=SOURCE
        ) from err
    held = {id(t): v for t, v in zip(wanted, keras.tree.flatten(values))}
    held.update(
        {id(t): tf.convert_to_tensor(v) for t, v in zip(flat_inputs, keras.tree.flatten(x))}
    )
    costs = [_seconds(_pass(call, held, given), repeats) for call in calls]
    tail = 0.0
    if loss is not None:
        predicted = [held[id(t)] for t in keras.tree.flatten(outputs)]
        tail = _seconds(_loss_pass(keras.losses.get(loss), y, predicted), repeats)
    return costs, tail


#: Passes a timed function runs in a loop: one call of a compiled function
#: costs tens of microseconds, as much as a small layer's pass, and a stage
#: runs all its layers in one call.
LOOP = 8


def _pass(call: Call, held: dict[int, tf.Tensor], given: set[int]) -> Callable[[], object]:
    """A forward and backward of one call: the gradients of the weights it
    trains and of its float inputs the stage receives or makes."""
    import tensorflow as tf

    def value(t: object) -> object:
        return held[id(t)] if symbolic(t) else t

    args = keras.tree.map_structure(value, call.args)
    kwargs = keras.tree.map_structure(value, call.kwargs)
    sources = [
        held[id(t)]
        for t in call.inputs
        if id(t) not in given and keras.backend.is_float_dtype(t.dtype)
    ]
    weights = list(call.layer.trainable_weights)

    def once() -> list:
        with tf.GradientTape() as tape:
            tape.watch(sources)
            out = [
                o for o in keras.tree.flatten(call.layer(*args, **kwargs)) if o.dtype.is_floating
            ]
        if not out or not (sources or weights):
            return out
        grads = tape.gradient(out, sources + weights, [tf.ones_like(o) for o in out])
        return [g for g in grads if g is not None]

    return _looped(once)


def _loss_pass(
    fn: Callable[..., tf.Tensor], y: object, predicted: list[tf.Tensor]
) -> Callable[[], object]:
    import tensorflow as tf

    y = keras.tree.map_structure(tf.convert_to_tensor, y)

    def once() -> list:
        with tf.GradientTape() as tape:
            tape.watch(predicted)
            value = tf.reduce_mean(fn(y, predicted[0] if len(predicted) == 1 else predicted))
        return tape.gradient(value, predicted)

    return _looped(once)


def _looped(once: Callable[[], list]) -> Callable[[], object]:
    """``once`` run LOOP times in one compiled function, one after another.
    Each run adds one value of its results to the loop's carry, so none is
    pruned and no two runs are merged as one."""
    import tensorflow as tf

    def first(value: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
        values = value.values if isinstance(value, tf.IndexedSlices) else value
        return tf.cast(tf.reshape(values, [-1])[:1], tf.float32)

    def body(i: tf.Tensor, carry: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        done = [first(v) for v in once()]
        return i + 1, carry + (tf.add_n([tf.reduce_sum(d) for d in done]) if done else 0.0)

    def run() -> tuple[tf.Tensor, tf.Tensor]:
        # One run at a time: overlapping runs on idle threads would time less
        # than the stage's one pass costs.
        return tf.while_loop(
            lambda i, _: i < LOOP,
            body,
            (tf.constant(0), tf.constant(0.0)),
            parallel_iterations=1,
        )

    return tf.function(run, autograph=False)


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of one of ``fn``'s LOOP passes."""
    fn()  # Traces it.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / LOOP
