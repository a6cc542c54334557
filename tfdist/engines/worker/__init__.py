"""The engines' code that runs inside the job's processes, where TensorFlow is.

A Spark barrier task (:mod:`~tfdist.engines.worker.spark_task`), a rank of
``tfdist.horovod.run`` (:mod:`~tfdist.engines.worker.hvd_worker`), the warm
pool's fork server (:mod:`~tfdist.engines.worker.warm_server`) and the client
that stands in for ``python`` in each task
(:mod:`~tfdist.engines.worker.warm_client`; both run as scripts, side by
side), and a chief's local ps/worker servers
(:mod:`~tfdist.engines.worker.local_cluster`). They may reach the strategies
and the Keras integration, inside functions, when they run. The rest of
:mod:`tfdist.engines` is the launcher side: it loads no TensorFlow and imports
no layer that does (``tests/test_layering.py``).
"""
