"""tfdist: distributed training for TensorFlow and Keras 3.

``tfdist.strategy_from_config()`` returns the right tf.distribute strategy for
wherever the script runs. TensorFlow is imported lazily, on first use of a
name that needs it, so that ``tfdist.cluster`` and the CLI's spec commands
stay fast and work without TensorFlow.
"""

from __future__ import annotations

from tfdist._lazy import lazy_attributes
from tfdist.errors import ClusterSpecError, ConfigError, TfdistError

__version__ = "0.1.0"

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
    "KerasDistributionError": "tfdist.parallel.guard",
    "fit": "tfdist.training",
    "evaluate": "tfdist.training",
    "predict": "tfdist.training",
    "ParameterServerError": "tfdist.training",
    "StepTimeoutError": "tfdist.training",
    "local_cluster": "tfdist.ps_cluster",
    "LocalCluster": "tfdist.ps_cluster",
    "define_flags": "tfdist.flags",
    "strategy_from_flags": "tfdist.flags",
    "parse_compression": "tfdist.compression",
    "BackupAndRestore": "tfdist.callbacks",
    "ModelCheckpoint": "tfdist.callbacks",
    "TensorBoard": "tfdist.callbacks",
    "LearningRateWarmup": "tfdist.callbacks",
    "scale_learning_rate": "tfdist.callbacks",
    "global_batch_size": "tfdist.data",
    "choose_shard_policy": "tfdist.data",
    "distribute_dataset": "tfdist.data",
    "CheckpointableIterator": "tfdist.resumable",
    "PreemptionWatcher": "tfdist.preemption",
    "Preempted": "tfdist.preemption",
    "PreemptionError": "tfdist.preemption",
    "PREEMPTED_EXIT_CODE": "tfdist.preemption",
    "StepProfile": "tfdist.profiling.callback",
    "LoopProfile": "tfdist.profiling.callback",
}

__all__ = ["ClusterSpecError", "ConfigError", "TfdistError", *_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
