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
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

# The shared pieces and this benchmark's other phases sit beside this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import slow_network_configs
from benchlib import netns
from benchlib.machine import load_snapshot
from benchlib.mlp import param_count
from benchlib.netns import NO_LIMIT, parse_rate, tc_command
from fast_links_report import fast_links_markdown
from slow_network_configs import ACC_WARMUP, FLAGS, REPO, SPEED_WARMUP, define_flags
from slow_network_report import markdown, plot, speed_skip, summarize, timed_steps
from slow_network_workers import tf_worker, torch_worker

# ---------------------------------------------------------------- orchestration


def _worker_flags(config: str, steps: int, warmup: int, evals: int, world: int) -> list[str]:
    return [
        f"--config={config}",
        f"--steps={steps}",
        f"--warmup={warmup}",
        f"--evals={evals}",
        f"--world={world}",
        f"--layers={','.join(FLAGS.layers)}",
        f"--batch={FLAGS.batch}",
        f"--learning_rate={FLAGS.learning_rate}",
        f"--test_examples={FLAGS.test_examples}",
        f"--threads={FLAGS.threads}",
        f"--seed={FLAGS.seed}",
    ]


def run_job(
    config: str,
    world: int,
    steps: int,
    warmup: int,
    evals: int,
    work: Path,
    timeout: float = 1200.0,
) -> dict:
    """Runs one job of ``world`` worker processes; returns rank 0's result."""
    from tfdist import spec
    from tfdist.engines.net import free_ports, local_spec

    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS=str(max(1, FLAGS.threads)),
    )
    env.pop("TF_CONFIG", None)
    base = _worker_flags(config, steps, warmup, evals, world)
    tag = f"{config.replace('/', '_').replace(':', '')}_{world}w_{int(time.time() * 1e3)}"
    outs, procs, logs = [], [], []
    if config.endswith("+mpi"):
        return _run_mpi_job(config, world, base, env, work, tag, timeout)
    if config.startswith("tf/"):
        tasks = [c for _, _, c in spec.all_task_configs(local_spec(world))]
    else:
        port = free_ports(1)[0]
        tasks = [None] * world
    started = time.time()
    try:
        for rank, task in enumerate(tasks):
            out = work / f"{tag}_{rank}.json"
            log = open(work / f"{tag}_{rank}.log", "w")  # noqa: SIM115 - open while the worker runs; closed below
            outs.append(out)
            logs.append(log)
            args = [sys.executable, __file__] + base + [f"--out={out}"]
            worker_env = dict(env)
            if task is not None:
                args.append("--mode=tf_worker")
                worker_env["TF_CONFIG"] = json.dumps(task)
            else:
                args += ["--mode=torch_worker", f"--rank={rank}", f"--port={port}"]
            procs.append(
                subprocess.Popen(args, env=worker_env, stdout=log, stderr=subprocess.STDOUT)
            )
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
        bad = next(
            (i for i, c in enumerate(codes) if c not in (0, -9)),
            next((i for i, c in enumerate(codes) if c), 0),
        )
        tail = (work / f"{tag}_{bad}.log").read_text()[-3000:]
        raise RuntimeError(
            f"{config} with {world} workers failed: exit codes {codes}; "
            f"worker {bad}'s log ends:\n{tail}"
        )
    result = json.loads(outs[0].read_text())
    result["wall_s"] = time.time() - started
    return result


def _run_mpi_job(
    config: str, world: int, base: list[str], env: dict, work: Path, tag: str, timeout: float
) -> dict:
    """A ``+mpi`` job: ``mpiexec -n world`` starts the TensorFlow workers.

    MPICH would use shared memory between ranks of one machine, which no
    link limits: ``MPIR_CVAR_NOLOCAL`` and the OFI TCP provider keep its
    traffic on the namespace's loopback, as between hosts.
    """
    from tfdist.engines.mpi_launch import find_mpiexec

    outs = [work / f"{tag}_{rank}.json" for rank in range(world)]
    mpi_env = dict(env, MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
    args = [find_mpiexec(), "-n", str(world), sys.executable, __file__, *base]
    args += [f"--out={work / f'{tag}_{{rank}}.json'}", "--mode=tf_worker"]
    started = time.time()
    with open(work / f"{tag}.log", "w") as log:
        proc = subprocess.Popen(
            args, env=mpi_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # mpiexec's own process group: it, its proxies, the ranks.
                os.killpg(proc.pid, 9)
                proc.wait()
    if code != 0 or not all(o.exists() for o in outs):
        tail = (work / f"{tag}.log").read_text()[-3000:]
        raise RuntimeError(
            f"{config} with {world} workers failed: exit code {code}; log ends:\n{tail}"
        )
    result = json.loads(outs[0].read_text())
    result["wall_s"] = time.time() - started
    return result


def _sh(args: list[str]) -> None:
    subprocess.run(args, check=True)


def inside() -> None:
    """Runs every phase inside the private network namespace; writes the raw JSON."""
    if netns.has_other_interfaces():
        raise SystemExit(
            "Refusing to throttle: this is not a private network namespace "
            "(run without --mode=inside)."
        )
    netns.loopback_up()  # MTU 65536 for the unthrottled phase
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
                failures.append(
                    {
                        "config": config,
                        "workers": world,
                        "link": link,
                        "attempt": attempt,
                        "error": str(error)[-1500:],
                    }
                )
        return None

    def record(config, world, link, phase, result, skip):
        if result is None:
            return
        timed = list(result["step_times"][skip:])
        if not timed:
            raise ValueError(f"{config}: no timed steps after the first {skip}")
        earlier = next(
            (
                r
                for r in runs
                if (r["config"], r["workers"], r["link"], r["phase"])
                == (config, world, link, phase)
            ),
            None,
        )
        if earlier is not None:  # A repeat: pool its timed steps with the first run's.
            earlier["timed_runs"].append(timed)
            earlier["step_s"] = statistics.median(sum(earlier["timed_runs"], []))  # noqa: RUF017 - a few short lists
            earlier["run_medians"].append(statistics.median(timed))
            result = earlier
        else:
            result.update(
                config=config,
                workers=world,
                link=link,
                phase=phase,
                timed_runs=[timed],
                run_medians=[statistics.median(timed)],
                step_s=statistics.median(timed),
            )
            runs.append(result)
        print(
            f"[{time.time() - started:7.1f}s] {link:>8} {world}w {config:<15} "
            f"{result['run_medians'][-1]:.4f} s/step (pooled {result['step_s']:.4f})  "
            f"{result.get('compression', '')}"
            + (f"  acc {result['evals'][-1][1]:.3f}" if result.get("evals") else ""),
            flush=True,
        )

    def speed(config, world, rate):
        skip = speed_skip(config)
        timed = timed_steps(
            config, rate, FLAGS.slow_steps, FLAGS.compressed_steps, FLAGS.fast_steps
        )
        record(
            config,
            world,
            rate,
            "speed",
            job(config, world, skip + timed, SPEED_WARMUP, 0, rate),
            skip,
        )

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
        netns.loopback_up(mtu=1500)  # like Ethernet when throttled
        for rate in FLAGS.bandwidths:
            if rate == NO_LIMIT:  # The unthrottled loopback, at its usual MTU.
                netns.unthrottle()
                netns.loopback_up(mtu=65536)
            else:
                netns.loopback_up(mtu=1500)
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
        netns.unthrottle()
    finally:
        meta.update(wall_s=time.time() - started, load=load, failures=failures)
        raw = {"meta": meta, "runs": runs}
        Path(FLAGS.results_dir).mkdir(parents=True, exist_ok=True)
        _raw_path().write_text(json.dumps(raw, indent=1))
        shutil.rmtree(work, ignore_errors=True)


def _meta() -> dict:
    versions = {}
    for mod in ("tensorflow", "keras", "torch"):
        try:
            out = subprocess.run(
                [sys.executable, "-c", f"import {mod}; print({mod}.__version__)"],
                capture_output=True,
                text=True,
                timeout=120,
                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
            )
            versions[mod] = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            versions[mod] = None
    layers = [int(w) for w in FLAGS.layers]
    return {
        "command": "python benchmarks/slow_network.py"
        + (" --quick" if FLAGS.quick else "")
        + (" --fast_links" if FLAGS.fast_links else ""),
        "fast_links": FLAGS.fast_links,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "bandwidths": list(FLAGS.bandwidths),
        "workers": [int(w) for w in FLAGS.workers],
        "layers": layers,
        "params": param_count(layers),
        "batch": FLAGS.batch,
        "learning_rate": FLAGS.learning_rate,
        "target": FLAGS.target,
        "acc_steps": FLAGS.acc_steps,
        "eval_every": FLAGS.eval_every,
        "test_examples": FLAGS.test_examples,
        "slow_steps": FLAGS.slow_steps,
        "compressed_steps": FLAGS.compressed_steps,
        "repeats": FLAGS.repeats,
        "repeat_configs": list(FLAGS.repeat_configs),
        "fast_steps": FLAGS.fast_steps,
        "threads": FLAGS.threads,
        "tf_version": versions["tensorflow"],
        "keras_version": versions["keras"],
        "torch_version": versions["torch"],
    }


def _raw_path() -> Path:
    return Path(FLAGS.results_dir) / f"{FLAGS.name}.json"


def report() -> None:
    """Writes the markdown table and the plot from the JSON of the last run."""
    raw = json.loads(_raw_path().read_text())
    summary = summarize(raw)
    raw["summary"] = {k: summary[k] for k in ("rows", "accuracy", "goals")}
    _raw_path().write_text(json.dumps(raw, indent=1))
    base = Path(FLAGS.results_dir) / FLAGS.name
    if raw["meta"].get("fast_links"):
        base.with_suffix(".md").write_text(fast_links_markdown(summary))
    else:
        base.with_suffix(".md").write_text(markdown(summary))
        try:
            plot(summary, base.with_suffix(".png"))
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    print(base.with_suffix(".md").read_text())


def _apply_fast_links() -> list[str]:
    """Flags --fast_links sets (unless given explicitly)."""
    configs = ",".join(slow_network_configs.FAST_LINK_CONFIGS)
    fast = {
        "name": "fast_links",
        "accuracy": "false",
        "bandwidths": f"{NO_LIMIT},1gbit",
        "workers": "2,4",
        "configs": configs,
        "configs4_fast": configs,
        "repeat_configs": configs,
        "repeats": "3",
        "fast_steps": "20",
    }
    given = {a.split("=", 1)[0].lstrip("-") for a in sys.argv[1:]}
    return [f"--{k}={v}" for k, v in fast.items() if k not in given]


def _apply_quick() -> list[str]:
    """Flags --quick sets (unless given explicitly)."""
    quick = {
        "layers": "64,512,512,10",
        "acc_steps": "120",
        "eval_every": "20",
        "target": "0.45",
        "slow_steps": "3",
        "compressed_steps": "5",
        "fast_steps": "5",
        "workers": "2",
        "name": "slow_network_quick",
    }
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
        netns.require("benchmarks/slow_network.py")
        extra = _apply_quick() if FLAGS.quick else []
        extra += _apply_fast_links() if FLAGS.fast_links else []
        netns.rerun_inside(__file__, sys.argv[1:] + extra)
        subprocess.run(
            [sys.executable, __file__] + sys.argv[1:] + extra + ["--mode=report"], check=True
        )


if __name__ == "__main__":
    define_flags()
    # The flags are defined in slow_network_configs: adopting them keeps them in
    # this script's --help (absl lists only the main module's key flags).
    flags.adopt_module_key_flags(slow_network_configs)
    app.run(main)
