"""LoRA fine-tuning under a memory limit per process: ModelParallel against DataParallel.

keras-hub's distributed tuning recipe (``LlamaBackbone.get_layout_map``,
``ModelParallel``, ``backbone.enable_lora``, Adam, ``fit``) runs on 4
(``--workers``) MultiWorkerMirrored worker processes on 127.0.0.1 (one CPU
device each), every worker in a memory cgroup of its own with the same limit.
Up a ladder of Llama widths (untied embeddings, 4 layers, vocabulary 32,000 by
default), each layout trains until a size is OOM-killed:

* ``model_parallel``: a (1, 4) mesh, Llama's own layout map plus the one rule
  tfdist's ``LayoutWarning`` asks for (the untied logits table,
  ``token_embedding/reverse_embeddings``, which keras-hub's map leaves whole);
* ``data_parallel``: ``DataParallel()`` over the same 4 devices (every
  process holds the whole model).

The result is the largest parameter count each layout fine-tunes, as a ratio,
and the median step time of both at the largest size both train. Token ids
are Zipf-distributed over the vocabulary, as text gives.

Usage::

    flock /tmp/tfdist-mp.lock python benchmarks/lora_capacity.py

Results: ``benchmarks/results/lora_capacity.{json,md}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib import capacity, cgroups, jobs, llama, results as results_lib  # noqa: E402
from benchlib.machine import load_snapshot, peak_over, status_kb  # noqa: E402

RESULTS = HERE / "results"
LAYOUTS = ("data_parallel", "model_parallel")
#: The flags a worker takes from the job (besides its width and layout).
SETTINGS = ("vocabulary", "layers", "sequence", "batch", "steps", "rank")
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("worker", None, LAYOUTS, "Run one worker of this layout (internal).")
    flags.DEFINE_integer("hidden", 512, "The worker's hidden width (internal).")
    flags.DEFINE_integer(
        "workers", 4, "Worker processes of each job (fewer: a cheaper smoke test)."
    )
    flags.DEFINE_list(
        "widths",
        ["512", "1024", "1536", "2048", "2560", "3072", "3584"],
        "The ladder of hidden widths, smallest first.",
    )
    flags.DEFINE_integer("limit_mib", 2048, "The memory limit of each worker's cgroup, in MiB.")
    flags.DEFINE_integer("vocabulary", 32000, "Vocabulary size.")
    flags.DEFINE_integer("layers", 4, "Transformer layers.")
    flags.DEFINE_integer("sequence", 64, "Tokens per row.")
    flags.DEFINE_integer("batch", 8, "Global batch (rows).")
    flags.DEFINE_integer("steps", 4, "fit steps (the first, traced, is not timed).")
    flags.DEFINE_integer("rank", 4, "LoRA rank.")
    flags.DEFINE_integer("timeout", 900, "Seconds a job may take.")
    flags.DEFINE_integer(
        "peer_timeout",
        120,
        "Seconds the workers of a job wait for a peer killed by its limit "
        "(TFDIST_COLLECTIVE_TIMEOUT) before they fail.",
    )
    flags.DEFINE_bool(
        "onednn",
        True,
        "TensorFlow's oneDNN CPU ops (its default on x86). False sets "
        "TF_ENABLE_ONEDNN_OPTS=0 for the workers: oneDNN's CPU allocator keeps the "
        "largest footprint a process ever had (a 250 MB random-normal initializer "
        "leaves 788 MB), and the plain one returns memory.",
    )
    flags.DEFINE_string("results_dir", str(RESULTS), "Where the JSON and Markdown go.")
    flags.DEFINE_string("name", "lora_capacity", "Results file name.")


def sizes(hidden: int) -> dict:
    """The Llama of width ``hidden`` (:func:`benchlib.llama.sizes`)."""
    return llama.sizes(hidden, FLAGS.vocabulary, FLAGS.layers)


class _StepTimes:
    """Seconds of each training step (batch begin to batch end)."""

    def __init__(self, keras):
        times = self.times = []

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.started = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.started)

        self.callback = Callback()


def worker(layout: str) -> None:
    import keras
    import keras_hub
    import numpy as np

    from tfdist.parallel import sharding

    keras.distribution.initialize()
    keras.distribution.set_distribution(llama.distribution(keras, keras_hub, layout))
    rng = np.random.default_rng(0)
    rows = FLAGS.batch * FLAGS.steps
    ids = (rng.zipf(1.3, (rows, FLAGS.sequence + 1)) - 1) % FLAGS.vocabulary
    x = {"token_ids": ids[:, :-1].astype("int32"), "padding_mask": np.ones_like(ids[:, :-1])}
    y = ids[:, 1:].astype("int32")
    before = status_kb("VmRSS")
    phases = {}

    def phase(name, step):
        """Runs ``step``; records its peak over the resident set before it."""
        value, start, peak, _ = peak_over(step)
        phases[name] = {"rss_before_kb": start, "peak_kb": peak}
        return value

    keras.utils.set_random_seed(0)
    backbone = phase("build", lambda: keras_hub.models.LlamaBackbone(**sizes(FLAGS.hidden)))
    lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    lm.backbone.enable_lora(FLAGS.rank)
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    steps = _StepTimes(keras)
    history = phase(
        "fit",
        lambda: lm.fit(
            x,
            y,
            batch_size=FLAGS.batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[steps.callback],
        ),
    )

    def full_size(v):
        spec = sharding.spec_of(v)
        return int(np.prod(spec.full_shape if spec else v.shape))

    print(
        "tfdist result: "
        + json.dumps(
            {
                "task": lm.distribute_strategy.task,
                "layout": layout,
                "hidden": FLAGS.hidden,
                "parameters": sum(full_size(v) for v in lm.weights),
                "trainable": sum(full_size(v) for v in lm.trainable_weights),
                "held_bytes": sum(
                    int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in lm.weights
                ),
                "rss_before_kb": before,
                "phases": phases,
                "step_seconds": steps.times,
                "losses": history.history["loss"],
            }
        ),
        flush=True,
    )


def run(layout: str, hidden: int) -> dict:
    """One job of ``layout`` at width ``hidden`` under the limit."""
    args = [f"--{name}={getattr(FLAGS, name)}" for name in SETTINGS]
    started = time.monotonic()
    outcomes = jobs.outcome_job(
        [str(Path(__file__).resolve()), f"--worker={layout}", f"--hidden={hidden}", *args],
        FLAGS.workers,
        # A peer killed by its limit makes the others fail, not hang.
        env={
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "TFDIST_COLLECTIVE_TIMEOUT": str(FLAGS.peer_timeout),
            "TF_ENABLE_ONEDNN_OPTS": "1" if FLAGS.onednn else "0",
        },
        timeout=FLAGS.timeout,
        limit_bytes=FLAGS.limit_mib * 2**20,
        tag=f"lora_{layout}_{hidden}",
    )
    trained, killed = capacity.outcome(outcomes, f"{layout} at width {hidden}")
    results = [o["result"] for o in outcomes if o["result"]]
    return {
        "layout": layout,
        "hidden": hidden,
        "sizes": sizes(hidden),
        "trained": trained,
        "oom_kills": killed,
        "seconds": time.monotonic() - started,
        "max_usage_mib": max(o["memory"]["max_usage_mib"] for o in outcomes),
        "parameters": results[0]["parameters"] if results else None,
        "workers": [
            {key: o[key] for key in ("returncode", "timed_out", "memory", "result")}
            for o in outcomes
        ],
    }


def _median_step(record: dict) -> float:
    """The slowest worker's median step, the first (traced) step left out."""
    return max(statistics.median(w["result"]["step_seconds"][1:]) for w in record["workers"])


def report(result: dict) -> str:
    runs = result["runs"]
    largest = {
        layout: max(
            (r for r in runs if r["layout"] == layout and r["trained"]),
            key=lambda r: r["parameters"],
            default=None,
        )
        for layout in LAYOUTS
    }
    mp, dp = largest["model_parallel"], largest["data_parallel"]
    workers = result.get("workers", 4)  # Records before the flag had 4.
    both = [r for r in runs if r["trained"] and dp is not None and r["hidden"] == dp["hidden"]]
    lines = [
        "# LoRA fine-tuning under a memory limit: ModelParallel against DataParallel",
        "",
        f"`{result['command']}` on {result['time']} UTC (tfdist {result.get('commit', '?')}); "
        f"2 cores shared by {workers} worker "
        f"processes on 127.0.0.1 (one CPU device each), each in a cgroup-v1 memory cgroup "
        f"limited to {result['limit_mib']:,} MiB; load average (1 min) "
        f"{result['load'][0]:.1f} before, {result['load'][1]:.1f} after. keras-hub "
        f"`LlamaCausalLM` (untied embeddings, {result['settings']['layers']} layers, "
        f"vocabulary {result['settings']['vocabulary']:,}, 128-wide heads, half as many "
        "key/value heads, feed-forward 2.75x the width), `backbone.enable_lora(rank="
        f"{result['settings']['rank']})`, Adam, {result['settings']['steps']} steps of `fit` "
        f"on global batches of {result['settings']['batch']} rows x "
        f"{result['settings']['sequence']} Zipf-distributed token ids. ModelParallel: a "
        f"(1, {workers}) mesh, `LlamaBackbone.get_layout_map` plus "
        "`layout_map['token_embedding/reverse_embeddings'] = (None, 'model')` (the untied "
        "logits table, which keras-hub's map leaves whole; tfdist's `LayoutWarning` names "
        f"it). DataParallel: `DataParallel()` over the same {workers} devices. Each layout "
        "climbs the widths until one is OOM-killed.",
        "",
        "TensorFlow's oneDNN CPU ops "
        + (
            "on (its default on x86)."
            if result.get("onednn", True)
            else "off (TF_ENABLE_ONEDNN_OPTS=0)."
        )
        + " With them on, TensorFlow's CPU allocator keeps the largest footprint a process "
        "ever had (a 250 MB random-normal initializer leaves 788 MB resident after it is "
        "freed); with them off, freed tensors return their memory.",
        "",
        "| layout | width | parameters | trained | OOM kills | largest cgroup peak | "
        "build, peak over before | fit, peak over before | median step (s), slowest "
        "worker | job (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        params = f"{r['parameters']:,}" if r["parameters"] else f"({_count(r['sizes']):,})"
        step = f"{_median_step(r):.2f}" if r["trained"] else "-"
        phases = [_phase(r, name) for name in ("build", "fit")]
        lines.append(
            f"| {r['layout']} | {r['hidden']:,} | {params} | {'yes' if r['trained'] else 'no'} "
            f"| {r['oom_kills']} | {r['max_usage_mib']:,.0f} MiB | {phases[0]} | {phases[1]} "
            f"| {step} | {r['seconds']:.0f} |"
        )
    lines.append("")
    if mp and dp:
        lines.append(
            f"**Largest fine-tuned: ModelParallel {mp['parameters']:,} parameters (width "
            f"{mp['hidden']:,}), DataParallel {dp['parameters']:,} (width {dp['hidden']:,}): "
            f"{mp['parameters'] / dp['parameters']:.2f}x.**"
        )
        steps = {r["layout"]: _median_step(r) for r in both}
        if len(steps) == 2:
            lines.append(
                f"At width {dp['hidden']:,}, the largest both train, a step takes "
                f"{steps['model_parallel']:.2f} s under ModelParallel and "
                f"{steps['data_parallel']:.2f} s under DataParallel: "
                f"{steps['model_parallel'] / steps['data_parallel']:.2f}x."
            )
    if mp and mp["hidden"] == max(r["hidden"] for r in runs):
        lines.append(
            "ModelParallel trained the ladder's widest model: its largest is at least that."
        )
    lines.append(
        "Parameters in parentheses are counted from the sizes (the job died before "
        "reporting). A step is timed from Keras's batch begin to its end; the first, "
        "which traces, is left out. Build: the backbone's construction from its "
        "initializers; fit: `fit` with its tracing."
    )
    return "\n".join(lines) + "\n"


def _phase(record: dict, name: str) -> str:
    """The largest worker's peak over its resident set before phase ``name``."""
    peaks = [
        w["result"]["phases"][name]["peak_kb"] - w["result"]["phases"][name]["rss_before_kb"]
        for w in record["workers"]
        if w["result"] and name in w["result"].get("phases", {})
    ]
    return f"{max(peaks) / 1024:,.0f} MiB" if peaks else "-"


def _count(config: dict) -> int:
    """Parameters of a Llama of ``config`` (the norms included)."""
    h, v = config["hidden_dim"], config["vocabulary_size"]
    kv = config["num_key_value_heads"] * (h // config["num_query_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * config["intermediate_dim"] + 2 * h
    return 2 * v * h + config["num_layers"] * layer + h


def main(argv) -> None:
    del argv
    if FLAGS.worker:
        return worker(FLAGS.worker)
    cgroups.require("lora_capacity")
    load = load_snapshot()["loadavg"][0]
    # ModelParallel starts where DataParallel stopped training.
    runs = capacity.climb(
        LAYOUTS,
        [int(w) for w in FLAGS.widths],
        run,
        lambda r: (
            f"trained {r['trained']}, oom kills {r['oom_kills']}, peak "
            f"{r['max_usage_mib']:,.0f} MiB, {r['seconds']:.0f} s"
        ),
    )
    result = {
        "command": "python benchmarks/lora_capacity.py "
        + " ".join(
            f"--{n}={getattr(FLAGS, n)}" for n in ("workers", "limit_mib", "onednn", *SETTINGS)
        ),
        "time": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": results_lib.commit(),
        "workers": FLAGS.workers,
        "limit_mib": FLAGS.limit_mib,
        "onednn": FLAGS.onednn,
        "settings": {name: getattr(FLAGS, name) for name in SETTINGS},
        "load": [load, load_snapshot()["loadavg"][0]],
        "runs": runs,
    }
    out = Path(FLAGS.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{FLAGS.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{FLAGS.name}.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    define_flags()
    app.run(main)
