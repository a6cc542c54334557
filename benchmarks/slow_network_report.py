"""The slow-network benchmark's report: time to target accuracy from the accuracy and
speed phases, the goals, the markdown tables and the plot. Pure Python (matplotlib
for the plot), so the tests check it on made-up runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from benchlib.netns import NO_LIMIT, parse_rate
from slow_network_configs import ACC_WARMUP, CONFIGS, LABELS, SPEED_WARMUP, TF_CONFIGS


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


def speed_skip(config: str) -> int:
    """Untimed first steps of a speed run: the traced first step, and for
    PowerSGD (and auto, which may choose it) its dense warm-up steps."""
    return SPEED_WARMUP + 1 if ("powersgd" in config or config.endswith("/auto")) else 1


def timed_steps(config: str, rate: str, slow: int, compressed: int, fast: int) -> int:
    """Timed steps of a speed run: few for dense payloads on a slow link."""
    if parse_rate(rate) >= 5e8:
        return fast
    return compressed if any(k in config for k in ("powersgd", "topk", "auto")) else slow


def time_to_target(
    steps: int | None, step_s: float, *, warmup: int = 0, warmup_s: float | None = None
) -> float | None:
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


def _run_index(runs: list[dict]) -> dict:
    return {(r["config"], r["workers"], r["link"]): r for r in runs}


def summarize(raw: dict) -> dict:
    """Per-configuration figures and the goals, from the raw runs of one invocation."""
    meta, runs = raw["meta"], raw["runs"]
    target = meta["target"]
    index = _run_index(runs)
    links = [NO_LIMIT] + [b for b in meta["bandwidths"] if b != NO_LIMIT]
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
        rows.append(
            {
                "config": config,
                "workers": n,
                "link": link,
                "step_s": run["step_s"],
                "run_medians": run.get("run_medians"),
                "auto": _auto_choice(run),
                "bf16_warmup": bf16_warmup(config, run),
            }
        )
    cells: dict = {}
    for row in rows:
        cells[(row["config"], row["workers"], row["link"])] = row
    for row in rows:
        config, n, link = row["config"], row["workers"], row["link"]
        steps = steps_of(config, link, n)
        warm = (
            ACC_WARMUP
            if ("powersgd" in config or (config == "tf/auto" and "powersgd" in (row["auto"] or "")))
            else 0
        )
        dense_cfg = (
            "ddp/dense"
            if config.startswith("ddp/")
            else "tf/bf16"
            if row["bf16_warmup"]
            else "tf/fp32"
        )
        dense = cells.get((dense_cfg, n, link))
        row["steps_to_target"] = steps
        row["time_to_target_s"] = time_to_target(
            steps, row["step_s"], warmup=warm, warmup_s=dense["step_s"] if dense else None
        )
    goals = _goals(cells, links, workers)
    final = {
        c: {
            "final_accuracy": final_accuracy(r["evals"]) if r["evals"] else None,
            "steps_to_target": steps_to_target(r["evals"], target),
            "auto": _auto_choice(r),
        }
        for c, r in acc.items()
    }
    return {
        "meta": meta,
        "rows": rows,
        "accuracy": final,
        "goals": goals,
        "links": links,
        "workers": workers,
    }


def bf16_warmup(config: str, run: dict | None) -> bool:
    """Whether a configuration's PowerSGD warm-up steps were sent as bfloat16:
    the fixed ``+bf16warm`` one, or ``auto`` when it picked that (its
    strategy's description shows the PowerSGD it chose)."""
    if config.endswith("+bf16warm"):
        return True
    return config == "tf/auto" and "warmup_dtype='bfloat16'" in ((run or {}).get("describe") or "")


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
            goals.append(
                {
                    "goal": f"tfdist PowerSGD >= 20x faster per step than TF fp32 "
                    f"({n} workers, {link_name(link)})",
                    "value": r,
                    "shown": f"{fmt(r, '.1f')}x",
                    "met": None if r is None else r >= 20,
                }
            )
            r = ratio(get("tf/powersgd:4", n, link), get("ddp/powersgd:4", n, link))
            goals.append(
                {
                    "goal": f"tfdist PowerSGD / DDP PowerSGD per step <= 1.0 "
                    f"({n} workers, {link_name(link)})",
                    "value": r,
                    "shown": fmt(r, ".2f"),
                    "met": None if r is None else r <= 1.0,
                }
            )
            for config in ("tf/bf16", "tf/bf16+packs"):
                r = ratio(get(config, n, link), get("ddp/fp16", n, link))
                if r is None and config != "tf/bf16":
                    continue
                goals.append(
                    {
                        "goal": f"{LABELS[config]} / DDP fp16 hook per step <= 1.0 "
                        f"({n} workers, {link_name(link)})",
                        "value": r,
                        "shown": fmt(r, ".3f"),
                        "met": None if r is None else r <= 1.0,
                    }
                )
    for link in links:
        if link == NO_LIMIT:
            continue
        for n in workers:
            for key, what in (("step_s", "per step"), ("time_to_target_s", "to target")):
                best, value = _best_fixed(cells, n, link, key)
                r = ratio(get("tf/auto", n, link, key), value)
                if r is None:
                    continue
                goals.append(
                    {
                        "goal": f"auto within 10% of the best fixed choice {what} "
                        f"({n} workers, {link_name(link)}; best: "
                        f"{LABELS.get(best, best)})",
                        "value": r,
                        "shown": fmt(r, ".2f"),
                        "met": r <= 1.10,
                    }
                )
    return goals


def markdown(summary: dict) -> str:
    """The result tables: seconds per step, time to target, accuracy, goals."""
    meta, links, workers = summary["meta"], summary["links"], summary["workers"]
    cells = {(r["config"], r["workers"], r["link"]): r for r in summary["rows"]}
    columns = [
        (n, link)
        for n in workers
        for link in links
        if any(k[1] == n and k[2] == link for k in cells)
    ]
    configs = [c for c in CONFIGS if any(k[0] == c for k in cells)]
    head = " | ".join(f"{n}w {link_name(link)}" for n, link in columns)
    lines = [f"# Slow network: tfdist vs PyTorch DDP ({meta['params']:,}-parameter MLP)", ""]
    lines += [
        f"`{meta['command']}` — {meta['when']}, wall time {meta['wall_s'] / 60:.1f} min.",
        "",
        _conditions(meta),
        "",
        "## Seconds per step (median)",
        "",
        f"| configuration | {head} |",
        "|---|" + "---:|" * len(columns),
    ]
    for c in configs:
        vals = [fmt(cells.get((c, n, link), {}).get("step_s")) for n, link in columns]
        lines.append(f"| {LABELS.get(c, c)} | " + " | ".join(vals) + " |")
    autos = [
        (n, link, cells[("tf/auto", n, link)]["auto"])
        for n, link in columns
        if ("tf/auto", n, link) in cells
    ]
    if autos:
        lines += [
            "",
            "`auto` chose: "
            + "; ".join(f"{n}w {link_name(link)} → {choice}" for n, link, choice in autos)
            + ".",
        ]
    two = [link for n, link in columns if n == 2]
    lines += [
        "",
        f"## Time to {meta['target']:.0%} held-out accuracy (2 workers, seconds)",
        "",
        "| configuration | steps to target | final acc.¹ | "
        + " | ".join(link_name(link) for link in two)
        + " |",
        "|---|---:|---:|" + "---:|" * len(two),
    ]
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
        lines.append(
            f"| {LABELS.get(c, c)} | {steps_text} "
            f"| {fmt(a.get('final_accuracy'), '.3f')} | " + " | ".join(vals) + " |"
        )
    acc_meta = (
        f"¹ Mean held-out accuracy of the last 3 evaluations (steps "
        f"{meta['acc_steps'] - 2 * meta['eval_every']}-{meta['acc_steps']}); "
        "the curves are noisy (momentum 0.9), so steps to target vary by about "
        f"±{meta['eval_every']} between configurations that train alike."
    )
    lines += ["", acc_meta]
    for link in two:
        dense, psgd = cells.get(("tf/fp32", 2, link)), cells.get(("tf/powersgd:4", 2, link))
        if dense and psgd and psgd.get("time_to_target_s") and link != NO_LIMIT:
            warm = ACC_WARMUP * dense["step_s"]
            lines += [
                "",
                f"At {link_name(link)}, PowerSGD's {ACC_WARMUP} dense warm-up steps "
                f"(tfdist's default; DDP's `start_powerSGD_iter` here) take {warm:.1f} s "
                f"of its {psgd['time_to_target_s']:.1f} s to target; top-k has no "
                "warm-up.",
            ]
            half = cells.get(("tf/bf16", 2, link))
            psgd16 = cells.get(("tf/powersgd:4+bf16warm", 2, link))
            if half and psgd16 and psgd16.get("time_to_target_s"):
                lines[-1] += (
                    f" Sent as bfloat16 (what `auto` picks where bf16 pays), they "
                    f"take {ACC_WARMUP * half['step_s']:.1f} s of "
                    f"{psgd16['time_to_target_s']:.1f} s."
                )
    lines += [
        "",
        "## Where compression pays",
        "",
        "Fastest configuration per framework (seconds per step), and its speed-up over "
        "the same framework without compression:",
        "",
        "| workers, link | tfdist best | × vs tfdist fp32 | DDP best | × vs DDP dense |",
        "|---|---|---:|---|---:|",
    ]
    for n, link in columns:
        row = [f"{n}w {link_name(link)}"]
        for prefix, dense in (("tf/", "tf/fp32"), ("ddp/", "ddp/dense")):
            have = {
                c: cells[(c, m, k)]["step_s"]
                for (c, m, k) in cells
                if m == n and k == link and c.startswith(prefix) and c != "tf/auto"
            }
            if not have:
                row += ["—", "—"]
                continue
            best = min(have, key=have.get)
            row += [LABELS.get(best, best), fmt(ratio(have.get(dense), have[best]), ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        'Within one process (Mirrored over logical CPUs, where the "link" is a '
        "memory copy) compression only costs time: see `compression.md`.",
    ]
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---:|:---:|"]
    for g in summary["goals"]:
        met = {True: "yes", False: "**no**", None: "—"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['shown']} | {met} |")
    failures = meta.get("failures") or []
    if failures:
        lines += [
            "",
            "## Failed attempts",
            "",
            "Each job gets a second attempt; these failed (the table uses the second "
            "attempt where it succeeded):",
            "",
        ]
        for f in failures:
            lines.append(
                f"- {f['config']}, {f['workers']} workers, {link_name(f['link'])}, "
                f"attempt {f['attempt']}: {failure_reason(f['error'])}"
            )
    lines += ["", "## How", "", _method(meta)]
    return "\n".join(lines) + "\n"


def _conditions(meta: dict) -> str:
    loads = [s.get("loadavg") for s in meta.get("load", []) if s.get("loadavg")]
    load = ", ".join(f"{s[0]:.1f}" for s in loads)
    return (
        f"Machine: {meta['cpus']} cores, no GPU; TensorFlow {meta.get('tf_version')}, "
        f"Keras {meta.get('keras_version')}, PyTorch {meta.get('torch_version')}. "
        f"1-minute load average sampled before, between phases and after: {load}. "
        f"{meta.get('note', '')}"
    ).strip()


def _method(meta: dict) -> str:
    return (
        f"MLP {'-'.join(map(str, meta['layers']))}, batch {meta['batch']} per worker, SGD "
        f"lr {meta['learning_rate']} momentum 0.9, the same initial weights and data order "
        f"in both frameworks, {meta['threads']} intra-op thread per worker (and "
        f"{meta['threads']} inter-op thread in TensorFlow). Each link is the "
        "loopback of a private network namespace (`unshare -n`, MTU 1500) limited by "
        "`tc qdisc replace dev lo root tbf rate R burst 256kb latency 200ms`; the limit is "
        'shared by all workers\' traffic. "no limit" is the same loopback without tbf, '
        "with its usual MTU of 65536 (the fastest link this machine has between "
        "processes).\n\n"
        f"Seconds per step: median of {meta['slow_steps']} (dense, bf16, fp16) or "
        f"{meta.get('compressed_steps')} (PowerSGD, top-k, auto) steps at 100 Mbit/s and of "
        f"{meta['fast_steps']} steps on faster links, after the first (tracing) and, for "
        f"PowerSGD and auto, {SPEED_WARMUP} more: PowerSGD's warm-up, cut to "
        f"{SPEED_WARMUP} steps in these runs in both frameworks. With 2 workers, "
        + ", ".join(meta.get("repeat_configs") or [])
        + f" ran {meta.get('repeats', 1)} times "
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
        '"packed all-reduce": `strategy_from_config(bytes_per_pack=...)` at an eighth of '
        "the bfloat16 gradients (3 packs of this MLP, last layers first), so that the "
        "transfer overlaps backprop and the optimizer. DDP runs with one 64 MB bucket in "
        "every configuration (its default 25 MB buckets were no faster with the fp16 hook "
        "here: 1.959 against 1.952 s per step at 100 Mbit/s)."
    )


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
            ax.bar(
                xs, ys, width, label=LABELS.get(c, c), hatch="//" if c.startswith("ddp/") else None
            )
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
