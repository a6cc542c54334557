"""The slow-network benchmark's configurations (tfdist's and PyTorch DDP's), what each
phase runs, and the flags of ``benchmarks/slow_network.py``.
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

TF_CONFIGS = [
    "tf/fp32",
    "tf/bf16",
    "tf/bf16+packs",
    "tf/powersgd:4",
    "tf/powersgd:4+bf16warm",
    "tf/topk:0.01",
    "tf/auto",
]
DDP_CONFIGS = ["ddp/dense", "ddp/fp16", "ddp/powersgd:4"]
#: Interleaved, so that drift in the machine's load hits both frameworks.
CONFIGS = [
    "tf/fp32",
    "ddp/dense",
    "tf/bf16",
    "ddp/fp16",
    "tf/bf16+packs",
    "tf/powersgd:4",
    "ddp/powersgd:4",
    "tf/powersgd:4+bf16warm",
    "tf/topk:0.01",
    "tf/auto",
]
#: Fewer configurations with 4 workers, to keep the benchmark within about
#: 25 minutes on a 2-core machine (4 TensorFlow workers take most of a
#: minute to start there): no top-k (slowest to compute, never best here) and
#: no DDP dense (the same bytes as tfdist fp32, shown equal with 2 workers);
#: on fast links only what the goals need.
CONFIGS4 = ["tf/fp32", "tf/bf16", "ddp/fp16", "tf/powersgd:4", "ddp/powersgd:4", "tf/auto"]
CONFIGS4_FAST = ["tf/fp32", "tf/powersgd:4", "ddp/powersgd:4", "tf/auto"]
#: The accuracy phase leaves out auto (it trains like the configuration it
#: picks; it gets a speed run on the unthrottled link instead) and packs
#: (the same sums as one all-reduce).
ACC_CONFIGS = [c for c in CONFIGS if c != "tf/auto" and not c.endswith("+packs")]
LABELS = {
    "tf/fp32": "tfdist fp32 (Keras all-reduce)",
    "tf/bf16": "tfdist bf16",
    "tf/bf16+packs": "tfdist bf16, packed all-reduce",
    "tf/powersgd:4": "tfdist PowerSGD r4",
    "tf/topk:0.01": "tfdist top-k 1%",
    "tf/powersgd:4+bf16warm": "tfdist PowerSGD r4, bf16 warm-up",
    "tf/auto": "tfdist auto",
    "tf/fp32+mpi": "tfdist fp32, MPI transport",
    "tf/bf16+mpi": "tfdist bf16, MPI transport",
    "ddp/dense": "DDP dense",
    "ddp/fp16": "DDP fp16 hook",
    "ddp/powersgd:4": "DDP PowerSGD r4",
}
#: Repeated with 2 workers (``--repeats``): the comparisons the goals make
#: between close figures.
REPEAT_CONFIGS = [
    "tf/bf16",
    "ddp/fp16",
    "tf/bf16+packs",
    "tf/powersgd:4",
    "ddp/powersgd:4",
    "tf/auto",
]
#: The fast-link comparison (issue 32): fp32 over TensorFlow's collective and
#: over MPI (``+mpi``: the workers are ranks of ``mpiexec``, MPICH forced onto
#: the namespace's loopback over TCP) beside DDP dense, on the unthrottled
#: link and at 1 Gbit/s. ``--name=fast_links --accuracy=false
#: --bandwidths=none,1gbit --configs=FAST_LINK_CONFIGS
#: --configs4_fast=FAST_LINK_CONFIGS``.
FAST_LINK_CONFIGS = ["tf/fp32", "tf/fp32+mpi", "ddp/dense"]
#: PowerSGD's dense warm-up steps in the accuracy runs (tfdist's default).
ACC_WARMUP = 10
#: Warm-up steps in the speed runs (PyTorch needs at least 2 with error feedback).
SPEED_WARMUP = 2

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "inside", "report", "tf_worker", "torch_worker"],
        "all: run in a new namespace, then report. The others are internal "
        "(inside the namespace; one worker) or redo the report.",
    )
    flags.DEFINE_bool("quick", False, "A small model and few steps (about 4 minutes).")
    flags.DEFINE_bool(
        "fast_links",
        False,
        "Only the fast-link comparison: fp32 over TensorFlow's collective and over MPI "
        "beside DDP dense, unthrottled and at 1 Gbit/s, 2 and 4 workers (about 8 minutes); "
        "results in fast_links.{json,md}.",
    )
    flags.DEFINE_list("bandwidths", ["100mbit", "1gbit"], "tc tbf rates to run at.")
    flags.DEFINE_list("workers", ["2", "4"], "Worker counts of the speed runs.")
    flags.DEFINE_list("configs", CONFIGS, "Configurations of the 2-worker speed runs.")
    flags.DEFINE_list("acc_configs", ACC_CONFIGS, "Configurations of the accuracy runs.")
    flags.DEFINE_list(
        "nolimit_configs",
        ["tf/auto", "tf/bf16+packs"],
        "Speed runs (2 workers) on the unthrottled link.",
    )
    flags.DEFINE_list(
        "configs4", CONFIGS4, "Configurations with more than 2 workers, below 500 Mbit/s."
    )
    flags.DEFINE_list(
        "configs4_fast",
        CONFIGS4_FAST,
        "Configurations with more than 2 workers at 500 Mbit/s and above.",
    )
    flags.DEFINE_list("layers", ["256", "2048", "2048", "512", "10"], "MLP widths.")
    flags.DEFINE_integer("batch", 32, "Batch per worker.")
    flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate (momentum 0.9).")
    flags.DEFINE_float("target", 0.55, "Held-out accuracy to reach.")
    flags.DEFINE_integer("acc_steps", 240, "Steps of the accuracy runs.")
    flags.DEFINE_integer("eval_every", 20, "Evaluate every this many steps (accuracy runs).")
    flags.DEFINE_integer("test_examples", 1024, "Held-out examples.")
    flags.DEFINE_integer("slow_steps", 6, "Timed steps below 500 Mbit/s (dense, bf16, fp16).")
    flags.DEFINE_integer(
        "compressed_steps",
        16,
        "Timed steps below 500 Mbit/s of PowerSGD, top-k and auto (fast there, and noisier).",
    )
    flags.DEFINE_integer("fast_steps", 8, "Timed steps at 500 Mbit/s and above.")
    flags.DEFINE_integer(
        "threads",
        1,
        "Intra-op threads per worker (both frameworks), and TensorFlow's inter-op threads.",
    )
    flags.DEFINE_bool("accuracy", True, "Run the accuracy phase.")
    flags.DEFINE_integer(
        "repeats",
        2,
        "Runs of each --repeat_configs with 2 workers per "
        "link, interleaved; their timed steps are pooled.",
    )
    flags.DEFINE_list("repeat_configs", REPEAT_CONFIGS, "The configurations repeated.")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "slow_network", "Base name of the result files.")
    # One worker (internal).
    flags.DEFINE_string("config", None, "One configuration (worker modes).")
    flags.DEFINE_integer("steps", 10, "Steps to train (worker modes).")
    flags.DEFINE_integer("warmup", ACC_WARMUP, "PowerSGD warm-up steps (worker modes).")
    flags.DEFINE_integer("world", 2, "Workers (worker modes).")
    flags.DEFINE_integer("rank", 0, "This worker (torch worker).")
    flags.DEFINE_integer("port", 0, "Rendezvous port (torch worker).")
    flags.DEFINE_integer("evals", 0, "Evaluate every this many steps; 0: never (worker modes).")
    flags.DEFINE_string("out", None, "Write the worker's JSON here.")
    flags.DEFINE_integer("seed", 0, "Seed of PowerSGD's initial Q, in both frameworks.")
