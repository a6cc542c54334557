"""Options of :func:`tfdist.strategy_from_config`, checked without TensorFlow.

Each option may also come from an environment variable (as Keras arguments
do), so that a launcher or a scheduler can set it without touching the script.
An explicit argument always wins over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tfdist.errors import ConfigError

#: Strategy names accepted by ``strategy=``.
STRATEGY_NAMES = (
    "auto",
    "default",
    "one_device",
    "mirrored",
    "multi_worker_mirrored",
    "parameter_server",
    "tpu",
)

#: Aliases users type, mapped to the canonical name.
_STRATEGY_ALIASES = {
    "multi_worker": "multi_worker_mirrored",
    "multiworkermirrored": "multi_worker_mirrored",
    "mwms": "multi_worker_mirrored",
    "ps": "parameter_server",
    "parameterserver": "parameter_server",
    "onedevice": "one_device",
    "single": "one_device",
}

COMMUNICATIONS = ("AUTO", "RING", "NCCL")

#: What carries the gradient all-reduce between processes: TensorFlow's own
#: collectives, or MPI (:mod:`tfdist.transport.mpi`, the ``mpi`` extra).
TRANSPORTS = ("tf", "mpi")

#: Environment variables read when the option is not given.
ENV_VARS = {
    "cpu_replicas": "TFDIST_CPU_REPLICAS",
    "communication": "TFDIST_COMMUNICATION",
    "collective_timeout": "TFDIST_COLLECTIVE_TIMEOUT",
    "register_timeout": "TFDIST_REGISTER_TIMEOUT",
    "tpu": "TPU_NAME",
    "slurm_port_base": "TFDIST_SLURM_PORT_BASE",
    "model_parallel": "TFDIST_MODEL_PARALLEL",
    "transport": "TFDIST_TRANSPORT",
}

_SOURCE = "strategy_from_config"

#: Default time for every task of a multi-worker job to join, in seconds.
#: TensorFlow's own default is to wait forever.
DEFAULT_REGISTER_TIMEOUT = 120.0


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """Validated options of :func:`tfdist.strategy_from_config`.

    Attributes:
        devices: Explicit device names for Mirrored, e.g. ``("/gpu:0",
            "/gpu:1")``. None lets the strategy pick every local GPU.
        cpu_replicas: Split the CPU into this many logical devices and mirror
            over them, to try Mirrored on a laptop. None or 1: no split.
        communication: Collective implementation, ``AUTO``, ``RING`` or
            ``NCCL``.
        bytes_per_pack: Split each all-reduce into packs of at least this
            many bytes, last variable first, so that between workers the
            transfer overlaps backprop and the optimizer (Keras's own
            all-reduce and tfdist's compressed one alike). 0: one pack,
            TensorFlow's default. Pays on slow links, costs on fast ones:
            measured with 2 workers on the slow-network benchmark's MLP,
            an eighth of the gradients per pack took bf16 steps from 1.975
            to 1.955 s at 100 Mbit/s (fp32: 3.919 to 3.892), left them
            unchanged at 1 Gbit/s, and made them 7% slower on the
            unthrottled loopback (2 workers sharing 2 cores).
        collective_timeout: Seconds a multi-worker peer may stop answering
            before the other tasks' collectives fail with a message naming
            it, so that a hung peer makes the others fail instead of waiting
            forever (a killed peer is detected in about 10 s anyway). One
            watchdog thread probes the peers (:mod:`tfdist.strategies.watchdog`); a peer
            that is compiling or writing a checkpoint still answers. Default
            600. None (or ``"none"``) disables it.
        register_timeout: Seconds every task of a multi-worker job has to join
            before construction fails, naming the tasks that did not join.
        variable_partitioner: For ParameterServer: a
            ``tf.distribute.experimental.partitioners.Partitioner``, or a
            string ``"fixed:N"``, ``"min_size:BYTES"`` or ``"max_size:BYTES"``.
        tpu: A TPU name, a ``grpc://host:port`` address, or ``"local"``.
        slurm_port_base: First TensorFlow port on each Slurm node. None
            derives one from the Slurm job and step ids.
        model_parallel: The tensor-parallel group size T. The replicas form a
            (data, tensor) mesh with the tensor groups innermost (replica r
            is at data index r // T, tensor index r % T, so a group sits on
            one host's devices), and DP = replicas / T. T must divide the
            replicas; T > 1 works under ``mirrored`` and
            ``multi_worker_mirrored`` only. The layers of
            :mod:`tfdist.parallel` split their weights over each group.
        transport: What carries the gradients between the processes of a
            ``multi_worker_mirrored`` job: ``"tf"`` (TensorFlow's collectives
            over gRPC) or ``"mpi"`` (MPI through mpi4py, for jobs an MPI
            launcher starts: ``mpiexec``, ``mpirun``, ``srun --mpi``; see
            :mod:`tfdist.transport.mpi`). Everything else (metrics, variable
            creation) stays on TensorFlow's collectives.
    """

    devices: tuple[str, ...] | None = None
    cpu_replicas: int | None = None
    communication: str = "AUTO"
    bytes_per_pack: int = 0
    collective_timeout: float | None = 600.0
    register_timeout: float = DEFAULT_REGISTER_TIMEOUT
    variable_partitioner: Any = None
    tpu: str | None = None
    slurm_port_base: int | None = None
    model_parallel: int = 1
    transport: str = "tf"


def canonical_strategy_name(name: Any) -> str:
    """Returns the canonical strategy name for ``name``.

    Raises:
        ConfigError: ``name`` is not a known strategy name.
    """
    if not isinstance(name, str):
        raise ConfigError("strategy", name, "a strategy name string", source=_SOURCE)
    key = name.strip().lower().replace("-", "_")
    key = _STRATEGY_ALIASES.get(key.replace("_", ""), key)
    if key not in STRATEGY_NAMES:
        raise ConfigError(
            "strategy", name, "one of " + ", ".join(map(repr, STRATEGY_NAMES)), source=_SOURCE
        )
    return key


def _int(field: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(field, value, f"an integer >= {minimum}", source=_SOURCE)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(field, value, f"an integer >= {minimum}", source=_SOURCE) from None
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(field, value, f"an integer >= {minimum}", source=_SOURCE)
    return value


def _seconds(field: str, value: Any, *, allow_none: bool) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "inf")):
        if allow_none:
            return None
        raise ConfigError(field, value, "a number of seconds > 0", source=_SOURCE)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not seconds > 0:
        raise ConfigError(
            field,
            value,
            "a number of seconds > 0" + (" or None" if allow_none else ""),
            source=_SOURCE,
        )
    return seconds


def make_options(env: Mapping[str, str] | None = None, **options: Any) -> StrategyOptions:
    """Validates keyword options, falling back to environment variables.

    Args:
        env: Environment to read fallbacks from; defaults to ``os.environ``.
        **options: The options of :class:`StrategyOptions`.

    Returns:
        The validated options.

    Raises:
        ConfigError: An unknown option, or a value out of range. The message
            names the option and the value received.
    """
    env = os.environ if env is None else env
    fields = {f.name for f in dataclasses.fields(StrategyOptions)}
    for name in options:
        if name not in fields:
            raise ConfigError(
                name, options[name], "a known option: " + ", ".join(sorted(fields)), source=_SOURCE
            )
    for name, var in ENV_VARS.items():
        if options.get(name) is None and env.get(var, "").strip():
            options[name] = env[var].strip()

    out: dict[str, Any] = {}
    for name, check in _CHECKS.items():
        # collective_timeout=None is a choice (no timeout), not an absence.
        given = name in options if name == "collective_timeout" else options.get(name) is not None
        if not given:
            continue
        out[name] = check(options[name])
        if name == "cpu_replicas" and "devices" in out:
            raise ConfigError(
                "cpu_replicas",
                options["cpu_replicas"],
                "either devices or cpu_replicas, not both",
                source=_SOURCE,
            )
    return StrategyOptions(**out)


def _devices(given: object) -> tuple[str, ...]:
    devices = [d for d in given.split(",") if d.strip()] if isinstance(given, str) else given
    if (
        not isinstance(devices, Sequence)
        or not devices
        or not all(isinstance(d, str) and d.strip() for d in devices)
    ):
        raise ConfigError(
            "devices",
            given,
            "a non-empty list of device names such as ['/gpu:0', '/gpu:1']",
            source=_SOURCE,
        )
    if len(set(devices)) != len(devices):
        raise ConfigError("devices", given, "each device at most once", source=_SOURCE)
    return tuple(d.strip() for d in devices)


def _communication(comm: object) -> str:
    if not isinstance(comm, str) or comm.strip().upper() not in COMMUNICATIONS:
        raise ConfigError(
            "communication", comm, "one of " + ", ".join(COMMUNICATIONS), source=_SOURCE
        )
    return comm.strip().upper()


def _tpu(tpu: object) -> str:
    if not isinstance(tpu, str) or not tpu.strip():
        raise ConfigError(
            "tpu", tpu, "a TPU name, a 'grpc://host:port' address or 'local'", source=_SOURCE
        )
    return tpu.strip()


def _slurm_port_base(given: object) -> int:
    port = _int("slurm_port_base", given, minimum=1024)
    if port > 65000:
        raise ConfigError("slurm_port_base", given, "a port in [1024, 65000]", source=_SOURCE)
    return port


def _transport(transport: object) -> str:
    if not isinstance(transport, str) or transport.strip().lower() not in TRANSPORTS:
        raise ConfigError(
            "transport", transport, "one of " + ", ".join(map(repr, TRANSPORTS)), source=_SOURCE
        )
    return transport.strip().lower()


#: Each option's check, in the order make_options runs them: the value given
#: -> the value kept. A check raises ConfigError naming the option.
_CHECKS: dict[str, Callable[[object], object]] = {
    "devices": _devices,
    "cpu_replicas": lambda v: _int("cpu_replicas", v, minimum=1),
    "communication": _communication,
    "bytes_per_pack": lambda v: _int("bytes_per_pack", v, minimum=0),
    "collective_timeout": lambda v: _seconds("collective_timeout", v, allow_none=True),
    "register_timeout": lambda v: _seconds("register_timeout", v, allow_none=False),
    "variable_partitioner": lambda v: _check_partitioner(v),
    "tpu": _tpu,
    "slurm_port_base": _slurm_port_base,
    "model_parallel": lambda v: _int("model_parallel", v, minimum=1),
    "transport": _transport,
}


#: Strategies whose replicas can form a (data, tensor) mesh.
MODEL_PARALLEL_STRATEGIES = ("mirrored", "multi_worker_mirrored")


def check_model_parallel(kind: str, model_parallel: int, *, role: str = "trainer") -> int:
    """Refuses ``model_parallel`` > 1 where no mesh can be built.

    Called before a strategy is built, as for compression. Whether T divides
    the replicas of a Mirrored or MultiWorkerMirrored strategy is checked by
    :func:`tfdist.parallel.attach.attach` once the replicas are known.

    Args:
        kind: The canonical strategy name that will be built.
        model_parallel: The validated T.
        role: The task's role; an ``"evaluator"`` of a multi-worker job
            evaluates the full model on one device, so T does not apply to
            it and 1 is returned.

    Returns:
        The T to attach: ``model_parallel``, or 1 for an evaluator.

    Raises:
        ConfigError: T > 1 under ``parameter_server``, ``tpu``,
            ``one_device`` (one replica) or ``default``.
    """
    if model_parallel == 1 or role == "evaluator":
        return 1
    if kind in MODEL_PARALLEL_STRATEGIES:
        return model_parallel
    if kind == "one_device":
        raise ConfigError(
            "model_parallel",
            model_parallel,
            "1 under the one_device strategy (T must divide the replicas, and there is 1 replica)",
            source=_SOURCE,
            hint="Tensor parallelism needs several replicas: pass "
            "cpu_replicas=N (N a multiple of T), devices=[...], or run "
            "under 'mirrored' on several GPUs or 'multi_worker_mirrored'.",
        )
    raise ConfigError(
        "model_parallel",
        model_parallel,
        f"1 under the {kind} strategy",
        source=_SOURCE,
        hint="Tensor parallelism (tfdist.parallel) runs "
        "under 'mirrored' and 'multi_worker_mirrored'.",
    )


def _check_partitioner(value: Any) -> Any:
    """Accepts a partitioner object or a ``kind:number`` string."""
    if not isinstance(value, str):
        if callable(value):
            return value
        raise ConfigError(
            "variable_partitioner",
            value,
            "a Partitioner or 'fixed:N', 'min_size:BYTES', 'max_size:BYTES'",
            source=_SOURCE,
        )
    kind, _, number = value.strip().lower().partition(":")
    if kind not in ("fixed", "min_size", "max_size"):
        raise ConfigError(
            "variable_partitioner",
            value,
            "'fixed:N', 'min_size:BYTES' or 'max_size:BYTES'",
            source=_SOURCE,
        )
    try:
        count = int(number)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(
            "variable_partitioner", value, f"'{kind}:N' with N a positive integer", source=_SOURCE
        )
    return value.strip().lower()
