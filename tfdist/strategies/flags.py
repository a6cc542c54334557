"""absl flags for training scripts, as in tensorflow/models.

Flags are defined only here and read only in a script's ``main()``; library
code takes plain arguments. A script does::

    from absl import app, flags
    import tfdist

    tfdist.define_flags()

    def main(_):
        strategy = tfdist.strategy_from_flags()
        ...

    if __name__ == "__main__":
        app.run(main)
"""

from __future__ import annotations

from typing import Any

from absl import flags

from tfdist.compression import COMPRESSOR_NAMES
from tfdist.spec.options import COMMUNICATIONS, STRATEGY_NAMES, TRANSPORTS

#: tfdist's strategy flags: (absl's DEFINE_*, name, default, enum values or
#: None, help), in the order ``--help`` lists them.
_FLAGS: tuple[tuple[Any, str, Any, Any, str], ...] = (
    (
        flags.DEFINE_enum,
        "strategy",
        "auto",
        STRATEGY_NAMES,
        "Distribution strategy; 'auto' picks from TF_CONFIG, Slurm, TPU and the local devices.",
    ),
    (
        flags.DEFINE_string,
        "tf_config",
        None,
        None,
        "TF_CONFIG as JSON or a spec path; default: the TF_CONFIG environment variable.",
    ),
    (
        flags.DEFINE_string,
        "compression",
        None,
        None,
        "Gradient compression: "
        + ", ".join(COMPRESSOR_NAMES)
        + ", optionally with a parameter ('topk:0.01').",
    ),
    (
        flags.DEFINE_bool,
        "error_feedback",
        None,
        None,
        "Force error feedback on or off; default: on for topk, sign and powersgd.",
    ),
    (
        flags.DEFINE_integer,
        "cpu_replicas",
        None,
        None,
        "Split the CPU into this many logical devices and mirror over them.",
    ),
    (
        flags.DEFINE_integer,
        "model_parallel",
        None,
        None,
        "Tensor-parallel group size T: the replicas form "
        "a (data, tensor) mesh, DP = replicas / T, for the "
        "layers of tfdist.parallel.",
    ),
    (flags.DEFINE_list, "devices", None, None, "Devices to mirror over, e.g. /gpu:0,/gpu:1."),
    (flags.DEFINE_enum, "communication", None, COMMUNICATIONS, "Collective implementation."),
    (
        flags.DEFINE_integer,
        "bytes_per_pack",
        None,
        None,
        "Pack gradients into chunks of this many bytes.",
    ),
    (
        flags.DEFINE_float,
        "collective_timeout",
        None,
        None,
        "Seconds before a collective that does not complete fails.",
    ),
    (
        flags.DEFINE_float,
        "register_timeout",
        None,
        None,
        "Seconds every task has to join the cluster.",
    ),
    (
        flags.DEFINE_string,
        "variable_partitioner",
        None,
        None,
        "Parameter-server partitioner: fixed:N, min_size:BYTES or max_size:BYTES.",
    ),
    (flags.DEFINE_string, "tpu", None, None, "TPU name, grpc:// address or 'local'."),
    (
        flags.DEFINE_enum,
        "transport",
        None,
        TRANSPORTS,
        "What carries the gradients between processes: tf (TensorFlow's collectives) or "
        "mpi (for scripts an MPI launcher starts).",
    ),
)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines tfdist's strategy flags on ``flag_values`` (once)."""
    if "strategy" in flag_values:
        return
    for define, name, default, values, help_text in _FLAGS:
        if values is None:
            define(name, default, help_text, flag_values=flag_values)
        else:
            define(name, default, values, help_text, flag_values=flag_values)


def options_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """The keyword arguments of strategy_from_config that the flags set."""
    names = (
        "cpu_replicas",
        "model_parallel",
        "devices",
        "communication",
        "bytes_per_pack",
        "collective_timeout",
        "register_timeout",
        "variable_partitioner",
        "tpu",
        "transport",
    )
    kwargs: dict[str, Any] = {
        n: flag_values[n].value for n in names if flag_values[n].value is not None
    }
    kwargs["strategy"] = flag_values.strategy
    kwargs["compression"] = flag_values.compression
    kwargs["error_feedback"] = flag_values.error_feedback
    kwargs["config"] = flag_values.tf_config
    return kwargs


def strategy_from_flags(flag_values: flags.FlagValues = flags.FLAGS):
    """Calls :func:`tfdist.strategy_from_config` with the flags' values."""
    from tfdist.strategies import strategy_from_config

    return strategy_from_config(**options_from_flags(flag_values))
