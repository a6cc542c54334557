"""tfdist: distributed training for TensorFlow and Keras 3.

``tfdist.strategy_from_config()`` returns the right tf.distribute strategy for
wherever the script runs. TensorFlow is imported lazily, on first use of a
name that needs it, so that ``tfdist.spec`` and the CLI's spec commands
stay fast and work without TensorFlow.
"""

from __future__ import annotations

from tfdist import plugins as _plugins
from tfdist._lazy import lazy_attributes
from tfdist.compat import import_hook as _import_hook, versions as _versions
from tfdist.errors import ClusterSpecError, ConfigError, TfdistError

__version__ = "0.2.0"

# A TensorFlow or Keras outside the tested range fails here, with the
# versions named, not later as an ImportError from deep inside TF.
_versions.check_supported()

# Public name -> module that defines it; imported on first access.
_LAZY = {
    "strategy_from_config": "tfdist.strategies",
    "explain": "tfdist.strategies",
    "describe": "tfdist.strategies",
    "TfdistStrategy": "tfdist.strategies",
    "OneDeviceStrategy": "tfdist.strategies",
    "MirroredStrategy": "tfdist.strategies",
    "MultiWorkerMirroredStrategy": "tfdist.strategies",
    "ParameterServerStrategy": "tfdist.strategies",
    "TPUStrategy": "tfdist.strategies",
    "ClusterJoinError": "tfdist.strategies",
    "TPUNotFoundError": "tfdist.strategies",
    "StrategyOrderError": "tfdist.strategies",
    "KerasDistributionError": "tfdist.distribution.guard",
    "fit": "tfdist.training.ps.fit",
    "evaluate": "tfdist.training.ps.fit",
    "predict": "tfdist.training.ps.fit",
    "shards": "tfdist.training.ps.fit",
    "ParameterServerError": "tfdist.training.ps.fit",
    "StepTimeoutError": "tfdist.training.ps.fit",
    "local_cluster": "tfdist.engines.worker.local_cluster",
    "LocalCluster": "tfdist.engines.worker.local_cluster",
    "define_flags": "tfdist.strategies.flags",
    "strategy_from_flags": "tfdist.strategies.flags",
    "parse_compression": "tfdist.compression",
    "BackupAndRestore": "tfdist.training.callbacks",
    "ModelCheckpoint": "tfdist.training.callbacks",
    "TensorBoard": "tfdist.training.callbacks",
    "LearningRateWarmup": "tfdist.training.callbacks",
    "scale_learning_rate": "tfdist.training.callbacks",
    "global_batch_size": "tfdist.training.data",
    "choose_shard_policy": "tfdist.training.data",
    "distribute_dataset": "tfdist.training.data",
    "CheckpointableIterator": "tfdist.training.fault_tolerance.resumable",
    "PreemptionWatcher": "tfdist.training.fault_tolerance.preemption",
    "Preempted": "tfdist.training.fault_tolerance.preemption",
    "PreemptionError": "tfdist.training.fault_tolerance.preemption",
    "PREEMPTED_EXIT_CODE": "tfdist.training.fault_tolerance.preemption",
    "StepProfile": "tfdist.profiling.callback",
    "LoopProfile": "tfdist.profiling.callback",
    "UnsupportedVersionError": "tfdist.compat.versions",
    "PatchError": "tfdist.compat.patching",
}

#: The layers above the strategies that plug into every strategy
#: (:mod:`tfdist.plugins`), in the order they install. This package
#: runs before any ``tfdist.*`` module, so no import path misses them.
PLUGINS = (
    "tfdist.distribution.plugin",
    "tfdist.parallel.plugin",
    "tfdist.training.plugin",
    "tfdist.profiling.plugin",
)
_plugins.use(*PLUGINS)

# keras.distribution on TensorFlow (tfdist.distribution.guard): Keras's
# set_distribution is wrapped as soon as Keras is imported, before or after
# tfdist, and without importing it here.
_import_hook.after_import("keras", "tfdist.distribution.guard:install_at_import")

__all__ = ["ClusterSpecError", "ConfigError", "TfdistError", *_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
