"""The compression benchmark still runs, on a tiny setting (no timing asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, subprocess_env


def test_compression_benchmark_runs_and_identity_equals_plain(tmp_path):
    args = [
        sys.executable,
        "benchmarks/compression.py",
        "--mode=replicas",
        "--epochs=2",
        "--examples=1024",
        "--hidden=128",
        "--global_batch=64",
        "--settings=plain,identity,topk:0.1",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "compression_replicas.json").read_text())["rows"]
    by = {r["setting"]: r for r in rows}
    # The identity compressor goes through tfdist's aggregation and must
    # train exactly like Keras's own all-reduce.
    assert by["identity"]["identity_max_weight_diff"] <= 1e-6
    assert by["identity"]["test_accuracy"] == by["plain"]["test_accuracy"]
    assert by["plain"]["bytes_ratio"] == 1.0
    assert by["topk:0.1"]["bytes_ratio"] > 4
    assert by["topk:0.1"]["callback_bytes"] == by["topk:0.1"]["bytes_sent"]
    assert "| topk:0.1 |" in (tmp_path / "compression_replicas.md").read_text()


# ------------------------------------------------ pure pieces of the new benchmarks


def _load_benchmark(name: str):
    """Imports benchmarks/<name>.py as a module (benchmarks/ is not a package;
    run as a script, Python puts its folder on sys.path, where its shared
    pieces are: benchmarks/benchlib)."""
    import importlib.util

    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))

    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", REPO / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overhead_ratio_is_the_median_over_pairs():
    overhead = _load_benchmark("overhead")
    assert overhead.pair_ratios([2.0, 3.0, 4.0], [1.0, 3.0, 5.0]) == [2.0, 1.0, 0.8]
    assert overhead.median_ratio([2.0, 3.0, 4.0], [1.0, 3.0, 5.0]) == 1.0
    # ABBA: the arm that runs first alternates.
    assert [overhead.pair_order(i)[0] for i in range(4)] == ["tfdist", "tf", "tfdist", "tf"]
    import pytest

    with pytest.raises(ValueError):
        overhead.pair_ratios([1.0], [1.0, 2.0])


def test_overhead_markdown_marks_the_goal():
    overhead = _load_benchmark("overhead")
    meta = {
        "when": "now",
        "cpus": 2,
        "hidden": 1024,
        "params": 1_135_626,
        "global_batch": 128,
        "steps": 40,
        "warmup_steps": 5,
        "pairs": 2,
        "load_before": 1.0,
        "load_after": 2.0,
    }
    rows = [
        {
            "label": "Mirrored",
            "tfdist_ms": 10.0,
            "tf_ms": 10.0,
            "ratios": [1.0, 1.01],
            "median_ratio": 1.005,
        },
        {
            "label": "Workers",
            "tfdist_ms": 11.0,
            "tf_ms": 10.0,
            "ratios": [1.1, 1.1],
            "median_ratio": 1.1,
        },
    ]
    text = overhead.markdown({"meta": meta, "rows": rows})
    assert "| Mirrored | 10.00 | 10.00 | 1.005 | 1.000, 1.010 | yes |" in text
    assert "| Workers | 11.00 | 10.00 | 1.100 | 1.100, 1.100 | **no** |" in text
    assert "1.0 / 2.0" in text  # the load is recorded


def test_slow_network_model_and_link_helpers():
    sn = _load_benchmark("slow_network_report")
    from benchlib import mlp, netns

    assert mlp.param_count([256, 2048, 2048, 512, 10]) == 5_776_906
    assert netns.parse_rate("100mbit") == 1e8 and netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("none") == float("inf")
    assert netns.tc_command("100mbit") == [
        "tc",
        "qdisc",
        "replace",
        "dev",
        "lo",
        "root",
        "tbf",
        "rate",
        "100mbit",
        "burst",
        "256kb",
        "latency",
        "200ms",
    ]
    assert sn.link_name("100mbit") == "100 Mbit/s" and sn.link_name("1gbit") == "1 Gbit/s"
    import pytest

    with pytest.raises(ValueError):
        netns.tc_command("fast")
    assert sn.speed_skip("tf/powersgd:4") == sn.SPEED_WARMUP + 1 == sn.speed_skip("tf/auto")
    assert sn.speed_skip("ddp/dense") == 1
    assert sn.timed_steps("tf/fp32", "100mbit", 4, 16, 12) == 4
    assert sn.timed_steps("ddp/powersgd:4", "100mbit", 4, 16, 12) == 16
    assert sn.timed_steps("tf/fp32", "1gbit", 4, 16, 12) == 12


def test_slow_network_workers_split_every_global_batch():
    import numpy as np

    _load_benchmark("slow_network")  # Its workers import the MLP from benchlib.
    from benchlib import mlp as sn

    x = np.arange(24, dtype="float32").reshape(12, 2)
    y = np.arange(12)
    parts = [sn.worker_slice(x, y, r, 2, 3) for r in range(2)]
    # Global batch 0 is rows 0-5: worker 0 takes 0-2, worker 1 takes 3-5.
    np.testing.assert_array_equal(parts[0][1], [0, 1, 2, 6, 7, 8])
    np.testing.assert_array_equal(parts[1][1], [3, 4, 5, 9, 10, 11])
    np.testing.assert_array_equal(parts[1][0][0], x[3])
    weights = sn.initial_weights([4, 3, 2])
    assert [w.shape for w in weights] == [(4, 3), (3,), (3, 2), (2,)]
    np.testing.assert_array_equal(weights[0], sn.initial_weights([4, 3, 2])[0])  # seeded
    # accuracy(): a 1-layer identity net predicts the argmax of x.
    eye = [np.eye(3, dtype="float32"), np.zeros(3, "float32")]
    xs = np.array([[0, 1, 0], [1, 0, 0]], "float32")
    assert sn.accuracy(eye, xs, np.array([1, 2])) == 0.5


def test_slow_network_target_and_time():
    sn = _load_benchmark("slow_network_report")
    from benchlib import timing

    evals = [(20, 0.3, 1.0), (40, 0.5, 2.0), (60, 0.56, 3.0), (80, 0.54, 4.0)]
    assert sn.steps_to_target(evals, 0.55) == 60
    assert sn.steps_to_target(evals, 0.9) is None
    assert sn.time_to_target(60, 0.1) == 6.0
    # 10 warm-up steps at the dense rate, the other 50 at the compressed one.
    assert abs(sn.time_to_target(60, 0.1, warmup=10, warmup_s=4.0) - 45.0) < 1e-9
    assert sn.time_to_target(None, 0.1) is None
    assert timing.median_step([9.0, 1.0, 2.0, 3.0], skip=1) == 2.0
    assert sn.ratio(4.0, 2.0) == 2.0 and sn.ratio(None, 2.0) is None
    assert sn.fmt(None) == "—" and sn.fmt(1.23456, ".2f") == "1.23"


def _raw_slow_network():
    def run(config, link, step_s, evals=(), compression="", phase="speed", n=2):
        return {
            "config": config,
            "workers": n,
            "link": link,
            "phase": phase,
            "step_s": step_s,
            "evals": [list(e) for e in evals],
            "compression": compression,
        }

    acc = [(20, 0.4), (40, 0.6)]
    runs = [
        run("tf/fp32", "none", 0.05, acc, "none", "accuracy"),
        run("ddp/dense", "none", 0.05, acc, "dense", "accuracy"),
        run("tf/bf16", "none", 0.05, acc, "bf16", "accuracy"),
        run("ddp/fp16", "none", 0.05, acc, "fp16", "accuracy"),
        run("tf/powersgd:4", "none", 0.04, [(20, 0.3), (40, 0.5), (60, 0.6)], "p", "accuracy"),
        run("ddp/powersgd:4", "none", 0.04, [(20, 0.3), (40, 0.5), (60, 0.6)], "p", "accuracy"),
        run("tf/auto", "none", 0.05, compression="auto -> none"),
        run("tf/fp32", "100mbit", 4.0),
        run("ddp/dense", "100mbit", 4.0),
        run("tf/bf16", "100mbit", 2.0),
        run("ddp/fp16", "100mbit", 2.1),
        run("tf/powersgd:4", "100mbit", 0.1),
        run("ddp/powersgd:4", "100mbit", 0.12),
        run("tf/auto", "100mbit", 0.105, compression="auto -> powersgd:4"),
    ]
    meta = {
        "target": 0.55,
        "bandwidths": ["100mbit"],
        "params": 5_776_906,
        "command": "python benchmarks/slow_network.py",
        "when": "now",
        "wall_s": 60.0,
        "cpus": 2,
        "load": [{"loadavg": [1.0, 1.0, 1.0]}],
        "layers": [256, 10],
        "batch": 32,
        "learning_rate": 0.05,
        "threads": 1,
        "slow_steps": 4,
        "compressed_steps": 16,
        "fast_steps": 12,
        "acc_steps": 60,
        "eval_every": 20,
        "test_examples": 1024,
    }
    return {"meta": meta, "runs": runs}


def test_slow_network_summary_goals_and_table():
    sn = _load_benchmark("slow_network_report")
    summary = sn.summarize(_raw_slow_network())
    cells = {(r["config"], r["link"]): r for r in summary["rows"]}
    # PowerSGD: 10 warm-up steps at the dense 4 s, then 50 at 0.1 s.
    assert abs(cells[("tf/powersgd:4", "100mbit")]["time_to_target_s"] - 45.0) < 1e-9
    assert cells[("tf/fp32", "100mbit")]["time_to_target_s"] == 160.0
    # auto chose PowerSGD on the slow link: its steps, its warm-up.
    auto = cells[("tf/auto", "100mbit")]
    assert auto["auto"] == "powersgd:4" and auto["steps_to_target"] == 60
    goals = {g["goal"].split(" (")[0]: g for g in summary["goals"]}
    assert goals["tfdist PowerSGD >= 20x faster per step than TF fp32"]["met"] is True
    assert goals["tfdist PowerSGD / DDP PowerSGD per step <= 1.0"]["met"] is True
    assert goals["tfdist bf16 / DDP fp16 hook per step <= 1.0"]["met"] is True
    per_step = goals["auto within 10% of the best fixed choice per step"]
    assert abs(per_step["value"] - 1.05) < 1e-9 and per_step["met"] is True
    text = sn.markdown(summary)
    assert "| tfdist PowerSGD r4 | 0.040 | 0.100 |" in text
    assert "2w 100 Mbit/s → powersgd:4" in text
    assert "| DDP PowerSGD r4 | 60 | 0.467 |" in text
    assert "| tfdist auto | those of its choice | — | 2.0 | 45.2 |" in text
    assert "load average" in text


def test_slow_network_bf16_warm_up_is_counted_at_the_bf16_rate():
    sn = _load_benchmark("slow_network_report")
    raw = _raw_slow_network()
    curve = [(20, 0.3), (40, 0.5), (60, 0.6)]
    raw["runs"] += [
        {
            "config": "tf/powersgd:4+bf16warm",
            "workers": 2,
            "link": "none",
            "phase": "accuracy",
            "step_s": 0.04,
            "evals": [list(e) for e in curve],
            "compression": "p",
        },
        {
            "config": "tf/powersgd:4+bf16warm",
            "workers": 2,
            "link": "100mbit",
            "phase": "speed",
            "step_s": 0.1,
            "evals": [],
            "compression": "p",
        },
    ]
    for r in raw["runs"]:
        if r["config"] == "tf/auto" and r["link"] == "100mbit":
            r["describe"] = (
                "compression: auto -> powersgd:4 (runs PowerSGD(rank=4, "
                "warmup_steps=2, warmup_dtype='bfloat16', ...)"
            )
    cells = {(r["config"], r["link"]): r for r in sn.summarize(raw)["rows"]}
    # 10 warm-up steps at tfdist bf16's 2.0 s, then 50 at 0.1 s.
    assert abs(cells[("tf/powersgd:4+bf16warm", "100mbit")]["time_to_target_s"] - 25.0) < 1e-9
    assert abs(cells[("tf/powersgd:4", "100mbit")]["time_to_target_s"] - 45.0) < 1e-9
    auto = cells[("tf/auto", "100mbit")]
    assert auto["bf16_warmup"] is True and auto["steps_to_target"] == 60
    assert abs(auto["time_to_target_s"] - (10 * 2.0 + 50 * 0.105)) < 1e-9
    assert not sn.bf16_warmup("tf/auto", {"describe": "PowerSGD(rank=4, warmup_steps=2)"})
    text = sn.markdown(sn.summarize(raw))
    assert "Sent as bfloat16" in text and "take 20.0 s of 25.0 s" in text


def test_slow_network_missed_goal_is_reported():
    sn = _load_benchmark("slow_network_report")
    raw = _raw_slow_network()
    for r in raw["runs"]:
        if r["config"] == "tf/powersgd:4" and r["link"] == "100mbit":
            r["step_s"] = 0.5  # only 8x faster than fp32, slower than DDP
    goals = sn.summarize(raw)["goals"]
    missed = [g["goal"] for g in goals if g["met"] is False]
    assert any("20x" in g for g in missed) and any("DDP PowerSGD" in g for g in missed)
    assert "**no**" in sn.markdown(sn.summarize(raw))


def test_slow_network_plot_is_written(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    sn = _load_benchmark("slow_network_report")
    path = tmp_path / "plot.png"
    sn.plot(sn.summarize(_raw_slow_network()), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slow_network_failure_reason_finds_the_abort():
    sn = _load_benchmark("slow_network_report")
    tail = (
        "some log\nterminate called after throwing an instance of 'std::system_error'\n"
        "  what():  Resource temporarily unavailable\n  File x, line 3\n"
    )
    assert (
        sn.failure_reason("x failed: exit codes [-6, -6]\n" + tail)
        == "what():  Resource temporarily unavailable"
    )
    assert sn.failure_reason("a\nlast line\n") == "last line"
    assert sn.failure_reason("") == "no output"


# ------------------------------------------------ preemption and elastic benchmarks


def test_preemption_models_steps_and_progress(tmp_path):
    import pytest

    pre = _load_benchmark("preemption")
    assert pre.param_count(pre.model_widths("mlp5.8m")) == 5_776_906
    assert 50e6 < pre.param_count(pre.model_widths("mlp52m")) < 55e6
    assert pre.model_widths("mlp:8-4-2") == [8, 4, 2]
    for bad in ("mlp:8", "mlp:8-x", "resnet"):
        with pytest.raises(ValueError, match="model"):
            pre.model_widths(bad)
    assert pre.steps_for("mlp52m", ["mlp52m:30", "*:20"]) == 30
    assert pre.steps_for("mlp:8-2", ["mlp52m:30", "*:20"]) == 20
    with pytest.raises(ValueError, match="steps_per_epoch"):
        pre.steps_for("mlp:8-2", ["mlp52m:30"])
    with pytest.raises(ValueError, match="steps_per_epoch"):
        pre.steps_for("mlp52m", ["mlp52m:x"])
    # Mid-epoch 1, never on an epoch boundary.
    assert pre.signal_step(200, 0.5) == 300
    assert pre.signal_step(20, 0.0) == 21 and pre.signal_step(20, 1.0) == 39
    progress = tmp_path / "p"
    progress.write_text("1 10.5\n2 11.0\n3 11")  # A torn last line is skipped.
    assert pre.read_progress(progress) == [(1, 10.5), (2, 11.0)]
    assert pre.read_progress(tmp_path / "none") == []


def test_preemption_summary_and_table():
    pre = _load_benchmark("preemption")

    def run(arm, save, exit_s, trained, resumed, codes):
        return {
            "model": "mlp5.8m",
            "arm": arm,
            "params": 5_776_906,
            "steps_per_epoch": 200,
            "signal_step": 300,
            "step_s": 0.1,
            "save_s": save,
            "pointer_s": save,
            "last_step_s": 0.2 if save else None,
            "save_only_s": save - 0.2 if save else None,
            "exit_s": exit_s,
            "trained": trained,
            "resumed": resumed,
            "lost": trained - resumed,
            "codes": codes,
            "backup_bytes": 69e6 if save else None,
        }

    raw = {
        "meta": {
            "command": "python benchmarks/preemption.py",
            "when": "now",
            "cpus": 2,
            "tf": "2.21.0",
            "keras": "3.15.1",
            "commit": "abc",
            "load_before": 1.0,
            "load_after": 2.0,
            "threads": 1,
            "batch": 32,
            "epochs": 3,
            "kill_after": 10.0,
            "survivor_timeout": 60.0,
            "disk": "/dev/vda (ext4)",
        },
        "runs": [
            run("tfdist", 0.5, 1.3, 302, 302, [143, 143]),
            run("tfdist", 0.7, 1.1, 302, 302, [143, 143]),
            run("tfdist", 0.6, 11.0, 303, 303, [143, 143]),
            run("keras", None, 12.0, 385, 200, [-9, -9]),
            run("keras", None, 11.0, 380, 200, [-9, 1]),
        ],
    }
    rows = {r["arm"]: r for r in pre.summarize(raw)}
    assert rows["tfdist"]["save_s"] == {"median": 0.6, "min": 0.5, "max": 0.7, "n": 3}
    assert rows["tfdist"]["lost"]["max"] == 0
    assert rows["keras"]["lost"] == {"median": 182.5, "min": 180, "max": 185, "n": 2}
    assert rows["keras"]["save_s"]["median"] is None
    text = pre.markdown(raw)
    assert "| 0.60 (0.50–0.70) | 1.30 (1.10–11.00) | 302 (302–303) | 302 (302–303) | 0 |" in text
    assert "| none (no save) | 11.50 (11.00–12.00) | 382 (380–385) | 200 | 182 (180–185) |" in text
    assert "TensorFlow 2.21.0, Keras 3.15.1" in text and "1.0 / 2.0" in text


def test_elastic_size_changes_are_measured_from_the_progress():
    el = _load_benchmark("elastic")
    # (attempt, size, optimizer step after the step, time)
    progress = [
        (0, 4, 1, 1.0),
        (0, 4, 2, 1.1),
        (0, 4, 3, 1.2),  # SIGKILL at 1.25
        (1, 3, 1, 9.0),
        (1, 3, 2, 9.1),
        (1, 3, 3, 9.2),
        (1, 3, 4, 9.3),  # grow at 9.35
        (2, 4, 5, 20.0),
        (2, 4, 6, 20.1),
    ]
    shrink = el.change(progress, 1.25, 3)
    # Resumed from the backup at step 0: 3 steps trained twice.
    assert shrink == {
        "seconds": 9.0 - 1.25,
        "last_step": 3,
        "resumed_at": 0,
        "retrained": 3,
        "attempt": 1,
    }
    grow = el.change(progress, 9.35, 4)
    assert grow["resumed_at"] == 4 and grow["retrained"] == 0 and grow["attempt"] == 2
    assert abs(grow["seconds"] - 10.65) < 1e-9
    assert el.change(progress, 30.0, 3)["seconds"] is None
    assert abs(el.step_seconds(progress, 3) - 0.1) < 1e-9
    assert el.step_seconds(progress, 5) is None


def test_elastic_data_and_accuracy():
    import numpy as np

    el = _load_benchmark("elastic")
    x, y, xt, yt = el.make_data()
    assert x.shape == (el.TRAIN, 32) and xt.shape == (el.TEST, 32)
    assert el.TRAIN % el.GLOBAL_BATCH == 0 and el.GLOBAL_BATCH % 3 == el.GLOBAL_BATCH % 4 == 0
    assert set(np.unique(y)) == set(range(10))
    np.testing.assert_array_equal(el.make_data()[1], y)  # Seeded.
    eye = [np.eye(3, dtype="float32"), np.zeros(3, "float32")]
    assert el.accuracy(eye, np.array([[0, 1, 0], [1, 0, 0]], "float32"), np.array([1, 2])) == 0.5


@pytest.mark.slow
def test_preemption_benchmark_runs_on_a_tiny_model(tmp_path):
    """Both arms on a tiny model: the tfdist arm loses no step; the status quo,
    SIGKILLed 2 s after the SIGTERM, resumes at an epoch start."""
    args = [
        sys.executable,
        "benchmarks/preemption.py",
        "--models=mlp:16-32-4",
        "--repeats=1",
        "--steps_per_epoch=*:20",
        "--kill_after=2",
        "--survivor_timeout=30",
        "--lock=",
        f"--results_dir={tmp_path}",
        f"--work_dir={tmp_path / 'work'}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["arm"]: r for r in json.loads((tmp_path / "preemption.json").read_text())["runs"]}
    assert runs["tfdist"]["codes"] == [143, 143]
    assert runs["tfdist"]["lost"] == 0 and runs["tfdist"]["resumed"] > 30
    assert 0 < runs["tfdist"]["save_s"] < runs["tfdist"]["exit_s"]
    assert runs["keras"]["resumed"] % 20 == 0  # An epoch start (or 0 after a finished run).
    assert "| mlp:16-32-4" in (tmp_path / "preemption.md").read_text()


@pytest.mark.slow
def test_elastic_benchmark_runs_a_short_job(tmp_path):
    args = [
        sys.executable,
        "benchmarks/elastic.py",
        "--pairs=1",
        "--epochs=6",
        "--lock=",
        "--discovery_interval=1",
        f"--results_dir={tmp_path}",
        f"--work_dir={tmp_path / 'work'}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["kind"]: r for r in json.loads((tmp_path / "elastic.json").read_text())["runs"]}
    assert runs["uninterrupted"]["sizes"] == [4]
    assert runs["elastic"]["sizes"] == [4, 3, 4]
    assert runs["elastic"]["iterations"] == runs["uninterrupted"]["iterations"] == 6 * 84
    assert runs["elastic"]["changes"]["grow"]["retrained"] == 0
    assert 0 <= runs["elastic"]["changes"]["shrink"]["retrained"] <= 20 + 1


def test_tensor_parallel_benchmark_halves_the_block_and_splits_the_wire_bytes(tmp_path):
    # The smallest run: T=1 against T=2 (DP=2) on 4 logical CPUs, 2 steps.
    args = [
        sys.executable,
        "benchmarks/tensor_parallel.py",
        "--d_model=64",
        "--epochs=2",
        "--steps=2",
        "--layouts=T1,T2",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "tensor_parallel.json").read_text())
    memory = results["memory"]
    assert memory["sharded_layers"]["T2_ratio"] < 0.6
    assert memory["sharded_layers"]["T2_ratio"] < memory["model"]["T2_ratio"] < 1
    # Two devices per shard: T=2's four devices hold two different byte counts at most.
    assert len(memory["sharded_layers"]["T2_devices"]) == 4
    rows = {row["key"]: row for row in results["traffic"]}
    assert rows["T1"]["measured"] is None  # no mesh at T=1
    sent = rows["T2"]["measured"]
    assert sent["tensor_parallel"] > 0 and sent["data_parallel"] > 0
    assert rows["T2"]["matches"], rows["T2"]
    # Sharding halves the gradients that cross the data-parallel group.
    assert sent["data_parallel"] < rows["T1"]["predicted"]["data_parallel"] / 2
    assert results["agreement"]["T2"]["max_loss_diff"] < 1e-5
    assert "| T=2 (DP=2) | none |" in (tmp_path / "tensor_parallel.md").read_text()


def test_xla_benchmark_names_the_error_and_marks_the_rows():
    xla = _load_benchmark("xla")
    log = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "ValueError: Attempt to convert a value (PerReplica:{\n  0: {'x': 1},\n  1: 2\n}) "
        "with an unsupported type (<class 'dict'>) to a Tensor."
    )
    assert xla._error_line(log) == (
        "ValueError: Attempt to convert a value (...) "
        "with an unsupported type (<class 'dict'>) to a Tensor."
    )
    aborted = "W0000 something\nF0000 Collectives are not yet implemented for CPU devices"
    assert xla._error_line(aborted).startswith("F0000 Collectives are not yet implemented")
    assert [xla.pair_order(i)[0] for i in range(3)] == ["off", "xla", "off"]
    row = xla._row(
        "Mirrored, 2 logical CPUs",
        "mlp",
        {"off": [0.010, 0.012], "xla": [0.015, 0.012]},
        "fails: x",
    )
    assert row["ratios"] == [1.5, 1.0] and row["median_ratio"] == 1.25
    alone = xla._row("no strategy, one device", "mlp", {"off": [0.01], "xla": [0.02]}, None)
    meta = {
        "when": "now",
        "cpus": 2,
        "tf": "2.21.0",
        "keras": "3.15.1",
        "models": ["mlp"],
        "pairs": 2,
        "steps": 15,
        "warmup_steps": 5,
        "load_before": 1.0,
        "load_after": 1.0,
    }
    table = xla.markdown({"meta": meta, "rows": [row, alone]})
    assert "| Mirrored, 2 logical CPUs | mlp | 11.0 | 13.5 | 1.25 | 1.50, 1.00 | fails:" in table
    assert "| no strategy, one device | mlp | 10.0 | 20.0 | 2.00 | 2.00 | - |" in table


@pytest.mark.slow
def test_keras_distribution_benchmark_measures_both_jobs(tmp_path):
    # The smallest run: two jobs of 4 processes with a tiny Qwen, 2 steps.
    pytest.importorskip("keras_hub")
    args = [
        sys.executable,
        "benchmarks/keras_distribution.py",
        "--vocabulary=256",
        "--hidden=32",
        "--layers=1",
        "--heads=4",
        "--kv_heads=2",
        "--intermediate=64",
        "--sequence=8",
        "--steps=2",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "keras_distribution.json").read_text())
    runs = results["runs"]
    assert [r["task"] for r in runs["model_parallel"]] == [f"worker:{i}" for i in range(4)]
    peak = {k: max(r["model_kb"] for r in v) for k, v in runs.items()}
    assert results["ratio"]["model_kb"] == peak["model_parallel"] / peak["data_parallel"]
    for mp, dp in zip(runs["model_parallel"], runs["data_parallel"]):
        assert mp["replicas"] == dp["replicas"] == 4
        assert mp["full_weights"] == dp["full_weights"] == dp["weights_per_device"]
        assert mp["weights_per_device"] < 0.5 * mp["full_weights"]
        assert abs(mp["loss"] - dp["loss"]) < 1e-4  # The same model and batches.
    text = (tmp_path / "keras_distribution.md").read_text()
    assert f"resident set {results['ratio']['model_kb']:.2f}×" in text
    assert "--vocabulary=256" in text
    # TensorFlow's allocator tracks large allocations only (a tiny model may read 0).
    tensors = results["ratio"]["tensor_peak_kb"]
    assert f"tensors {'n/a' if tensors is None else format(tensors, '.2f')}×" in text


@pytest.mark.slow
def test_preset_memory_benchmark_loads_the_preset_on_4_workers(tmp_path):
    # The smallest run: a tiny Llama preset, 4 workers, the logits table split.
    pytest.importorskip("keras_hub")
    args = [
        sys.executable,
        "benchmarks/preset_memory.py",
        "--vocabulary=4096",
        "--hidden=32",
        "--intermediate=64",
        "--split_logits",
        "--label=smoke",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = json.loads((tmp_path / "preset_memory.json").read_text())
    assert [w["task"] for w in record["workers"]] == [f"worker:{i}" for i in range(4)]
    for worker in record["workers"]:
        assert worker["output_difference"] < 1e-5, worker
        assert worker["peak_kb"] >= worker["rss_before_kb"]
        assert worker["layout_warnings"] == []  # Nothing large is left whole.
        assert worker["restored_output_difference"] < 1e-5, worker
        assert worker["save_seconds"] > 0 and worker["restore_seconds"] > 0
    text = (tmp_path / "preset_memory.md").read_text()
    full = record["full_weights_bytes"]
    loads = [w["load_kb"] * 1024 for w in record["workers"]]
    assert f"{max(loads) / full:.2f}x" in text
    saves = [w["save_kb"] * 1024 for w in record["workers"]]
    assert f"{max(saves) / 2**20:,.0f} MiB | {max(saves) / full:.2f}x" in text


@pytest.mark.slow
def test_preset_limit_benchmark_loads_tunes_and_saves_under_the_limit(tmp_path):
    # The smallest run: a tiny Llama preset, ModelParallel on 2 workers and
    # one device, each under a 1 GiB cgroup: both load, fine-tune with LoRA
    # and save. (The recorded run makes the preset larger than the limit;
    # the OOM kills it then counts are benchlib's, tested with lora_capacity.)
    import importlib.util

    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip("needs keras_hub")
    if not os.access("/sys/fs/cgroup/memory", os.W_OK):
        pytest.skip("needs a writable cgroup-v1 memory controller (root)")
    args = [
        sys.executable,
        "benchmarks/preset_limit.py",
        "--workers=2",
        "--layouts=model_parallel,one_device",
        "--hidden=128",
        "--vocabulary=1024",
        "--layers=1",
        "--sequence=16",
        "--limit_mib=1024",
        "--peer_timeout=20",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "preset_limit.json").read_text())
    runs = {r["layout"]: r for r in result["runs"]}
    assert list(runs) == ["model_parallel", "one_device"]
    full = result["full_weights_bytes"]
    for layout, processes in (("model_parallel", 2), ("one_device", 1)):
        run = runs[layout]
        assert run["trained"] and run["oom_kills"] == 0, run
        workers = [w["result"] for w in run["workers"]]
        assert len(workers) == processes
        for worker in workers:
            assert np.isfinite(worker["losses"]).all() and worker["losses"] == workers[0]["losses"]
            assert 0 < worker["trainable"] < full / 4 / 20  # LoRA trains the adapters only.
            assert worker["layout_warnings"] == []
            assert set(worker["phases"]) == {"load", "fit", "save"}
        # The chief's file holds every weight whole (the adapters merged in).
        assert max(w["saved_bytes"] or 0 for w in workers) >= full
    # Each ModelParallel worker holds half of each split weight.
    held = [w["result"]["held_bytes"] for w in runs["model_parallel"]["workers"]]
    assert all(h < 0.6 * runs["one_device"]["workers"][0]["result"]["held_bytes"] for h in held)
    text = (tmp_path / "preset_limit.md").read_text()
    assert "| model_parallel | 2 | yes | 0 | - |" in text
    assert "| one_device | 1 | yes | 0 | - |" in text
    assert f"{result['parameters']:,} parameters" in text


@pytest.mark.slow
def test_lora_capacity_benchmark_climbs_until_a_worker_is_oom_killed(tmp_path):
    # The smallest run: 2 workers, 1 layer, 2 steps (one timed); a width both
    # layouts train (about 0.4 GiB each), then one whose query kernel alone
    # (268 MB) cannot be drawn under 1 GiB: every process draws a weight
    # whole before keeping its block, so both layouts are killed as they
    # build, not after minutes of training.
    import importlib.util

    # Looked up, not imported: importing it here would cost this process
    # TensorFlow's import (seconds), and only the workers use it.
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip("needs keras_hub")
    if not os.access("/sys/fs/cgroup/memory", os.W_OK):
        pytest.skip("needs a writable cgroup-v1 memory controller (root)")
    wide = 8192
    args = [
        sys.executable,
        "benchmarks/lora_capacity.py",
        "--workers=2",
        f"--widths=128,{wide}",
        "--vocabulary=1024",
        "--layers=1",
        "--limit_mib=1024",
        "--sequence=16",
        "--steps=2",
        "--peer_timeout=20",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "lora_capacity.json").read_text())
    runs = {(r["layout"], r["hidden"]): r for r in result["runs"]}
    small, large = runs["data_parallel", 128], runs["data_parallel", wide]
    assert small["trained"] and not large["trained"] and large["oom_kills"] >= 1
    for run in result["runs"]:
        # Trained: every worker reported the same finite losses; else killed.
        assert run["trained"] or run["oom_kills"] >= 1, run
        assert len(run["workers"]) == 2
        if run["trained"]:
            losses = [w["result"]["losses"] for w in run["workers"]]
            assert all(np.isfinite(loss).all() and loss == losses[0] for loss in losses)
            trainable = run["workers"][0]["result"]["trainable"]
            assert 0 < trainable < run["parameters"] / 20  # LoRA trains the adapters only.
    # ModelParallel starts at the largest width DataParallel trains.
    assert min(h for layout, h in runs if layout == "model_parallel") == 128
    text = (tmp_path / "lora_capacity.md").read_text()
    assert f"| data_parallel | {wide:,} |" in text and "| no | " in text
    assert "(1, 2) mesh" in text and "2 worker processes" in text
    mp = max(
        (r for r in result["runs"] if r["layout"] == "model_parallel" and r["trained"]),
        key=lambda r: r["parameters"],
    )
    assert f"ModelParallel {mp['parameters']:,} parameters" in text


@pytest.mark.slow
def test_allreduce_benchmark_checks_every_sum_and_compares_with_mpi(tmp_path):
    import shutil

    if shutil.which("mpiexec") is None or os.geteuid() != 0:
        pytest.skip("needs mpiexec (the mpi extra) and root (a network namespace)")
    done = subprocess.run(
        [sys.executable, "benchmarks/allreduce.py", "--quick", f"--results_dir={tmp_path}"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    raw = json.loads((tmp_path / "allreduce_quick.json").read_text())
    configs = {r["config"] for r in raw["runs"]}
    assert {"tf/default", "tf/flat", "mpi/flat", "mpi/tensors"} <= configs
    # Every collective's result was compared with the expected sum (a socket sums nothing).
    assert all(r["verified"] for r in raw["runs"] if not r["config"].startswith("socket/"))
    # The alpha/beta sweeps time several sizes; the others one median each.
    assert all(r["median_s"] > 0 for r in raw["runs"] if not r["config"].endswith("/sweep"))
    text = (tmp_path / "allreduce_quick.md").read_text()
    assert "| `mpi/flat`" in text and "| `tf/default`" in text


def test_fast_links_report_gives_the_ratios_and_marks_the_goals():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from fast_links_report import GOALS, fast_links_markdown

    steps = {"tf/fp32": 0.08, "tf/fp32+mpi": 0.045, "ddp/dense": 0.04}
    slow = {"tf/fp32": 0.45, "tf/fp32+mpi": 0.44, "ddp/dense": 0.40}
    rows = [
        {"config": c, "workers": 2, "link": link, "step_s": s, "run_medians": [s]}
        for link, table in (("none", steps), ("1gbit", slow))
        for c, s in table.items()
    ]
    meta = {
        "params": 5776906,
        "command": "python benchmarks/slow_network.py --fast_links",
        "when": "now",
        "wall_s": 60.0,
        "cpus": 2,
        "load": [],
        "layers": [256, 2048, 2048, 512, 10],
        "batch": 32,
        "threads": 1,
        "fast_steps": 20,
        "repeats": 3,
    }
    text = fast_links_markdown(
        {"meta": meta, "rows": rows, "workers": [2], "links": ["none", "1gbit"]}
    )
    fast = steps["tf/fp32+mpi"] / steps["ddp/dense"]
    limited = slow["tf/fp32+mpi"] / slow["ddp/dense"]
    assert f"| MPI transport / DDP dense | {fast:.2f} | {limited:.2f} |" in text
    assert (
        f"| MPI transport / DDP dense <= {GOALS['none']} (2 workers, no limit) | {fast:.2f} | "
        + ("yes" if fast <= GOALS["none"] else "**no**")
    ) in text
    assert (
        f"(2 workers, 1 Gbit/s) | {limited:.2f} | "
        + ("yes" if limited <= GOALS["1gbit"] else "**no**")
    ) in text


# ------------------------------------------------ pipeline benchmark


def test_pipeline_benchmark_rows_and_table():
    from tfdist.pipeline.schedule import simulate

    pipe = _load_benchmark("pipeline")
    assert pipe.theory(2, 4) == pytest.approx(1 / 5) and pipe.theory(4, 8) == pytest.approx(3 / 11)

    def run(step, peak, scale):
        # One timed step (3) of GPipe with m = 1 on 2 processes, on one clock:
        # the window is [0, 4 scale]; process 0 computes 2 of it, process 1 1.9.
        t = lambda *a: [x * scale for x in a]  # noqa: E731
        first = [("F", 3, *t(0, 1)), ("send", 3, *t(1, 1.1)), ("recv", 3, *t(1.1, 3))]
        first += [("B", 3, *t(3, 4)), ("update", 3, *t(4, 4.2))]
        second = [("recv", 3, *t(-1, 1.1)), ("F", 3, *t(1.1, 2)), ("B", 3, *t(2, 3))]
        second += [("send", 3, *t(3, 3.04)), ("recv", 4, *t(3.1, 5))]
        return [
            {"step_s": step, "peak_mb": peak, "spans": first},
            {"step_s": step, "peak_mb": peak + 1, "spans": second},
        ]

    runs = [
        {"tfdist": run(0.30, 40.0, 1.0), "torch": run(0.20, 50.0, 1.0)},
        {"tfdist": run(0.50, 60.0, 2.0), "torch": run(0.25, 70.0, 2.0)},
    ]
    row = pipe._row("gpipe", 1, runs)
    assert row["ratios"] == pytest.approx([0.30 / 0.20, 0.50 / 0.25])
    assert row["ratio"] == pytest.approx((1.5 + 2.0) / 2)
    assert row["tfdist"]["idle"] == pytest.approx([0.5, 0.525])
    assert row["tfdist"]["send"] == pytest.approx([0.025, 0.01])
    assert row["tfdist"]["wait"] == pytest.approx([0.475, 0.275])
    assert row["tfdist"]["update_s"] == pytest.approx([0.3, 0.0])  # Medians of 0.2, 0.4.
    replayed = simulate("gpipe", 2, 1, [1.5, 1.35], [1.5, 1.5]).idle  # The median run's.
    assert row["tfdist"]["replayed"] == pytest.approx(list(replayed))
    # These spans name no message: no delivery measured, the same replay.
    assert row["tfdist"]["delivery_s"] == 0.0
    assert row["tfdist"]["replayed_sends"] == pytest.approx(list(replayed))
    assert pipe._span(["send", 3, 0.0, 1.0, ["F", 1, 0]]).message == ("F", 1, 0)
    assert pipe._span(["F", 3, 0.0, 1.0]).message == ()
    assert row["torch"]["peak_mb"] == pytest.approx([60.0, 61.0])
    # The pass times the replay took: medians over the two runs (scales 1, 2).
    assert row["tfdist"]["forward_s"] == pytest.approx([1.5, 1.35])
    assert row["tfdist"]["backward_s"] == pytest.approx([1.5, 1.5])
    # Each step replayed with its own passes (one step each run, both the same).
    from tfdist.pipeline.schedule import Action

    own = {(0, Action("F", 0)): 1.0, (0, Action("B", 0)): 1.0}
    own.update({(1, Action("F", 0)): 0.9, (1, Action("B", 0)): 1.0})
    each = simulate("gpipe", 2, 1, durations=own).idle
    assert row["tfdist"]["replayed_each"] == pytest.approx(list(each))
    row = {**row, "cuts": [5], "balance_s": [0.0316, 0.0311]}
    meta = {
        "command": "python benchmarks/pipeline.py",
        "when": "now",
        "commit": "abc",
        "cpus": 2,
        "tf": "2.21",
        "keras": "3.15",
        "torch": "2.13",
        "features": 64,
        "layers": 9,
        "width": 1024,
        "batch": 256,
        "steps": 12,
        "warmup": 3,
        "pin": True,
        "split": "time",
        "notes": ["a note"],
    }
    text = pipe.markdown({"meta": meta, "rows": [row]})
    r = [f"{x:.3f}" for x in replayed]
    e = [f"{x:.3f}" for x in each]
    assert (
        f"| gpipe | 1 | 5 | 31.6, 31.1 | 0.500 | {r[0]}, {r[1]} | {r[0]}, {r[1]} | {e[0]}, {e[1]} "
        f"| 0.500, 0.525 | +0.0, +2.5 | 0.025, 0.010 | 0.475, 0.275 | 0.00 | {r[0]}, {r[1]} "
        "| 0.500, 0.525 |"
    ) in text
    assert "an MLP of 64 inputs and 9 x 1024" in text and "each on its own CPU" in text
    assert "| gpipe | 1 | 400.0 | 225.0 | 1.75 | 300.0, 0.0 | 50, 51 | 60, 61 |" in text
    assert text.rstrip().endswith("- a note")


@pytest.mark.slow
def test_pipeline_memory_benchmark_trains_in_stages_what_one_device_cannot(tmp_path):
    # The smallest run: 4 layers; width 256 trains everywhere, width 3072
    # (38 M parameters: 150 MB of weights, 600 MB with their gradients and
    # Adam's moments) is killed on one device under 640 MiB, and trains (and
    # saves) in 4 stages built by stage (a quarter of that per process).
    if not os.access("/sys/fs/cgroup/memory", os.W_OK):
        pytest.skip("needs a writable cgroup-v1 memory controller (root)")
    args = [
        sys.executable,
        "benchmarks/pipeline_memory.py",
        "--widths=256,3072",
        "--layers=4",
        "--steps=2",
        "--limit_mib=640",
        "--arms=one_device,pipeline_by_stage",
        f"--results_dir={tmp_path}",
    ]
    done = subprocess.run(
        args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "pipeline_memory.json").read_text())
    runs = {(r["arm"], r["width"]): r for r in result["runs"]}
    assert runs["one_device", 256]["trained"]
    assert not runs["one_device", 3072]["trained"] and runs["one_device", 3072]["oom_kills"] >= 1
    staged = runs["pipeline_by_stage", 3072]
    assert staged["trained"] and len(staged["workers"]) == 4
    # It saved too, by stage: the .keras file holds every weight (4 bytes
    # each), which no process under the limit could hold with its training.
    assert staged["saved_mib"] >= staged["parameters"] * 4 / 2**20
    # The same model in both arms: the first step's loss agrees.
    small = runs["pipeline_by_stage", 256]
    assert small["loss"][0] == pytest.approx(runs["one_device", 256]["loss"][0], abs=1e-5)
    ratio = staged["parameters"] / runs["one_device", 256]["parameters"]
    text = (tmp_path / "pipeline_memory.md").read_text()
    assert f"| pipeline_by_stage | 3072 | 37.8 M | {ratio:.2f} | none |" in text
    assert "| one_device | 256 |" in text and "| 3072 |" in text
