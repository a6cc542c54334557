"""The report of ``benchmarks/slow_network.py --fast_links``: uncompressed fp32
gradients over TensorFlow's collective and over MPI, beside PyTorch DDP dense.
"""

from __future__ import annotations

from benchlib.netns import NO_LIMIT
from slow_network_configs import LABELS
from slow_network_report import fmt, link_name, ratio

MPI, TF, DDP = "tf/fp32+mpi", "tf/fp32", "ddp/dense"
#: The issue's goals: MPI's step time over DDP dense's, per link.
GOALS = {NO_LIMIT: 1.2, "1gbit": 1.05}


def fast_links_markdown(summary: dict) -> str:
    """Seconds per step, the ratios to DDP dense, and the goals."""
    meta = summary["meta"]
    cells = {(r["config"], r["workers"], r["link"]): r for r in summary["rows"]}
    columns = [
        (n, link)
        for n in summary["workers"]
        for link in summary["links"]
        if any(k[1] == n and k[2] == link for k in cells)
    ]
    step = {key: row["step_s"] for key, row in cells.items()}
    runs = {key: row.get("run_medians") for key, row in cells.items()}
    head = " | ".join(f"{n}w {link_name(link)}" for n, link in columns)
    lines = [
        f"# Fast links: fp32 all-reduce over MPI ({meta['params']:,}-parameter MLP)",
        "",
        f"`{meta['command']}` — {meta['when']}, wall time {meta['wall_s'] / 60:.1f} min.",
        "",
        f"Machine: {meta['cpus']} cores, no GPU; TensorFlow {meta.get('tf_version')}, "
        f"Keras {meta.get('keras_version')}, PyTorch {meta.get('torch_version')}. "
        "1-minute load average sampled before, between links and after: "
        + ", ".join(f"{s['loadavg'][0]:.1f}" for s in meta.get("load", []) if s.get("loadavg"))
        + ".",
        "",
        "## Seconds per step (median of the pooled timed steps)",
        "",
        f"| configuration | {head} |",
        "|---|" + "---:|" * len(columns),
    ]
    for config in (TF, MPI, DDP):
        vals = [fmt(step.get((config, n, link))) for n, link in columns]
        lines.append(f"| {LABELS.get(config, config)} | " + " | ".join(vals) + " |")
    lines += ["", "## Ratios", "", f"| ratio | {head} |", "|---|" + "---:|" * len(columns)]
    for label, a, b in (
        ("MPI transport / DDP dense", MPI, DDP),
        ("TF collective / DDP dense", TF, DDP),
        ("MPI transport / TF collective", MPI, TF),
    ):
        vals = [
            fmt(ratio(step.get((a, n, link)), step.get((b, n, link))), ".2f") for n, link in columns
        ]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    lines += [
        "",
        "Each run's median, in the order they ran (the runs of one cell are interleaved "
        "with the other configurations'):",
        "",
    ]
    for n, link in columns:
        parts = []
        for config in (TF, MPI, DDP):
            medians = runs.get((config, n, link)) or []
            parts.append(f"{LABELS.get(config, config)} " + ", ".join(f"{m:.3f}" for m in medians))
        lines.append(f"- {n}w {link_name(link)}: " + "; ".join(parts))
    lines += ["", "## Goals", "", "| goal | measured | met |", "|---|---:|:---:|"]
    for n, link in columns:
        if link not in GOALS:
            continue
        value = ratio(step.get((MPI, n, link)), step.get((DDP, n, link)))
        met = "—" if value is None else ("yes" if value <= GOALS[link] else "**no**")
        lines.append(
            f"| MPI transport / DDP dense <= {GOALS[link]} ({n} workers, {link_name(link)}) "
            f"| {fmt(value, '.2f')} | {met} |"
        )
    lines += [
        "",
        "## How",
        "",
        f"The slow-network benchmark's MLP ({'-'.join(map(str, meta['layers']))}), batch "
        f"{meta['batch']} per worker, SGD with momentum, the same initial weights and data "
        f"in both frameworks, {meta['threads']} intra-op thread per worker (and 1 inter-op "
        "thread in TensorFlow); fp32 gradients, no compression. Each job trains "
        f"{meta['fast_steps']} timed steps after the first (tracing). With 2 workers each "
        f"configuration ran {meta['repeats']} times per link, interleaved, and the timed "
        "steps are pooled; with 4 workers once (4 TensorFlow processes take most of a "
        "minute to start on 2 cores).",
        "",
        "- **TF collective**: tfdist's MultiWorkerMirroredStrategy, Keras's own all-reduce "
        "(RING over gRPC, one pack).",
        '- **MPI transport**: `strategy_from_config(transport="mpi")`, the workers '
        "started by MPICH's `mpiexec`; the step's gradients go in one `MPI_Allreduce`. "
        "MPICH is kept off shared memory (`MPIR_CVAR_NOLOCAL=1`, OFI's TCP provider), so "
        "its bytes cross the same loopback, as between hosts.",
        "- **DDP dense**: PyTorch DDP over gloo, one 64 MB bucket.",
        "",
        "The link is the loopback of a private network namespace (`unshare -n`): "
        "unthrottled at MTU 65536, or at MTU 1500 limited by `tc qdisc replace dev lo "
        "root tbf rate 1gbit burst 256kb latency 200ms` (shared by every worker's traffic).",
    ]
    return "\n".join(lines) + "\n"
