"""``keras.distribution`` on TensorFlow.

On the TensorFlow backend Keras's distribution API is a prototype that
applies nothing. After ``import tfdist``:

* ``keras.distribution.DataParallel`` trains on tfdist's Mirrored strategy
  over the mesh's devices (:mod:`~tfdist.distribution.data_parallel`);
  :class:`DataParallel` adds tfdist's gradient compression;
* ``keras.distribution.initialize()`` joins a job of several processes as a
  MultiWorkerMirrored worker, and ``list_devices()`` names every process's
  devices (:mod:`~tfdist.distribution.cluster`);
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

from tfdist.distribution.guard import KerasDistributionError

__all__ = ["DataParallel", "ModelParallel", "KerasDistributionError", "report"]


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
