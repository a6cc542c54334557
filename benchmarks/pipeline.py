"""tfdist's pipeline parallelism beside PyTorch's ``torch.distributed.pipelining``.

The same MLP (``--features`` inputs, ``--layers`` Dense/Linear layers of
``--width``, ReLU, a 10-class head, cross-entropy), cut into 2 stages where
``tfdist.pipeline.balance`` finds their measured costs closest (or at the
middle layer: ``--split=even``), the same cut for both frameworks, the same
batch, micro-batch count and schedule (GPipe, 1F1B, and interleaved
1F1B with ``--chunks`` stages a process: the model cut into ``2 x chunks``
stages, process ``k`` running stages ``k, k + 2, ...``), one process per
pipeline place with one thread each, each process on its own CPU
(``--pin``), on 127.0.0.1: tfdist's stages send
activations over tfdist.transport.p2p (TCP), PyTorch's over gloo. Per run and
process:

- the step time (median over the timed steps after warm-up), and the ratio
  tfdist / PyTorch in the same pair of runs (goal <= 1.2);
- the bubble: each process's idle fraction, 1 - (seconds computing forward
  and backward passes) / (the schedule's window: from the step's first
  forward to its last backward, over both processes, on the host's monotonic
  clock), against the theory (p - 1) / (v m + p - 1) (v = 1 but for
  interleaved), and against the schedule replayed with the measured pass
  times (tfdist.pipeline.trace.replay: unequal stages leave more idle than
  the formula). tfdist's spans come from its StageRunner's Trace, which also
  times the sends (making bytes and posting them to the sender thread) and
  the waits; PyTorch's passes are timed with module hooks. The optimizer
  step comes after the window;
- the peak resident memory of the steps (warm-up included) above the
  resident set before them (``/proc/self/clear_refs``): GPipe keeps every
  micro-batch's activations, 1F1B at most p - s.

Usage::

    flock /tmp/tfdist-mp.lock python benchmarks/pipeline.py
    python benchmarks/pipeline.py --microbatches=2,4,8 --pairs=2

Needs PyTorch (``pip install -e .[bench]``). Results:
``benchmarks/results/pipeline.{json,md}``.
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
sys.path.insert(0, str(HERE))  # For benchlib, the benchmarks' shared pieces.
from benchlib import jobs, results as results_lib  # noqa: E402
from benchlib.machine import peak_over  # noqa: E402

REPO = HERE.parent
RESULTS = HERE / "results"
FRAMEWORKS = ("tfdist", "torch")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: The flags every worker of a run takes from the main process.
SHAPE = ("features", "layers", "width", "batch", "steps", "warmup", "chunks", "pin")
STAGES = 2
CLASSES = 10
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode", "all", ["all", "worker", "report"], "all: measure; worker: one stage."
    )
    flags.DEFINE_integer(
        "features", 64, "Input features (a real model begins with a small input or an embedding)."
    )
    flags.DEFINE_integer("layers", 9, "Hidden layers (the first from the input features).")
    flags.DEFINE_integer("width", 1024, "Hidden width.")
    flags.DEFINE_enum(
        "split",
        "time",
        ["time", "even"],
        "Where the stages begin: by tfdist.pipeline.balance's measured times, or the "
        "same number of hidden layers each.",
    )
    flags.DEFINE_integer("batch", 256, "Global batch.")
    flags.DEFINE_list("microbatches", ["2", "4", "8"], "Micro-batch counts.")
    flags.DEFINE_list("schedules", list(SCHEDULES), "Schedules.")
    flags.DEFINE_integer("steps", 12, "Timed steps per run.")
    flags.DEFINE_integer("warmup", 3, "Steps before the timed ones.")
    flags.DEFINE_integer("chunks", 2, "Stages a process with the interleaved schedule.")
    flags.DEFINE_integer("pairs", 1, "(tfdist, torch) pairs of runs per setting, ABBA order.")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "pipeline", "Base name of the result files.")
    flags.DEFINE_multi_string("note", [], "A note for the report (repeatable).")
    # One worker of a run.
    flags.DEFINE_enum("framework", "tfdist", list(FRAMEWORKS), "Worker: the framework.")
    flags.DEFINE_enum("schedule", "1f1b", list(SCHEDULES), "Worker: the schedule.")
    flags.DEFINE_integer("m", 4, "Worker: micro-batches.")
    flags.DEFINE_bool(
        "pin", True, "Each process on its own CPU (as each stage has its own accelerator)."
    )
    flags.DEFINE_list(
        "cuts", [], "Worker: the hidden layer each stage after the first begins with."
    )
    flags.DEFINE_string("out", None, "Worker: where it writes its JSON.")


def theory(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction in theory: (p - 1) / (v m + p - 1)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def chunks_of(schedule: str) -> int:
    """Stages a process runs with ``schedule``."""
    return FLAGS.chunks if schedule == "interleaved" else 1


def keras_model():
    """The benchmark's model in Keras: hidden layers ``h0``, ``h1``, ... and
    a ``head`` (PyTorch's is built alike)."""
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((FLAGS.features,))]
    layers += [
        keras.layers.Dense(FLAGS.width, activation="relu", name=f"h{i}")
        for i in range(FLAGS.layers)
    ]
    return keras.Sequential([*layers, keras.layers.Dense(CLASSES, name="head")])


def _cuts(schedule: str) -> list[int]:
    """The hidden layer each stage after the first begins with: ``--cuts``,
    or the same number of layers each."""
    if FLAGS.cuts:
        return [int(c) for c in FLAGS.cuts]
    total = STAGES * chunks_of(schedule)
    return [FLAGS.layers * k // total for k in range(1, total)]


def balanced_cuts(schedule: str, m: int) -> tuple[list[int], list[float]]:
    """``tfdist.pipeline.balance``'s cuts for the run's stages, timed on one
    micro-batch with one thread (as the workers run), and the stages' costs."""
    import tensorflow as tf

    from tfdist.pipeline import balance

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    x, y = _data()
    rows = FLAGS.batch // m
    found = balance(
        keras_model(),
        STAGES * chunks_of(schedule),
        x=x[:rows],
        y=y[:rows],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        repeats=5,
    )
    cuts = [FLAGS.layers if p == "head" else int(p[1:]) for p in found.split_points]
    return cuts, list(found.costs)


def _task() -> tuple[int, list[str]]:
    config = json.loads(os.environ["TF_CONFIG"])
    return int(config["task"]["index"]), list(config["cluster"]["worker"])


def _data(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((FLAGS.batch, FLAGS.features)).astype("float32")
    y = rng.integers(0, CLASSES, FLAGS.batch).astype("int64")
    return x, y


def _measure(step_fn, spans_fn) -> dict:
    """Warm-up, then the timed steps; the peak memory counts from before the
    first step (allocators keep what the warm-up took). ``spans_fn()``: the
    spans recorded so far, ``(kind, step, start, end)``."""
    times = []

    def run() -> None:
        for step in range(FLAGS.warmup):
            step_fn(step)
        for step in range(FLAGS.warmup, FLAGS.warmup + FLAGS.steps):
            started = time.perf_counter()
            step_fn(step)
            times.append(time.perf_counter() - started)

    _, rss_kb, peak_kb, _ = peak_over(run)
    return {
        "step_s": statistics.median(times),
        "peak_mb": (peak_kb - rss_kb) / 1024,
        "rss_mb": rss_kb / 1024,
        "spans": [list(s) for s in spans_fn() if s[1] >= FLAGS.warmup],
    }


def tfdist_worker() -> dict:
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfdist.pipeline import split_model
    from tfdist.pipeline.runtime import StageRunner
    from tfdist.pipeline.trace import Trace
    from tfdist.transport.p2p import connect_peers

    stage, addresses = _task()
    v = chunks_of(FLAGS.schedule)
    stages = split_model(keras_model(), [f"h{c}" for c in _cuts(FLAGS.schedule)])
    links = connect_peers(stage, addresses, {1 - stage}, timeout=120, recv_timeout=300)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    own = [stages[stage + c * STAGES] for c in range(v)]
    runner = StageRunner(
        own, STAGES * v, links, FLAGS.schedule, FLAGS.m, loss, keras.optimizers.SGD(0.01)
    )
    runner.trace = Trace()
    x, y = _data()
    result = _measure(
        lambda step: runner.train_step(step, [x], y),
        lambda: [(s.kind, s.step, s.start, s.end, list(s.message)) for s in runner.trace.spans],
    )
    result["peak_in_flight"] = runner.peak_in_flight
    runner.close()
    return result


def torch_worker() -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    torch.set_num_threads(1)
    stage, addresses = _task()
    port = int(addresses[0].rsplit(":", 1)[1])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage, world_size=STAGES
    )
    torch.manual_seed(0)
    widths = [FLAGS.features] + [FLAGS.width] * FLAGS.layers
    mods: list = []
    for a, b in zip(widths, widths[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(FLAGS.width, CLASSES))
    # Stage g holds the Linear+ReLU pairs from its cut to the next; the
    # last also the head (the same cut as tfdist's split points).
    v = chunks_of(FLAGS.schedule)
    total, bounds = STAGES * v, [0, *_cuts(FLAGS.schedule), FLAGS.layers]

    def part(g: int):
        end = 2 * bounds[g + 1] if g < total - 1 else len(mods)
        return torch.nn.Sequential(*mods[2 * bounds[g] : end])

    spans: list = []
    now = [0]  # The step, for the spans' tags.
    parts = [part(stage + c * STAGES) for c in range(v)]
    for module in parts:
        _time_passes(module, spans, now)
    pipe_stages = [
        PipelineStage(module, stage + c * STAGES, total, torch.device("cpu"))
        for c, module in enumerate(parts)
    ]
    loss_fn = torch.nn.CrossEntropyLoss()
    if FLAGS.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=FLAGS.m, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if FLAGS.schedule == "gpipe" else Schedule1F1B
        schedule = kind(pipe_stages[0], n_microbatches=FLAGS.m, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([w for module in parts for w in module.parameters()], lr=0.01)
    x, y = (torch.from_numpy(a) for a in _data())

    def step(number: int) -> None:
        now[0] = number
        optimizer.zero_grad()
        if stage == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()

    result = _measure(step, lambda: spans)
    dist.destroy_process_group()
    return result


def _time_passes(module, spans: list, step: list) -> None:
    """Appends each forward's and backward's span to ``spans`` (tagged with
    ``step[0]``): a forward from the module's pre-hook to its hook; a
    backward from the moment the gradient of its output arrives to the moment
    its first layer's weight gradient is made (the last one its backward
    computes)."""
    marks: dict[str, float] = {}

    def begin(name: str) -> None:
        marks[name] = time.perf_counter()

    def end(name: str) -> None:
        now = time.perf_counter()
        spans.append((name, step[0], marks.pop(name, now), now))

    def forward_done(_, __, output):
        end("F")
        if output.requires_grad:
            output.register_hook(lambda grad: begin("B"))

    module.register_forward_pre_hook(lambda *_: begin("F"))
    module.register_forward_hook(forward_done)
    first = next(iter(module.parameters()))
    first.register_hook(lambda grad: end("B"))


def worker() -> None:
    if FLAGS.pin:
        stage, _ = _task()
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[stage % len(cpus)]})
    result = tfdist_worker() if FLAGS.framework == "tfdist" else torch_worker()
    Path(FLAGS.out).write_text(json.dumps(result))


def run_pair(schedule: str, m: int, cuts: list[int], order: tuple[str, ...], work: Path) -> dict:
    """One run of each framework; returns their workers' results."""
    got = {}
    for framework in order:
        args = [
            f"--framework={framework}",
            f"--schedule={schedule}",
            f"--m={m}",
            f"--cuts={','.join(map(str, cuts))}",
            *(f"--{n}={getattr(FLAGS, n)}" for n in SHAPE),
        ]
        codes, outputs, logs = jobs.worker_job(__file__, args, work, framework, every=True)
        if codes != [0, 0] or None in outputs:
            raise RuntimeError(f"{framework} {schedule} m={m}: codes {codes}\n{logs[-1][-3000:]}")
        got[framework] = outputs
    return got


def markdown(raw: dict) -> str:
    meta = raw["meta"]
    lines = [
        "# Pipeline parallelism: tfdist and PyTorch's pipelining",
        "",
        f"`{meta['command']}` at {meta['when']} ({meta['commit']}); {meta['cpus']} CPUs, "
        f"TensorFlow {meta['tf']}, Keras {meta['keras']}, PyTorch {meta['torch']}; an MLP of "
        f"{meta.get('features', meta['width'])} inputs and {meta['layers']} x {meta['width']} "
        f"in {STAGES} processes, batch {meta['batch']}, {meta['steps']} timed steps after "
        f"{meta['warmup']}, one thread per process"
        + (", each on its own CPU" if meta.get("pin") else "")
        + f"; stages cut {_split_words(meta)}.",
        "",
        "## The bubble",
        "",
        "Idle fraction of the schedule's window (first forward to last backward of a step), "
        "per process (0, 1); medians over the timed steps and runs. *Replayed*: the schedule "
        "with the framework's measured pass times and free transfers; *with delivery*: and "
        "each message taking the measured *delivery* time (from the end of its send span to "
        "the end of a receive that waited for it); *each pass as measured*: each step "
        "replayed with its own passes' times (their jitter) and the delivery "
        "(tfdist.pipeline.trace.replay_step).",
        "",
        "| schedule | m | cuts | balance (ms) | theory | tfdist replayed | with delivery "
        "| each pass as measured | tfdist idle | over theory (points) | of which sends "
        "| of which waits | delivery (ms) | PyTorch replayed | PyTorch idle |",
        "|---|---:|---|---|---:|---|---|---|---|---|---|---|---:|---|---|",
    ]
    pair = lambda values: ", ".join(f"{v:.3f}" for v in values)  # noqa: E731
    for row in raw["rows"]:
        t, p = row["tfdist"], row["torch"]
        over = ", ".join(f"{100 * (v - row['theory']):+.1f}" for v in t["idle"])
        costs = ", ".join(f"{1e3 * c:.1f}" for c in row.get("balance_s", [])) or "-"
        lines.append(
            f"| {_label(row['schedule'], meta)} | {row['m']} "
            f"| {', '.join(map(str, row.get('cuts', []))) or '-'} | {costs} | {row['theory']:.3f} "
            f"| {pair(t['replayed'])} | {pair(t['replayed_sends'])} "
            f"| {pair(t['replayed_each']) if t.get('replayed_each') else '-'} "
            f"| {pair(t['idle'])} | {over} "
            f"| {pair(t['send'])} | {pair(t['wait'])} | {1e3 * t['delivery_s']:.2f} "
            f"| {pair(p['replayed'])} | {pair(p['idle'])} |"
        )
    lines += [
        "",
        "## Step time and memory",
        "",
        "| schedule | m | tfdist step (ms) | PyTorch step (ms) | ratio "
        "| tfdist update (ms) | tfdist peak MB (0, 1) | PyTorch peak MB (0, 1) |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for row in raw["rows"]:
        t, p = row["tfdist"], row["torch"]
        lines.append(
            f"| {_label(row['schedule'], meta)} | {row['m']} | {1e3 * t['step_s']:.1f} "
            f"| {1e3 * p['step_s']:.1f} | {row['ratio']:.2f} "
            f"| {1e3 * t['update_s'][0]:.1f}, {1e3 * t['update_s'][1]:.1f} "
            f"| {t['peak_mb'][0]:.0f}, {t['peak_mb'][1]:.0f} "
            f"| {p['peak_mb'][0]:.0f}, {p['peak_mb'][1]:.0f} |"
        )
    lines += ["", *(f"- {note}" for note in meta.get("notes", []))]
    return "\n".join(lines) + "\n"


def _split_words(meta: dict) -> str:
    if meta.get("split") == "time":
        return (
            "where tfdist.pipeline.balance's measured costs are closest (the *cuts* column: "
            "the hidden layer each stage after the first begins with; *balance*: its costs, ms)"
        )
    return "into the same number of hidden layers each"


def _label(schedule: str, meta: dict) -> str:
    return f"interleaved (v={meta.get('chunks', 2)})" if schedule == "interleaved" else schedule


def _span(fields: list):
    """A span from its JSON list; tfdist's sends and receives name their
    message, PyTorch's spans have none."""
    from tfdist.pipeline.trace import Span

    return Span(*fields[:4], tuple(fields[4]) if len(fields) > 4 else ())


def bubble_of(outs: list[dict], schedule: str, m: int) -> dict:
    """One run's bubble, from its processes' spans: per process, the medians
    over the timed steps of the idle, send and wait fractions of the window
    and of the update's seconds, and the schedule replayed with the run's
    median pass times."""
    from tfdist.pipeline.trace import breakdown, delivery, replay

    spans = [[_span(s) for s in out["spans"]] for out in outs]
    v = chunks_of(schedule)
    numbers = sorted({s.step for s in spans[0]})
    steps = [breakdown(spans, step, v) for step in numbers]
    latency = delivery(spans, numbers) or 0.0

    def median(field: str) -> list[float]:
        return [statistics.median(getattr(b, field)[k] for b in steps) for k in range(len(outs))]

    return {
        **{field: median(field) for field in ("idle", "send", "wait")},
        "update_s": median("update"),
        "forward_s": median("forward"),
        "backward_s": median("backward"),
        "window_s": statistics.median(b.window for b in steps),
        "replayed": list(replay(schedule, m, steps, v).idle),
        # The replay again, each message taking the measured delivery time.
        "delivery_s": latency,
        "replayed_sends": list(replay(schedule, m, steps, v, latency).idle),
        # Each step replayed with its own passes' times and the delivery.
        "replayed_each": _replayed_each(spans, numbers, schedule, m, latency),
    }


def _replayed_each(spans: list, numbers: list[int], schedule: str, m: int, latency: float):
    """Per process, the median over the steps of ``replay_step``'s idle; None
    where the passes were not recorded in the schedule's order (PyTorch's
    interleaved schedule orders them its own way)."""
    from tfdist.errors import ConfigError
    from tfdist.pipeline.trace import replay_step

    try:
        each = [replay_step(schedule, m, spans, n, chunks_of(schedule), latency) for n in numbers]
    except ConfigError:
        return None
    return [statistics.median(t.idle[k] for t in each) for k in range(len(spans))]


def _row(schedule: str, m: int, runs: list[dict]) -> dict:
    row: dict = {"schedule": schedule, "m": m, "theory": theory(STAGES, m, chunks_of(schedule))}
    for framework in FRAMEWORKS:
        outs = [run[framework] for run in runs]
        bubbles = [bubble_of(o, schedule, m) for o in outs]
        row[framework] = {
            "step_s": statistics.median(o[0]["step_s"] for o in outs),
            "peak_mb": [statistics.median(o[s]["peak_mb"] for o in outs) for s in range(STAGES)],
            **{
                field: [statistics.median(b[field][s] for b in bubbles) for s in range(STAGES)]
                for field in (
                    "idle",
                    "send",
                    "wait",
                    "update_s",
                    "forward_s",
                    "backward_s",
                    "replayed",
                    "replayed_sends",
                )
            },
            "delivery_s": statistics.median(b["delivery_s"] for b in bubbles),
            "replayed_each": None
            if any(b["replayed_each"] is None for b in bubbles)
            else [statistics.median(b["replayed_each"][s] for b in bubbles) for s in range(STAGES)],
        }
    ratios = [run["tfdist"][0]["step_s"] / run["torch"][0]["step_s"] for run in runs]
    row["ratio"] = statistics.median(ratios)
    row["ratios"] = ratios
    return row


def main(argv) -> None:
    del argv
    if FLAGS.mode == "worker":
        worker()
        return
    results = Path(FLAGS.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    if FLAGS.mode == "report":
        print(results_lib.rewrite_report(results / f"{FLAGS.name}.json", FLAGS.note, markdown))
        return
    import torch

    meta = {
        **results_lib.header("pipeline.py"),
        "torch": torch.__version__,
        **{n: getattr(FLAGS, n) for n in (*SHAPE, "pairs", "split")},
        "notes": list(FLAGS.note),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfdist-bench-pipeline-") as work:
        for schedule in FLAGS.schedules:
            for m in (int(v) for v in FLAGS.microbatches):
                even = (_cuts(schedule), [])
                cuts, costs = balanced_cuts(schedule, m) if FLAGS.split == "time" else even
                runs = [
                    run_pair(schedule, m, cuts, jobs.pair_order(FRAMEWORKS, i), Path(work))
                    for i in range(FLAGS.pairs)
                ]
                rows.append({**_row(schedule, m, runs), "cuts": cuts, "balance_s": costs})
                print(json.dumps(rows[-1]), flush=True)
    meta["load_after"] = os.getloadavg()[0]
    results_lib.write(results, FLAGS.name, {"meta": meta, "rows": rows}, markdown)


if __name__ == "__main__":
    define_flags()
    app.run(main)
