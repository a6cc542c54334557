"""The engines: what starts the processes of a job, on this machine or elsewhere.

It owns ``tfdist launch`` (:mod:`~tfdist.engines.launch`, with restarts and
elastic sizes in :mod:`~tfdist.engines.elastic`), per-host commands and
Kubeflow TFJob manifests (:mod:`~tfdist.engines.hosts`), Horovod's launch
spellings (:mod:`~tfdist.engines.horovodrun`, :mod:`~tfdist.engines.worker.hvd_worker`),
Spark barrier jobs (:mod:`~tfdist.engines.spark`), local parameter-server
clusters (:mod:`~tfdist.engines.worker.local_cluster`), local ports, and warm pools
that fork a job's processes with TensorFlow already imported
(:mod:`~tfdist.engines.warm`). TensorFlow's
own runtime is the distributed engine: nothing here schedules or transports.
Everything here but :mod:`tfdist.engines.worker` is the launcher side: it
loads no TensorFlow and imports no layer that does (a launched process
imports it, not the launcher). The code that runs inside the job's processes
sits in :mod:`tfdist.engines.worker`, which may reach the layers below. The
engines never import the CLI.
"""
