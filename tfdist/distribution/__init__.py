"""``keras.distribution`` on TensorFlow.

On the TensorFlow backend Keras's distribution API is a prototype that
applies nothing. After ``import tfdist``:

* ``keras.distribution.DataParallel`` trains on tfdist's Mirrored strategy
  over the mesh's devices (:mod:`~tfdist.distribution.data_parallel`);
  :class:`DataParallel` adds tfdist's gradient compression;
* ``keras.distribution.initialize()`` joins a job of several processes as a
  MultiWorkerMirrored worker, and ``list_devices()`` names every process's
  devices (:mod:`~tfdist.distribution.cluster`); :func:`initialize` does
  the same with tfdist's compression for the job's strategy;
* ``keras.distribution.ModelParallel`` honours its layout map: each weight
  is split over the mesh's axes as its layout says
  (:mod:`~tfdist.distribution.model_parallel`,
  :mod:`~tfdist.distribution.layouts`), and :func:`report` shows what each
  weight got; :class:`ModelParallel` adds tfdist's compression;
* a distribution tfdist cannot honour, and any distribution beside a tfdist
  strategy of the user's, raise :class:`KerasDistributionError`
  (:mod:`~tfdist.distribution.guard`) instead of training unsharded.

It sits above tensor parallelism (:mod:`tfdist.parallel`) and below the
Keras integration. A strategy reaches it through :mod:`tfdist.plugins`
(:mod:`~tfdist.distribution.plugin`).
"""

from typing import Any

from tfdist.distribution.guard import KerasDistributionError

__all__ = ["DataParallel", "ModelParallel", "KerasDistributionError", "initialize", "report"]


def initialize(
    job_addresses: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    compression: Any = None,
    error_feedback: bool | None = None,
) -> Any:
    """``keras.distribution.initialize()`` with tfdist's gradient compression.

    Joins this process to its job, as ``keras.distribution.initialize()``
    does after ``import tfdist``: from the arguments, Keras's
    ``KERAS_DISTRIBUTION_*`` variables, or ``TF_CONFIG``. The job's
    MultiWorkerMirrored strategy is made with ``compression`` and
    ``error_feedback``, so a ``DataParallel`` or ``ModelParallel`` over
    every process's devices trains with them (``ModelParallel``: the
    batch-axis gradient sums of split weights take ``"bf16"``/``"fp16"``).

    Args:
        job_addresses: ``"host:port,host:port"``, one per process.
        num_processes: How many processes the job has.
        process_id: This process's index.
        compression: Any ``compression=`` of ``tfdist.strategy_from_config``.
        error_feedback: As ``tfdist.strategy_from_config`` takes it.

    Returns:
        The job's strategy; None where there is no job (one process).

    Raises:
        ConfigError: Bad arguments or options, or options other than the
            first call's.
    """
    from tfdist.distribution import cluster

    options = {
        k: v
        for k, v in (("compression", compression), ("error_feedback", error_feedback))
        if v is not None
    }
    return cluster.initialize(
        *cluster.keras_defaults(job_addresses, num_processes, process_id), **options
    )


def __getattr__(name):
    # DataParallel subclasses Keras's: Keras is imported on first use only.
    if name == "DataParallel":
        from tfdist.distribution.data_parallel import DataParallel

        return DataParallel
    if name == "ModelParallel":
        from tfdist.distribution.model_parallel import ModelParallel

        return ModelParallel
    if name == "report":
        from tfdist.distribution.reporting import report

        return report
    raise AttributeError(f"module 'tfdist.distribution' has no attribute {name!r}")
