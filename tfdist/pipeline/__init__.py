"""Pipeline parallelism: a Keras model cut into stages, each on its own worker.

- :func:`split_model` cuts a functional or Sequential model at named layers;
  :func:`balance` chooses the layers so that the stages cost the same.
- :mod:`~tfdist.pipeline.schedule`: GPipe and 1F1B, and their bubble.
- :class:`PipelineModel` wraps a Keras model so that ``fit``, ``evaluate``,
  ``predict`` and ``save`` run it in stages, one per process.
- :class:`~tfdist.pipeline.runtime.StageRunner` runs one stage's passes in a
  training step, sending activations and gradients to its neighbours; its
  :class:`~tfdist.pipeline.trace.Trace` times them, and
  :func:`~tfdist.pipeline.trace.breakdown` measures the bubble.
- :mod:`~tfdist.pipeline.saving`: the weights file, written and read by stage.
- :mod:`~tfdist.pipeline.laid_out`: a stage laid out over its process's devices
  by a ``keras.distribution`` (``PipelineModel(..., distribution=)``).

Importing this package imports no TensorFlow; its names load on first use.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes

_LAZY = {
    "Balance": "balancing",
    "balance": "balancing",
    "Stage": "split",
    "split_model": "split",
    "StageRunner": "runtime",
    "PipelineModel": "model",
    "stage_from_environment": "model",
    "SCHEDULES": "schedule",
    "bubble": "schedule",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
