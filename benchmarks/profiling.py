"""Profiler benchmark: what StepProfile costs, and what it shows, on a 100 Mbit/s link.

One command, as root::

    python benchmarks/profiling.py                   # the recorded run
    python benchmarks/profiling.py --mode=report     # the table again from the JSON

Like ``benchmarks/slow_network.py`` it re-runs itself under ``unshare -n``:
a private network namespace whose loopback (MTU 1500) ``tc ... tbf`` limits
to ``--rate``, shared by the workers' traffic. Every job is 2 MultiWorkerMirrored
workers started by ``tfdist launch``, training the slow-network benchmark's
MLP (256-2048-2048-512-10, 5.8M parameters, the same initial weights) with
Keras ``fit``, batch 32 per worker, one intra-op and one inter-op thread per
worker, in two configurations:

* ``fp32``: no compression (Keras's own all-reduce);
* ``powersgd``: PowerSGD rank 4 without dense warm-up steps.

Each configuration runs with the profiler off, on (``StepProfile()``) and on
with its per-step barrier (``StepProfile(barrier=True)``), in interleaved
rounds (off on barrier, then barrier on off, ...) so that drift in the
machine's load hits every arm alike. A run's figure is its median host step
time after ``--skip`` steps; the overhead is the median over rounds of on /
off (goal: <= 1.03). The profiled runs also give where the time went: the
shares of compute (forward, backward, compress, decompress) and of
communication in each configuration.

Results: ``benchmarks/results/profiling.{json,md}``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from benchlib import netns  # noqa: E402
from benchlib.mlp import initial_weights, param_count  # noqa: E402
from benchlib.timing import median_step, step_timer  # noqa: E402

#: The overhead goal: profiled step time / unprofiled.
GOAL = 1.03
CONFIGS = ("fp32", "powersgd")
#: Phases that are this worker's own computation.
COMPUTE = ("compute", "compress", "decompress")

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "inside", "worker", "report"],
        "all: run in a new namespace, then report; the others are internal.",
    )
    flags.DEFINE_string("rate", "100mbit", "tc tbf rate of the loopback; 'none': no limit.")
    flags.DEFINE_list("layers", ["256", "2048", "2048", "512", "10"], "MLP widths.")
    flags.DEFINE_list("configs", list(CONFIGS), "Configurations: fp32, powersgd.")
    flags.DEFINE_list(
        "arms",
        ["off", "on", "barrier"],
        "Profiler arms to run: off, on "
        "(StepProfile's defaults), barrier (StepProfile(barrier=True)).",
    )
    flags.DEFINE_integer("pairs", 3, "Interleaved rounds of the arms per configuration.")
    flags.DEFINE_integer("steps", 12, "Steps per run.")
    flags.DEFINE_integer("skip", 3, "Steps left out of a run's median (start-up).")
    flags.DEFINE_integer("batch", 32, "Batch per worker.")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "profiling", "Base name of the result files.")
    flags.DEFINE_string("work_dir", None, "Where runs keep their files (default: a temp dir).")
    flags.DEFINE_string("config", "fp32", "worker: the configuration.")
    flags.DEFINE_bool("profile", False, "worker: run with StepProfile.")
    flags.DEFINE_bool("barrier", False, "worker: StepProfile's per-step barrier.")
    flags.DEFINE_string("out", None, "worker: the run's directory.")
    flags.DEFINE_multi_string("note", [], "A note for the report (repeatable).")


def _compression(config: str):
    from tfdist.compression import PowerSGD

    if config == "fp32":
        return None
    if config == "powersgd":
        return PowerSGD(4, warmup_steps=0)
    raise ValueError(f"Expected a configuration in {CONFIGS}. Received: {config!r}")


def worker() -> None:
    """One worker of a job (TF_CONFIG in the environment)."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import tfdist

    strategy = tfdist.strategy_from_config(
        compression=_compression(FLAGS.config), register_timeout=300
    )
    rank = strategy.cluster_resolver.task_id
    layers = [int(w) for w in FLAGS.layers]
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(FLAGS.batch * FLAGS.steps, layers[0])).astype("float32")
    y = rng.integers(0, layers[-1], size=FLAGS.batch * FLAGS.steps).astype("int32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((layers[0],))]
            + [keras.layers.Dense(w, activation="relu") for w in layers[1:-1]]
            + [keras.layers.Dense(layers[-1])]
        )
        model.set_weights(initial_weights(layers))
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def dataset(ctx):
        data = tf.data.Dataset.from_tensor_slices((x, y))
        return data.batch(FLAGS.batch, drop_remainder=True).prefetch(2)

    times: list[float] = []

    out = Path(FLAGS.out)
    callbacks = [step_timer(times)]
    profile = None
    if FLAGS.profile:
        profile = tfdist.StepProfile(log_dir=str(out / "logs"), barrier=FLAGS.barrier)
        callbacks.append(profile)
    model.fit(
        strategy.distribute_datasets_from_function(dataset),
        epochs=1,
        steps_per_epoch=FLAGS.steps,
        verbose=0,
        callbacks=callbacks,
    )
    result = {"rank": rank, "step_times": times, "params": model.count_params()}
    if profile is not None:
        result["phases"] = profile.summaries[-1]
        result["link"] = (
            None
            if profile.link is None
            else {"bandwidth": profile.link.bandwidth, "latency": profile.link.latency}
        )
    (out / f"worker{rank}.json").write_text(json.dumps(result))


def run_job(config: str, arm: str, work: Path, timeout: float = 900.0) -> dict:
    """Runs one 2-worker job with ``tfdist launch`` in profiler arm ``arm``;
    returns worker 0's result (with its directory)."""
    out = work / f"{config}_{arm}_{int(time.time() * 1e3)}"
    out.mkdir(parents=True)
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("TF_CONFIG", None)
    env.pop("TFDIST_TIMELINE", None)
    args = [
        sys.executable,
        "-m",
        "tfdist",
        "launch",
        "--workers",
        "2",
        "--show-all",
        __file__,
        "--mode=worker",
        f"--config={config}",
        f"--out={out}",
        f"--layers={','.join(FLAGS.layers)}",
        f"--steps={FLAGS.steps}",
        f"--batch={FLAGS.batch}",
    ] + {"off": [], "on": ["--profile"], "barrier": ["--profile", "--barrier"]}[arm]
    with open(out / "launch.log", "w") as log:
        done = subprocess.run(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO
        )
    if done.returncode != 0 or not (out / "worker0.json").exists():
        tail = (out / "launch.log").read_text()[-6000:]
        raise RuntimeError(
            f"{config} (profiler {arm}) failed with exit code "
            f"{done.returncode}; its log ({out / 'launch.log'}) ends:\n{tail}"
        )
    result = json.loads((out / "worker0.json").read_text())
    result["dir"] = str(out)
    return result


def arm_order(pair: int, arms: Sequence[str]) -> list[str]:
    """The arms of round ``pair``: as given, then reversed, alternately."""
    return list(arms) if pair % 2 == 0 else list(reversed(arms))


def inside() -> None:
    """Runs every job inside the private network namespace; writes the raw JSON."""
    if FLAGS.rate != "none":
        netns.loopback_up(mtu=1500)
        subprocess.run(netns.tc_command(FLAGS.rate), check=True)
    else:
        netns.loopback_up()
    work = Path(FLAGS.work_dir or tempfile.mkdtemp(prefix="tfdist-profiling-"))
    runs = []
    started = time.time()
    for pair in range(FLAGS.pairs):
        for config in FLAGS.configs:
            for arm in arm_order(pair, FLAGS.arms):
                result = run_job(config, arm, work)
                runs.append(
                    {
                        "config": config,
                        "arm": arm,
                        "pair": pair,
                        "step_s": median_step(result["step_times"], FLAGS.skip),
                        **{k: result[k] for k in ("step_times", "params", "dir")},
                        **{k: result[k] for k in ("phases", "link") if k in result},
                    }
                )
                print(
                    f"{config} {arm} pair {pair}: {runs[-1]['step_s'] * 1e3:.1f} ms/step",
                    flush=True,
                )
    meta = {
        "command": " ".join(["python", "benchmarks/profiling.py", *sys.argv[1:]]).replace(
            " --mode=inside", ""
        ),
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "rate": FLAGS.rate,
        "layers": [int(w) for w in FLAGS.layers],
        "params": param_count([int(w) for w in FLAGS.layers]),
        "batch": FLAGS.batch,
        "steps": FLAGS.steps,
        "skip": FLAGS.skip,
        "pairs": FLAGS.pairs,
        "load": os.getloadavg(),
        "wall_s": time.time() - started,
        "notes": FLAGS.note,
    }
    Path(FLAGS.results_dir).mkdir(parents=True, exist_ok=True)
    _raw_path().write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


def shares(phases: dict) -> dict[str, float]:
    """Worker 0's own computation and communication, as shares of its step."""
    mine = phases.get("0", phases.get(0))
    step = mine["step"]
    return {
        "compute": sum(mine[k] for k in COMPUTE) / step,
        "communicate": mine["communicate"] / step,
        "wait": mine["wait"] / step,
        "step_s": step,
        "bytes": mine["bytes"],
    }


def summarize(raw: dict) -> dict:
    """Per configuration: median step of each arm, the overheads (median over
    rounds of on / off, barrier / off) and the measured shares of the
    profiled runs."""
    rows = {}
    for config in dict.fromkeys(r["config"] for r in raw["runs"]):
        runs = [r for r in raw["runs"] if r["config"] == config]
        by_pair: dict[int, dict[str, float]] = {}
        for r in runs:
            by_pair.setdefault(r["pair"], {})[r["arm"]] = r["step_s"]
        profiled = [shares(r["phases"]) for r in runs if r["arm"] == "on" and "phases" in r]
        row = {"off_s": _median([r["step_s"] for r in runs if r["arm"] == "off"])}
        for arm, key in (("on", "overhead"), ("barrier", "overhead_barrier")):
            ratios = [p[arm] / p["off"] for p in by_pair.values() if arm in p and "off" in p]
            row[f"{arm}_s"] = _median([r["step_s"] for r in runs if r["arm"] == arm])
            row[key] = _median(ratios)
            row[f"{key}_pairs"] = ratios
        if profiled:
            for key in ("compute", "communicate", "wait", "bytes"):
                row[key] = statistics.median(p[key] for p in profiled)
            row["larger"] = "communicate" if row["communicate"] > row["compute"] else "compute"
        rows[config] = row
    return rows


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(raw: dict, rows: dict) -> str:
    meta = raw["meta"]
    lines = [
        "# StepProfile: cost and what it shows on a slow link",
        "",
        f"`{meta['command']}`, {meta['when']}; {meta['cpus']} CPUs, load "
        f"{', '.join(f'{v:.2f}' for v in meta['load'])}; 2 MultiWorkerMirrored workers "
        f"(`tfdist launch`), loopback limited to {meta['rate']} (tc tbf, MTU 1500) in a "
        f"private network namespace; MLP {'-'.join(map(str, meta['layers']))} "
        f"({meta['params']:,} parameters), batch {meta['batch']} per worker, "
        f"{meta['steps']} steps per run (median after {meta['skip']}), "
        f"{meta['pairs']} interleaved rounds of the arms per configuration.",
        "",
        f"| configuration | step, profiler off | step, on | overhead (goal <= {GOAL}) "
        "| with barrier=True | compute share | communicate share | wait share "
        "| bytes per step | larger |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for config, row in rows.items():
        ok = row["overhead"] is not None and row["overhead"] <= GOAL
        lines.append(
            f"| {config} | {_ms(row['off_s'])} | {_ms(row['on_s'])} "
            f"| {_fmt(row['overhead'], '.3f')}{' (met)' if ok else ''} "
            f"| {_fmt(row.get('overhead_barrier'), '.3f')} "
            f"| {_fmt(row.get('compute'), '.1%')} | {_fmt(row.get('communicate'), '.1%')} "
            f"| {_fmt(row.get('wait'), '.1%')} | {_fmt(row.get('bytes'), ',.0f')} "
            f"| {row.get('larger', '—')} |"
        )
    lines += [
        "",
        "Compute is forward, backward, compress and decompress, as StepProfile "
        "measured them on worker 0 (the `on` runs); the shares are of its host step "
        "time. The overhead is the median over rounds of the profiled / unprofiled "
        "median step time; `barrier=True` adds a one-float all-reduce per step to "
        "measure the wait directly. Per-round ratios are in the JSON.",
    ]
    for note in meta.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _raw_path() -> Path:
    return Path(FLAGS.results_dir) / f"{FLAGS.name}.json"


def report() -> dict:
    raw = json.loads(_raw_path().read_text())
    rows = summarize(raw)
    raw["summary"] = rows
    _raw_path().write_text(json.dumps(raw, indent=1))
    text = markdown(raw, rows)
    (Path(FLAGS.results_dir) / f"{FLAGS.name}.md").write_text(text)
    print(text)
    return rows


def main(argv) -> None:
    del argv
    if FLAGS.mode == "worker":
        worker()
    elif FLAGS.mode == "inside":
        inside()
    elif FLAGS.mode == "report":
        report()
    else:
        netns.require("benchmarks/profiling.py")
        try:
            netns.rerun_inside(__file__, sys.argv[1:])
        except subprocess.CalledProcessError as error:
            # The inner run printed its own error (the failed job and its log)
            # on this stderr: end with one line pointing there, not a traceback.
            raise SystemExit(
                f"benchmarks/profiling.py: the run in the network namespace "
                f"failed with exit code {error.returncode}; its error is "
                "above"
            ) from None
        subprocess.run([sys.executable, __file__] + sys.argv[1:] + ["--mode=report"], check=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
