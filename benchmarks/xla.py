"""XLA benchmark: ``compile(jit_compile=True)`` against no XLA, under tfdist.

For three models (the keras-hub GPT-2 from a small config, a CNN, the
benchmark MLP), Keras ``fit`` step times with and without XLA:

* ``--mode=mirrored``: tfdist's Mirrored over 2 logical CPUs, one process;
* ``--mode=workers``: tfdist's MultiWorkerMirrored, 2 worker processes on
  127.0.0.1 per job.

Runs are interleaved (off, xla, then xla, off, ...) so that drift in the
machine's load hits both arms alike; each run's figure is its median step
time after warm-up (the warm-up includes XLA's compilation), and the result
is the median over pairs of the xla / off ratio. TensorFlow's own strategy
with ``jit_compile=True`` is tried once per model and mode beside them, and
its error is recorded (it has no XLA figure to compare).

Usage::

    python benchmarks/xla.py                       # both modes
    python benchmarks/xla.py --mode=mirrored --pairs=2 --steps=10

Results: ``benchmarks/results/xla.{json,md}``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib import jobs, results as results_lib  # noqa: E402
from benchlib.timing import step_timer  # noqa: E402

REPO = HERE.parent
RESULTS = HERE / "results"
MODELS = ("gpt2", "cnn", "mlp")
ARMS = ("off", "xla")

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "mirrored", "workers", "worker"],
        "What to measure; 'worker' is one process of a --mode=workers job.",
    )
    flags.DEFINE_list("models", list(MODELS), f"Models, of {MODELS}.")
    flags.DEFINE_integer("pairs", 3, "Interleaved (off, xla) pairs per model and mode.")
    flags.DEFINE_integer("steps", 20, "Timed steps per run.")
    flags.DEFINE_integer("warmup_steps", 5, "Untimed steps first (tracing, XLA compiling).")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "xla", "Base name of the result files.")
    flags.DEFINE_string("model", "mlp", "The model of one worker.")
    flags.DEFINE_enum("arm", "off", [*ARMS, "stock"], "The arm of one worker.")
    flags.DEFINE_string("out", None, "Where one worker writes its step times.")


# ---------------------------------------------------------------- the models

#: Global batch and a line describing each model.
SPECS = {
    "gpt2": (
        16,
        "keras-hub GPT2CausalLM: 2 layers, hidden 128, 4 heads, vocabulary 1024, "
        "sequence 64 (about 0.5M parameters)",
    ),
    "cnn": (
        64,
        "CNN: 3 conv layers (32, 64, 64 filters, 3x3) on 32x32x3, global pooling, "
        "dense 10 (about 57k parameters)",
    ),
    "mlp": (128, "MLP 64-1024-1024-10 (about 1.1M parameters)"),
}


def build(name: str):
    """The compiled-later model and a dataset of ``warmup + steps`` global batches."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    batch, _ = SPECS[name]
    rows = batch * (FLAGS.warmup_steps + FLAGS.steps)
    rng = np.random.default_rng(0)
    if name == "gpt2":
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=1024,
            num_layers=2,
            num_heads=4,
            hidden_dim=128,
            intermediate_dim=512,
            max_sequence_length=64,
            dropout=0.0,
        )
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        ids = rng.integers(0, 1024, size=(rows, 65)).astype("int32")
        x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((rows, 64), "int32")}
        y = ids[:, 1:]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif name == "cnn":
        model = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
                keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        x = rng.normal(size=(rows, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 10, size=rows).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(1024, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        x = rng.normal(size=(rows, 64)).astype("float32")
        y = x[:, :10].argmax(axis=1).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return model, loss, data.with_options(options)


def fit_step_times(strategy, name: str, jit: bool) -> list[float]:
    """Step times of a Keras ``fit`` of ``name`` under ``strategy`` (after warm-up)."""
    import keras

    with strategy.scope():
        model, loss, data = build(name)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss, jit_compile=jit
        )
    times: list[float] = []
    model.fit(data, epochs=1, verbose=0, callbacks=[step_timer(times)])
    return times[FLAGS.warmup_steps :]


def stock_error(strategy, name: str) -> str | None:
    """What TensorFlow's own strategy does with ``jit_compile=True``: None or the error."""
    try:
        fit_step_times(strategy, name, True)
        return None
    except Exception as error:  # noqa: BLE001 - recorded for the table
        text = f"{type(error).__name__}: {error}"
        line = next(
            (x for x in text.splitlines() if "resource" in x or "Collectives" in x),
            text.splitlines()[0],
        )
        # Where the variable was created says nothing here; the devices do.
        return re.sub(r" \(defined @ [^)]*\)", "", line.strip())[:240]


# ---------------------------------------------------------------- measuring


def pair_order(i: int) -> tuple[str, ...]:
    """Which arm runs first in pair ``i`` (off, xla, then xla, off)."""
    return jobs.pair_order(ARMS, i)


def _row(label: str, name: str, medians: dict[str, list[float]], stock: str | None) -> dict:
    ratios = [x / o for x, o in zip(medians["xla"], medians["off"])]
    return {
        "label": label,
        "model": name,
        "off_s": medians["off"],
        "xla_s": medians["xla"],
        "off_ms": 1e3 * statistics.median(medians["off"]),
        "xla_ms": 1e3 * statistics.median(medians["xla"]),
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "stock": stock,
    }


def bench_mirrored() -> list[dict]:
    import tensorflow as tf

    import tfdist

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    rows = []
    for name in FLAGS.models:
        medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(FLAGS.pairs):
            for arm in pair_order(i):
                strategy = tfdist.strategy_from_config(cpu_replicas=2)
                medians[arm].append(statistics.median(fit_step_times(strategy, name, arm == "xla")))
                print(
                    f"mirrored {name} pair {i} {arm}: {medians[arm][-1] * 1e3:.2f} ms", flush=True
                )
        stock = stock_error(tf.distribute.MirroredStrategy(devices), name)
        rows.append(_row("Mirrored, 2 logical CPUs", name, medians, stock))
        # The same model on one device and no strategy: what XLA itself does
        # on this CPU, apart from tfdist's split of the step.
        alone: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(FLAGS.pairs):
            for arm in pair_order(i):
                alone[arm].append(
                    statistics.median(
                        fit_step_times(tf.distribute.get_strategy(), name, arm == "xla")
                    )
                )
        rows.append(_row("no strategy, one device", name, alone, None))
    return rows


def _job(name: str, arm: str) -> tuple[list[int], list[float] | None, str]:
    """One 2-process job; returns the exit codes, worker 0's times and its log."""
    codes, times, logs = jobs.worker_job(
        __file__,
        [
            f"--arm={arm}",
            f"--model={name}",
            f"--steps={FLAGS.steps}",
            f"--warmup_steps={FLAGS.warmup_steps}",
        ],
        Path(FLAGS.results_dir),
        "xla",
    )
    return codes, times, logs[0]


def _error_line(log: str) -> str:
    """The line of a worker's log that names its error."""
    # A value's repr can span thousands of lines (Keras 3's "Attempt to
    # convert a value (PerReplica:{...}) ... to a Tensor"): fold it.
    log = re.sub(
        r"(Attempt to convert a value \().*?(\) with an unsupported type)",
        r"\1...\2",
        log,
        flags=re.S,
    )
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    for line in lines:
        if "Collectives are not yet implemented" in line:
            return line[:200]
    errors = [x for x in lines if re.search(r"\b\w*(Error|Exception): ", x)]
    return (errors[0] if errors else lines[-1] if lines else "no output")[:200]


def bench_workers() -> list[dict]:
    rows = []
    for name in FLAGS.models:
        medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(FLAGS.pairs):
            for arm in pair_order(i):
                codes, times, log = _job(name, arm)
                if any(codes) or times is None:
                    raise SystemExit(
                        f"xla workers ({name}, {arm}) exited with {codes}\n{log[-4000:]}"
                    )
                medians[arm].append(statistics.median(times))
                print(f"workers {name} pair {i} {arm}: {medians[arm][-1] * 1e3:.2f} ms", flush=True)
        codes, _, log = _job(name, "stock")
        stock = None if not any(codes) else f"exit codes {codes}: " + _error_line(log)
        rows.append(_row("MultiWorkerMirrored, 2 processes", name, medians, stock))
    return rows


def worker() -> None:
    """One process of a --mode=workers job."""
    import tensorflow as tf

    if FLAGS.arm == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        import tfdist

        strategy = tfdist.strategy_from_config(register_timeout=120)
    times = fit_step_times(strategy, FLAGS.model, FLAGS.arm != "off")
    Path(FLAGS.out).write_text(json.dumps(times))


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# XLA under tfdist's strategies: `jit_compile=True` against no XLA",
        "",
        f"`python benchmarks/xla.py` — {meta['when']}; {meta['cpus']} cores, no GPU; "
        f"TF {meta['tf']}, Keras {meta['keras']}; {meta['steps']} timed steps per run "
        f"after {meta['warmup_steps']} (which include XLA's compilation), "
        f"{meta['pairs']} interleaved pairs per model and mode (ABBA order). Load "
        f"average (1 min) before/after: {meta['load_before']:.1f} / "
        f"{meta['load_after']:.1f}.",
        "",
        "| strategy | model | no XLA (ms) | XLA (ms) | median ratio XLA / no XLA "
        "| ratios per pair | TensorFlow's own strategy with XLA |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in results["rows"]:
        ratios = ", ".join(f"{r:.2f}" for r in row["ratios"])
        stock = (
            "-"
            if row["label"].startswith("no strategy")
            else "trains"
            if row["stock"] is None
            else f"fails: `{row['stock']}`"
        )
        lines.append(
            f"| {row['label']} | {row['model']} | {row['off_ms']:.1f} "
            f"| {row['xla_ms']:.1f} | {row['median_ratio']:.2f} | {ratios} | {stock} |"
        )
    lines += ["", "Models (global batch):"]
    lines += [f"- {name} ({SPECS[name][0]}): {SPECS[name][1]}" for name in meta["models"]]
    lines += [
        "",
        "A ratio below 1 means XLA is faster. tfdist compiles each replica's "
        "forward and backward pass and all-reduces outside XLA (XLA has no collectives "
        "on CPU). Under TensorFlow's own MultiWorkerMirroredStrategy Keras 3's fit "
        "fails before any XLA (keras-team/keras#20585); tfdist's strategy without its "
        "XLA split aborts the workers with 'Collectives are not yet implemented for CPU "
        "devices when compiling with XLA'.",
        "",
        "No GPU was available: the GPU path, where XLA matters most, is untested.",
    ]
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "worker":
        worker()
        return
    unknown = set(FLAGS.models) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: expected names of {MODELS}. Received: {sorted(unknown)}")
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    head = results_lib.header("xla.py")
    rows = []
    if FLAGS.mode in ("all", "mirrored"):
        if FLAGS.mode == "all":
            rows += jobs.mirrored_rows(
                __file__,
                [
                    f"--models={','.join(FLAGS.models)}",
                    f"--pairs={FLAGS.pairs}",
                    f"--steps={FLAGS.steps}",
                    f"--warmup_steps={FLAGS.warmup_steps}",
                ],
                results,
                FLAGS.name,
            )
        else:
            rows += bench_mirrored()
    if FLAGS.mode in ("all", "workers"):
        rows += bench_workers()
    meta = {
        **head,
        "models": FLAGS.models,
        "pairs": FLAGS.pairs,
        "steps": FLAGS.steps,
        "warmup_steps": FLAGS.warmup_steps,
        "load_after": os.getloadavg()[0],
    }
    results_lib.write(results, FLAGS.name, {"meta": meta, "rows": rows}, markdown)


if __name__ == "__main__":
    define_flags()
    app.run(main)
