"""Elastic benchmark: a ``tfdist launch --workers 3:4`` job that goes 4 -> 3 -> 4 workers.

Each pair of runs trains the same Keras 3 model with ``fit`` under tfdist's
MultiWorkerMirrored on 127.0.0.1, started by ``tfdist launch``:

* **uninterrupted**: ``tfdist launch --workers 4``;
* **elastic**: ``tfdist launch --workers 3:4 --worker-failed shrink
  --host-discovery-script S --discovery-interval I``, where S prints the
  number in a file the benchmark writes (4 at the start). Once the chief
  trained ``--kill_at`` of the planned steps, the benchmark SIGKILLs the last
  worker for good and writes 3: the launcher shrinks the job to 3 workers,
  which resume from the last backup (``save_freq``). Once the 3-worker job
  trained up to ``--grow_at``, it writes 4 again: at its next discovery the
  launcher sends the preemption signal, the workers save at one agreed step,
  and the job is relaunched at 4 workers from that step.

The task: 10 classes, each 3 Gaussian clusters in 32 dimensions (30 fixed
centres, noise sigma 1.2), 4,032 training examples in fixed order (global
batch 48, divisible by 3 and 4: the global batch is kept at every size, so an
epoch has 84 steps at any size), 2,016 held-out examples; MLP
32-128-128-10, Adam 1e-3, ``tfdist.BackupAndRestore(save_freq=--save_freq)``.

Measured: the held-out accuracy at the end (and the largest difference of
the final weights) of the elastic run against the uninterrupted one; at each
size change the wall time from the event (the SIGKILL; the discovery file
saying 4) to the first step trained at the new size, with the launcher's log
lines between; the steps trained twice (those since the last backup, lost at
the SIGKILL; goal 0 at a grow, which saves first); the total wall times.

Each run holds ``--lock`` (flock) for itself only. Usage::

    python benchmarks/elastic.py                 # the recorded run
    python benchmarks/elastic.py --pairs=1 --epochs=4
    python benchmarks/elastic.py --mode=report   # tables again from the JSON

Results: ``benchmarks/results/elastic.{json,md}``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from benchlib import jobs, results as results_lib
from benchlib.results import fmt, spread

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WIDTHS = [32, 128, 128, 10]
GLOBAL_BATCH = 48
TRAIN, TEST = 4032, 2016

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "train", "report"],
        "all: measure and report; train: the script tfdist launch runs; "
        "report: tables from the JSON.",
    )
    flags.DEFINE_integer("pairs", 2, "(uninterrupted, elastic) pairs of runs.")
    flags.DEFINE_integer("epochs", 20, "Epochs of 84 steps.")
    flags.DEFINE_integer("save_freq", 20, "BackupAndRestore save_freq (steps).")
    flags.DEFINE_float("kill_at", 0.3, "Fraction of the planned steps before the SIGKILL.")
    flags.DEFINE_float(
        "grow_at",
        0.4,
        "Fraction of the planned steps before slots go back to 4 "
        "(early enough that the 3-worker job is still training at the next "
        "discovery).",
    )
    flags.DEFINE_float("discovery_interval", 2.0, "tfdist launch --discovery-interval.")
    flags.DEFINE_integer("threads", 1, "Intra- and inter-op threads per worker.")
    flags.DEFINE_float("run_timeout", 900.0, "Seconds any one run may take.")
    flags.DEFINE_string(
        "lock", "/tmp/tfdist-heavy.lock", "File locked (flock) during each run; '' for none."
    )
    flags.DEFINE_string("work_dir", None, "Where runs keep their files (default: a temp dir).")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_integer(
        "preempt_at",
        None,
        "Also run a 4-worker job (--max-restarts 1) whose "
        "worker 1 gets a SIGTERM after this step, in each pair: does a resume "
        "at a fixed size end with the uninterrupted run's weights?",
    )
    flags.DEFINE_list(
        "kinds",
        ["uninterrupted", "elastic"],
        "Runs of each pair (an uninterrupted one first, as the reference).",
    )
    flags.DEFINE_bool("append", False, "Add the runs to those already in the JSON.")
    flags.DEFINE_multi_string("note", [], "A note for the report (repeatable).")
    flags.DEFINE_string("name", "elastic", "Base name of the result files.")
    flags.DEFINE_string("out", None, "train: the run's directory.")


# ---------------------------------------------------------------- pure pieces


def make_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): 30 Gaussian clusters, 3 per class."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(30, WIDTHS[0])).astype("float32")
    cluster = rng.integers(0, 30, size=TRAIN + TEST)
    x = (centres[cluster] + 1.2 * rng.normal(size=(TRAIN + TEST, WIDTHS[0]))).astype("float32")
    y = (cluster % 10).astype("int32")
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def accuracy(weights: Sequence, x, y) -> float:
    """Accuracy of the Dense-ReLU stack ``weights`` (kernel, bias, ...) on (x, y)."""
    import numpy as np

    h = x
    for i in range(0, len(weights), 2):
        h = h @ weights[i] + weights[i + 1]
        if i + 2 < len(weights):
            h = np.maximum(h, 0)
    return float((h.argmax(axis=1) == y).mean())


def read_progress(path: str | os.PathLike) -> list[tuple[int, int, int, float]]:
    """(attempt, size, optimizer step, time) of every step the chief trained."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 4 and line.endswith("\n"):
                    rows.append((int(parts[0]), int(parts[1]), int(parts[2]), float(parts[3])))
    except FileNotFoundError:
        pass
    return rows


def change(progress: Sequence[tuple[int, int, int, float]], event: float, new_size: int) -> dict:
    """What a size change cost: from the event (time) to the first step trained
    by an attempt of ``new_size`` workers that started after it.

    Returns:
        ``seconds`` (event to that step's end), ``last_step`` (the last step
        trained before, at the old size), ``resumed_at`` (the optimizer step
        the new attempt started from), ``retrained`` (steps trained twice),
        ``attempt``. Values are None when no such step exists.
    """
    before = [r for r in progress if r[3] <= event]
    after = [
        r
        for r in progress
        if r[3] > event and r[1] == new_size and (not before or r[0] > before[-1][0])
    ]
    if not after:
        return {
            "seconds": None,
            "last_step": before[-1][2] if before else None,
            "resumed_at": None,
            "retrained": None,
            "attempt": None,
        }
    first = after[0]
    old = [r for r in progress if r[0] < first[0]]
    last_step = old[-1][2] if old else 0
    resumed_at = first[2] - 1  # The optimizer step after the first step, minus it.
    return {
        "seconds": first[3] - event,
        "last_step": last_step,
        "resumed_at": resumed_at,
        "retrained": last_step - resumed_at,
        "attempt": first[0],
    }


def step_seconds(progress: Sequence[tuple[int, int, int, float]], size: int) -> float | None:
    """Median seconds between consecutive steps of one attempt at ``size`` workers."""
    gaps = [
        b[3] - a[3]
        for a, b in zip(progress, progress[1:])
        if a[0] == b[0] and a[1] == b[1] == size and b[2] == a[2] + 1
    ]
    return statistics.median(gaps) if gaps else None


def timeline(run: dict) -> list[tuple[float, str]]:
    """The launcher's lines, the events and the first step at each new size."""
    rows = [(t, line) for t, line in run["launcher_lines"]]
    names = {"kill": ">> SIGKILL to worker:3; slots file: 3", "grow": ">> slots file: 4"}
    for key, text in names.items():
        if key in run.get("events", {}):
            rows.append((run["events"][key], text))
    for key, size in (("kill", 3), ("grow", 4)):
        cell = run.get("changes", {}).get("shrink" if key == "kill" else "grow", {})
        if cell.get("seconds") is not None:
            rows.append(
                (
                    run["events"][key] + cell["seconds"],
                    f".. first step trained by {size} workers (resumed at step "
                    f"{cell['resumed_at']})",
                )
            )
    return sorted(rows, key=lambda row: row[0])


def markdown(raw: dict) -> str:
    """The results tables with the conditions of the run."""
    meta = raw["meta"]
    plain = [r for r in raw["runs"] if r["kind"] == "uninterrupted"]
    elastic = [r for r in raw["runs"] if r["kind"] == "elastic"]
    lines = [
        "# Elastic: a `tfdist launch --workers 3:4` job going 4 → 3 → 4 workers",
        "",
        f"`{meta['command']}` — {meta['when']}; {meta['cpus']} cores shared with other jobs, "
        f"no GPU; TensorFlow {meta['tf']}, Keras {meta['keras']}; code {meta['commit']}; "
        f"load average (1 min) before / after: {meta['load_before']:.1f} / "
        f"{meta['load_after']:.1f}.",
        "",
        f"Task: 10 classes of 3 Gaussian clusters each in 32 dimensions (noise σ 1.2), "
        f"{TRAIN:,} training examples in a fixed order, {TEST:,} held out; MLP "
        f"{'-'.join(map(str, WIDTHS))}, Adam 1e-3, global batch {GLOBAL_BATCH} at every size "
        f"(12 or 16 per worker), {meta['epochs']} epochs of {TRAIN // GLOBAL_BATCH} steps "
        f"({meta['planned']} steps); `tfdist.BackupAndRestore(save_freq={meta['save_freq']})`; "
        f"{meta['threads']} intra-op and inter-op thread per worker. Elastic run: "
        f"`tfdist launch --workers 3:4 --worker-failed shrink --host-discovery-script S "
        f"--discovery-interval {meta['discovery_interval']:g}`; the last worker is SIGKILLed "
        f"after step {meta['kill_step']} and S then prints 3; S prints 4 again once the "
        f"3-worker job trained step {meta['grow_step']}. {len(plain)} uninterrupted and "
        f"{len(elastic)} elastic runs, alternating. Cells: median (min–max).",
        "",
        "| run | held-out accuracy | optimizer steps | wall time (s) | s / step at 4 | "
        "s / step at 3 | sizes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    preempted = [r for r in raw["runs"] if r["kind"] == "preempted"]
    for kind, runs in (
        ("uninterrupted 4 workers", plain),
        ("elastic 4 → 3 → 4", elastic),
        ("4 workers, worker 1 SIGTERMed once (--max-restarts 1)", preempted),
    ):
        if not runs:
            continue
        sizes = "; ".join(" → ".join(map(str, r["sizes"])) for r in runs)
        lines.append(
            f"| {kind} | {fmt(spread([r['accuracy'] for r in runs]), '.4f')} "
            f"| {fmt(spread([r['iterations'] for r in runs]), '.0f')} "
            f"| {fmt(spread([r['wall_s'] for r in runs]), '.1f')} "
            f"| {fmt(spread([r['step_s'].get('4') for r in runs]), '.3f')} "
            f"| {fmt(spread([r['step_s'].get('3') for r in runs]), '.3f')} | {sizes} |"
        )
    if plain and elastic:
        diffs = [abs(e["accuracy"] - p["accuracy"]) for p, e in zip(plain, elastic)]
        wdiff = [e.get("weight_diff") for e in elastic]
        lines += [
            "",
            "Accuracy, elastic minus uninterrupted, per pair: "
            + ", ".join(f"{e['accuracy'] - p['accuracy']:+.4f}" for p, e in zip(plain, elastic))
            + f" (largest |difference| {max(diffs):.4f}); largest |difference| of the "
            f"final weights from the pair's uninterrupted run: "
            + ", ".join(f"{w:.2e}" if w is not None else "—" for w in wdiff)
            + "; resumed at step (shrink, grow): "
            + ", ".join(
                f"({e['changes']['shrink']['resumed_at']}, {e['changes']['grow']['resumed_at']})"
                for e in elastic
            )
            + ".",
        ]
    if preempted:
        lines += [
            "",
            "4 workers preempted once (worker 1 SIGTERMed after step "
            f"{preempted[0].get('preempt_at')}; the launcher restarts the job at the "
            "saved step): resumed at step, steps trained again, accuracy and largest "
            "|weight difference| against the pair's uninterrupted run: "
            + "; ".join(
                f"{r['changes']['restart']['resumed_at']}, "
                f"{r['changes']['restart']['retrained']}, {r['accuracy']:.4f}, "
                + (f"{r['weight_diff']:.2e}" if r.get("weight_diff") is not None else "—")
                for r in preempted
            )
            + ".",
        ]
    if elastic:
        lines += [
            "",
            "Each size change (median (min–max) over the elastic runs):",
            "",
            "| change | event | event → first step at the new size (s) | "
            "steps trained again | resumed at step |",
            "|---|---|---:|---:|---:|",
        ]
        for key, label, event in (
            ("shrink", "4 → 3", "SIGKILL of worker:3 (slots file: 3)"),
            ("grow", "3 → 4", "slots file says 4"),
        ):
            cells = [r["changes"][key] for r in elastic]
            lines.append(
                f"| {label} | {event} | {fmt(spread([c['seconds'] for c in cells]))} "
                f"| {fmt(spread([c['retrained'] for c in cells]), '.0f')} "
                f"| {', '.join(str(c['resumed_at']) for c in cells)} |"
            )
        lines += [
            "",
            "The first elastic run as it went, in seconds since the launch: the "
            "launcher's lines, the benchmark's events (`>>`) and the first step trained "
            "at each new size (`..`):",
            "",
            "```",
        ]
        lines += [f"{t:7.1f}  {line}" for t, line in timeline(elastic[0])]
        lines += ["```"]
    lines += [
        "",
        "Notes:",
        "",
        "- *Event → first step* is the wall time from the SIGKILL (or the moment the "
        "discovery file said 4) to the end of the first step the new-size job trained "
        "(the chief's `on_train_batch_end`, a step not skipped on resume). It includes "
        "noticing the event (a dead process at once; the discovery script every "
        f"{meta['discovery_interval']:g} s), stopping or saving the old job, starting "
        "new processes (importing TensorFlow, joining the cluster), loading the backup "
        "and tracing the first step.",
        "- *Steps trained again*: the shrink resumes from the last `save_freq` backup, so "
        "the steps since it are trained twice; the grow saves at an agreed step first "
        "(goal 0).",
        "- The global batch is kept at every size and the data are split per global "
        "batch, so the elastic run trains the same global batches in the same order as "
        "the uninterrupted one; its weights differ only by the order of floating-point "
        "sums (3 instead of 4 parts) and by the steps trained again after the SIGKILL, "
        "which are the same batches from the same backed-up state.",
    ]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the training script


def train() -> None:
    """What ``tfdist launch`` runs on every worker."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    import keras

    import tfdist

    out = Path(FLAGS.out)
    attempt = int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0"))
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    size = len(config["cluster"]["worker"])
    (out / f"worker-{index}-{attempt}.pid").write_text(str(os.getpid()))
    strategy = tfdist.strategy_from_config(register_timeout=120)
    x, y, x_test, y_test = make_data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((WIDTHS[0],))]
            + [keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:-1]]
            + [keras.layers.Dense(WIDTHS[-1])]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    backup = tfdist.BackupAndRestore(out / "backup", save_freq=FLAGS.save_freq)
    progress = out / "progress"

    class Progress(keras.callbacks.Callback):
        last = None

        def on_train_batch_begin(self, batch, logs=None):
            if self.last is None:
                # After BackupAndRestore restored: batches skipped on resume
                # leave the optimizer step there.
                self.last = int(model.optimizer.iterations.numpy())

        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if index == 0 and step != self.last:  # Trained, not skipped on resume.
                with open(progress, "a") as f:
                    f.write(f"{attempt} {size} {step} {time.time():.4f}\n")
            self.last = step

    # Progress first: a preemption save exits inside the backup's batch hook.
    model.fit(data, epochs=FLAGS.epochs, verbose=0, shuffle=False, callbacks=[Progress(), backup])
    if index == 0:
        weights = model.get_weights()
        np.savez(out / "weights.npz", *weights)
        (out / "result.json").write_text(
            json.dumps(
                {
                    "accuracy": accuracy(weights, x_test, y_test),
                    "size": size,
                    "attempt": attempt,
                    "iterations": int(model.optimizer.iterations.numpy()),
                }
            )
        )


# ---------------------------------------------------------------- measuring


def _launch(args: Sequence[str], work: Path) -> tuple[subprocess.Popen, list, threading.Thread]:
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "tfdist",
        "launch",
        *args,
        "--log-dir",
        str(work / "logs"),
        __file__,
        "--mode=train",
        f"--out={work}",
        f"--epochs={FLAGS.epochs}",
        f"--save_freq={FLAGS.save_freq}",
        f"--threads={FLAGS.threads}",
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


def _end(proc: subprocess.Popen, reader: threading.Thread, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # The launcher's own session.
        proc.wait()
        raise
    finally:
        reader.join(5)


def _wait_step(work: Path, step: int, proc, deadline: float, size: int | None = None) -> None:
    while True:
        rows = read_progress(work / "progress")
        if rows and rows[-1][2] >= step and (size is None or rows[-1][1] == size):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before step {step}: code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} within the run's time limit")
        time.sleep(0.01)


def run_once(kind: str, work: Path) -> dict:
    """One run: 'uninterrupted' (4 workers) or 'elastic' (4 -> 3 -> 4)."""
    import numpy as np

    planned = FLAGS.epochs * (TRAIN // GLOBAL_BATCH)
    kill_step, grow_step = round(FLAGS.kill_at * planned), round(FLAGS.grow_at * planned)
    slots = work / "slots"
    script = work / "slots.sh"
    slots.write_text("4\n")
    script.write_text(f"#!/bin/sh\ncat {slots}\n")
    script.chmod(0o755)
    if kind == "uninterrupted":
        args = ["--workers", "4"]
    elif kind == "preempted":
        args = ["--workers", "4", "--max-restarts", "1"]
    else:
        args = [
            "--workers",
            "3:4",
            "--worker-failed",
            "shrink",
            "--host-discovery-script",
            str(script),
            "--discovery-interval",
            str(FLAGS.discovery_interval),
        ]
    load_before = os.getloadavg()[0]
    start = time.time()
    deadline = time.monotonic() + FLAGS.run_timeout
    proc, lines, reader = _launch(args, work)
    events = {}
    try:
        if kind == "elastic":
            _wait_step(work, kill_step, proc, deadline, size=4)
            pid = int((work / "worker-3-0.pid").read_text())
            events["kill"] = time.time()
            os.kill(pid, signal.SIGKILL)  # A worker this benchmark's launcher started.
            slots.write_text("3\n")
            _wait_step(work, grow_step, proc, deadline, size=3)
            events["grow"] = time.time()
            slots.write_text("4\n")
        if kind == "preempted":
            _wait_step(work, FLAGS.preempt_at, proc, deadline)
            events["sigterm"] = time.time()
            os.kill(int((work / "worker-1-0.pid").read_text()), signal.SIGTERM)
        code = _end(proc, reader, deadline)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.time() - start
    if code != 0:
        tail = "\n".join(line for _, line in lines[-40:])
        raise RuntimeError(f"{kind}: tfdist launch exited with {code}\n{tail}")
    result = json.loads((work / "result.json").read_text())
    progress = read_progress(work / "progress")
    sizes = [progress[0][1]]
    for row in progress[1:]:
        if row[1] != sizes[-1]:
            sizes.append(row[1])
    run = {
        "kind": kind,
        "accuracy": result["accuracy"],
        "iterations": result["iterations"],
        "wall_s": wall,
        "sizes": sizes,
        "planned": planned,
        "step_s": {str(n): step_seconds(progress, n) for n in (3, 4)},
        "launcher_lines": [
            (t - start, line) for t, line in lines if line.startswith("[tfdist launch]")
        ],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "kill_step": kill_step,
        "grow_step": grow_step,
        "preempt_at": FLAGS.preempt_at,
    }
    if kind == "elastic":
        run["events"] = {k: v - start for k, v in events.items()}
        run["changes"] = {
            "shrink": change(progress, events["kill"], 3),
            "grow": change(progress, events["grow"], 4),
        }
    if kind == "preempted":
        run["events"] = {k: v - start for k, v in events.items()}
        run["changes"] = {"restart": change(progress, events["sigterm"], 4)}
    with np.load(work / "weights.npz") as f:
        run["weights"] = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    return run


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "train":
        train()
        return
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{FLAGS.name}.json"
    if FLAGS.mode == "report":
        print(results_lib.rewrite_report(path, FLAGS.note, markdown))
        return
    if not 0 < FLAGS.kill_at < FLAGS.grow_at < 1:
        raise ValueError(
            f"kill_at, grow_at: expected 0 < kill_at < grow_at < 1. Received: "
            f"{FLAGS.kill_at}, {FLAGS.grow_at}"
        )
    import numpy as np

    base = Path(FLAGS.work_dir or tempfile.mkdtemp(prefix="tfdist-bench-elastic-"))
    planned = FLAGS.epochs * (TRAIN // GLOBAL_BATCH)
    meta = {
        **results_lib.header("elastic.py"),
        "epochs": FLAGS.epochs,
        "planned": planned,
        "save_freq": FLAGS.save_freq,
        "discovery_interval": FLAGS.discovery_interval,
        "threads": FLAGS.threads,
        "kill_step": round(FLAGS.kill_at * planned),
        "grow_step": round(FLAGS.grow_at * planned),
        "notes": list(FLAGS.note),
    }
    raw = {"meta": meta, "runs": []}
    first = 0
    if FLAGS.append and path.exists():
        raw = json.loads(path.read_text())
        meta = raw["meta"]
        now = time.strftime("%H:%M UTC", time.gmtime())
        meta["command"] += f" (and at {now}: {' '.join(sys.argv[1:])})"
        first = sum(r["kind"] == "uninterrupted" for r in raw["runs"])
    for pair in range(first, first + FLAGS.pairs):
        reference = None
        kinds = list(FLAGS.kinds) + (
            ["preempted"] if FLAGS.preempt_at is not None and "preempted" not in FLAGS.kinds else []
        )
        for kind in kinds:
            work = base / f"{kind}-{pair}"
            work.mkdir(parents=True, exist_ok=True)
            with jobs.flocked(FLAGS.lock):
                run = run_once(kind, work)
            weights = run.pop("weights")
            if kind == "uninterrupted":
                reference = weights
            elif reference is not None:
                run["weight_diff"] = max(
                    float(np.abs(a - b).max()) for a, b in zip(weights, reference)
                )
            raw["runs"].append(run)
            print(
                f"{kind} #{pair}: accuracy {run['accuracy']:.4f}, {run['iterations']} steps, "
                f"{run['wall_s']:.1f} s, sizes {run['sizes']}, changes "
                f"{run.get('changes')}",
                flush=True,
            )
            meta["load_after"] = os.getloadavg()[0]
            path.write_text(json.dumps(raw, indent=1))
    (results / f"{FLAGS.name}.md").write_text(markdown(raw))
    print(markdown(raw))


if __name__ == "__main__":
    define_flags()
    app.run(main)
