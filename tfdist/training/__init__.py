"""The Keras integration: what makes Keras 3 ``fit`` and custom loops train under
tfdist's strategies.

It owns the fit fixes a strategy installs (:mod:`~tfdist.training.plugin`:
``steps_per_execution``, custom loops, gradient accumulation, chief-only
saves, save-on-preemption), the multi-worker-safe callbacks
(:mod:`~tfdist.training.callbacks`), input pipelines (:mod:`~tfdist.training.data`,
:mod:`~tfdist.training.resumable`), preemption (:mod:`~tfdist.training.preemption`)
and parameter-server training (:func:`fit` in
:mod:`~tfdist.training.parameter_server`). It imports the strategies,
compression, parallel and the spec layer; never profiling, horovod, the
engines or the CLI. Importing the package imports no TensorFlow; its names load
on first use.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes

_LAZY = {
    "fit": "parameter_server",
    "evaluate": "parameter_server",
    "predict": "parameter_server",
    "ParameterServerError": "parameter_server",
    "StepTimeoutError": "parameter_server",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
