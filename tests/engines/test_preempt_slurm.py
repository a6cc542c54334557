"""Preemption under Slurm: ``scancel --signal=TERM`` of a running step on the
real slurmctld and slurmd (tests/engines/slurm_engine.py), then a requeued run.

The batch job carries the Slurm page's preemption directives (``--signal=TERM@60``,
``--requeue``, ``--open-mode=append``) and requeues itself when its step ends
with the preempted exit code. Its ``srun -n2`` step trains
tests/workers/preempt_engine_fit.py: a Keras fit under tfdist's MultiWorkerMirrored
(the cluster from the Slurm step, no TF_CONFIG) with
``tfdist.BackupAndRestore``. In the middle of an epoch the test sends SIGTERM
to the step's tasks with ``scancel --signal=TERM JOB.STEP``. The tasks must agree
on one step, save there and exit 143; the job requeues itself; the requeued run
(a new step of the same command) must resume at exactly that step and end
with the planned number of optimizer steps.

Slurm holds a requeued job for 2 minutes (its BeginTime); the test releases it
at once with ``scontrol update JobId=J StartTime=now``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from slurm_engine import SlurmCluster, slurm_cluster  # noqa: F401 - a fixture
from tfdist.training.callbacks import read_backup_pointer

pytestmark = pytest.mark.slow

#: The preemption directives of the Slurm page (docs/clusters/slurm.md); the
#: test's job uses them.
PREEMPT_DIRECTIVES = (
    "#SBATCH --signal=TERM@60",
    "#SBATCH --requeue",
    "#SBATCH --open-mode=append",
    "export TFDIST_GRACE=60",
)
#: What that page's script does after its step (the test's job does the same).
REQUEUE_LINE = 'if [ "$code" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi'

JOB_SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=tfdist-preempt
#SBATCH --ntasks=2
#SBATCH --time=00:10:00
{directives}
srun --kill-on-bad-exit=1 --label {python} tests/workers/preempt_engine_fit.py {backup} {progress}
code=$?
echo "srun exit code $code at $(date +%s.%N) (restart ${{SLURM_RESTART_COUNT:-0}})"
{requeue}
exit $code
"""
#: The worker's plan (tests/workers/preempt_engine_fit.py): 3 epochs of 20 steps.
STEPS_PER_EPOCH = 20
PLANNED_STEPS = 3 * STEPS_PER_EPOCH
#: Signal once the chief has done this many steps: in the middle of epoch 1.
SIGNAL_AT = STEPS_PER_EPOCH + 5
#: Slurm's step line in the job's output, from the script above.
_STEP_END = re.compile(r"^srun exit code (\d+) at ([\d.]+) \(restart (\d+)\)$", re.M)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _results(text: str) -> dict[int, dict]:
    found = {}
    for match in re.finditer(r"^\s*(\d+): tfdist result: (.*)$", text, re.M):
        found[int(match.group(1))] = json.loads(match.group(2))
    return found


def test_the_slurm_page_documents_the_preemption_directives():
    page = (REPO / "docs" / "clusters" / "slurm.md").read_text()
    for line in PREEMPT_DIRECTIVES + (REQUEUE_LINE,):
        assert line in page, f"expected docs/clusters/slurm.md to contain {line!r}"


def test_scancel_signal_term_saves_and_the_requeued_job_resumes_at_that_step(
    slurm_cluster,  # noqa: F811 - the fixture imported above
    tmp_path,
):
    backup, progress, job_dir = tmp_path / "backup", tmp_path / "progress", tmp_path / "job"
    progress.mkdir()
    output = tmp_path / "job.out"
    script = tmp_path / "train.sbatch"
    script.write_text(
        JOB_SCRIPT.format(
            directives="\n".join(PREEMPT_DIRECTIVES),
            python=sys.executable,
            backup=backup,
            progress=progress,
            requeue=REQUEUE_LINE,
        )
    )
    submitted = slurm_cluster.run(
        ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={output}", str(script)],
        timeout=60,
        TFDIST_JOB_DIR=str(job_dir),
    )
    job = submitted.stdout.strip().split(";")[0]
    assert job.isdigit(), submitted.stdout

    def context(what: str) -> str:
        text = output.read_text(errors="replace") if output.exists() else "(no output)"
        return slurm_cluster.failure(f"job {job}: {what}", out=text)

    # Wait until the chief is mid-epoch 1, then signal the step's tasks.
    chief_steps = progress / "worker-0.step"
    deadline = time.monotonic() + 180
    while (_read_int(chief_steps) or 0) < SIGNAL_AT:
        state = slurm_cluster.job_state(job).get("JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING") or time.monotonic() > deadline:
            slurm_cluster.cancel_all()
            pytest.fail(context(f"never reached step {SIGNAL_AT} (state {state})"))
        time.sleep(0.05)
    signalled_at_step = _read_int(chief_steps)
    signal_time = time.time()
    slurm_cluster.run(["scancel", "--signal=TERM", f"{job}.0"], timeout=30)

    # The step ends, the script requeues the job; Slurm holds it 2 minutes.
    deadline = time.monotonic() + 120
    while True:
        text = output.read_text(errors="replace") if output.exists() else ""
        fields = slurm_cluster.job_state(job)
        if _STEP_END.search(text) and fields.get("JobState") == "PENDING":
            break
        if time.monotonic() > deadline:
            slurm_cluster.cancel_all()
            pytest.fail(
                context(
                    f"expected the step to end and the job to be requeued "
                    f"(state {fields.get('JobState')})"
                )
            )
        time.sleep(0.2)
    [first] = _STEP_END.findall(text)
    assert first[0] == "143" and first[2] == "0", context(
        f"expected the first run's step to end with 143, got {first}"
    )
    step_end_time = float(first[1])
    assert fields["Restarts"] == "1", context("expected one requeue")
    assert not _results(text), context("expected no task to finish in the first run")

    # Every task stopped after the same step, and the chief's backup is at it.
    records = {
        p.stem: json.loads(p.read_text()) for p in sorted((job_dir / "preempted").glob("*.json"))
    }
    assert sorted(records) == ["worker-0", "worker-1"], context(f"records: {records}")
    stopped = {r["step"] for r in records.values()}
    assert len(stopped) == 1, context(f"the workers stopped at different steps: {records}")
    [stopped_step] = stopped
    assert signalled_at_step <= stopped_step < PLANNED_STEPS, context(
        f"signalled at step {signalled_at_step}, stopped at {stopped_step}"
    )
    pointer = read_backup_pointer(backup)
    assert pointer is not None and pointer.get("preempted") is True, context(f"pointer: {pointer}")
    assert pointer["global_step"] == stopped_step, context(f"pointer: {pointer}")
    assert (pointer["epoch"], pointer["step"]) == divmod(stopped_step, STEPS_PER_EPOCH)

    # The requeued run: a new step of the same command, released early. Not
    # within the second of the requeue: slurmd refuses a job credential
    # created in the second its job's last one was revoked ("Job credential
    # revoked", the job FAILED) -- one reason for Slurm's 2 minute hold.
    time.sleep(2.5)
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
    fields = slurm_cluster.wait_job(job, timeout=180, output=output)
    text = output.read_text(errors="replace")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), context(
        "expected the requeued run to complete"
    )
    ends = _STEP_END.findall(text)
    assert [(code, restart) for code, _, restart in ends] == [("143", "0"), ("0", "1")], context(
        "step ends"
    )
    results = _results(text)
    assert sorted(results) == [0, 1], context("expected a result from both tasks")
    for rank, result in results.items():
        # Resumed at exactly the step where the first run stopped, mid-epoch...
        assert result["first"]["iterations"] == stopped_step, context(f"task {rank}")
        assert (result["first"]["epoch"], result["first"]["batch"]) == divmod(
            stopped_step, STEPS_PER_EPOCH
        ), context(f"task {rank}")
        # ...trained only the steps that were left, and ended on the plan.
        assert result["trained"] == PLANNED_STEPS - stopped_step, context(f"task {rank}")
        assert result["iterations"] == result["planned_steps"] == PLANNED_STEPS
        assert result["restart_count"] == "1"
        assert result["slurm_job_id"] == job
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]

    # The same command without a preemption, as one step: the same weights,
    # bit for bit (the data resumed at the right batch, the optimizer state).
    progress_ref = tmp_path / "progress-ref"
    progress_ref.mkdir()
    reference = slurm_cluster.run(
        [
            "srun",
            "-n2",
            "--label",
            "--kill-on-bad-exit=1",
            "--time=5",
            sys.executable,
            "tests/workers/preempt_engine_fit.py",
            str(tmp_path / "backup-ref"),
            str(progress_ref),
        ],
        timeout=180,
        TFDIST_TEST_STEP_SLEEP="0",
    )
    uninterrupted = _results(reference.stdout)
    assert sorted(uninterrupted) == [0, 1], context(f"reference run:\n{reference.stdout}")
    assert uninterrupted[0]["trained"] == PLANNED_STEPS
    assert results[0]["weights_sha256"] == uninterrupted[0]["weights_sha256"], context(
        "expected the preempted and resumed job to end with the uninterrupted weights"
    )

    saved = max(r["saved_time"] for r in records.values())
    exited = max(r["exit_time"] for r in records.values())
    figures = {
        "signalled_at_step": signalled_at_step,
        "stopped_step": stopped_step,
        # Steps the first run trained that the second one trained again.
        "steps_lost": stopped_step - results[0]["first"]["iterations"],
        "signal_to_saved_s": round(saved - signal_time, 3),
        "signal_to_exit_s": round(exited - signal_time, 3),
        "signal_to_step_end_s": round(step_end_time - signal_time, 3),
    }
    print("tfdist slurm preemption: " + json.dumps(figures))
    # Well inside the 60 s that --signal=TERM@60 leaves before the time limit.
    assert figures["signal_to_step_end_s"] < 30, context(str(figures))
