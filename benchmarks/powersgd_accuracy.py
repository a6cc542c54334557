"""PowerSGD accuracy: tfdist against PyTorch DDP's PowerSGD hook, over seeds.

One command (about 3 minutes; PyTorch from ``pip install -e .[bench]``)::

    python benchmarks/powersgd_accuracy.py

The slow-network benchmark's accuracy run (its MLP, data, batch, optimizer,
240 steps and 10 dense warm-up steps, 2 worker processes on 127.0.0.1) for
tfdist's PowerSGD rank 4 and DDP's PowerSGD hook rank 4, once per seed of
PowerSGD's initial Q (``PowerSGD(seed=)``, ``PowerSGDState(random_seed=)``);
the model's initial weights and the data order stay the same. One run per
framework and seed says little: the curves are noisy (momentum 0.9), and
two runs that differ only in rounding end up a point or two apart. The
mean over seeds is the figure to compare. No network namespace and no root
are needed: accuracy does not depend on the link.

Results: ``benchmarks/results/powersgd_accuracy.{json,md}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# slow_network.py is split by phase: each name comes from the module that defines it.
import slow_network_configs as configs  # noqa: E402
from slow_network import run_job  # noqa: E402
from slow_network_report import final_accuracy, steps_to_target  # noqa: E402

FLAGS = flags.FLAGS
CONFIGS = ["tf/powersgd:4", "ddp/powersgd:4"]


def define_flags() -> None:
    configs.define_flags()
    flags.DEFINE_integer("seeds", 3, "Seeds of PowerSGD's initial Q per framework.")


def markdown(raw: dict) -> str:
    meta = raw["meta"]
    lines = [
        "# PowerSGD accuracy: tfdist vs PyTorch DDP, over seeds",
        "",
        f"`{meta['command']}` — {meta['when']}, wall time {meta['wall_s'] / 60:.1f} min. "
        f"TensorFlow {meta['tf_version']}, Keras {meta['keras_version']}, PyTorch "
        f"{meta['torch_version']}; {meta['cpus']} cores.",
        "",
        f"MLP {'-'.join(map(str, meta['layers']))}, 2 workers, batch {meta['batch']} per "
        f"worker, SGD lr {meta['learning_rate']} momentum 0.9, {meta['acc_steps']} steps, the "
        f"first {configs.ACC_WARMUP} dense; rank 4 with error feedback and warm start in both. "
        "Final accuracy: mean held-out accuracy of the last 3 evaluations (every "
        f"{meta['eval_every']} steps, {meta['test_examples']} examples). Seeds change "
        "PowerSGD's initial Q only.",
        "",
        "| configuration | final accuracy per seed | mean | steps to "
        f"{meta['target']:.0%} per seed |",
        "|---|---|---:|---|",
    ]
    for config in CONFIGS:
        runs = [r for r in raw["runs"] if r["config"] == config]
        if not runs:
            continue
        accs = [r["final"] for r in runs]
        steps = [str(r["steps_to_target"]) if r["steps_to_target"] else "—" for r in runs]
        lines.append(
            f"| {configs.LABELS[config]} | {', '.join(f'{a:.3f}' for a in accs)} | "
            f"{statistics.mean(accs):.3f} | {', '.join(steps)} |"
        )
    means = {c: raw["summary"].get(c) for c in CONFIGS}
    if None not in means.values():
        lines += [
            "",
            f"tfdist − DDP, mean final accuracy: "
            f"{100 * (means[CONFIGS[0]] - means[CONFIGS[1]]):+.1f} points.",
        ]
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    import keras
    import tensorflow as tf
    import torch

    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="tfdist_psgd_acc_"))
    runs = []
    for seed in range(FLAGS.seeds):
        for config in CONFIGS:  # Interleaved.
            FLAGS.seed = seed
            result = run_job(config, 2, FLAGS.acc_steps, configs.ACC_WARMUP, FLAGS.eval_every, work)
            runs.append(
                {
                    "config": config,
                    "seed": seed,
                    "evals": result["evals"],
                    "final": final_accuracy(result["evals"]),
                    "steps_to_target": steps_to_target(result["evals"], FLAGS.target),
                }
            )
            print(
                f"{config} seed {seed}: final {runs[-1]['final']:.3f}, steps to target "
                f"{runs[-1]['steps_to_target']}",
                flush=True,
            )
    meta = {
        "command": "python benchmarks/powersgd_accuracy.py",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "wall_s": time.time() - started,
        "layers": [int(w) for w in FLAGS.layers],
        "batch": FLAGS.batch,
        "learning_rate": FLAGS.learning_rate,
        "acc_steps": FLAGS.acc_steps,
        "eval_every": FLAGS.eval_every,
        "test_examples": FLAGS.test_examples,
        "target": FLAGS.target,
        "seeds": FLAGS.seeds,
        "cpus": os.cpu_count(),
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "torch_version": torch.__version__,
    }
    summary = {
        c: statistics.mean(r["final"] for r in runs if r["config"] == c)
        for c in CONFIGS
        if any(r["config"] == c for r in runs)
    }
    raw = {"meta": meta, "runs": runs, "summary": summary}
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "powersgd_accuracy.json").write_text(json.dumps(raw, indent=1))
    (results / "powersgd_accuracy.md").write_text(markdown(raw))
    print(markdown(raw))


if __name__ == "__main__":
    define_flags()
    app.run(main)
