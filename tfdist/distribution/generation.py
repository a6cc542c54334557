"""keras-hub's ``generate()`` under a ``ModelParallel`` that spans processes.

keras-hub compiles ``CausalLM.generate_step`` as a plain ``tf.function``
and calls it outside any replica context. In one process that is enough:
each sharded weight is read whole from this process's blocks. Across
processes the other blocks live in other processes, and only a replica
can reach them, through its layers' collectives, as ``fit`` does. So here
the step runs on every replica with :meth:`strategy.run`:

- every replica gets the whole batch of prompts. Prompts are few, and the
  sampler's ``while`` loop ends when every row has met a stop token: with
  the same rows every replica runs the same number of iterations, so the
  collectives of each iteration pair up (split rows would not);
- the sampler draws the same tokens on every replica (the same seed);
- this process returns its first replica's tokens, which every replica
  shares.

The step is not compiled with XLA there: XLA on CPU has no collectives.

A process with several devices (a host's GPUs) runs each of its replicas'
step as a function of its own, on a thread of its own
(:func:`_threaded`). One function holding every local replica's sampling
loop never finished: TensorFlow ran one replica's ``while`` op to its first
collective while the other replicas' loops had not started (measured with 4
logical CPUs, a loop of one all-reduce; the same all-reduce outside a loop
finished). Each function is traced first, one after the other, so a tracing
error surfaces before any replica waits on a collective.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import tensorflow as tf

from tfdist.parallel import collectives

__all__ = ["spanning_strategy", "on_every_replica", "wrap_make_generate_function"]


def spanning_strategy(model: Any) -> Any:
    """The model's tfdist strategy if its replicas span processes, else None."""
    from tfdist.strategies import TfdistStrategy

    strategy = getattr(model, "_distribute_strategy", None)
    if not isinstance(strategy, TfdistStrategy):
        return None
    local = len(strategy.extended.worker_devices)
    return strategy if strategy.num_replicas_in_sync > local else None


def wrap_make_generate_function(original):
    """keras-hub's ``CausalLM.make_generate_function``: across processes, a
    function that runs ``generate_step`` on every replica."""

    @functools.wraps(original)
    def make_generate_function(self):
        strategy = spanning_strategy(self)
        if strategy is None or self.run_eagerly or self.generate_function is not None:
            return original(self)
        self.generate_function = on_every_replica(self, strategy)
        return self.generate_function

    return make_generate_function


def on_every_replica(model: Any, strategy: Any):
    """A function like keras-hub's ``generate_function`` that runs
    ``model.generate_step`` on each of ``strategy``'s replicas and returns
    this process's first replica's result."""
    if len(strategy.extended.worker_devices) > 1:
        return _threaded(model, strategy)

    @tf.function(jit_compile=False)
    def generate_function(inputs, stop_token_ids=None):
        outputs = strategy.run(
            model.generate_step, args=(inputs,), kwargs={"stop_token_ids": stop_token_ids}
        )
        return strategy.experimental_local_results(outputs)[0]

    return generate_function


def _threaded(model: Any, strategy: Any):
    devices = tuple(strategy.extended.worker_devices)
    first = collectives.first_local_replica(strategy)
    steps = [tf.function(model.generate_step, jit_compile=False) for _ in devices]

    def enter(stack: contextlib.ExitStack, i: int) -> None:
        stack.enter_context(tf.distribute.ReplicaContext(strategy, first + i))
        stack.enter_context(tf.device(devices[i]))

    def generate_function(inputs, stop_token_ids=None):
        concrete = []
        for i, step in enumerate(steps):
            with contextlib.ExitStack() as stack:
                enter(stack, i)
                concrete.append(step.get_concrete_function(inputs, stop_token_ids=stop_token_ids))
        results: list[Any] = [None] * len(devices)
        errors: list[BaseException | None] = [None] * len(devices)

        def run(i: int) -> None:
            try:
                with contextlib.ExitStack() as stack:
                    enter(stack, i)
                    results[i] = concrete[i](inputs, stop_token_ids=stop_token_ids)
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors[i] = error

        threads = [
            threading.Thread(target=run, args=(i,), name=f"tfdist-generate-{i}", daemon=True)
            for i in range(len(devices))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for error in errors:
            if error is not None:
                raise error
        return results[0]

    return generate_function
