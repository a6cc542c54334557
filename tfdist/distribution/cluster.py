"""``keras.distribution.initialize()`` on TensorFlow: one job of several processes.

Keras's TensorFlow backend has no ``initialize`` (keras-team/keras#18983):
the public function raises ``AttributeError``. After ``import tfdist`` it
joins this process to the job as a worker of tfdist's MultiWorkerMirrored
strategy:

* from Keras's arguments or their environment variables
  (``job_addresses="10.0.0.1:1234,10.0.0.2:2345", num_processes=2,
  process_id=0``; ``KERAS_DISTRIBUTION_*``), every address a worker;
* with no argument, from ``TF_CONFIG`` (what ``tfdist launch``, Slurm or
  Kubernetes give), as ``tfdist.strategy_from_config()`` reads it.

:func:`tfdist.distribution.initialize` does the same and takes tfdist's
gradient compression for the job's strategy (``compression=``,
``error_feedback=``): a ``DataParallel`` or ``ModelParallel`` over every
process's devices then trains with it.

``keras.distribution.list_devices()`` then lists every process's devices
(``/job:worker/replica:0/task:1/device:CPU:0``), and a ``DataParallel`` over
them (its default) trains on that strategy
(:func:`tfdist.distribution.data_parallel.strategy_for`).
"""

from __future__ import annotations

from typing import Any

from absl import logging

from tfdist.distribution.kept import making, mark
from tfdist.errors import ConfigError

__all__ = [
    "cluster_config",
    "cluster_strategy",
    "global_devices",
    "initialize",
    "keras_defaults",
    "job_options",
    "check_options",
]

#: The strategy of the job initialize() joined, once it has.
_joined: list[Any] = []
#: The compression options that strategy was made with.
_options: dict[str, Any] = {}
#: The options a distribution can take; a job's strategy has them once made.
OPTIONS = ("compression", "error_feedback")


def keras_defaults(job_addresses: Any, num_processes: Any, process_id: Any) -> tuple:
    """Keras's own defaults for initialize()'s arguments: its
    ``KERAS_DISTRIBUTION_*`` variables."""
    import os

    if job_addresses is None:
        job_addresses = os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    if num_processes is None and "KERAS_DISTRIBUTION_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"])
    if process_id is None and "KERAS_DISTRIBUTION_PROCESS_ID" in os.environ:
        process_id = int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
    return job_addresses, num_processes, process_id


def cluster_config(job_addresses: Any, num_processes: Any, process_id: Any) -> dict | None:
    """The TF_CONFIG of Keras's ``initialize`` arguments; None for none.

    Raises:
        ConfigError: An argument is missing, malformed or inconsistent.
    """
    if job_addresses is None and num_processes is None and process_id is None:
        return None
    source = "keras.distribution.initialize"
    if job_addresses is None:
        raise ConfigError(
            "job_addresses",
            None,
            "every process's host:port, comma-separated",
            source=source,
            hint="Or set none of the three and give TF_CONFIG",
        )
    addresses = (
        [a.strip() for a in job_addresses.split(",")]
        if isinstance(job_addresses, str)
        else list(job_addresses)
    )
    if not addresses or any(not a or ":" not in str(a) for a in addresses):
        raise ConfigError(
            "job_addresses", job_addresses, "host:port entries, comma-separated", source=source
        )
    if num_processes is not None and num_processes != len(addresses):
        raise ConfigError(
            "num_processes",
            num_processes,
            f"{len(addresses)}, the number of job_addresses",
            source=source,
        )
    if (
        not isinstance(process_id, int)
        or isinstance(process_id, bool)
        or not 0 <= process_id < len(addresses)
    ):
        raise ConfigError(
            "process_id", process_id, f"an integer in [0, {len(addresses) - 1}]", source=source
        )
    return {
        "cluster": {"worker": [str(a) for a in addresses]},
        "task": {"type": "worker", "index": process_id},
    }


def initialize(
    job_addresses: Any = None, num_processes: Any = None, process_id: Any = None, **options: Any
) -> Any:
    """Joins this process to its job; returns the MultiWorkerMirrored strategy.

    Returns None, with a log line, where there is no job (no arguments and
    no TF_CONFIG cluster). ``options`` go to ``strategy_from_config``
    (``register_timeout``, ...).

    Raises:
        ConfigError: Bad arguments, or a second initialize() for another job.
    """
    from tfdist.spec.detect import choose
    from tfdist.strategies import strategy_from_config

    config = cluster_config(job_addresses, num_processes, process_id)
    wanted = {key: options.get(key) for key in OPTIONS}
    if _joined:
        if config is not None and _joined[0].task != f"worker:{config['task']['index']}":
            raise ConfigError(
                "process_id",
                process_id,
                f"{_joined[0].task}, as the first call",
                source="keras.distribution.initialize",
                hint="This process already joined its job",
            )
        for key in OPTIONS:
            if wanted[key] is not None and wanted[key] != _options.get(key):
                raise ConfigError(
                    key,
                    wanted[key],
                    f"{_options.get(key)!r}, as the first call made the job's strategy",
                    source="initialize",
                    hint="A job's strategy is made once: pass the same options "
                    "to the first initialize() of the process",
                )
        return _joined[0]
    if config is None and choose().name != "multi_worker_mirrored":
        logging.info(
            "keras.distribution.initialize(): no job_addresses and no TF_CONFIG "
            "cluster: this process trains alone"
        )
        return None
    with making():
        strategy = strategy_from_config(config, strategy="multi_worker_mirrored", **options)
    mark(strategy)
    _joined[:] = [strategy]
    _options.clear()
    _options.update(wanted)
    return strategy


def job_options() -> dict[str, Any]:
    """The compression options of the job's strategy (None where unset)."""
    return {key: _options.get(key) for key in OPTIONS}


def check_options(options: dict[str, Any], source: str) -> None:
    """A distribution's compression options against the job's strategy's.

    A distribution across processes trains on the strategy initialize() made,
    so it takes that strategy's compression; one it names must be that one.

    Raises:
        ConfigError: An option set on the distribution differs from the job's.
    """
    job = job_options()
    for key in OPTIONS:
        value = options.get(key)
        if value is not None and value != job[key]:
            raise ConfigError(
                key,
                value,
                f"{job[key]!r}, the job's: across processes the strategy is the "
                "one initialize() made",
                source=source,
                hint=f"Pass {key}= to tfdist.distribution.initialize() in every process, "
                "before the distribution is set",
            )


def cluster_strategy() -> Any:
    """The strategy of the job initialize() joined, or None."""
    return _joined[0] if _joined else None


def global_devices(device_type: str | None = None) -> list[str] | None:
    """Every process's devices, as Keras's ``list_devices`` names them for a
    mesh; None before initialize()."""
    strategy = cluster_strategy()
    if strategy is None:
        return None
    local = [d.rsplit("device:", 1)[-1] for d in strategy.extended.worker_devices]
    if device_type is not None:
        local = [d for d in local if d.split(":")[0].lower() == device_type.lower()]
    workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
    return [
        f"/job:worker/replica:0/task:{task}/device:{device}"
        for task in range(workers)
        for device in local
    ]
