"""The Keras integration: what makes Keras 3 ``fit`` and custom loops train under
tfdist's strategies.

It owns the fit fixes a strategy installs (:mod:`~tfdist.training.plugin`:
``steps_per_execution``, custom loops, gradient accumulation, chief-only
saves, save-on-preemption), the multi-worker-safe callbacks
(:mod:`~tfdist.training.callbacks`), input pipelines (:mod:`~tfdist.training.data`,
:mod:`~tfdist.training.fault_tolerance.resumable`), fault tolerance
(:mod:`~tfdist.training.fault_tolerance`: preemption, backups every task agrees
on) and parameter-server training (:mod:`~tfdist.training.ps`; :func:`fit` in
:mod:`~tfdist.training.ps.fit`). It imports the strategies,
compression, parallel and the spec layer; never profiling, horovod, the
engines or the CLI. Importing the package imports no TensorFlow; its names load
on first use.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes

_LAZY = {
    "fit": "tfdist.training.ps.fit",
    "evaluate": "tfdist.training.ps.fit",
    "predict": "tfdist.training.ps.fit",
    "ParameterServerError": "tfdist.training.ps.fit",
    "StepTimeoutError": "tfdist.training.ps.fit",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
