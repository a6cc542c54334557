"""Parameter-server training: Keras's ``fit``, ``evaluate`` and ``predict``
through a ClusterCoordinator (:mod:`~tfdist.training.ps.fit`).

The data each worker reads (:mod:`~tfdist.training.ps.data`), the steps and
their timeouts (:mod:`~tfdist.training.ps.steps`), the epoch loop
(:mod:`~tfdist.training.ps.loop`), the Keras fixes for ShardedVariables
(:mod:`~tfdist.training.ps.patches`) and a ps or worker server's part in a
preemption (:mod:`~tfdist.training.ps.preemption`).
"""
