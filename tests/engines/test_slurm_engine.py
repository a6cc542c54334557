"""tfdist on a real Slurm cluster: slurmctld and slurmd on 127.0.0.1.

The module starts one single-node cluster (tests/engines/slurm_engine.py) and runs
``srun -n2`` and ``sbatch`` jobs on it: a Keras fit through
``strategy_from_config()`` with no TF_CONFIG, ``tfdist info`` inside a step,
the Slurm page's batch script (docs/clusters/slurm.md), and a step whose task fails.
Without Slurm the tests skip, saying how to install it; with TFDIST_REQUIRE_ENGINES=1 (CI) they
fail instead. Every Slurm call has a time limit, and a failure shows the
job's output and both daemons' logs.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from conftest import REPO
from slurm_engine import SlurmCluster, slurm_cluster  # noqa: F401 - a fixture
from tfdist.strategies import slurm as tfdist_slurm

pytestmark = pytest.mark.slow

#: First port of the kernel's ephemeral range (Linux and IANA start above).
EPHEMERAL_LOW = 32768

#: The batch script of docs/clusters/slurm.md.
SBATCH_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=tfdist-train
#SBATCH --ntasks=2
#SBATCH --time=00:10:00
#SBATCH --output=train-%j.out
srun --kill-on-bad-exit=1 --label python strategies/multi_worker_mirrored.py --epochs=2
"""


def by_task(output: str) -> dict[int, list[str]]:
    """Splits ``srun --label`` output into each task's lines."""
    lines: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = re.match(r"\s*(\d+): (.*)$", line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def task_results(output: str, tasks: int, context: str) -> dict[int, dict]:
    """The 'tfdist result:' JSON of each task of a labelled srun output.

    Args:
        output: The labelled output (``srun --label``).
        tasks: How many tasks must have printed a result.
        context: Added to the failure message (the output and logs).
    """
    results = {}
    for task, lines in by_task(output).items():
        for line in lines:
            if line.startswith("tfdist result: "):
                results[task] = json.loads(line[len("tfdist result: ") :])
    assert sorted(results) == list(range(tasks)), (
        f"expected a 'tfdist result:' line from tasks {list(range(tasks))}, "
        f"got them from {sorted(results)}\n{context}"
    )
    return results


def srun_two_tasks(cluster: SlurmCluster, argv: list[str], what: str) -> tuple[dict, str]:
    """``srun -n2`` of ``python ARGV`` on ``cluster`` (labelled, a task that
    fails ends the step); each task's 'tfdist result:' and the failure context."""
    command = ["srun", "-n2", "--label", "--kill-on-bad-exit=1", "--time=8", sys.executable]
    result = cluster.run([*command, *argv], timeout=420)
    context = cluster.failure(
        f"srun {what} output", code=result.returncode, out=result.stdout, err=result.stderr
    )
    return task_results(result.stdout, 2, context), context


def tf_ports(addresses: list[str]) -> list[int]:
    return [int(address.rsplit(":", 1)[1]) for address in addresses]


def test_srun_sets_the_step_variables_tensorflow_reads(slurm_cluster):  # noqa: F811 - the fixture imported above
    result = slurm_cluster.run(
        [
            "srun",
            "-n2",
            "--label",
            "--time=1",
            "printenv",
            "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_STEP_NODELIST",
            "SLURM_STEP_TASKS_PER_NODE",
        ],
        timeout=60,
    )
    assert by_task(result.stdout) == {
        0: ["0", "2", "localhost", "2"],
        1: ["1", "2", "localhost", "2"],
    }, slurm_cluster.failure(
        "unexpected step environment", code=0, out=result.stdout, err=result.stderr
    )


def test_srun_two_tasks_fit_through_strategy_from_config(slurm_cluster):  # noqa: F811 - the fixture imported above
    results, context = srun_two_tasks(slurm_cluster, ["tests/workers/slurm_fit.py"], "fit")
    chief, other = results[0], results[1]

    for rank, res in results.items():
        assert res["procid"] == rank
        # No TF_CONFIG: the cluster came from the Slurm step.
        assert res["tf_config"] is None
        assert res["choice"]["name"] == "multi_worker_mirrored", context
        assert res["choice"]["slurm"] is True, context
        assert res["strategy"] == "MultiWorkerMirroredStrategy"
        assert res["replicas"] == 2
        assert res["task"] == f"worker:{rank}"
        assert res["is_chief"] is (rank == 0)

    # Both tasks found the same cluster, on the port base derived from the
    # job and step ids, below the ephemeral range the daemons' ports and
    # srun's sockets come from.
    assert chief["cluster"] == other["cluster"]
    base = tfdist_slurm.default_port_base(
        {"SLURM_JOB_ID": chief["slurm_job_id"], "SLURM_STEP_ID": chief["slurm_step_id"]}
    )
    ports = tf_ports(chief["cluster"]["worker"])
    assert chief["cluster"] == {"worker": [f"localhost:{base}", f"localhost:{base + 1}"]}
    assert max(ports) < EPHEMERAL_LOW, f"expected TF ports below {EPHEMERAL_LOW}, got {ports}"
    assert not set(ports) & set(slurm_cluster.ports.values()), (
        f"TF ports {ports} collide with the daemons' {slurm_cluster.ports}"
    )

    # Synchronous training: the same weights, bit for bit, and the same losses.
    assert chief["weights_sha256"] == other["weights_sha256"], context
    assert chief["loss"] == other["loss"]
    assert chief["loss"][-1] < 0.7 * chief["loss"][0], (
        f"expected the loss to fall by 30%, got {chief['loss']}"
    )


def test_srun_two_tasks_run_a_horovod_script(slurm_cluster):  # noqa: F811 - the fixture imported above
    # `import tfdist.horovod as hvd` in a step: ranks from SLURM_PROCID and the
    # step's node list, no TF_CONFIG.
    results, context = srun_two_tasks(slurm_cluster, ["tests/workers/hvd_small_fit.py"], "horovod")
    for rank, res in results.items():
        assert (res["rank"], res["size"]) == (rank, 2), context
        assert (res["local_rank"], res["local_size"]) == (rank, 2), context
        assert res["sum"] == 3.0
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"], context


def test_srun_two_tasks_train_a_pipeline_like_one_device(slurm_cluster):  # noqa: F811 - the fixture imported above
    # strategies/pipeline.py in a step: each task finds its stage from
    # SLURM_PROCID and the step's node list (no TF_CONFIG), and the two
    # stages train the MLP as one device does.
    results, context = srun_two_tasks(
        slurm_cluster,
        [
            "strategies/pipeline.py",
            "--model=mlp",
            "--examples=64",
            "--per_replica_batch_size=16",
            "--microbatches=2",
            "--epochs=1",
            "--compare",
        ],
        "pipeline",
    )
    assert [results[k]["stage"] for k in (0, 1)] == [0, 1], context
    assert results[0]["loss"] == results[1]["loss"], context
    assert results[0]["max_weight_diff"] < 1e-5, context


def test_tfdist_info_in_a_step_shows_the_cluster(slurm_cluster):  # noqa: F811 - the fixture imported above
    result = slurm_cluster.run(
        ["srun", "-n2", "--label", "--time=5", sys.executable, "-m", "tfdist", "info"], timeout=300
    )
    lines = by_task(result.stdout)
    context = slurm_cluster.failure(
        "srun tfdist info output", code=result.returncode, out=result.stdout, err=result.stderr
    )
    assert sorted(lines) == [0, 1], context
    clusters = set()
    for rank, task_lines in lines.items():
        fields = {
            line.split(":", 1)[0]: line.split(":", 1)[1].strip()
            for line in task_lines
            if ":" in line
        }
        assert fields["strategy"] == "multi_worker_mirrored", context
        assert "Slurm job step of 2 tasks" in fields["why"], context
        assert fields["source"] == f"Slurm job step (SLURM_PROCID={rank})", context
        chief = "chief" if rank == 0 else "not chief"
        assert fields["task"] == f"worker:{rank} ({chief})", context
        assert fields["cpus"].startswith("1 "), context
        clusters.add(fields["cluster"])
    assert len(clusters) == 1, f"expected both tasks to find one cluster, got {clusters}"
    [found] = clusters
    match = re.fullmatch(r"worker: localhost:(\d+), localhost:(\d+)", found)
    assert match, f"expected 'worker: localhost:P, localhost:P+1', got {found!r}"
    first, second = int(match.group(1)), int(match.group(2))
    assert second == first + 1 and second < EPHEMERAL_LOW, found


def test_tfdist_info_takes_the_port_base_from_the_environment(slurm_cluster):  # noqa: F811 - the fixture imported above
    result = slurm_cluster.run(
        ["srun", "-n2", "--label", "--time=5", sys.executable, "-m", "tfdist", "info"],
        timeout=300,
        TFDIST_SLURM_PORT_BASE="23456",
    )
    lines = by_task(result.stdout)
    expected = "cluster:  worker: localhost:23456, localhost:23457"
    for rank in (0, 1):
        assert expected in lines.get(rank, []), slurm_cluster.failure(
            f"expected task {rank} to print {expected!r}",
            code=result.returncode,
            out=result.stdout,
            err=result.stderr,
        )


def test_sbatch_script_trains_on_two_tasks(slurm_cluster, tmp_path):  # noqa: F811 - the fixture imported above
    script = tmp_path / "train.sbatch"
    script.write_text(SBATCH_SCRIPT)
    output = tmp_path / "train.out"  # Instead of the script's train-%j.out.
    submitted = slurm_cluster.run(
        ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={output}", str(script)], timeout=60
    )
    job_id = submitted.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"expected a job id from sbatch --parsable, got {submitted.stdout!r}"
    fields = slurm_cluster.wait_job(job_id, timeout=420, output=output)
    text = output.read_text(errors="replace") if output.exists() else "(no output file)"
    context = slurm_cluster.failure(f"batch job {job_id}: {fields.get('JobState')}", out=text)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), context
    results = task_results(text, 2, context)
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"], context
    assert results[0]["replicas"] == 2
    assert results[0]["loss"][-1] < results[0]["loss"][0]


FAIL_ONE = """
import os, sys, time
from pathlib import Path
ready = Path(sys.argv[1])
if os.environ["SLURM_PROCID"] == "1":
    # Fail once task 0 is about to wait for this task to join.
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)
    sys.exit("task 1 fails before it joins")
import tensorflow, tfdist, tfdist.strategies  # The slow imports come first.
ready.write_text("joining")
tfdist.strategy_from_config(register_timeout=600)
"""


def test_a_failing_task_ends_the_step_without_waiting_for_it(slurm_cluster, tmp_path):  # noqa: F811 - the fixture imported above
    # Task 0 would wait 600 s for task 1 to join; --kill-on-bad-exit ends the
    # step. While it joins, TensorFlow's coordination service catches SIGTERM
    # (as a preemption notice), so Slurm's SIGKILL after KillWait (30 s by
    # default) is what ends task 0.
    ready = tmp_path / "task0-joining"
    result = slurm_cluster.run(
        [
            "srun",
            "-n2",
            "--label",
            "--kill-on-bad-exit=1",
            "--time=5",
            sys.executable,
            "-c",
            FAIL_ONE,
            str(ready),
        ],
        timeout=240,
        check=False,
    )
    context = slurm_cluster.failure(
        "srun with a failing task", code=result.returncode, out=result.stdout, err=result.stderr
    )
    assert ready.exists(), "expected task 0 to reach strategy_from_config\n" + context
    assert result.returncode != 0, context
    assert "1: task 1 fails before it joins" in result.stderr, context
    assert result.seconds < 120, (
        f"expected the step to end within KillWait of the failure, took {result.seconds:.0f} s"
    )
    deadline = time.monotonic() + 30
    while slurm_cluster.job_ids() and time.monotonic() < deadline:
        time.sleep(0.5)  # The job may list as COMPLETING for a moment.
    assert slurm_cluster.job_ids() == [], "expected no job left running\n" + context


def test_srun_mpi_pmi2_trains_over_the_mpi_transport(slurm_cluster):  # noqa: F811 - the fixture imported above
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs the mpi extra (mpi4py and MPICH)")
    result = slurm_cluster.run(
        [
            "srun",
            "-n2",
            "--mpi=pmi2",
            "--time=3",
            sys.executable,
            str(REPO / "tests" / "workers" / "mpi_job.py"),
            "plain",
        ],
        timeout=240,
        TFDIST_TRANSPORT="mpi",
    )
    from test_mpi import rank_results

    ranks = rank_results(result.stdout)
    assert sorted(ranks) == [0, 1], slurm_cluster.failure(
        "no result from both ranks", code=0, out=result.stdout, err=result.stderr
    )
    for found in ranks.values():
        assert found["replicas"] == 2
        assert found["allreduce_calls"] == 2 * 6 * 4  # Every step's 4 dense gradients, over MPI.
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
