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

Each process must bring one device. The sampling loop runs the layers'
collectives once per token; several replicas of one process running the
loop side by side never finished (4 replicas in one process, measured), so
a process with several is refused (:func:`check_devices`) rather than left
to hang. MultiWorkerMirrored on CPUs gives each process one device.
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf

from tfdist.errors import ConfigError

__all__ = ["spanning_strategy", "check_devices", "wrap_make_generate_function"]


def spanning_strategy(model: Any) -> Any:
    """The model's tfdist strategy if its replicas span processes, else None."""
    from tfdist.strategies import TfdistStrategy

    strategy = getattr(model, "_distribute_strategy", None)
    if not isinstance(strategy, TfdistStrategy):
        return None
    local = len(strategy.extended.worker_devices)
    return strategy if strategy.num_replicas_in_sync > local else None


def check_devices(local: int, replicas: int) -> None:
    """Raises ConfigError unless each process holds one of the replicas.

    Args:
        local: This process's replicas.
        replicas: The job's.
    """
    if local != 1:
        raise ConfigError(
            "devices per process",
            local,
            "1 for generate() under a ModelParallel across processes (keras-hub's "
            "sampling loop runs the layers' collectives once per token, and several "
            "replicas of one process did not finish it)",
            source="tfdist.distribution.generation",
            hint=f"Run the job's {replicas} replicas as {replicas} processes of one device each.",
        )


def wrap_make_generate_function(original):
    """keras-hub's ``CausalLM.make_generate_function``: across processes, a
    function that runs ``generate_step`` on every replica."""

    @functools.wraps(original)
    def make_generate_function(self):
        strategy = spanning_strategy(self)
        if strategy is None or self.run_eagerly or self.generate_function is not None:
            return original(self)
        check_devices(len(strategy.extended.worker_devices), strategy.num_replicas_in_sync)
        self.generate_function = _on_every_replica(self, strategy)
        return self.generate_function

    return make_generate_function


def _on_every_replica(model: Any, strategy: Any):
    @tf.function(jit_compile=False)
    def generate_function(inputs, stop_token_ids=None):
        outputs = strategy.run(
            model.generate_step, args=(inputs,), kwargs={"stop_token_ids": stop_token_ids}
        )
        return strategy.experimental_local_results(outputs)[0]

    return generate_function
