"""The largest model that trains under a memory limit per process: one
device, against 4 pipeline stages.

An MLP (``--layers`` Dense layers of a width taken from a ladder, ReLU, a
10-class head), Adam, trained with Keras's ``fit`` for ``--steps`` steps,
every process in a memory cgroup of its own with the same limit
(``--limit_mib``, :mod:`benchlib.cgroups`). Up the ladder of widths, each arm
trains until a size is OOM-killed:

* ``one_device``: the model on one process, Keras's own ``fit``; it holds
  every weight, its gradient and Adam's two moments (4 copies of the model);
* ``pipeline_built``: ``tfdist.pipeline.PipelineModel`` given the built
  model, 4 stages (one per process, 1F1B, ``--microbatches``): every process
  builds every weight, and keeps its stage's gradients and Adam state;
* ``pipeline_by_stage``: ``PipelineModel`` given the model's builder: each
  process makes only its stage's weights (a quarter of the model's).

With ``--save`` (the default), each job then saves what it trained, as a
user's script does: ``save_weights`` to a ``.weights.h5`` file and ``save``
to a ``.keras`` file (a pipeline writes both by stage); a job counts as
trained only if it saved too.

The result is the largest parameter count each arm trains, and its ratio to
one device's; each process's peak memory (the cgroup's) at the largest size
all arms train; and the first step's loss there, the same model in every
arm.

Usage::

    flock /tmp/tfdist-mp.lock python benchmarks/pipeline_memory.py

Needs root and a cgroup-v1 memory controller. Results:
``benchmarks/results/pipeline_memory.{json,md}``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib import capacity, cgroups, jobs, results as results_lib  # noqa: E402
from benchlib.machine import load_snapshot  # noqa: E402

RESULTS = HERE / "results"
ARMS = ("one_device", "pipeline_built", "pipeline_by_stage")
STAGES = 4
CLASSES = 10
#: The flags a worker takes from the job (besides its arm and width).
SETTINGS = ("layers", "batch", "microbatches", "steps", "save")
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("worker", None, ARMS, "Run one worker of this arm (internal).")
    flags.DEFINE_integer("width", 1024, "The worker's width (internal).")
    flags.DEFINE_list(
        "widths",
        ["1024", "1536", "2048", "2560", "3072", "3584", "4096", "4608", "5120"],
        "The ladder of widths, smallest first.",
    )
    flags.DEFINE_list("arms", list(ARMS), "Arms to measure, in order.")
    flags.DEFINE_integer("limit_mib", 1024, "The memory limit of each process's cgroup, in MiB.")
    flags.DEFINE_integer("layers", 8, "Hidden Dense layers (2 per stage).")
    flags.DEFINE_integer("batch", 16, "Global batch.")
    flags.DEFINE_integer("microbatches", 4, "Micro-batches per batch (the pipeline arms).")
    flags.DEFINE_integer("steps", 3, "fit steps.")
    flags.DEFINE_integer("timeout", 900, "Seconds a job may take.")
    flags.DEFINE_bool("save", True, "Each job then saves its weights and its model.")
    flags.DEFINE_string("save_dir", None, "Where a job saves (internal: set per job).")
    flags.DEFINE_bool(
        "onednn",
        True,
        "TensorFlow's oneDNN CPU ops (its default on x86); False sets TF_ENABLE_ONEDNN_OPTS=0.",
    )
    flags.DEFINE_string("results_dir", str(RESULTS), "Where the JSON and Markdown go.")
    flags.DEFINE_string("name", "pipeline_memory", "Results file name.")


def parameters(width: int) -> int:
    """The MLP's parameter count at ``width`` (its input is ``width`` wide)."""
    return FLAGS.layers * (width * width + width) + width * CLASSES + CLASSES


def make_model(width: int):
    import keras

    inputs = keras.Input((width,), name="features")
    h = inputs
    for i in range(FLAGS.layers):
        h = keras.layers.Dense(width, activation="relu", name=f"h{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(h))


def worker(arm: str) -> None:
    import resource

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    rows = FLAGS.batch * FLAGS.steps
    x = (rng.standard_normal((rows, FLAGS.width)) / np.sqrt(FLAGS.width)).astype("float32")
    y = np.minimum(rng.zipf(1.6, rows) - 1, CLASSES - 1).astype("int32")
    keras.utils.set_random_seed(0)
    task = 0
    if arm == "one_device":
        model = make_model(FLAGS.width)
    else:
        from tfdist.pipeline import PipelineModel

        per_stage = FLAGS.layers // STAGES
        points = [f"h{k * per_stage}" for k in range(1, STAGES)]
        given = (lambda: make_model(FLAGS.width)) if arm == "pipeline_by_stage" else None
        model = PipelineModel(
            given or make_model(FLAGS.width),
            points,
            microbatches=FLAGS.microbatches,
            schedule="1f1b",
            recv_timeout=300,
        )
        task = model.rank
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, batch_size=FLAGS.batch, epochs=1, shuffle=False, verbose=0)
    saved = None
    if FLAGS.save:
        model.save_weights(f"{FLAGS.save_dir}/model.weights.h5")
        model.save(f"{FLAGS.save_dir}/model.keras")
        if task == 0:
            saved = Path(FLAGS.save_dir, "model.keras").stat().st_size / 2**20
    # Per step, not the epoch's running mean: the first step's loss is the
    # same model's in every arm.
    print(
        "tfdist result: "
        + json.dumps(
            {
                "task": task,
                "arm": arm,
                "width": FLAGS.width,
                "parameters": parameters(FLAGS.width),
                "loss": history.history["loss"],
                "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "saved_mib": saved,
            }
        ),
        flush=True,
    )
    if arm != "one_device":
        model.close()


def run(arm: str, width: int) -> dict:
    """One job of ``arm`` at ``width`` under the limit."""
    args = [f"--{name}={getattr(FLAGS, name)}" for name in SETTINGS]
    started = time.monotonic()
    save_dir = tempfile.mkdtemp(prefix="tfdist-pipemem-")
    try:
        outcomes = _job(arm, width, [*args, f"--save_dir={save_dir}"])
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)
    trained, killed = capacity.outcome(outcomes, f"{arm} at width {width}")
    results = sorted((o["result"] for o in outcomes if o["result"]), key=lambda r: r["task"])
    return {
        "arm": arm,
        "width": width,
        "parameters": parameters(width),
        "trained": trained,
        "oom_kills": killed,
        "seconds": time.monotonic() - started,
        "peak_mib": [o["memory"]["max_usage_mib"] for o in outcomes],
        "loss": results[0]["loss"] if trained else None,
        "saved_mib": results[0].get("saved_mib") if trained else None,
        "workers": [
            {key: o[key] for key in ("returncode", "timed_out", "memory", "result")}
            for o in outcomes
        ],
    }


def _job(arm: str, width: int, args: list[str]) -> list[dict]:
    return jobs.outcome_job(
        [str(Path(__file__).resolve()), f"--worker={arm}", f"--width={width}", *args],
        1 if arm == "one_device" else STAGES,
        env={
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "TF_ENABLE_ONEDNN_OPTS": "1" if FLAGS.onednn else "0",
        },
        timeout=FLAGS.timeout,
        limit_bytes=FLAGS.limit_mib * 2**20,
        tag=f"pipemem_{arm}_{width}",
    )


def report(result: dict) -> str:
    runs = result["runs"]
    largest = {
        arm: max(
            (r for r in runs if r["arm"] == arm and r["trained"]),
            key=lambda r: r["width"],
            default=None,
        )
        for arm in result["arms"]
    }
    base = largest.get("one_device")
    lines = [
        "# The largest model under a memory limit: one device and 4 pipeline stages",
        "",
        f"`{result['command']}` at {result['when']} ({result['commit']}); {result['cpus']} "
        f"CPUs, TensorFlow {result['tf']}, Keras {result['keras']}; load "
        f"{result['load'][0]:.2f} before, {result['load'][1]:.2f} after. Every process in a "
        f"memory cgroup of {result['limit_mib']} MiB; an MLP of {result['settings']['layers']} "
        f"Dense layers (2 per stage), Adam, batch {result['settings']['batch']}, "
        f"{result['settings']['microbatches']} micro-batches, 1F1B, "
        f"{result['settings']['steps']} fit steps"
        + (
            ", then save_weights (.weights.h5) and save (.keras)."
            if result["settings"].get("save")
            else "."
        ),
        "",
        "| arm | largest width trained | parameters | x one device | killed at width |"
        " peak MiB per process (largest trained) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for arm in result["arms"]:
        best = largest[arm]
        failed = [r["width"] for r in runs if r["arm"] == arm and not r["trained"]]
        ratio = best["parameters"] / base["parameters"] if best and base else None
        lines.append(
            f"| {arm} | {best['width'] if best else '-'} "
            f"| {best['parameters'] / 1e6:.1f} M | {'' if ratio is None else f'{ratio:.2f}'} "
            f"| {failed[0] if failed else 'none'} "
            f"| {', '.join(f'{p:.0f}' for p in best['peak_mib']) if best else '-'} |"
            if best
            else f"| {arm} | - | - | - | {failed[0] if failed else '-'} | - |"
        )
    common = [r for r in runs if r["trained"]]
    widths = {arm: {r["width"] for r in common if r["arm"] == arm} for arm in result["arms"]}
    shared = set.intersection(*widths.values()) if widths else set()
    if shared:
        width = max(shared)
        lines += ["", f"At width {width}, trained by every arm:", ""]
        lines += ["| arm | peak MiB per process | first step's loss |", "|---|---|---:|"]
        for r in common:
            if r["width"] == width:
                lines.append(
                    f"| {r['arm']} | {', '.join(f'{p:.0f}' for p in r['peak_mib'])} "
                    f"| {r['loss'][0]:.6f} |"
                )
    lines += ["", *(f"- {note}" for note in result.get("notes", []))]
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    del argv
    if FLAGS.worker:
        return worker(FLAGS.worker)
    cgroups.require("pipeline_memory")
    header = results_lib.header("pipeline_memory.py")
    runs = capacity.climb(
        FLAGS.arms,
        [int(w) for w in FLAGS.widths],
        run,
        lambda r: (
            f"trained {r['trained']}, oom kills {r['oom_kills']}, peak "
            f"{max(r['peak_mib']):,.0f} MiB, {r['seconds']:.0f} s"
        ),
    )
    result = {
        **header,
        "arms": list(FLAGS.arms),
        "onednn": FLAGS.onednn,
        "limit_mib": FLAGS.limit_mib,
        "settings": {name: getattr(FLAGS, name) for name in SETTINGS},
        "load": [header["load_before"], load_snapshot()["loadavg"][0]],
        "runs": runs,
    }
    out = Path(FLAGS.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_lib.write(out, FLAGS.name, result, report)


if __name__ == "__main__":
    define_flags()
    app.run(main)
