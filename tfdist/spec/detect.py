"""Which strategy to build here, and why. Pure Python: no TensorFlow import.

:func:`choose` turns the environment (TF_CONFIG, Slurm variables, a TPU
setting, the local accelerators) into a :class:`Choice`: a strategy name and
one sentence saying why. :func:`tfdist.strategy_from_config` builds the
strategy from it and ``tfdist info`` prints it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from tfdist import spec as spec_lib
from tfdist.errors import ConfigError
from tfdist.spec.options import StrategyOptions, canonical_strategy_name

#: Counts local devices of a kind: ``"TPU"`` and ``"GPU"`` count physical
#: devices; ``"logical GPU"`` and ``"logical CPU"`` count the logical devices
#: TensorFlow runs on (several per physical device once the user split it with
#: ``tf.config.set_logical_device_configuration``, none for a device hidden
#: with ``tf.config.set_visible_devices``). The default asks TensorFlow; tests
#: pass a stub so that detection runs without it.
DeviceCounter = Callable[[str], int]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The strategy to build.

    Attributes:
        name: Canonical strategy name (never ``"auto"``).
        reason: Why this strategy, in one sentence.
        tf_config: The validated cluster (local when there is none).
        slurm: The cluster comes from a Slurm job step, not TF_CONFIG.
        tpu: The TPU to use when ``name == "tpu"``.
        role: ``"server"`` when this task only serves a parameter-server
            cluster (a ps or a worker task), ``"evaluator"`` for a side-car
            evaluator, else ``"trainer"``.
    """

    name: str
    reason: str
    tf_config: spec_lib.TFConfig
    slurm: bool = False
    tpu: str | None = None
    role: str = "trainer"


def slurm_step_tasks(env: Mapping[str, str]) -> int | None:
    """Returns the number of tasks of the Slurm job step we run in, or None.

    Slurm sets ``SLURM_PROCID`` in every task that ``srun`` starts, and
    ``SLURM_STEP_NUM_TASKS`` (older releases: ``SLURM_NTASKS``) to the
    number of tasks of the step. A batch script outside ``srun`` has no
    ``SLURM_PROCID``, so it is not a step.
    """
    if "SLURM_PROCID" not in env:
        return None
    raw = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        raise ConfigError(
            "SLURM_STEP_NUM_TASKS", raw, "an integer", source="Slurm environment"
        ) from None


def _tf_device_count(kind: str) -> int:
    logical = kind.startswith("logical ")
    device_type = kind.split()[-1]
    if logical and "tensorflow" not in sys.modules:
        # Nothing in this process could have split or hidden a device yet.
        # A CPU is one device; a GPU count is only asked for after
        # _tf_device_count("GPU") imported TensorFlow.
        return 1 if device_type == "CPU" else 0
    import tensorflow as tf  # Only when detection needs to look at hardware.

    if not logical:
        return len(tf.config.list_physical_devices(device_type))
    # What MirroredStrategy() would mirror over, read without starting the
    # runtime (tf.config.list_logical_devices would start it, and a later
    # set_logical_device_configuration in the script would then fail). Both
    # calls only read the configuration, before or after the runtime started.
    return sum(
        len(tf.config.get_logical_device_configuration(device) or [None])
        for device in tf.config.get_visible_devices(device_type)
    )


def _describe_cluster(cfg: spec_lib.TFConfig) -> str:
    jobs = ", ".join(f"{len(addrs)} {job}" for job, addrs in cfg.cluster.items())
    return f"{cfg.source} lists {jobs}"


def choose(
    config: Any = None,
    *,
    strategy: str = "auto",
    options: StrategyOptions | None = None,
    env: Mapping[str, str] | None = None,
    count_devices: DeviceCounter | None = None,
) -> Choice:
    """Decides which strategy to build, without building it.

    Args:
        config: A TF_CONFIG dict, JSON string, spec path or
            :class:`tfdist.spec.TFConfig`; None reads ``TF_CONFIG``.
        strategy: A strategy name or ``"auto"``.
        options: Validated options (devices, cpu_replicas, tpu...).
        env: The environment; defaults to ``os.environ``.
        count_devices: Counts local devices of a kind (see
            :data:`DeviceCounter`); defaults to asking TensorFlow without
            starting its runtime, and is only called when it matters.

    Returns:
        The :class:`Choice`.

    Raises:
        ConfigError: A bad TF_CONFIG, strategy name, or a strategy that does
            not fit the cluster. The message names the field and value.
    """
    env = os.environ if env is None else env
    options = options or StrategyOptions()
    count = count_devices or _tf_device_count
    name = canonical_strategy_name(strategy)
    cfg = spec_lib.parse(config, env=env, strategy=None if name == "auto" else name)
    in_cluster = bool(cfg.cluster)
    slurm_tasks = None if (in_cluster or config is not None) else (slurm_step_tasks(env))

    if name != "auto":
        return _asked(cfg, name, strategy, options, in_cluster, slurm_tasks)
    return _from_cluster_or_options(cfg, options, in_cluster, slurm_tasks) or _from_devices(
        cfg, options, count, slurm_tasks
    )


def _choice(cfg: spec_lib.TFConfig, kind: str, reason: str, **kw: Any) -> Choice:
    """A :class:`Choice`, with this process's role in it."""
    role = "trainer"
    if kind == "parameter_server" and cfg.task_type in ("ps", "worker"):
        role = "server"
    elif cfg.task_type == "evaluator":
        role = "evaluator"
    return Choice(kind, reason, cfg, role=role, **kw)


def _asked(
    cfg: spec_lib.TFConfig,
    name: str,
    strategy: str,
    options: StrategyOptions,
    in_cluster: bool,
    slurm_tasks: int | None,
) -> Choice:
    """The strategy asked for by name."""
    reason = f"strategy={strategy!r} was asked for"
    if name == "tpu":
        return _choice(cfg, "tpu", reason, tpu=options.tpu or "local")
    if name == "multi_worker_mirrored" and not in_cluster and slurm_tasks:
        return _choice(cfg, name, reason + f" in a Slurm step of {slurm_tasks} tasks", slurm=True)
    return _choice(cfg, name, reason)


def _from_cluster_or_options(
    cfg: spec_lib.TFConfig, options: StrategyOptions, in_cluster: bool, slurm_tasks: int | None
) -> Choice | None:
    """ "auto" from a TPU given, the cluster, a Slurm step or the devices
    asked for; None when none of them decides."""
    if options.tpu:
        return _choice(cfg, "tpu", f"a TPU was given (tpu={options.tpu!r})", tpu=options.tpu)
    if cfg.kind == "parameter_server":
        return _choice(
            cfg,
            "parameter_server",
            _describe_cluster(cfg) + ": a 'ps' job means parameter-server training",
        )
    if in_cluster:
        return _choice(
            cfg,
            "multi_worker_mirrored",
            _describe_cluster(cfg) + ": synchronous training over "
            f"{cfg.num_workers} worker task(s)",
        )
    if slurm_tasks and slurm_tasks > 1:
        return _choice(
            cfg,
            "multi_worker_mirrored",
            f"a Slurm job step of {slurm_tasks} tasks (SLURM_PROCID is set): one worker per task",
            slurm=True,
        )
    if options.devices and len(options.devices) > 1:
        return _choice(
            cfg,
            "mirrored",
            f"{len(options.devices)} devices were given: {', '.join(options.devices)}",
        )
    if options.devices:
        return _choice(cfg, "one_device", f"1 device was given: {options.devices[0]}")
    if options.cpu_replicas and options.cpu_replicas > 1:
        return _choice(
            cfg,
            "mirrored",
            f"cpu_replicas={options.cpu_replicas}: the CPU is split into that many logical devices",
        )
    return None


def _from_devices(
    cfg: spec_lib.TFConfig,
    options: StrategyOptions,
    count: DeviceCounter,
    slurm_tasks: int | None,
) -> Choice:
    """ "auto" from this machine's devices: TPUs, GPUs, a split CPU, or one device."""
    tpus = count("TPU")
    if tpus:
        return _choice(cfg, "tpu", f"{tpus} local TPU device(s) found", tpu="local")
    gpus = count("GPU")
    logical_gpus = count("logical GPU") if gpus else 0
    if logical_gpus > 1:
        if logical_gpus == gpus:
            return _choice(cfg, "mirrored", f"{gpus} local GPUs found")
        return _choice(
            cfg,
            "mirrored",
            f"{logical_gpus} logical GPUs, as tf.config "
            f"set up the {gpus} local GPU(s) before this call",
        )
    # cpu_replicas=1 asks for one CPU replica, however the CPU was split.
    cpus = 1 if logical_gpus or options.cpu_replicas else count("logical CPU")
    if cpus > 1:
        return _choice(
            cfg,
            "mirrored",
            f"{cpus} logical CPUs, as tf.config."
            "set_logical_device_configuration split the CPU before "
            "this call",
        )
    device = "1 GPU" if logical_gpus == 1 else "the CPU"
    where = (
        "no TF_CONFIG cluster"
        + (", a Slurm step of 1 task" if slurm_tasks == 1 else "")
        + (", cpu_replicas=1" if options.cpu_replicas == 1 and not gpus else "")
    )
    return _choice(cfg, "one_device", f"{where} and one device ({device})")
