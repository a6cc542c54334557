"""Gradient-compression benchmark: bytes, accuracy and compute per compressor.

Fits one fixed task (a 64-1024-1024-10 MLP on synthetic 10-class data made
by a random teacher network) with each compression setting, under

* ``--mode=replicas``: tfdist's MirroredStrategy over 2 logical CPUs in this
  process, and
* ``--mode=workers``: MultiWorkerMirroredStrategy over 2 worker processes on
  127.0.0.1 (this script starts them),

and records per setting: bytes each replica sends per step as a ratio to a
dense fp32 all-reduce and to a bf16 all-reduce (the cheap baseline,
:func:`tfdist.compression.predict_traffic`, checked against the
CommunicationStats callback), held-out accuracy against the
uncompressed run, and the median step time as a ratio to the uncompressed
run of the same invocation (absolute times drift on shared machines). It
also checks that the identity compressor sent through tfdist's aggregation
gives the same weights as plain training.

Usage::

    python benchmarks/compression.py --mode=replicas
    python benchmarks/compression.py --mode=workers
    python benchmarks/compression.py --mode=all   # both, then write results
    python benchmarks/compression.py --mode=report  # the tables again from the JSON

A setting may end in ``/accK`` (``powersgd:4/acc4``): the optimizer then
accumulates K steps (Keras's ``gradient_accumulation_steps``) and the
gradients are compressed and sent once per K steps; the rows then also give
the bytes per training example, from the CommunicationStats totals::

    python benchmarks/compression.py --mode=replicas --epochs=2 --examples=8192 \
        --settings=plain,plain/acc4,powersgd:4,powersgd:4/acc4 \
        --results_dir=benchmarks/results/accumulation

Results go to ``benchmarks/results/compression_<mode>.json`` and
``compression_<mode>.md``; ``benchmarks/results/compression.md`` is the
hand-written summary with the machine's conditions.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib.timing import step_timer  # noqa: E402

TEST_EXAMPLES = 8192  # Held out; 1 accuracy point = 82 examples.
REPO = HERE.parent
RESULTS = HERE / "results"

SETTINGS = [
    "plain",
    "identity",
    "fp16",
    "bf16",
    "topk:0.01",
    "randomk",
    "randomk:0.1",
    "randomk:0.01",
    "sign",
    "qsgd:16",
    "powersgd:4",
]

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["replicas", "workers", "all", "worker", "report"],
        "What to run; 'worker' is one process of --mode=workers; 'report' "
        "rewrites the markdown tables from the recorded JSON.",
    )
    flags.DEFINE_list("settings", SETTINGS, "Compression settings to run.")
    flags.DEFINE_integer("epochs", 3, "Epochs per run.")
    flags.DEFINE_integer("examples", 32768, "Training examples.")
    flags.DEFINE_integer("global_batch", 128, "Global batch size.")
    flags.DEFINE_integer("hidden", 1024, "Width of the two hidden layers.")
    flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate (momentum 0.9).")
    flags.DEFINE_string("out", None, "Write the JSON result here (worker mode).")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_bool(
        "update",
        False,
        "Merge the rows measured into the recorded JSON of the mode instead of "
        "replacing it: each replaces the row of its setting, with --note and "
        "the accuracy of the plain run of its own invocation.",
    )
    flags.DEFINE_string("note", None, "With --update: why the rows were measured again.")


def make_data(examples: int, seed: int = 0):
    """Synthetic 10-class data labelled by a random 2-layer teacher."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples + TEST_EXAMPLES, 64)).astype("float32")
    w1 = rng.normal(size=(64, 64)) / 8
    w2 = rng.normal(size=(64, 10)) / 8
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype("int32")
    return (x[:examples], y[:examples]), (x[examples:], y[examples:])


def split_setting(setting: str) -> tuple[str, int | None]:
    """``"powersgd:4/acc4"`` -> ``("powersgd:4", 4)``; no suffix: no accumulation."""
    name, _, accumulation = setting.partition("/acc")
    return name, int(accumulation) if accumulation else None


def run_one(
    strategy,
    setting: str,
    *,
    epochs: int,
    examples: int,
    global_batch: int,
    hidden: int,
    learning_rate: float,
) -> dict:
    """Fits under ``strategy``; returns accuracy, step times and bytes."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.compression import CommunicationStats, predict_traffic

    (x, y), (x_test, y_test) = make_data(examples)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = data.with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        accumulation = split_setting(setting)[1]
        model.compile(
            optimizer=keras.optimizers.SGD(
                learning_rate, momentum=0.9, gradient_accumulation_steps=accumulation
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    times: list[float] = []

    stats = CommunicationStats()
    history = model.fit(
        data, epochs=epochs, verbose=0, shuffle=False, callbacks=[step_timer(times), stats]
    )
    steps_per_epoch = len(times) // epochs
    # Steady state: skip the first epoch (tracing, warm-up).
    step_time = statistics.median(times[steps_per_epoch:])
    logits = model.predict(x_test, batch_size=512, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    n = strategy.num_replicas_in_sync
    name = split_setting(setting)[0]
    compression = None if name in ("plain", "identity") else name
    traffic = predict_traffic(model, compression, n)
    bf16 = predict_traffic(model, "bf16", n)  # The cheap baseline to beat.
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    import hashlib

    return {
        "weights_sha256": hashlib.sha256(weights.astype("<f4").tobytes()).hexdigest(),
        "setting": setting,
        "replicas": n,
        "test_accuracy": accuracy,
        "final_loss": float(history.history["loss"][-1]),
        "median_step_s": step_time,
        "bytes_sent": traffic.sent,
        "dense_bytes_sent": traffic.dense_sent,
        "bytes_ratio": traffic.ratio,
        "bf16_bytes_sent": bf16.sent,
        "bytes_ratio_bf16": bf16.sent / traffic.sent if traffic.sent else float("inf"),
        "callback_bytes": stats.last.sent,
        "accumulation": accumulation or 1,
        "global_batch": global_batch,
        "updates": int(model.optimizer.iterations.numpy()),
        # What the callback counted over the run, per example trained on.
        "bytes_per_example": stats.total_bytes / (stats.steps * global_batch),
        "weights": weights.tolist() if setting in ("plain", "identity") else None,
    }


def _strategy(setting: str, **kwargs):
    import tfdist
    from tfdist.compression import NoneCompressor

    name = split_setting(setting)[0]
    compression = {"plain": None, "identity": NoneCompressor()}.get(name, name)
    return tfdist.strategy_from_config(compression=compression, **kwargs)


def _run_kwargs() -> dict:
    return dict(
        epochs=FLAGS.epochs,
        examples=FLAGS.examples,
        global_batch=FLAGS.global_batch,
        hidden=FLAGS.hidden,
        learning_rate=FLAGS.learning_rate,
    )


def bench_replicas() -> list[dict]:
    """All settings on 2 logical CPUs in this process."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    rows = []
    for setting in FLAGS.settings:
        rows.append(run_one(_strategy(setting, cpu_replicas=2), setting, **_run_kwargs()))
        print(_row_text(rows[-1]), flush=True)
    return rows


def bench_workers() -> list[dict]:
    """Each setting on 2 worker processes (MultiWorkerMirrored on 127.0.0.1)."""
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    rows = []
    for setting in FLAGS.settings:
        spec = local_spec(2)
        procs, outs = [], []
        for i, (_, _, config) in enumerate(spec_lib.all_task_configs(spec)):
            out = Path(FLAGS.results_dir) / f".worker{i}.json"
            outs.append(out)
            env = dict(
                os.environ,
                TF_CONFIG=json.dumps(config),
                TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONPATH=str(REPO),
            )
            args = [
                sys.executable,
                __file__,
                "--mode=worker",
                f"--settings={setting}",
                f"--out={out}",
            ] + [f"--{k}={v}" for k, v in _run_kwargs().items()]
            procs.append(subprocess.Popen(args, env=env))
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:  # Never leave a worker behind.
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"{setting}: workers exited with {codes}")
        chief, other = (json.loads(o.read_text()) for o in outs)
        for o in outs:
            o.unlink()
        chief["workers_identical"] = chief.pop("weights_sha256") == other.pop("weights_sha256")
        rows.append(chief)
        print(_row_text(rows[-1]), flush=True)
    return rows


def worker() -> None:
    """One process of --mode=workers."""
    [setting] = FLAGS.settings
    row = run_one(_strategy(setting, register_timeout=120), setting, **_run_kwargs())
    Path(FLAGS.out).write_text(json.dumps(row))


def _row_text(row: dict) -> str:
    return (
        f"{row['setting']:>13}: acc {row['test_accuracy']:.4f}  loss {row['final_loss']:.4f}"
        f"  step {row['median_step_s'] * 1e3:7.1f} ms  bytes/step {row['bytes_sent']:>12,.0f}"
        f"  ({row['bytes_ratio']:.1f}x fewer)"
    )


def summarize(rows: list[dict]) -> list[dict]:
    """Adds ratios against the plain run of the same invocation."""
    plain = next(r for r in rows if r["setting"] == "plain")
    identity = next((r for r in rows if r["setting"] == "identity"), None)
    for r in rows:
        r["accuracy_delta_pp"] = 100 * (r["test_accuracy"] - plain["test_accuracy"])
        r["step_time_ratio"] = r["median_step_s"] / plain["median_step_s"]
    if identity is not None and identity.get("weights") and plain.get("weights"):
        import numpy as np

        diff = float(np.max(np.abs(np.asarray(identity["weights"]) - np.asarray(plain["weights"]))))
        for r in rows:
            r["identity_max_weight_diff"] = diff
    for r in rows:
        r.pop("weights", None)
        r.pop("weights_sha256", None)
    return rows


def merge(
    recorded: dict, meta: dict, rows: list[dict], note: str | None
) -> tuple[dict, list[dict]]:
    """The recorded results with some settings measured again (``--update``).

    Each measured row (but the plain run it was compared with) replaces the
    recorded row of its setting, or is added; it keeps ``note`` and its own
    plain run's accuracy (``plain_accuracy``), since its Δ accuracy and step
    ratio are against that run. Rows are kept in :data:`SETTINGS` order.
    """
    if meta["flags"] != recorded["meta"]["flags"]:
        raise SystemExit(
            f"--update: these runs used {meta['flags']}, the recorded ones "
            f"{recorded['meta']['flags']}; rows of different runs do not compare"
        )
    plain = next(r for r in rows if r["setting"] == "plain")
    merged = {r["setting"]: r for r in recorded["rows"]}
    for r in rows:
        if r["setting"] != "plain":
            merged[r["setting"]] = dict(r, note=note, plain_accuracy=plain["test_accuracy"])
    order = {s: i for i, s in enumerate(SETTINGS)}
    out = sorted(merged.values(), key=lambda r: order.get(r["setting"], len(order)))
    old = dict(recorded["meta"])
    old.setdefault("updates", []).append(
        {
            "settings": [r["setting"] for r in rows],
            "wall_s": meta["wall_s"],
            "date": time.strftime("%Y-%m-%d"),
            "note": note,
        }
    )
    return old, out


def bf16_ratio(row: dict) -> float:
    """How many times fewer bytes than a bf16 all-reduce of the same gradients.

    Rows recorded before this column existed lack ``bytes_ratio_bf16``; for
    their float32 models a bf16 all-reduce sends exactly half the fp32 bytes.
    """
    if "bytes_ratio_bf16" in row:
        return row["bytes_ratio_bf16"]
    return row["dense_bytes_sent"] / 2 / row["bytes_sent"]


def markdown(mode: str, rows: list[dict]) -> str:
    lines = [
        f"### {mode}",
        "",
        "| setting | bytes/step/replica | ratio vs fp32 | ratio vs bf16 | test acc "
        "| Δ acc (pp) | step time ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['bytes_sent']:,.0f} | {r['bytes_ratio']:.1f}x "
            f"| {bf16_ratio(r):.1f}x "
            f"| {r['test_accuracy']:.4f} | {r['accuracy_delta_pp']:+.2f} "
            f"| {r['step_time_ratio']:.2f} |"
        )
    diff = rows[0].get("identity_max_weight_diff")
    if diff is not None:
        lines += [
            "",
            f"Identity compressor vs plain training: max |weight difference| = {diff:.2e}",
        ]
    if "workers_identical" in rows[0]:
        same = all(r["workers_identical"] for r in rows)
        lines += ["", f"Both workers ended with bit-identical weights in every run: {same}"]
    if any(r.get("accumulation", 1) > 1 for r in rows):
        lines += [
            "",
            "Gradient accumulation. Bytes per example: over the run, the "
            "CommunicationStats totals divided by the examples trained on (PowerSGD's "
            "10 dense warm-up updates included); after warm-up, one update's bytes "
            "divided by the examples it accumulated (accumulated steps x global batch).",
            "",
            "| setting | accumulated steps | updates | bytes/update/replica "
            "| bytes/example, run | bytes/example, after warm-up | test acc |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            accumulation = r.get("accumulation", 1)
            steady = r["bytes_sent"] / (accumulation * r["global_batch"])
            lines.append(
                f"| {r['setting']} | {accumulation} | {r['updates']} "
                f"| {r['bytes_sent']:,.0f} | {r['bytes_per_example']:,.1f} "
                f"| {steady:,.1f} | {r['test_accuracy']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "worker":
        worker()
        return
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    if FLAGS.mode == "report":
        for mode in ("replicas", "workers"):
            path = results / f"compression_{mode}.json"
            if path.exists():
                rows = json.loads(path.read_text())["rows"]
                (results / f"compression_{mode}.md").write_text(markdown(mode, rows))
                print(markdown(mode, rows))
        return
    modes = ["replicas", "workers"] if FLAGS.mode == "all" else [FLAGS.mode]
    for mode in modes:
        if mode == "replicas" and len(modes) > 1:
            # Logical devices are fixed once TF starts: a subprocess per mode.
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--mode=replicas",
                    f"--settings={','.join(FLAGS.settings)}",
                    f"--results_dir={results}",
                    f"--update={FLAGS.update}",
                ]
                + ([f"--note={FLAGS.note}"] if FLAGS.note else [])
                + [f"--{k}={v}" for k, v in _run_kwargs().items()],
                check=True,
            )
            continue
        started = time.time()
        rows = summarize(bench_replicas() if mode == "replicas" else bench_workers())
        meta = {
            "mode": mode,
            "wall_s": time.time() - started,
            "cpus": os.cpu_count(),
            "flags": _run_kwargs(),
        }
        recorded = results / f"compression_{mode}.json"
        if FLAGS.update and recorded.exists():
            meta, rows = merge(json.loads(recorded.read_text()), meta, rows, FLAGS.note)
        (results / f"compression_{mode}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1)
        )
        (results / f"compression_{mode}.md").write_text(markdown(mode, rows))
        print(markdown(mode, rows))


if __name__ == "__main__":
    define_flags()
    app.run(main)
