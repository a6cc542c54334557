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


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines tfdist's strategy flags on ``flag_values`` (once)."""
    if "strategy" in flag_values:
        return
    flags.DEFINE_enum(
        "strategy",
        "auto",
        STRATEGY_NAMES,
        "Distribution strategy; 'auto' picks from TF_CONFIG, Slurm, TPU and the local devices.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "tf_config",
        None,
        "TF_CONFIG as JSON or a spec path; default: the TF_CONFIG environment variable.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "compression",
        None,
        "Gradient compression: "
        + ", ".join(COMPRESSOR_NAMES)
        + ", optionally with a parameter ('topk:0.01').",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "error_feedback",
        None,
        "Force error feedback on or off; default: on for topk, sign and powersgd.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "cpu_replicas",
        None,
        "Split the CPU into this many logical devices and mirror over them.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "model_parallel",
        None,
        "Tensor-parallel group size T: the replicas form "
        "a (data, tensor) mesh, DP = replicas / T, for the "
        "layers of tfdist.parallel.",
        flag_values=flag_values,
    )
    flags.DEFINE_list(
        "devices", None, "Devices to mirror over, e.g. /gpu:0,/gpu:1.", flag_values=flag_values
    )
    flags.DEFINE_enum(
        "communication", None, COMMUNICATIONS, "Collective implementation.", flag_values=flag_values
    )
    flags.DEFINE_integer(
        "bytes_per_pack",
        None,
        "Pack gradients into chunks of this many bytes.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "collective_timeout",
        None,
        "Seconds before a collective that does not complete fails.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "register_timeout",
        None,
        "Seconds every task has to join the cluster.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "variable_partitioner",
        None,
        "Parameter-server partitioner: fixed:N, min_size:BYTES or max_size:BYTES.",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "tpu", None, "TPU name, grpc:// address or 'local'.", flag_values=flag_values
    )
    flags.DEFINE_enum(
        "transport",
        None,
        TRANSPORTS,
        "What carries the gradients between processes: tf (TensorFlow's collectives) or "
        "mpi (for scripts an MPI launcher starts).",
        flag_values=flag_values,
    )


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
