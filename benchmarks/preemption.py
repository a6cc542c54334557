"""Preemption benchmark: what a SIGTERM to one worker costs, with and without tfdist.

Each measurement is one 2-worker MultiWorkerMirrored job on 127.0.0.1
(Keras 3 ``fit``, ``--epochs`` epochs of ``--steps_per_epoch`` batches, a
backup every epoch), then the same command run again:

1. Once both workers have trained ``--signal_at`` of epoch 1 (mid-epoch,
   after one epoch-end backup), the benchmark sends SIGTERM to one worker
   (worker 1, then 0, then 1, ...), as a spot VM, Slurm or Kubernetes does.
2. Arms:

   * ``tfdist``: tfdist's strategy and ``tfdist.BackupAndRestore(dir,
     save_freq="epoch")``: the workers agree on a step, the chief saves there
     and both exit with code 143. Measured: seconds from the signal to a
     complete backup (the chief's status record ``saved_time``; the pointer's
     ``time`` is recorded too) and to the exit of every worker.
   * ``keras`` (the status quo): TensorFlow's own
     ``MultiWorkerMirroredStrategy`` and Keras's
     ``BackupAndRestore(dir, save_freq="epoch")``. Keras 3 ``fit`` fails under
     TF's strategy out of the box (keras-team/keras#20585: "unsupported type
     PerReplica"), so its ``reduce`` is patched to map over the structure —
     nothing else; and each worker gets its own backup directory (a shared one
     fails with an HDF5 lock or a makedirs race, see DESIGN.md). TF's
     coordination service swallows the SIGTERM, so the job trains on; the
     benchmark sends SIGKILL to that worker ``--kill_after`` seconds later (the
     end of a grace period) and waits up to ``--survivor_timeout`` seconds for
     the other worker to fail by itself before killing it too.

3. The rerun (same command, same directories) stops at its first batch and
   reports the optimizer step it resumed at. Steps lost = steps trained before
   the stop (the largest optimizer step either worker finished) minus that.

Every measurement holds ``--lock`` (flock) only for its own two jobs, so other
multi-process work can run between measurements; the machine is shared, so the
results are medians and ranges over ``--repeats`` runs, with the load recorded.

Usage::

    python benchmarks/preemption.py                      # the recorded run
    python benchmarks/preemption.py --models=mlp5.8m --arms=tfdist --repeats=1
    python benchmarks/preemption.py --mode=report        # tables again from the JSON

Results: ``benchmarks/results/preemption.{json,md}``.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from benchlib import jobs, results as results_lib
from benchlib.results import fmt, spread

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
ARMS = ("tfdist", "keras")
PREEMPTED = 143

#: Named models: Dense widths, input first. 256-2048-2048-512-10 is the
#: 5.8M-parameter MLP of benchmarks/slow_network.py.
MODELS = {
    "mlp5.8m": [256, 2048, 2048, 512, 10],
    "mlp52m": [512, 4096, 4096, 4096, 4096, 10],
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "worker", "report"],
        "all: measure and report; worker: one process of a job; report: tables from the JSON.",
    )
    flags.DEFINE_list(
        "models",
        ["mlp5.8m", "mlp52m"],
        "Models: names of MODELS or 'mlp:W0-W1-...' (Dense widths).",
    )
    flags.DEFINE_list("arms", list(ARMS), "Arms to measure: tfdist, keras.")
    flags.DEFINE_integer("repeats", 3, "Measurements per model and arm.")
    flags.DEFINE_integer("epochs", 3, "Epochs each job is asked to train.")
    flags.DEFINE_list(
        "steps_per_epoch",
        ["mlp5.8m:200", "mlp52m:30", "*:20"],
        "Batches per epoch, MODEL:STEPS ('*' for any other model).",
    )
    flags.DEFINE_float("signal_at", 0.5, "Where in epoch 1 the SIGTERM comes (fraction).")
    flags.DEFINE_integer("batch", 32, "Batch per worker (the global batch is twice it).")
    flags.DEFINE_float("kill_after", 10.0, "Status quo: seconds from SIGTERM to SIGKILL.")
    flags.DEFINE_float(
        "survivor_timeout", 60.0, "Status quo: seconds the other worker gets to fail by itself."
    )
    flags.DEFINE_float("job_timeout", 600.0, "Seconds any one job may take.")
    flags.DEFINE_integer("threads", 1, "Intra- and inter-op threads per worker.")
    flags.DEFINE_string(
        "lock",
        "/tmp/tfdist-heavy.lock",
        "File locked (flock) during each measurement; '' for none.",
    )
    flags.DEFINE_string("work_dir", None, "Where jobs keep backups (default: a temp dir).")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_bool("append", False, "Keep the runs in the JSON; measure only the missing ones.")
    flags.DEFINE_multi_string("note", [], "A note for the report (repeatable).")
    flags.DEFINE_string("name", "preemption", "Base name of the result files.")
    # One worker of a job.
    flags.DEFINE_string("model", "mlp5.8m", "Worker: the model.")
    flags.DEFINE_enum("arm", "tfdist", list(ARMS), "Worker: the arm.")
    flags.DEFINE_string("backup_dir", None, "Worker: the backup directory.")
    flags.DEFINE_string("progress", None, "Worker: file it appends 'step time' to per batch.")
    flags.DEFINE_string("out", None, "Worker: where it writes the step it started at.")
    flags.DEFINE_bool(
        "stop_at_first_batch",
        False,
        "Worker: write where training resumed, then exit at the first batch.",
    )


# ---------------------------------------------------------------- pure pieces


def model_widths(name: str) -> list[int]:
    """Dense widths (input first) of a named model or of 'mlp:W0-W1-...'.

    Raises:
        ValueError: Neither a known name nor a valid 'mlp:' spec.
    """
    if name in MODELS:
        return list(MODELS[name])
    if name.startswith("mlp:"):
        try:
            widths = [int(w) for w in name[4:].split("-")]
        except ValueError:
            widths = []
        if len(widths) >= 2 and all(w > 0 for w in widths):
            return widths
    raise ValueError(
        f"model: expected one of {sorted(MODELS)} or 'mlp:W0-W1-...' with "
        f"positive widths. Received: {name!r}"
    )


def param_count(widths: Sequence[int]) -> int:
    """Parameters of a Dense stack with biases."""
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def steps_for(model: str, spec: Sequence[str]) -> int:
    """The batches per epoch for ``model`` from 'MODEL:STEPS' entries ('*' = any)."""
    table = {}
    for entry in spec:
        key, sep, value = entry.rpartition(":")
        if not sep or not value.isdigit() or int(value) < 2:
            raise ValueError(
                f"steps_per_epoch: expected MODEL:STEPS with STEPS >= 2. Received: {entry!r}"
            )
        table[key] = int(value)
    if model in table:
        return table[model]
    if "*" in table:
        return table["*"]
    raise ValueError(
        f"steps_per_epoch: no entry for model {model!r} (and no '*'). Received: {list(spec)}"
    )


def signal_step(steps_per_epoch: int, fraction: float) -> int:
    """The global step after which the signal is sent: inside epoch 1."""
    return steps_per_epoch + min(steps_per_epoch - 1, max(1, round(fraction * steps_per_epoch)))


def read_progress(path: str | os.PathLike) -> list[tuple[int, float]]:
    """(optimizer step, time) lines a worker wrote; a torn last line is skipped."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and line.endswith("\n"):
                    rows.append((int(parts[0]), float(parts[1])))
    except FileNotFoundError:
        pass
    return rows


def summarize(raw: dict) -> list[dict]:
    """One row per (model, arm) with median and range of each figure."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in raw["runs"]:
        groups.setdefault((run["model"], run["arm"]), []).append(run)
    rows = []
    for (model, arm), runs in groups.items():
        rows.append(
            {
                "model": model,
                "arm": arm,
                "runs": len(runs),
                "params": runs[0]["params"],
                "steps_per_epoch": runs[0]["steps_per_epoch"],
                "signal_step": runs[0]["signal_step"],
                "step_s": spread([r["step_s"] for r in runs]),
                "save_s": spread([r.get("save_s") for r in runs]),
                "pointer_s": spread([r.get("pointer_s") for r in runs]),
                "last_step_s": spread([r.get("last_step_s") for r in runs]),
                "save_only_s": spread([r.get("save_only_s") for r in runs]),
                "exit_s": spread([r["exit_s"] for r in runs]),
                "exit_signalled_s": spread(
                    [r["exit_each_s"][r["signalled"]] for r in runs if "exit_each_s" in r]
                ),
                "exit_other_s": spread(
                    [r["exit_each_s"][1 - r["signalled"]] for r in runs if "exit_each_s" in r]
                ),
                "trained": spread([r["trained"] for r in runs]),
                "resumed": spread([r["resumed"] for r in runs]),
                "lost": spread([r["lost"] for r in runs]),
                "codes": [r["codes"] for r in runs],
                "backup_mb": spread(
                    [r.get("backup_bytes") and r["backup_bytes"] / 1e6 for r in runs]
                ),
            }
        )
    return rows


def markdown(raw: dict) -> str:
    """The results table with the conditions of the run."""
    meta = raw["meta"]
    rows = summarize(raw)
    arm_name = {
        "tfdist": "tfdist.BackupAndRestore (tfdist strategy)",
        "keras": "status quo: Keras BackupAndRestore (TF strategy)",
    }
    model_name = {
        r["model"]: f"{r['model']} ({'-'.join(map(str, model_widths(r['model'])))}, "
        f"{r['params'] / 1e6:.1f}M params)"
        for r in rows
    }
    lines = [
        "# Preemption: SIGTERM to one worker of a 2-worker job",
        "",
        f"`{meta['command']}` — {meta['when']}; {meta['cpus']} cores shared with other jobs, "
        f"no GPU; TensorFlow {meta['tf']}, Keras {meta['keras']}; code {meta['commit']}; "
        f"load average (1 min) before / after: {meta['load_before']:.1f} / "
        f"{meta['load_after']:.1f}. 2 worker processes on 127.0.0.1 per job, "
        f"{meta['threads']} intra-op and inter-op thread each; batch {meta['batch']} per worker; "
        f"Adam; a backup every epoch; {meta['epochs']} epochs planned; the SIGTERM comes once "
        f"both workers finished the step named below (mid-epoch 1); backups on {meta['disk']}. "
        f"Status quo: SIGKILL {meta['kill_after']:g} s after the SIGTERM. "
        "Each cell: median (min–max) over the runs.",
        "",
        "| model | arm | runs | s / step | signal after step | SIGTERM → backup complete (s) "
        "| SIGTERM → every worker exited (s) | steps trained | rerun resumed at | "
        "steps lost (goal 0) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {model_name[r['model']]} | {arm_name.get(r['arm'], r['arm'])} | {r['runs']} "
            f"| {fmt(r['step_s'], '.3f')} | {r['signal_step']} "
            f"| {fmt(r['save_s']) if r['arm'] == 'tfdist' else 'none (no save)'} "
            f"| {fmt(r['exit_s'])} | {fmt(r['trained'], '.0f')} | {fmt(r['resumed'], '.0f')} "
            f"| {fmt(r['lost'], '.0f')} |"
        )
    tf_rows = [r for r in rows if r["arm"] == "tfdist"]
    if tf_rows:
        lines += [
            "",
            "Where the tfdist time goes (median (min–max), seconds from the SIGTERM):",
            "",
            "| model | last step done (agreement) | save: last step → backup complete "
            "| pointer written | backup file (MB) | signalled worker exited "
            "| other worker exited | exit codes |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in tf_rows:
            codes = "; ".join(",".join(map(str, c)) for c in r["codes"])
            lines.append(
                f"| {model_name[r['model']]} | {fmt(r['last_step_s'])} "
                f"| {fmt(r['save_only_s'])} | {fmt(r['pointer_s'])} "
                f"| {fmt(r['backup_mb'], '.0f')} | {fmt(r['exit_signalled_s'])} "
                f"| {fmt(r['exit_other_s'])} | {codes} |"
            )
    sq = [r for r in rows if r["arm"] == "keras"]
    if sq:
        lines += [
            "",
            "Status quo exit codes per run (signalled worker SIGKILLed = -9; the "
            "other worker's own code, or -9 if the benchmark had to kill it after "
            f"{meta['survivor_timeout']:g} s): "
            + "; ".join(
                f"{r['model']}: " + " / ".join(",".join(map(str, c)) for c in r["codes"])
                for r in sq
            )
            + ".",
        ]
    lines += [
        "",
        "Notes:",
        "",
        "- *Steps trained* is the largest optimizer step either worker finished before "
        "it stopped; *resumed at* is the optimizer step the same command restarted from; "
        "*lost* is their difference, training the rerun must do again.",
        "- *Backup complete* is the chief's status-record `saved_time` (after the weights "
        "file is fsynced and renamed and the pointer written); the clock starts when the "
        "benchmark sends the signal. The save includes the non-chief worker's "
        "discarded save into a scratch directory, which Keras needs for its collectives.",
        "- The status quo loses the steps since the last epoch boundary plus everything "
        "trained until the SIGKILL; with a longer epoch or grace period it loses more. "
        "Its *exit* column is the time until the last worker was gone.",
    ]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- one worker


def _strategy(arm: str):
    import tensorflow as tf

    if arm == "tfdist":
        import tfdist

        return tfdist.strategy_from_config(register_timeout=120)

    class KerasFitMultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
        """TF's strategy with only keras-team/keras#20585 worked around:
        Keras 3 ``fit`` reduces tuples of per-replica values, and scalars
        with axis=0; reduce each element, scalars over axis None."""

        def reduce(self, reduce_op, value, axis):
            base = super()

            def one(v):
                rank = v.values[0].shape.rank if hasattr(v, "values") else v.shape.rank
                return base.reduce(reduce_op, v, None if rank == 0 else axis)

            return tf.nest.map_structure(one, value)

    return KerasFitMultiWorker()


def worker() -> None:
    """One process of a job: fit with a backup, report progress."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    import keras

    strategy = _strategy(FLAGS.arm)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    widths = model_widths(FLAGS.model)
    steps = steps_for(FLAGS.model, FLAGS.steps_per_epoch)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, widths[0])).astype("float32")
    y = x[:, : widths[-1]].argmax(axis=1).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(2 * FLAGS.batch)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((widths[0],))]
            + [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
            + [keras.layers.Dense(widths[-1])]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    if FLAGS.arm == "tfdist":
        import tfdist

        backup = tfdist.BackupAndRestore(FLAGS.backup_dir, save_freq="epoch")
    else:
        # One directory per worker: a shared one fails under TF's strategy.
        backup = keras.callbacks.BackupAndRestore(
            os.path.join(FLAGS.backup_dir, f"worker-{task}"), save_freq="epoch"
        )

    class Report(keras.callbacks.Callback):
        started = False

        def on_train_batch_begin(self, batch, logs=None):
            if self.started:
                return
            self.started = True
            start = int(model.optimizer.iterations.numpy())
            if FLAGS.out:
                Path(FLAGS.out).write_text(
                    json.dumps(
                        {
                            "start_iterations": start,
                            "time": time.time(),
                            "resumed_from": getattr(backup, "resumed_from", None),
                        }
                    )
                )
            if FLAGS.stop_at_first_batch:
                sys.stdout.flush()
                os._exit(0)  # Both workers stop here, before any collective.

        def on_train_batch_end(self, batch, logs=None):
            if FLAGS.progress:
                step = int(model.optimizer.iterations.numpy())
                with open(FLAGS.progress, "a") as f:
                    f.write(f"{step} {time.time():.4f}\n")

    # Report first: a tfdist preemption exits inside BackupAndRestore's hook.
    model.fit(
        data, epochs=FLAGS.epochs, steps_per_epoch=steps, verbose=0, callbacks=[Report(), backup]
    )
    print(f"finished at step {int(model.optimizer.iterations.numpy())}", flush=True)


# ---------------------------------------------------------------- measuring


def _start_job(model: str, arm: str, work: Path, extra: Sequence[str], tag: str) -> list:
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs = []
    for rank, (_, _, config) in enumerate(spec_lib.all_task_configs(local_spec(2))):
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps(config),
            TF_CPP_MIN_LOG_LEVEL="2",
            TFDIST_JOB_DIR=str(work / "job"),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        args = [
            sys.executable,
            __file__,
            "--mode=worker",
            f"--model={model}",
            f"--arm={arm}",
            f"--backup_dir={work / 'backup'}",
            f"--epochs={FLAGS.epochs}",
            f"--steps_per_epoch={','.join(FLAGS.steps_per_epoch)}",
            f"--batch={FLAGS.batch}",
            f"--threads={FLAGS.threads}",
            f"--out={work / f'{tag}-out{rank}.json'}",
            *extra,
        ]
        if tag == "run":
            args.append(f"--progress={work / f'progress{rank}'}")
        log = open(work / f"{tag}-worker{rank}.log", "w")  # noqa: SIM115 - handed to the worker, closed right after
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _kill(procs) -> None:
    for p in procs:  # Only the processes this benchmark started.
        if p.poll() is None:
            p.kill()
            p.wait()


def _tail(work: Path, tag: str) -> str:
    return "\n".join(
        f"--- {log.name}\n" + log.read_text()[-2500:]
        for log in sorted(work.glob(f"{tag}-worker*.log"))
    )


def measure(model: str, arm: str, repeat: int, work: Path) -> dict:
    """One preempted job and its rerun."""
    steps = steps_for(model, FLAGS.steps_per_epoch)
    target = signal_step(steps, FLAGS.signal_at)
    who = 1 if repeat % 2 == 0 else 0
    load_before = os.getloadavg()[0]
    procs = _start_job(model, arm, work, [], "run")
    exits: dict[int, float] = {}
    sent = killed_at = None
    deadline = time.monotonic() + FLAGS.job_timeout
    try:
        while time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in exits and p.poll() is not None:
                    exits[i] = time.time()
            if len(exits) == len(procs):
                break
            if sent is None:
                if exits:
                    raise RuntimeError(
                        f"a worker ended before the signal: "
                        f"{[p.returncode for p in procs]}\n{_tail(work, 'run')}"
                    )
                done = [read_progress(work / f"progress{i}") for i in range(2)]
                if all(d and d[-1][0] >= target for d in done):
                    sent = time.time()
                    procs[who].send_signal(signal.SIGTERM)
            elif arm == "keras":
                if killed_at is None and time.time() >= sent + FLAGS.kill_after:
                    killed_at = time.time()
                    procs[who].kill()
                elif killed_at is not None and time.time() >= killed_at + FLAGS.survivor_timeout:
                    _kill(procs)
            time.sleep(0.01)
        else:
            raise RuntimeError(
                f"{model}/{arm}: the job did not end within "
                f"{FLAGS.job_timeout:g} s\n{_tail(work, 'run')}"
            )
    finally:
        _kill(procs)
    codes = [p.returncode for p in procs]
    progress = [read_progress(work / f"progress{i}") for i in range(2)]
    trained = max(d[-1][0] for d in progress if d)
    after = [t for d in progress for s, t in d if s > target]
    # Seconds per step: the median gap between batch ends after the first epoch.
    gaps = [b[1] - a[1] for a, b in zip(progress[0], progress[0][1:]) if a[0] >= steps // 2]
    run = {
        "model": model,
        "arm": arm,
        "repeat": repeat,
        "signalled": who,
        "params": param_count(model_widths(model)),
        "steps_per_epoch": steps,
        "signal_step": target,
        "codes": codes,
        "exit_s": max(exits.values()) - sent,
        "exit_each_s": [exits[i] - sent for i in range(2)],
        "trained": trained,
        "step_s": statistics.median(gaps) if gaps else None,
        "last_step_s": (max(after) - sent) if after else 0.0,
        "load_before": load_before,
    }
    if arm == "tfdist":
        records = {
            Path(p).stem: json.loads(Path(p).read_text())
            for p in glob.glob(str(work / "job" / "preempted" / "*.json"))
        }
        pointer = json.loads((work / "backup" / "checkpoint.json").read_text())
        chief = records.get("worker-0", {})
        run.update(
            records=records,
            pointer_step=pointer.get("global_step"),
            backup_bytes=pointer.get("size"),
            pointer_s=pointer["time"] - sent,
            save_s=chief["saved_time"] - sent if chief.get("saved_time") else None,
        )
        if run["save_s"] is not None:
            run["save_only_s"] = run["save_s"] - run["last_step_s"]
    else:
        run["killed_s"] = killed_at - sent if killed_at else None

    # The rerun: same command, stops at its first batch.
    rerun = _start_job(model, arm, work, ["--stop_at_first_batch"], "rerun")
    try:
        rcodes = [p.wait(timeout=FLAGS.job_timeout) for p in rerun]
    finally:
        _kill(rerun)
    if any(rcodes):
        raise RuntimeError(f"{model}/{arm}: the rerun failed {rcodes}\n{_tail(work, 'rerun')}")
    starts = [json.loads((work / f"rerun-out{i}.json").read_text()) for i in range(2)]
    resumed = {s["start_iterations"] for s in starts}
    if len(resumed) != 1:
        raise RuntimeError(f"the workers resumed at different steps: {starts}")
    run["resumed"] = resumed.pop()
    run["lost"] = trained - run["resumed"]
    run["load_after"] = os.getloadavg()[0]
    return run


def _disk(path: str) -> str:
    try:
        done = subprocess.run(
            ["df", "--output=source,fstype", path], capture_output=True, text=True, timeout=10
        )
        source, fstype = done.stdout.split("\n")[1].split()
        return f"{source} ({fstype})"
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return "unknown disk"


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "worker":
        worker()
        return
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{FLAGS.name}.json"
    if FLAGS.mode == "report":
        print(results_lib.rewrite_report(path, FLAGS.note, markdown))
        return
    for model in FLAGS.models:
        model_widths(model)
        steps_for(model, FLAGS.steps_per_epoch)
    for arm in FLAGS.arms:
        if arm not in ARMS:
            raise ValueError(f"arms: expected some of {ARMS}. Received: {arm!r}")

    base = Path(FLAGS.work_dir or tempfile.mkdtemp(prefix="tfdist-bench-preempt-"))
    base.mkdir(parents=True, exist_ok=True)
    meta = {
        **results_lib.header("preemption.py"),
        "threads": FLAGS.threads,
        "batch": FLAGS.batch,
        "epochs": FLAGS.epochs,
        "kill_after": FLAGS.kill_after,
        "survivor_timeout": FLAGS.survivor_timeout,
        "disk": _disk(str(base)),
        "notes": list(FLAGS.note),
    }
    raw = {"meta": meta, "runs": []}
    if FLAGS.append and path.exists():
        raw = json.loads(path.read_text())
        now = time.strftime("%H:%M UTC", time.gmtime())
        raw["meta"]["command"] += f" (completed at {now}: {' '.join(sys.argv[1:])})"
        meta = raw["meta"]
    done = {(r["model"], r["arm"], r["repeat"]) for r in raw["runs"]}
    # Interleaved: model, then for each repeat each arm, so drift hits all alike.
    for model in FLAGS.models:
        for repeat in range(FLAGS.repeats):
            for arm in FLAGS.arms:
                if (model, arm, repeat) in done:
                    continue
                work = base / f"{model.replace(':', '_')}-{arm}-{repeat}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                with jobs.flocked(FLAGS.lock):
                    run = measure(model, arm, repeat, work)
                raw["runs"].append(run)
                print(
                    f"{model} {arm} #{repeat}: codes {run['codes']}, save "
                    f"{run.get('save_s')}, exit {run['exit_s']:.2f} s, trained "
                    f"{run['trained']}, resumed {run['resumed']}, lost {run['lost']}",
                    flush=True,
                )
                # Backups go; the workers' logs stay (in --work_dir, if given).
                shutil.rmtree(work / "backup", ignore_errors=True)
                meta["load_after"] = os.getloadavg()[0]
                path.write_text(json.dumps(raw, indent=1))
    if not FLAGS.work_dir:
        shutil.rmtree(base, ignore_errors=True)
    (results / f"{FLAGS.name}.md").write_text(markdown(raw))
    print(markdown(raw))


if __name__ == "__main__":
    define_flags()
    app.run(main)
