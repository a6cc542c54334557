"""A preset larger than a process's memory limit: only ModelParallel loads it.

A keras-hub ``LlamaBackbone`` (untied embeddings) is saved once with
``save_to_preset`` by a process with no limit. Then, every worker in a
cgroup-v1 memory cgroup of its own with the same limit (``--limit_mib``,
smaller than the preset's weights), three jobs try keras-hub's distributed
tuning recipe from that preset: ``from_preset``, ``backbone.enable_lora``,
Adam, ``fit`` on Zipf-distributed token ids, then ``save_weights`` into one
file (the chief writes it):

* ``model_parallel``: 4 (``--workers``) MultiWorkerMirrored worker processes
  on 127.0.0.1, one CPU device each, a (1, 4) mesh with
  ``LlamaBackbone.get_layout_map`` plus the rule tfdist's ``LayoutWarning``
  asks for (the untied logits table);
* ``data_parallel``: ``DataParallel()`` over the same 4 processes;
* ``one_device``: one process, no distribution, stock Keras.

Each worker records its peak over its resident set before each phase
(load, fit, save) and the job its cgroups' peaks and OOM kills. A layout that
fails without an OOM kill is an error, not a result.

Usage::

    flock /tmp/tfdist-mp.lock python benchmarks/preset_limit.py

Results: ``benchmarks/results/preset_limit.{json,md}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib import cgroups, jobs, llama, results as results_lib  # noqa: E402
from benchlib.machine import load_snapshot, peak_over, status_kb  # noqa: E402

RESULTS = HERE / "results"
LAYOUTS = ("model_parallel", "data_parallel", "one_device")
#: The flags the preset's maker and every worker take from the main process.
SETTINGS = ("hidden", "vocabulary", "layers", "sequence", "batch", "steps", "rank")
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("worker", None, LAYOUTS, "Run one worker of this layout (internal).")
    flags.DEFINE_string("preset", None, "The preset a worker loads (internal).")
    flags.DEFINE_string("save_dir", None, "Where a worker saves (internal).")
    flags.DEFINE_string("make_preset", None, "Save the preset here and exit (internal).")
    flags.DEFINE_string(
        "preset_dir",
        None,
        "Keep the preset here, and reuse it when it exists (it must match the sizes); "
        "default: a temporary directory.",
    )
    flags.DEFINE_integer("workers", 4, "Worker processes of the two distributed jobs.")
    flags.DEFINE_list("layouts", list(LAYOUTS), "The jobs to run.")
    flags.DEFINE_integer("limit_mib", 2560, "The memory limit of each worker's cgroup, in MiB.")
    flags.DEFINE_integer("hidden", 3584, "Hidden width (128-wide heads).")
    flags.DEFINE_integer("vocabulary", 32000, "Vocabulary size.")
    flags.DEFINE_integer("layers", 4, "Transformer layers.")
    flags.DEFINE_integer("sequence", 32, "Tokens per row.")
    flags.DEFINE_integer("batch", 8, "Global batch (rows).")
    flags.DEFINE_integer("steps", 2, "fit steps.")
    flags.DEFINE_integer("rank", 4, "LoRA rank.")
    flags.DEFINE_integer("timeout", 1800, "Seconds a job may take.")
    flags.DEFINE_integer(
        "peer_timeout",
        120,
        "Seconds the workers of a job wait for a peer killed by its limit "
        "(TFDIST_COLLECTIVE_TIMEOUT) before they fail.",
    )
    flags.DEFINE_bool(
        "onednn",
        False,
        "TensorFlow's oneDNN CPU ops. Off by default here (TF_ENABLE_ONEDNN_OPTS=0): "
        "oneDNN's CPU allocator keeps the largest footprint a process ever had "
        "(benchmarks/lora_capacity.py measures both).",
    )
    flags.DEFINE_string("results_dir", str(RESULTS), "Where the JSON and Markdown go.")


def sizes() -> dict:
    """The Llama of the flags (:func:`benchlib.llama.sizes`)."""
    return llama.sizes(FLAGS.hidden, FLAGS.vocabulary, FLAGS.layers)


def make_preset(path: str) -> None:
    """Saves the backbone's preset (no limit: the maker is not measured)."""
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(**sizes())
    backbone.save_to_preset(path)
    weights = sum(int(np.prod(v.shape)) * 4 for v in backbone.weights)
    (Path(path) / "full_weights.json").write_text(json.dumps({"bytes": weights, "sizes": sizes()}))


def worker(layout: str) -> None:
    import keras
    import keras_hub
    import numpy as np

    if layout != "one_device":
        import tfdist  # noqa: F401 - keras.distribution on TensorFlow

        keras.distribution.initialize()
        keras.distribution.set_distribution(llama.distribution(keras, keras_hub, layout))
    rng = np.random.default_rng(0)
    ids = (rng.zipf(1.3, (FLAGS.batch * FLAGS.steps, FLAGS.sequence + 1)) - 1) % FLAGS.vocabulary
    x = {"token_ids": ids[:, :-1].astype("int32"), "padding_mask": np.ones_like(ids[:, :-1])}
    y = ids[:, 1:].astype("int32")
    phases = {}

    def phase(name, step):
        """Runs ``step``; records its peak over the resident set before it."""
        # On stderr as it starts: a worker killed by its limit shows the phase.
        print(f"preset_limit: {name} from {status_kb('VmRSS') / 1024:,.0f} MiB", file=sys.stderr)
        sys.stderr.flush()
        value, start, peak, seconds = peak_over(step)
        phases[name] = {"rss_before_kb": start, "peak_kb": peak, "seconds": seconds}
        return value

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backbone = phase("load", lambda: keras_hub.models.LlamaBackbone.from_preset(FLAGS.preset))
    lm = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    lm.backbone.enable_lora(FLAGS.rank)
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = phase(
        "fit", lambda: lm.fit(x, y, batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)
    )
    target = Path(FLAGS.save_dir) / "lm.weights.h5"
    phase("save", lambda: lm.save_weights(target))
    strategy = lm.distribute_strategy
    print(
        "tfdist result: "
        + json.dumps(
            {
                "task": getattr(strategy, "task", "one device"),
                "layout": layout,
                "trainable": int(sum(np.prod(v.shape) for v in lm.trainable_weights)),
                "held_bytes": int(
                    sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in lm.weights)
                ),
                "rss_after_kb": status_kb("VmRSS"),
                "phases": phases,
                "losses": history.history["loss"],
                "saved_bytes": target.stat().st_size if target.exists() else None,
                "layout_warnings": [
                    str(w.message).split(" (shape")[0]
                    for w in caught
                    if type(w.message).__name__ == "LayoutWarning"
                ],
            }
        ),
        flush=True,
    )


def run(layout: str, preset: str, scratch: Path) -> dict:
    """One job of ``layout`` under the limit; its outcome."""
    save_dir = scratch / f"saved_{layout}"
    save_dir.mkdir()
    args = [f"--{name}={getattr(FLAGS, name)}" for name in SETTINGS]
    started = time.monotonic()
    outcomes = jobs.outcome_job(
        [
            str(Path(__file__).resolve()),
            f"--worker={layout}",
            f"--preset={preset}",
            f"--save_dir={save_dir}",
            *args,
        ],
        1 if layout == "one_device" else FLAGS.workers,
        env={
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "TFDIST_COLLECTIVE_TIMEOUT": str(FLAGS.peer_timeout),
            "TF_ENABLE_ONEDNN_OPTS": "1" if FLAGS.onednn else "0",
        },
        timeout=FLAGS.timeout,
        limit_bytes=FLAGS.limit_mib * 2**20,
        tag=f"preset_limit_{layout}",
    )
    trained = all(o["returncode"] == 0 and o["result"] for o in outcomes)
    killed = sum(o["memory"]["oom_kills"] for o in outcomes)
    if not trained and not killed:
        tails = "\n---\n".join(o["stderr_tail"][-1500:] for o in outcomes)
        raise RuntimeError(f"{layout} failed without an OOM kill:\n{tails}")
    return {
        "layout": layout,
        "trained": trained,
        "oom_kills": killed,
        "seconds": time.monotonic() - started,
        "max_usage_mib": max(o["memory"]["max_usage_mib"] for o in outcomes),
        "workers": [
            {key: o[key] for key in ("returncode", "timed_out", "memory", "result")}
            | {"last_phase": _last_phase(o["stderr_tail"])}
            for o in outcomes
        ],
    }


def _last_phase(stderr: str) -> str | None:
    """The last phase a worker started (what its limit killed)."""
    started = [line for line in stderr.splitlines() if line.startswith("preset_limit: ")]
    return started[-1].removeprefix("preset_limit: ") if started else None


def _phase(record: dict, name: str) -> str:
    """The largest worker's peak over its resident set before phase ``name``."""
    peaks = [
        w["result"]["phases"][name]["peak_kb"] - w["result"]["phases"][name]["rss_before_kb"]
        for w in record["workers"]
        if w["result"]
    ]
    return f"{max(peaks) / 1024:,.0f} MiB" if peaks else "-"


def report(result: dict) -> str:
    full = result["full_weights_bytes"]
    limit = result["limit_mib"] * 2**20
    s = result["sizes"]
    lines = [
        "# A preset larger than a process's memory limit: ModelParallel against "
        "DataParallel and one device",
        "",
        f"`{result['command']}` on {result['time']} UTC (tfdist {result['commit']}); 2 cores, "
        f"every worker in a cgroup-v1 memory cgroup limited to {result['limit_mib']:,} MiB; "
        f"load average (1 min) {result['load'][0]:.1f} before, {result['load'][1]:.1f} after; "
        f"TensorFlow's oneDNN ops {'on' if result['onednn'] else 'off'}. A keras-hub "
        f"`LlamaBackbone` preset (untied embeddings, {s['num_layers']} layers, width "
        f"{s['hidden_dim']:,}, vocabulary {s['vocabulary_size']:,}, {s['num_query_heads']} "
        f"query and {s['num_key_value_heads']} key/value heads, feed-forward "
        f"{s['intermediate_dim']:,}): **{result['parameters']:,} parameters, "
        f"{full / 2**20:,.0f} MiB of float32 weights, {full / limit:.2f}x the limit**. "
        f"Each job runs keras-hub's distributed tuning recipe from it: `from_preset`, "
        f"`backbone.enable_lora(rank={result['settings']['rank']})`, Adam, "
        f"{result['settings']['steps']} steps of `fit` on {result['settings']['batch']} rows "
        f"x {result['settings']['sequence']} Zipf-distributed token ids, then `save_weights` "
        "into one file the chief writes. ModelParallel: "
        f"{result['workers']} processes, a (1, {result['workers']}) mesh, "
        "`LlamaBackbone.get_layout_map` plus `layout_map['token_embedding/reverse_embeddings'] "
        f"= (None, 'model')`. DataParallel: the same {result['workers']} processes. One "
        "device: one process, stock Keras, no distribution.",
        "",
        "| layout | processes | loaded, fine-tuned and saved | OOM kills | killed in | "
        "largest cgroup peak | load, peak over before | fit, peak over before | "
        "save, peak over before | saved file | job (s) |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        saved = [w["result"]["saved_bytes"] for w in r["workers"] if w["result"]]
        saved = max((b for b in saved if b), default=None)
        killed = sorted({w["last_phase"] for w in r["workers"] if not w["result"]} - {None})
        lines.append(
            f"| {r['layout']} | {len(r['workers'])} | {'yes' if r['trained'] else 'no'} | "
            f"{r['oom_kills']} | {'; '.join(killed) or '-'} | "
            f"{r['max_usage_mib']:,.0f} MiB | {_phase(r, 'load')} | "
            f"{_phase(r, 'fit')} | {_phase(r, 'save')} | "
            f"{f'{saved / 2**20:,.0f} MiB' if saved else '-'} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "A peak over before is the worker's `VmHWM` after the phase minus its `VmRSS` "
        "before it (`/proc/self/clear_refs` resets the mark). Under ModelParallel each "
        "process makes its blocks of every split weight as its own zeros and reads them "
        "from the preset in pieces (`tfdist.distribution.local_values`); DataParallel and "
        "one device build every weight whole with its initializer before the preset is "
        "read over it, as keras-hub does.",
    ]
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    if FLAGS.make_preset:
        return make_preset(FLAGS.make_preset)
    if FLAGS.worker:
        return worker(FLAGS.worker)
    unknown = sorted(set(FLAGS.layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(
            f"preset_limit: --layouts expected some of {', '.join(LAYOUTS)}; "
            f"received {', '.join(unknown)}"
        )
    cgroups.require("preset_limit")
    args = [f"--{name}={getattr(FLAGS, name)}" for name in SETTINGS]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        preset = FLAGS.preset_dir or str(scratch / "preset")
        made = Path(preset) / "full_weights.json"
        if made.exists() and json.loads(made.read_text()).get("sizes") != sizes():
            raise SystemExit(
                f"preset_limit: --preset_dir={preset} holds a preset of other sizes "
                f"({json.loads(made.read_text()).get('sizes')}); expected {sizes()}"
            )
        if not made.exists():
            subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), f"--make_preset={preset}", *args],
                check=True,
                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            )
        full = json.loads(made.read_text())["bytes"]
        load = load_snapshot()["loadavg"][0]
        runs = []
        for layout in FLAGS.layouts:
            record = run(layout, preset, scratch)
            runs.append(record)
            print(
                f"{layout}: trained {record['trained']}, oom kills {record['oom_kills']}, "
                f"peak {record['max_usage_mib']:,.0f} MiB, {record['seconds']:.0f} s",
                flush=True,
            )
    result = {
        "command": "python benchmarks/preset_limit.py "
        + " ".join(
            f"--{n}={getattr(FLAGS, n)}" for n in ("workers", "limit_mib", "onednn", *SETTINGS)
        ),
        "time": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": results_lib.commit(),
        "workers": FLAGS.workers,
        "limit_mib": FLAGS.limit_mib,
        "onednn": FLAGS.onednn,
        "sizes": sizes(),
        "settings": {name: getattr(FLAGS, name) for name in SETTINGS},
        "full_weights_bytes": full,
        "parameters": full // 4,
        "load": [load, load_snapshot()["loadavg"][0]],
        "runs": runs,
    }
    out = Path(FLAGS.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "preset_limit.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "preset_limit.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    define_flags()
    app.run(main)
