"""The strategies layer: tfdist's tf.distribute strategies and :func:`strategy_from_config`.

Not the example scripts: those are the repository root's ``strategies/``
folder (``strategies/mirrored.py``, ...), which use this package as a user's
script does.

It owns the strategy classes (each subclasses TensorFlow's own, so anything
that takes a ``tf.distribute.Strategy`` takes them), the factory that picks one
from the spec layer's choice, the multi-worker join and peer watchdog, the late
start, the Slurm resolver and the absl flags of training scripts. It imports
the spec layer and compression, never the Keras integration, parallel,
profiling, horovod, the engines or the CLI: those plug in through
:mod:`~tfdist.plugins`. Importing the package imports no TensorFlow;
its names load on first use.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes

_LAZY = {
    "TfdistStrategy": "base",
    "ClusterJoinError": "base",
    "TPUNotFoundError": "base",
    "compression_for": "base",
    "OneDeviceStrategy": "local",
    "MirroredStrategy": "local",
    "MultiWorkerMirroredStrategy": "multi_worker",
    "ParameterServerStrategy": "parameter_server",
    "serve": "parameter_server",
    "TPUStrategy": "tpu",
    "check_tpu": "tpu",
    "strategy_from_config": "factory",
    "explain": "factory",
    "describe": "factory",
    "StrategyOrderError": "late_start",
}

__all__ = [
    "ClusterJoinError",
    "StrategyOrderError",
    "TPUNotFoundError",
    "TfdistStrategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "TPUStrategy",
    "strategy_from_config",
    "explain",
    "describe",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
