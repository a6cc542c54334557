"""Slow-network benchmark: tfdist's compression against PyTorch DDP on a throttled link.

One command, as root::

    python benchmarks/slow_network.py            # the recorded run (about 21 min)
    python benchmarks/slow_network.py --quick    # a few minutes, a smaller model
    python benchmarks/slow_network.py --mode=report   # tables and plot again from the JSON

It re-runs itself under ``unshare -n``: a private network namespace whose
only interface is a loopback, so multi-worker jobs on 127.0.0.1 see a real
link. After the unthrottled phase it sets the loopback's MTU to 1500 (like
Ethernet), and ``tc qdisc ... tbf`` limits that loopback to
each rate of ``--bandwidths`` in turn (the limit is shared by all the
workers' traffic, like one shared medium). The namespace dies with the
``unshare`` process; nothing outside it is touched. It needs root, iproute2
and tc, and PyTorch for the DDP rows (``pip install -e .[bench]``).

Every job trains the same MLP (256-2048-2048-512-10, 5.8M parameters, the
same initial weights in both frameworks), batch 32 per worker, SGD with
momentum, on the same synthetic data (each worker its own slice of every
global batch), one intra-op thread per worker (and one inter-op thread in
TensorFlow):

* tfdist (Keras 3 ``fit`` under tfdist's MultiWorkerMirroredStrategy):
  fp32 (no compression: Keras's own all-reduce), bf16 (in one all-reduce
  pack, and in packs through ``bytes_per_pack``), PowerSGD rank 4, top-k 1%
  (both with error feedback), PowerSGD with its warm-up steps sent as
  bfloat16, and ``compression="auto"``;
* PyTorch DDP (gloo, one 64 MB bucket): dense, its fp16 compress hook and
  its PowerSGD hook at rank 4.

Phases:

1. **Accuracy** (2 workers, no rate limit): every configuration trains
   ``--acc_steps`` steps, evaluating held-out accuracy every
   ``--eval_every`` steps; PowerSGD (both) uses 10 dense warm-up steps. This
   gives the steps each needs to reach ``--target`` accuracy, and the
   seconds per step on the unthrottled loopback.
2. **Speed** (each bandwidth, 2 and 4 workers): a few steps per
   configuration, timed after the first ones (PowerSGD's warm-up is cut to
   2 steps here, in both frameworks).

Time to target = steps to target (phase 1: the arithmetic does not depend
on the link) x seconds per step measured on that link (phase 2), with
PowerSGD's 10 warm-up steps counted at the dense rate of its framework on
that link (tfdist bf16's rate for a bfloat16 warm-up). For ``auto`` it is
the steps of the configuration it chose on that link. Ratios compare runs
of the same invocation; absolute times drift on shared machines, so the
load is recorded.

Results: ``benchmarks/results/slow_network.{json,md,png}``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from absl import app, flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

TF_CONFIGS = ["tf/fp32", "tf/bf16", "tf/bf16+packs", "tf/powersgd:4", "tf/powersgd:4+bf16warm",
              "tf/topk:0.01", "tf/auto"]
DDP_CONFIGS = ["ddp/dense", "ddp/fp16", "ddp/powersgd:4"]
#: Interleaved, so that drift in the machine's load hits both frameworks.
CONFIGS = ["tf/fp32", "ddp/dense", "tf/bf16", "ddp/fp16", "tf/bf16+packs", "tf/powersgd:4",
           "ddp/powersgd:4", "tf/powersgd:4+bf16warm", "tf/topk:0.01", "tf/auto"]
#: Fewer configurations with 4 workers, to keep the benchmark within about
#: 25 minutes on a 2-core machine (4 TensorFlow workers take most of a
#: minute to start there): no top-k (slowest to compute, never best here) and
#: no DDP dense (the same bytes as tfdist fp32, shown equal with 2 workers);
#: on fast links only what the goals need.
CONFIGS4 = ["tf/fp32", "tf/bf16", "ddp/fp16", "tf/powersgd:4", "ddp/powersgd:4", "tf/auto"]
CONFIGS4_FAST = ["tf/fp32", "tf/powersgd:4", "ddp/powersgd:4", "tf/auto"]
#: The accuracy phase leaves out auto (it trains like the configuration it
#: picks; it gets a speed run on the unthrottled link instead) and packs
#: (the same sums as one all-reduce).
ACC_CONFIGS = [c for c in CONFIGS if c != "tf/auto" and not c.endswith("+packs")]
LABELS = {
    "tf/fp32": "tfdist fp32 (Keras all-reduce)", "tf/bf16": "tfdist bf16",
    "tf/bf16+packs": "tfdist bf16, packed all-reduce",
    "tf/powersgd:4": "tfdist PowerSGD r4", "tf/topk:0.01": "tfdist top-k 1%",
    "tf/powersgd:4+bf16warm": "tfdist PowerSGD r4, bf16 warm-up",
    "tf/auto": "tfdist auto", "ddp/dense": "DDP dense", "ddp/fp16": "DDP fp16 hook",
    "ddp/powersgd:4": "DDP PowerSGD r4",
}
#: Repeated with 2 workers (``--repeats``): the comparisons the goals make
#: between close figures.
REPEAT_CONFIGS = ["tf/bf16", "ddp/fp16", "tf/bf16+packs", "tf/powersgd:4", "ddp/powersgd:4",
                  "tf/auto"]
#: PowerSGD's dense warm-up steps in the accuracy runs (tfdist's default).
ACC_WARMUP = 10
#: Warm-up steps in the speed runs (PyTorch needs at least 2 with error feedback).
SPEED_WARMUP = 2
NO_LIMIT = "none"

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("mode", "all", ["all", "inside", "report", "tf_worker", "torch_worker"],
                      "all: run in a new namespace, then report. The others are internal "
                      "(inside the namespace; one worker) or redo the report.")
    flags.DEFINE_bool("quick", False, "A small model and few steps (about 4 minutes).")
    flags.DEFINE_list("bandwidths", ["100mbit", "1gbit"], "tc tbf rates to run at.")
    flags.DEFINE_list("workers", ["2", "4"], "Worker counts of the speed runs.")
    flags.DEFINE_list("configs", CONFIGS, "Configurations of the 2-worker speed runs.")
    flags.DEFINE_list("acc_configs", ACC_CONFIGS, "Configurations of the accuracy runs.")
    flags.DEFINE_list("nolimit_configs", ["tf/auto", "tf/bf16+packs"],
                      "Speed runs (2 workers) on the unthrottled link.")
    flags.DEFINE_list("configs4", CONFIGS4, "Configurations with more than 2 workers, "
                      "below 500 Mbit/s.")
    flags.DEFINE_list("configs4_fast", CONFIGS4_FAST, "Configurations with more than 2 "
                      "workers at 500 Mbit/s and above.")
    flags.DEFINE_list("layers", ["256", "2048", "2048", "512", "10"], "MLP widths.")
    flags.DEFINE_integer("batch", 32, "Batch per worker.")
    flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate (momentum 0.9).")
    flags.DEFINE_float("target", 0.55, "Held-out accuracy to reach.")
    flags.DEFINE_integer("acc_steps", 240, "Steps of the accuracy runs.")
    flags.DEFINE_integer("eval_every", 20, "Evaluate every this many steps (accuracy runs).")
    flags.DEFINE_integer("test_examples", 1024, "Held-out examples.")
    flags.DEFINE_integer("slow_steps", 6, "Timed steps below 500 Mbit/s (dense, bf16, fp16).")
    flags.DEFINE_integer("compressed_steps", 16, "Timed steps below 500 Mbit/s of PowerSGD, "
                         "top-k and auto (fast there, and noisier).")
    flags.DEFINE_integer("fast_steps", 8, "Timed steps at 500 Mbit/s and above.")
    flags.DEFINE_integer("threads", 1, "Intra-op threads per worker (both frameworks), and "
                         "TensorFlow's inter-op threads.")
    flags.DEFINE_bool("accuracy", True, "Run the accuracy phase.")
    flags.DEFINE_integer("repeats", 2, "Runs of each --repeat_configs with 2 workers per "
                         "link, interleaved; their timed steps are pooled.")
    flags.DEFINE_list("repeat_configs", REPEAT_CONFIGS, "The configurations repeated.")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "slow_network", "Base name of the result files.")
    # One worker (internal).
    flags.DEFINE_string("config", None, "One configuration (worker modes).")
    flags.DEFINE_integer("steps", 10, "Steps to train (worker modes).")
    flags.DEFINE_integer("warmup", ACC_WARMUP, "PowerSGD warm-up steps (worker modes).")
    flags.DEFINE_integer("world", 2, "Workers (worker modes).")
    flags.DEFINE_integer("rank", 0, "This worker (torch worker).")
    flags.DEFINE_integer("port", 0, "Rendezvous port (torch worker).")
    flags.DEFINE_integer("evals", 0, "Evaluate every this many steps; 0: never (worker modes).")
    flags.DEFINE_string("out", None, "Write the worker's JSON here.")
    flags.DEFINE_integer("seed", 0, "Seed of PowerSGD's initial Q, in both frameworks.")


# ---------------------------------------------------------------- pure pieces

def parse_rate(text: str) -> float:
    """Bits per second of a tc rate such as ``100mbit`` or ``1gbit``; inf for ``none``."""
    text = text.strip().lower()
    if text == NO_LIMIT:
        return math.inf
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * scale
    raise ValueError(f"Expected a rate like '100mbit' or '1gbit'. Received: {text!r}")


def tc_command(rate: str) -> list[str]:
    """The tc command that limits the namespace's loopback to ``rate``."""
    parse_rate(rate)
    return ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "200ms"]


def mlp_shapes(layers: Sequence[int]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of an MLP's kernels and biases, in Keras's order."""
    shapes = []
    for a, b in zip(layers[:-1], layers[1:]):
        shapes += [((a, b), "float32"), ((b,), "float32")]
    return shapes


def param_count(layers: Sequence[int]) -> int:
    """Parameters of an MLP with these widths."""
    return sum(math.prod(s) for s, _ in mlp_shapes(layers))


def initial_weights(layers: Sequence[int], seed: int = 1) -> list:
    """Glorot-uniform kernels and zero biases (numpy), the same in both frameworks."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for a, b in zip(layers[:-1], layers[1:]):
        limit = math.sqrt(6.0 / (a + b))
        out += [rng.uniform(-limit, limit, size=(a, b)).astype("float32"),
                np.zeros(b, "float32")]
    return out


def make_data(examples: int, test_examples: int, features: int, classes: int, seed: int = 0):
    """Synthetic data labelled by a random 2-layer teacher (64 tanh units)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(features, 64)) / math.sqrt(features)
    w2 = rng.normal(size=(64, classes))
    x = rng.normal(size=(examples + test_examples, features)).astype("float32")
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype("int64")
    return (x[:examples], y[:examples]), (x[examples:], y[examples:])


def worker_slice(x, y, rank: int, world: int, batch: int):
    """This worker's rows: for each global batch of ``world * batch`` rows, its ``batch``."""
    steps = len(x) // (world * batch)
    idx = (steps * world * batch)
    xs = x[:idx].reshape(steps, world, batch, -1)[:, rank].reshape(steps * batch, -1)
    ys = y[:idx].reshape(steps, world, batch)[:, rank].reshape(-1)
    return xs, ys


def accuracy(weights: Sequence[Any], x, y) -> float:
    """Held-out accuracy of the MLP (ReLU between layers) with numpy weights."""
    import numpy as np
    h = x
    for i in range(0, len(weights), 2):
        h = h @ weights[i] + weights[i + 1]
        if i + 2 < len(weights):
            h = np.maximum(h, 0)
    return float(np.mean(np.argmax(h, axis=1) == y))


def steps_to_target(evals: Sequence[Sequence[float]], target: float) -> int | None:
    """The first evaluated step whose accuracy reaches ``target``; None if none does.

    Args:
        evals: ``(step, accuracy, ...)`` in step order.
        target: The accuracy to reach.
    """
    for row in evals:
        if row[1] >= target:
            return int(row[0])
    return None


def median_step(times: Sequence[float], skip: int) -> float:
    """Median of the step times after the first ``skip`` (tracing, warm-up)."""
    kept = list(times[skip:])
    if not kept:
        raise ValueError(f"Expected more than {skip} step times. Received: {len(times)}")
    return statistics.median(kept)


def speed_skip(config: str) -> int:
    """Untimed first steps of a speed run: the traced first step, and for
    PowerSGD (and auto, which may choose it) its dense warm-up steps."""
    return SPEED_WARMUP + 1 if ("powersgd" in config or config.endswith("/auto")) else 1


def timed_steps(config: str, rate: str, slow: int, compressed: int, fast: int) -> int:
    """Timed steps of a speed run: few for dense payloads on a slow link."""
    if parse_rate(rate) >= 5e8:
        return fast
    return compressed if any(k in config for k in ("powersgd", "topk", "auto")) else slow


def time_to_target(steps: int | None, step_s: float, *, warmup: int = 0,
                   warmup_s: float | None = None) -> float | None:
    """Seconds of training to reach the target: warm-up steps at the dense
    rate, the rest at the configuration's own rate. None if never reached."""
    if steps is None:
        return None
    dense = min(steps, warmup)
    return dense * (step_s if warmup_s is None else warmup_s) + (steps - dense) * step_s


def failure_reason(log_tail: str) -> str:
    """The telling line of a failed job's log: an error or abort message."""
    keys = ("what():", "Error:", "terminate called", "Aborted", "exit codes")
    for key in keys:  # In order of how much they tell.
        for line in log_tail.splitlines():
            if key in line:
                return line.strip()[:200]
    lines = [line for line in log_tail.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else "no output"


def final_accuracy(evals: Sequence[Sequence[float]]) -> float:
    """Mean held-out accuracy of the last 3 evaluations: one evaluation is
    noisy (momentum 0.9)."""
    return statistics.mean(e[1] for e in evals[-3:])


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, spec: str = ".3f", missing: str = "—") -> str:
    """Formats a number, or a dash for a missing one."""
    return missing if value is None else format(value, spec)


def link_name(rate: str) -> str:
    """``100mbit`` -> ``100 Mbit/s``; ``none`` -> ``no limit``."""
    if rate == NO_LIMIT:
        return "no limit"
    bits = parse_rate(rate)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def load_snapshot() -> dict:
    """The load averages and the busiest processes, as ``uptime``/``ps`` show them."""
    snap: dict[str, Any] = {"time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        snap["loadavg"] = [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        snap["loadavg"] = None
    try:
        ps = subprocess.run(["ps", "-eo", "pcpu,pid,comm", "--sort=-pcpu"], capture_output=True,
                            text=True, timeout=10).stdout.splitlines()[1:6]
        snap["top"] = [" ".join(line.split()) for line in ps]
    except (OSError, subprocess.SubprocessError):
        snap["top"] = []
    return snap


# ---------------------------------------------------------------- summary

def _run_index(runs: list[dict]) -> dict:
    return {(r["config"], r["workers"], r["link"]): r for r in runs}


def summarize(raw: dict) -> dict:
    """Per-configuration figures and the goals, from the raw runs of one invocation."""
    meta, runs = raw["meta"], raw["runs"]
    target = meta["target"]
    index = _run_index(runs)
    links = [NO_LIMIT] + list(meta["bandwidths"])
    workers = sorted({r["workers"] for r in runs})
    acc = {r["config"]: r for r in runs if r["phase"] == "accuracy"}

    def steps_of(config: str, link: str, n: int) -> int | None:
        if n != 2:
            return None
        if config == "tf/auto":
            run = index.get((config, n, link))
            chosen = _auto_choice(run) if run else None
            config = {"none": "tf/fp32"}.get(chosen, f"tf/{chosen}") if chosen else config
            if run and bf16_warmup("tf/auto", run) and config.startswith("tf/powersgd"):
                config += "+bf16warm"  # Trains like the fixed configuration with it.
        run = acc.get(config.removesuffix("+packs"))
        return steps_to_target(run["evals"], target) if run else None

    rows = []
    for (config, n, link), run in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        rows.append({"config": config, "workers": n, "link": link,
                     "step_s": run["step_s"], "auto": _auto_choice(run),
                     "bf16_warmup": bf16_warmup(config, run)})
    cells: dict = {}
    for row in rows:
        cells[(row["config"], row["workers"], row["link"])] = row
    for row in rows:
        config, n, link = row["config"], row["workers"], row["link"]
        steps = steps_of(config, link, n)
        warm = ACC_WARMUP if ("powersgd" in config or (config == "tf/auto"
                                                        and "powersgd" in (row["auto"] or ""))) else 0
        dense_cfg = ("ddp/dense" if config.startswith("ddp/")
                     else "tf/bf16" if row["bf16_warmup"] else "tf/fp32")
        dense = cells.get((dense_cfg, n, link))
        row["steps_to_target"] = steps
        row["time_to_target_s"] = time_to_target(
            steps, row["step_s"], warmup=warm, warmup_s=dense["step_s"] if dense else None)
    goals = _goals(cells, links, workers)
    final = {c: {"final_accuracy": final_accuracy(r["evals"]) if r["evals"] else None,
                 "steps_to_target": steps_to_target(r["evals"], target),
                 "auto": _auto_choice(r)} for c, r in acc.items()}
    return {"meta": meta, "rows": rows, "accuracy": final, "goals": goals,
            "links": links, "workers": workers}


def bf16_warmup(config: str, run: dict | None) -> bool:
    """Whether a configuration's PowerSGD warm-up steps were sent as bfloat16:
    the fixed ``+bf16warm`` one, or ``auto`` when it picked that (its
    strategy's description shows the PowerSGD it chose)."""
    if config.endswith("+bf16warm"):
        return True
    return config == "tf/auto" and "warmup_dtype='bfloat16'" in ((run or {}).get("describe")
                                                               or "")


def _auto_choice(run: dict | None) -> str | None:
    text = (run or {}).get("compression") or ""
    return text.split("->", 1)[1].strip() if "->" in text else None


def _best_fixed(cells: dict, n: int, link: str, key: str) -> tuple[str | None, float | None]:
    best = (None, None)
    for config in TF_CONFIGS:
        if config == "tf/auto":
            continue
        cell = cells.get((config, n, link))
        value = cell and cell.get(key)
        if value is not None and (best[1] is None or value < best[1]):
            best = (config, value)
    return best


def _goals(cells: dict, links: list[str], workers: list[int]) -> list[dict]:
    """The issue's goals, each with the measured ratio and whether it was met."""
    goals = []

    def get(config, n, link, key="step_s"):
        cell = cells.get((config, n, link))
        return None if cell is None else cell.get(key)

    slow = [link for link in links if link != NO_LIMIT and parse_rate(link) <= 1e8]
    for link in slow:
        for n in workers:
            r = ratio(get("tf/fp32", n, link), get("tf/powersgd:4", n, link))
            goals.append({"goal": f"tfdist PowerSGD >= 20x faster per step than TF fp32 "
                                  f"({n} workers, {link_name(link)})",
                          "value": r, "shown": f"{fmt(r, '.1f')}x",
                          "met": None if r is None else r >= 20})
            r = ratio(get("tf/powersgd:4", n, link), get("ddp/powersgd:4", n, link))
            goals.append({"goal": f"tfdist PowerSGD / DDP PowerSGD per step <= 1.0 "
                                  f"({n} workers, {link_name(link)})",
                          "value": r, "shown": fmt(r, ".2f"),
                          "met": None if r is None else r <= 1.0})
            for config in ("tf/bf16", "tf/bf16+packs"):
                r = ratio(get(config, n, link), get("ddp/fp16", n, link))
                if r is None and config != "tf/bf16":
                    continue
                goals.append({"goal": f"{LABELS[config]} / DDP fp16 hook per step <= 1.0 "
                                      f"({n} workers, {link_name(link)})",
                              "value": r, "shown": fmt(r, ".3f"),
                              "met": None if r is None else r <= 1.0})
    for link in links:
        if link == NO_LIMIT:
            continue
        for n in workers:
            for key, what in (("step_s", "per step"), ("time_to_target_s", "to target")):
                best, value = _best_fixed(cells, n, link, key)
                r = ratio(get("tf/auto", n, link, key), value)
                if r is None:
                    continue
                goals.append({"goal": f"auto within 10% of the best fixed choice {what} "
                                      f"({n} workers, {link_name(link)}; best: "
                                      f"{LABELS.get(best, best)})",
                              "value": r, "shown": fmt(r, ".2f"), "met": r <= 1.10})
    return goals


def markdown(summary: dict) -> str:
    """The result tables: seconds per step, time to target, accuracy, goals."""
    meta, links, workers = summary["meta"], summary["links"], summary["workers"]
    cells = {(r["config"], r["workers"], r["link"]): r for r in summary["rows"]}
    columns = [(n, link) for n in workers for link in links
               if any(k[1] == n and k[2] == link for k in cells)]
    configs = [c for c in CONFIGS if any(k[0] == c for k in cells)]
    head = " | ".join(f"{n}w {link_name(link)}" for n, link in columns)
    lines = [f"# Slow network: tfdist vs PyTorch DDP ({meta['params']:,}-parameter MLP)", ""]
    lines += [f"`{meta['command']}` — {meta['when']}, wall time {meta['wall_s'] / 60:.1f} min.",
              "", _conditions(meta), "",
              "## Seconds per step (median)", "",
              f"| configuration | {head} |", "|---|" + "---:|" * len(columns)]
    for c in configs:
        vals = [fmt(cells.get((c, n, link), {}).get("step_s")) for n, link in columns]
        lines.append(f"| {LABELS.get(c, c)} | " + " | ".join(vals) + " |")
    autos = [(n, link, cells[("tf/auto", n, link)]["auto"]) for n, link in columns
             if ("tf/auto", n, link) in cells]
    if autos:
        lines += ["", "`auto` chose: " + "; ".join(
            f"{n}w {link_name(link)} → {choice}" for n, link, choice in autos) + "."]
    two = [link for n, link in columns if n == 2]
    lines += ["", f"## Time to {meta['target']:.0%} held-out accuracy (2 workers, seconds)", "",
              "| configuration | steps to target | final acc.¹ | "
              + " | ".join(link_name(link) for link in two) + " |",
              "|---|---:|---:|" + "---:|" * len(two)]
    for c in configs:
        a = summary["accuracy"].get(c, {})
        steps = a.get("steps_to_target")
        if c.endswith("+packs") and c.removesuffix("+packs") in summary["accuracy"]:
            steps_text = f"as {LABELS[c.removesuffix('+packs')]}"  # The same sums.
        elif c not in summary["accuracy"]:
            steps_text = "those of its choice" if c == "tf/auto" else "not run"
        else:
            steps_text = str(steps) if steps is not None else "not reached"
        vals = [fmt(cells.get((c, 2, link), {}).get("time_to_target_s"), ".1f") for link in two]
        lines.append(f"| {LABELS.get(c, c)} | {steps_text} "
                     f"| {fmt(a.get('final_accuracy'), '.3f')} | " + " | ".join(vals) + " |")
    acc_meta = (f"¹ Mean held-out accuracy of the last 3 evaluations (steps "
                f"{meta['acc_steps'] - 2 * meta['eval_every']}-{meta['acc_steps']}); "
                "the curves are noisy (momentum 0.9), so steps to target vary by about "
                f"±{meta['eval_every']} between configurations that train alike.")
    lines += ["", acc_meta]
    for link in two:
        dense, psgd = cells.get(("tf/fp32", 2, link)), cells.get(("tf/powersgd:4", 2, link))
        if dense and psgd and psgd.get("time_to_target_s") and link != NO_LIMIT:
            warm = ACC_WARMUP * dense["step_s"]
            lines += ["", f"At {link_name(link)}, PowerSGD's {ACC_WARMUP} dense warm-up steps "
                      f"(tfdist's default; DDP's `start_powerSGD_iter` here) take {warm:.1f} s "
                      f"of its {psgd['time_to_target_s']:.1f} s to target; top-k has no "
                      "warm-up."]
            half = cells.get(("tf/bf16", 2, link))
            psgd16 = cells.get(("tf/powersgd:4+bf16warm", 2, link))
            if half and psgd16 and psgd16.get("time_to_target_s"):
                lines[-1] += (f" Sent as bfloat16 (what `auto` picks where bf16 pays), they "
                              f"take {ACC_WARMUP * half['step_s']:.1f} s of "
                              f"{psgd16['time_to_target_s']:.1f} s.")
    lines += ["", "## Where compression pays", "",
              "Fastest configuration per framework (seconds per step), and its speed-up over "
              "the same framework without compression:", "",
              "| workers, link | tfdist best | × vs tfdist fp32 | DDP best | × vs DDP dense |",
              "|---|---|---:|---|---:|"]
    for n, link in columns:
        row = [f"{n}w {link_name(link)}"]
        for prefix, dense in (("tf/", "tf/fp32"), ("ddp/", "ddp/dense")):
            have = {c: cells[(c, m, k)]["step_s"] for (c, m, k) in cells
                    if m == n and k == link and c.startswith(prefix) and c != "tf/auto"}
            if not have:
                row += ["—", "—"]
                continue
            best = min(have, key=have.get)
            row += [LABELS.get(best, best), fmt(ratio(have.get(dense), have[best]), ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Within one process (Mirrored over logical CPUs, where the \"link\" is a "
              "memory copy) compression only costs time: see `compression.md`."]
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---:|:---:|"]
    for g in summary["goals"]:
        met = {True: "yes", False: "**no**", None: "—"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['shown']} | {met} |")
    failures = meta.get("failures") or []
    if failures:
        lines += ["", "## Failed attempts", "",
                  "Each job gets a second attempt; these failed (the table uses the second "
                  "attempt where it succeeded):", ""]
        for f in failures:
            lines.append(f"- {f['config']}, {f['workers']} workers, {link_name(f['link'])}, "
                         f"attempt {f['attempt']}: {failure_reason(f['error'])}")
    lines += ["", "## How", "", _method(meta)]
    return "\n".join(lines) + "\n"


def _conditions(meta: dict) -> str:
    loads = [s.get("loadavg") for s in meta.get("load", []) if s.get("loadavg")]
    load = ", ".join(f"{s[0]:.1f}" for s in loads)
    return (f"Machine: {meta['cpus']} cores, no GPU; TensorFlow {meta.get('tf_version')}, "
            f"Keras {meta.get('keras_version')}, PyTorch {meta.get('torch_version')}. "
            f"1-minute load average sampled before, between phases and after: {load}. "
            f"{meta.get('note', '')}").strip()


def _method(meta: dict) -> str:
    return (
        f"MLP {'-'.join(map(str, meta['layers']))}, batch {meta['batch']} per worker, SGD "
        f"lr {meta['learning_rate']} momentum 0.9, the same initial weights and data order "
        f"in both frameworks, {meta['threads']} intra-op thread per worker (and "
        f"{meta['threads']} inter-op thread in TensorFlow). Each link is the "
        "loopback of a private network namespace (`unshare -n`, MTU 1500) limited by "
        "`tc qdisc replace dev lo root tbf rate R burst 256kb latency 200ms`; the limit is "
        "shared by all workers' traffic. \"no limit\" is the same loopback without tbf, "
        "with its usual MTU of 65536 (the fastest link this machine has between "
        "processes).\n\n"
        f"Seconds per step: median of {meta['slow_steps']} (dense, bf16, fp16) or "
        f"{meta.get('compressed_steps')} (PowerSGD, top-k, auto) steps at 100 Mbit/s and of "
        f"{meta['fast_steps']} steps on faster links, after the first (tracing) and, for "
        f"PowerSGD and auto, {SPEED_WARMUP} more: PowerSGD's warm-up, cut to "
        f"{SPEED_WARMUP} steps in these runs in both frameworks. With 2 workers, "
        + ", ".join(meta.get("repeat_configs") or []) + f" ran {meta.get('repeats', 1)} times "
        "per link, interleaved, and their timed steps are pooled. With no limit, the median "
        f"over the {meta['acc_steps']}-step accuracy run after PowerSGD's {ACC_WARMUP} "
        "warm-up steps.\n\n"
        f"Time to target: steps to reach {meta['target']:.0%} on {meta['test_examples']} "
        f"held-out examples (evaluated every {meta['eval_every']} steps in the accuracy run, "
        f"which uses {ACC_WARMUP} dense PowerSGD warm-up steps in both frameworks) × that "
        "link's seconds per step, the warm-up steps at the dense rate of the same framework "
        "(at tfdist bf16's rate for a bfloat16 warm-up). "
        "The accuracy runs are on the unthrottled loopback; the arithmetic of a synchronous "
        "step does not depend on the link. `auto` counts the steps of the configuration it "
        "chose on that link. Start-up and tracing are not counted.\n\n"
        "tfdist fp32 is tfdist's MultiWorkerMirroredStrategy without compression, i.e. "
        "Keras's own all-reduce (TensorFlow's own MultiWorkerMirroredStrategy cannot run "
        "Keras 3 `fit` multi-worker: keras-team/keras#20585; "
        "`benchmarks/overhead.py` shows the two cost the same where both run). Every "
        "tfdist configuration all-reduces in one pack (TensorFlow's default) except "
        "\"packed all-reduce\": `strategy_from_config(bytes_per_pack=...)` at an eighth of "
        "the bfloat16 gradients (3 packs of this MLP, last layers first), so that the "
        "transfer overlaps backprop and the optimizer. DDP runs with one 64 MB bucket in "
        "every configuration (its default 25 MB buckets were no faster with the fp16 hook "
        "here: 1.959 against 1.952 s per step at 100 Mbit/s).")


def plot(summary: dict, path: Path) -> None:
    """Seconds per step on each link (log scale), one panel per worker count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {(r["config"], r["workers"], r["link"]): r for r in summary["rows"]}
    workers, links = summary["workers"], summary["links"]
    fig, axes = plt.subplots(1, len(workers), figsize=(6 * len(workers), 4.5), squeeze=False)
    configs = [c for c in CONFIGS if any(k[0] == c for k in cells)]
    for ax, n in zip(axes[0], workers):
        present = [link for link in links if any(k[1] == n and k[2] == link for k in cells)]
        width = 0.8 / max(1, len(configs))
        for i, c in enumerate(configs):
            ys = [cells.get((c, n, link), {}).get("step_s") or float("nan") for link in present]
            xs = [j + (i - len(configs) / 2 + 0.5) * width for j in range(len(present))]
            ax.bar(xs, ys, width, label=LABELS.get(c, c),
                   hatch="//" if c.startswith("ddp/") else None)
        ax.set_xticks(range(len(present)), [link_name(link) for link in present])
        ax.set_yscale("log")
        ax.set_ylabel("seconds per step (log)")
        ax.set_title(f"{n} workers, {summary['meta']['params'] / 1e6:.1f}M-parameter MLP")
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- workers

def pack_bytes(layers: Sequence[int], packs: int = 8) -> int:
    """``bytes_per_pack`` of the ``+packs`` configuration: the bfloat16
    gradients in about ``packs`` packs of at least 1 MiB."""
    return max(1 << 20, -(-2 * param_count(layers) // packs))


def _tf_compression(config: str, warmup: int):
    from tfdist.compression import AutoCompression, PowerSGD
    name = config.split("/", 1)[1].removesuffix("+packs")
    if name == "fp32":
        return None
    if name.startswith("powersgd"):
        rank, _, warm = name.split(":")[1].partition("+")
        return PowerSGD(int(rank), warmup_steps=warmup, seed=FLAGS.seed,
                        warmup_dtype="bfloat16" if warm == "bf16warm" else "float32")
    if name == "auto":
        if warmup == ACC_WARMUP:
            return "auto"  # The default candidates (PowerSGD with 10 warm-up steps).
        # The default candidates, with PowerSGD's warm-up steps of this run
        # (auto still picks their precision).
        return AutoCompression(candidates=("none", "bf16", PowerSGD(4, warmup_steps=warmup)))
    return name


def _data(rank: int, world: int):
    layers = [int(w) for w in FLAGS.layers]
    (x, y), (xt, yt) = make_data(FLAGS.steps * world * FLAGS.batch, FLAGS.test_examples,
                                 layers[0], layers[-1])
    xs, ys = worker_slice(x, y, rank, world, FLAGS.batch)
    return layers, xs, ys, xt, yt


def tf_worker() -> None:
    """One worker of a tfdist job (TF_CONFIG in the environment)."""
    import tensorflow as tf
    if FLAGS.threads:
        # A core's worth of threads per worker in both frameworks: PyTorch
        # runs its ops one at a time on the calling thread, so TensorFlow
        # gets one inter-op thread (its default, one per core, makes the
        # workers of one machine fight for the cores: 10% slower steps).
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
        tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    import keras

    import tfdist

    # "+packs": the all-reduce in several packs (TensorFlow's
    # bytes_per_pack), last layers first, so that it overlaps backprop and
    # the optimizer; one pack otherwise (TensorFlow's default).
    packs = FLAGS.config.endswith("+packs")
    strategy = tfdist.strategy_from_config(
        compression=_tf_compression(FLAGS.config, FLAGS.warmup), register_timeout=300,
        bytes_per_pack=pack_bytes([int(w) for w in FLAGS.layers]) if packs else 0)
    rank = strategy.cluster_resolver.task_id
    layers, xs, ys, xt, yt = _data(rank, FLAGS.world)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((layers[0],))]
            + [keras.layers.Dense(w, activation="relu") for w in layers[1:-1]]
            + [keras.layers.Dense(layers[-1])])
        model.set_weights(initial_weights(layers))
        model.compile(optimizer=keras.optimizers.SGD(FLAGS.learning_rate, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def dataset(ctx):
        data = tf.data.Dataset.from_tensor_slices((xs, ys.astype("int32")))
        return data.batch(FLAGS.batch, drop_remainder=True).prefetch(2)

    times: list[float] = []
    evals: list[list[float]] = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)
            if FLAGS.evals and (batch + 1) % FLAGS.evals == 0 and rank == 0:
                evals.append([batch + 1, accuracy(self.model.get_weights(), xt, yt),
                              sum(times)])

    data = strategy.distribute_datasets_from_function(dataset)
    model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0, callbacks=[Record()])
    _write({"step_times": times, "evals": evals, "compression": str(strategy.compression),
            "describe": strategy.describe(), "params": model.count_params(), "rank": rank})


def torch_worker() -> None:
    """One rank of a PyTorch DDP job (gloo)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(1, FLAGS.threads))
    rank, world = FLAGS.rank, FLAGS.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{FLAGS.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    layers, xs, ys, xt, yt = _data(rank, world)
    mods: list = []
    for a, b in zip(layers[:-1], layers[1:]):
        mods += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*mods[:-1])
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    init = initial_weights(layers)
    with torch.no_grad():
        for lin, w, b in zip(linears, init[::2], init[1::2]):
            lin.weight.copy_(torch.from_numpy(w.T.copy()))
            lin.bias.copy_(torch.from_numpy(b))
    # One bucket: PowerSGD with several buckets fails on gloo ("Received data
    # size doesn't match expected size").
    ddp = DistributedDataParallel(model, bucket_cap_mb=64)
    kind = FLAGS.config.split("/", 1)[1]
    calls = [0]
    if kind == "fp16":
        hook, state = default_hooks.fp16_compress_hook, None
    elif kind.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(kind.split(":")[1]),
            start_powerSGD_iter=FLAGS.warmup, min_compression_rate=2,
            use_error_feedback=True, warm_start=True, random_seed=FLAGS.seed)
        hook = powerSGD_hook.powerSGD_hook
    else:
        hook, state = default_hooks.allreduce_hook, None

    def counted(state, bucket):
        calls[0] += 1
        return hook(state, bucket)

    ddp.register_comm_hook(state, counted)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=FLAGS.learning_rate, momentum=0.9)
    xs_t, ys_t = torch.from_numpy(xs), torch.from_numpy(ys)
    times: list[float] = []
    evals: list[list[float]] = []
    for step in range(FLAGS.steps):
        xb = xs_t[step * FLAGS.batch:(step + 1) * FLAGS.batch]
        yb = ys_t[step * FLAGS.batch:(step + 1) * FLAGS.batch]
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if FLAGS.evals and (step + 1) % FLAGS.evals == 0 and rank == 0:
            weights = []
            for lin in linears:
                weights += [lin.weight.detach().numpy().T, lin.bias.detach().numpy()]
            evals.append([step + 1, accuracy(weights, xt, yt), sum(times)])
    _write({"step_times": times, "evals": evals, "compression": kind,
            "buckets_per_step": calls[0] / max(1, FLAGS.steps),
            "params": sum(p.numel() for p in model.parameters()), "rank": rank})
    dist.barrier()
    # gloo sometimes aborts while the interpreter tears its threads down
    # ("terminate called without an active exception"), after the work is
    # done and written: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write(result: dict) -> None:
    Path(FLAGS.out).write_text(json.dumps(result))


# ---------------------------------------------------------------- orchestration

def _worker_flags(config: str, steps: int, warmup: int, evals: int, world: int) -> list[str]:
    return [f"--config={config}", f"--steps={steps}", f"--warmup={warmup}", f"--evals={evals}",
            f"--world={world}", f"--layers={','.join(FLAGS.layers)}", f"--batch={FLAGS.batch}",
            f"--learning_rate={FLAGS.learning_rate}", f"--test_examples={FLAGS.test_examples}",
            f"--threads={FLAGS.threads}", f"--seed={FLAGS.seed}"]


def run_job(config: str, world: int, steps: int, warmup: int, evals: int, work: Path,
            timeout: float = 1200.0) -> dict:
    """Runs one job of ``world`` worker processes; returns rank 0's result."""
    from tfdist import cluster
    from tfdist.net import free_ports, local_spec

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(max(1, FLAGS.threads)))
    env.pop("TF_CONFIG", None)
    base = _worker_flags(config, steps, warmup, evals, world)
    tag = f"{config.replace('/', '_').replace(':', '')}_{world}w_{int(time.time() * 1e3)}"
    outs, procs, logs = [], [], []
    if config.startswith("tf/"):
        tasks = [c for _, _, c in cluster.all_task_configs(local_spec(world))]
    else:
        port = free_ports(1)[0]
        tasks = [None] * world
    started = time.time()
    try:
        for rank, task in enumerate(tasks):
            out = work / f"{tag}_{rank}.json"
            log = open(work / f"{tag}_{rank}.log", "w")
            outs.append(out)
            logs.append(log)
            args = [sys.executable, __file__] + base + [f"--out={out}"]
            worker_env = dict(env)
            if task is not None:
                args.append("--mode=tf_worker")
                worker_env["TF_CONFIG"] = json.dumps(task)
            else:
                args += ["--mode=torch_worker", f"--rank={rank}", f"--port={port}"]
            procs.append(subprocess.Popen(args, env=worker_env, stdout=log,
                                          stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        codes = [None] * world
        while None in codes and time.time() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                break  # One failed: its peers would wait for it forever.
            time.sleep(0.5)
    finally:
        for p in procs:  # Only the processes this function started.
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes) or not all(o.exists() for o in outs):
        # Show the worker that failed by itself, not one this function killed.
        bad = next((i for i, c in enumerate(codes) if c not in (0, -9)),
                   next((i for i, c in enumerate(codes) if c), 0))
        tail = (work / f"{tag}_{bad}.log").read_text()[-3000:]
        raise RuntimeError(f"{config} with {world} workers failed: exit codes {codes}; "
                           f"worker {bad}'s log ends:\n{tail}")
    result = json.loads(outs[0].read_text())
    result["wall_s"] = time.time() - started
    return result


def _sh(args: list[str]) -> None:
    subprocess.run(args, check=True)


def inside() -> None:
    """Runs every phase inside the private network namespace; writes the raw JSON."""
    if _netns_has_other_interfaces():
        raise SystemExit("Refusing to throttle: this is not a private network namespace "
                         "(run without --mode=inside).")
    _sh(["ip", "link", "set", "lo", "up"])  # MTU 65536 for the unthrottled phase
    work = Path(tempfile.mkdtemp(prefix="tfdist_slow_network_"))
    meta = _meta()
    runs: list[dict] = []
    load = [load_snapshot()]
    started = time.time()

    failures: list[dict] = []

    def job(config, world, steps, warmup, evals, link):
        """run_job, once more after a failure; None (and a note) after two."""
        for attempt in (1, 2):
            try:
                return run_job(config, world, steps, warmup, evals, work)
            except RuntimeError as error:
                print(f"{link} {world}w {config}: attempt {attempt} failed: {error}", flush=True)
                failures.append({"config": config, "workers": world, "link": link,
                                 "attempt": attempt, "error": str(error)[-1500:]})
        return None

    def record(config, world, link, phase, result, skip):
        if result is None:
            return
        timed = list(result["step_times"][skip:])
        if not timed:
            raise ValueError(f"{config}: no timed steps after the first {skip}")
        earlier = next((r for r in runs if (r["config"], r["workers"], r["link"], r["phase"])
                        == (config, world, link, phase)), None)
        if earlier is not None:  # A repeat: pool its timed steps with the first run's.
            earlier["timed_runs"].append(timed)
            earlier["step_s"] = statistics.median(sum(earlier["timed_runs"], []))
            earlier["run_medians"].append(statistics.median(timed))
            result = earlier
        else:
            result.update(config=config, workers=world, link=link, phase=phase,
                          timed_runs=[timed], run_medians=[statistics.median(timed)],
                          step_s=statistics.median(timed))
            runs.append(result)
        print(f"[{time.time() - started:7.1f}s] {link:>8} {world}w {config:<15} "
              f"{result['run_medians'][-1]:.4f} s/step (pooled {result['step_s']:.4f})  "
              f"{result.get('compression', '')}"
              + (f"  acc {result['evals'][-1][1]:.3f}" if result.get("evals") else ""),
              flush=True)

    def speed(config, world, rate):
        skip = speed_skip(config)
        timed = timed_steps(config, rate, FLAGS.slow_steps, FLAGS.compressed_steps,
                            FLAGS.fast_steps)
        record(config, world, rate, "speed", job(config, world, skip + timed, SPEED_WARMUP,
                                                 0, rate), skip)

    try:
        if FLAGS.accuracy:
            for config in FLAGS.acc_configs:
                res = job(config, 2, FLAGS.acc_steps, ACC_WARMUP, FLAGS.eval_every, NO_LIMIT)
                record(config, 2, NO_LIMIT, "accuracy", res, ACC_WARMUP + 1)
            for config in FLAGS.nolimit_configs:
                skip = speed_skip(config)
                res = job(config, 2, skip + FLAGS.fast_steps * 2, SPEED_WARMUP, 0, NO_LIMIT)
                record(config, 2, NO_LIMIT, "speed", res, skip)
            load.append(load_snapshot())
        _sh(["ip", "link", "set", "lo", "mtu", "1500"])  # like Ethernet when throttled
        for rate in FLAGS.bandwidths:
            _sh(tc_command(rate))
            for world in [int(w) for w in FLAGS.workers]:
                many = FLAGS.configs4 if parse_rate(rate) < 5e8 else FLAGS.configs4_fast
                configs = FLAGS.configs if world == 2 else many
                for config in configs:
                    speed(config, world, rate)
                if world == 2:  # Interleaved repeats of the close contests, pooled.
                    for _ in range(FLAGS.repeats - 1):
                        for config in [c for c in FLAGS.repeat_configs if c in configs]:
                            speed(config, world, rate)
                load.append(load_snapshot())
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    finally:
        meta.update(wall_s=time.time() - started, load=load, failures=failures)
        raw = {"meta": meta, "runs": runs}
        Path(FLAGS.results_dir).mkdir(parents=True, exist_ok=True)
        _raw_path().write_text(json.dumps(raw, indent=1))
        shutil.rmtree(work, ignore_errors=True)


def _netns_has_other_interfaces() -> bool:
    """Whether this network namespace has more than a loopback (not one unshare made)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return any(n != "lo" for n in names)


def _meta() -> dict:
    versions = {}
    for mod in ("tensorflow", "keras", "torch"):
        try:
            out = subprocess.run([sys.executable, "-c", f"import {mod}; print({mod}.__version__)"],
                                 capture_output=True, text=True, timeout=120,
                                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
            versions[mod] = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            versions[mod] = None
    layers = [int(w) for w in FLAGS.layers]
    return {"command": "python benchmarks/slow_network.py" + (" --quick" if FLAGS.quick else ""),
            "when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "bandwidths": list(FLAGS.bandwidths), "workers": [int(w) for w in FLAGS.workers],
            "layers": layers, "params": param_count(layers), "batch": FLAGS.batch,
            "learning_rate": FLAGS.learning_rate, "target": FLAGS.target,
            "acc_steps": FLAGS.acc_steps, "eval_every": FLAGS.eval_every,
            "test_examples": FLAGS.test_examples, "slow_steps": FLAGS.slow_steps,
            "compressed_steps": FLAGS.compressed_steps, "repeats": FLAGS.repeats,
            "repeat_configs": list(FLAGS.repeat_configs),
            "fast_steps": FLAGS.fast_steps, "threads": FLAGS.threads,
            "tf_version": versions["tensorflow"], "keras_version": versions["keras"],
            "torch_version": versions["torch"]}


def _raw_path() -> Path:
    return Path(FLAGS.results_dir) / f"{FLAGS.name}.json"


def report() -> None:
    """Writes the markdown table and the plot from the JSON of the last run."""
    raw = json.loads(_raw_path().read_text())
    summary = summarize(raw)
    raw["summary"] = {k: summary[k] for k in ("rows", "accuracy", "goals")}
    _raw_path().write_text(json.dumps(raw, indent=1))
    base = Path(FLAGS.results_dir) / FLAGS.name
    base.with_suffix(".md").write_text(markdown(summary))
    try:
        plot(summary, base.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(base.with_suffix(".md").read_text())


def _apply_quick() -> list[str]:
    """Flags --quick sets (unless given explicitly)."""
    quick = {"layers": "64,512,512,10", "acc_steps": "120", "eval_every": "20",
             "target": "0.45", "slow_steps": "3", "compressed_steps": "5", "fast_steps": "5",
             "workers": "2",
             "name": "slow_network_quick"}
    given = {a.split("=", 1)[0].lstrip("-") for a in sys.argv[1:]}
    return [f"--{k}={v}" for k, v in quick.items() if k not in given]


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "tf_worker":
        tf_worker()
    elif FLAGS.mode == "torch_worker":
        torch_worker()
    elif FLAGS.mode == "inside":
        inside()
    elif FLAGS.mode == "report":
        report()
    else:
        if os.geteuid() != 0:
            raise SystemExit("benchmarks/slow_network.py needs root: it creates a network "
                             "namespace (unshare -n) and limits its loopback with tc.")
        for tool in ("unshare", "ip", "tc"):
            if shutil.which(tool) is None:
                raise SystemExit(f"benchmarks/slow_network.py needs {tool!r} (util-linux, "
                                 "iproute2).")
        extra = _apply_quick() if FLAGS.quick else []
        args = [sys.executable, __file__] + sys.argv[1:] + extra
        subprocess.run(["unshare", "-n", "--"] + args + ["--mode=inside"], check=True)
        subprocess.run(args + ["--mode=report"], check=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
