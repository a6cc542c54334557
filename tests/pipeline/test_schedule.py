"""Pipeline schedules: each stage runs every micro-batch's forward and
backward once, the schedule never deadlocks, the bubble is GPipe's theory,
and 1F1B keeps fewer micro-batches in flight."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tfdist.errors import ConfigError
from tfdist.pipeline.schedule import actions, bubble, simulate


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 16),
    forward=st.floats(0.1, 3.0),
    backward=st.floats(0.1, 3.0),
)
def test_every_pass_runs_once_in_an_order_that_finishes(
    schedule, stages, microbatches, forward, backward
):
    for s in range(stages):
        order = actions(schedule, s, stages, microbatches)
        assert sorted((a.kind, a.microbatch) for a in order) == sorted(
            [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        )
        # A stage's own backward of a micro-batch comes after its forward.
        for i in range(microbatches):
            kinds = [a.kind for a in order if a.microbatch == i]
            assert kinds == ["F", "B"]
    timeline = simulate(schedule, stages, microbatches, forward, backward)
    # Each stage computes m forwards and m backwards: its busy time.
    for idle in timeline.idle:
        busy = microbatches * (forward + backward)
        assert idle == pytest.approx(1 - busy / timeline.step, abs=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 4), (3, 1), (1, 5)])
def test_the_bubble_is_the_theory_when_passes_take_equal_times(schedule, stages, microbatches):
    timeline = simulate(schedule, stages, microbatches, 1.0, 2.0)
    for idle in timeline.idle:
        assert idle == pytest.approx(bubble(stages, microbatches), abs=1e-9)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_keeps_at_most_p_minus_s_micro_batches_in_flight_and_gpipe_all(stages, microbatches):
    gpipe = simulate("gpipe", stages, microbatches).peak_in_flight
    one = simulate("1f1b", stages, microbatches).peak_in_flight
    assert gpipe == (microbatches,) * stages
    assert one == tuple(min(stages - s, microbatches) for s in range(stages))


@pytest.mark.parametrize(
    "args, field, value",
    [
        (("zero", 0, 2, 4), "schedule", "zero"),
        (("gpipe", 2, 2, 4), "stage", 2),
        (("gpipe", -1, 2, 4), "stage", -1),
        (("1f1b", 0, 0, 4), "stages", 0),
        (("1f1b", 0, 2, 0), "microbatches", 0),
        (("1f1b", 0, 2, 2.5), "microbatches", 2.5),
        (("1f1b", 0, True, 2), "stages", True),
        (("1f1b", 0, 2, 4, 2), "chunks", 2),
        (("interleaved", 0, 2, 4, 0), "chunks", 0),
        # Interleaved micro-batches go through the chunks in groups of p.
        (("interleaved", 0, 4, 6, 2), "microbatches", 6),
    ],
)
def test_bad_schedule_arguments_name_the_field(args, field, value):
    with pytest.raises(ConfigError) as caught:
        actions(*args)
    assert caught.value.field == field and caught.value.value == value


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(1, 6),
    groups=st.integers(1, 4),
    chunks=st.integers(1, 4),
    forward=st.floats(0.1, 3.0),
    backward=st.floats(0.1, 3.0),
)
def test_interleaved_runs_every_chunk_s_passes_once_and_finishes(
    stages, groups, chunks, forward, backward
):
    m = stages * groups
    for s in range(stages):
        order = actions("interleaved", s, stages, m, chunks)
        expected = [(k, i, c) for k in "FB" for i in range(m) for c in range(chunks)]
        assert sorted((a.kind, a.microbatch, a.chunk) for a in order) == sorted(expected)
        for i in range(m):
            for c in range(chunks):
                kinds = [a.kind for a in order if (a.microbatch, a.chunk) == (i, c)]
                assert kinds == ["F", "B"]
    timeline = simulate("interleaved", stages, m, forward, backward, chunks=chunks)
    for idle in timeline.idle:
        busy = m * (forward + backward)
        assert idle == pytest.approx(1 - busy / timeline.step, abs=1e-9)


@pytest.mark.parametrize(
    "stages, microbatches, chunks", [(2, 4, 2), (4, 8, 2), (4, 4, 4), (3, 6, 3)]
)
def test_interleaving_divides_the_bubble_by_the_chunks(stages, microbatches, chunks):
    timeline = simulate("interleaved", stages, microbatches, 1.0, 2.0, chunks=chunks)
    for idle in timeline.idle:
        assert idle == pytest.approx(bubble(stages, microbatches, chunks), abs=1e-9)
    assert bubble(stages, microbatches, chunks) < bubble(stages, microbatches)
    # One chunk is 1F1B.
    assert actions("interleaved", 1, stages, microbatches, 1) == actions(
        "1f1b", 1, stages, microbatches
    )


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (3, 1)])
def test_a_transfer_time_adds_two_per_boundary_to_gpipe_s_step(stages, microbatches):
    # Each boundary is crossed twice on the critical path (the first
    # micro-batch's forward going up, the first backward coming down).
    p, m, d = stages, microbatches, 0.25
    timeline = simulate("gpipe", p, m, 1.0, 1.0, transfer=d)
    assert timeline.step == pytest.approx(2 * (m + p - 1) + 2 * (p - 1) * d)
    assert timeline.idle == pytest.approx((1 - 2 * m / timeline.step,) * p)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_transfers_only_ever_add_idle(schedule):
    chunks = 2 if schedule == "interleaved" else 1
    forward = [1.0, 1.2, 0.9, 1.1]
    idle = [simulate(schedule, 4, 8, forward, 2.0, chunks, d).idle for d in (0.0, 0.1, 0.5)]
    for k in range(4):
        assert idle[0][k] < idle[1][k] < idle[2][k]
    # One process sends to no other: a transfer time changes nothing.
    assert simulate(schedule, 1, 4, 1.0, 1.0, chunks, transfer=5.0).idle == (0.0,)


@pytest.mark.parametrize("transfer", [-0.1, "1", True, None])
def test_a_bad_transfer_time_is_named(transfer):
    with pytest.raises(ConfigError) as caught:
        simulate("gpipe", 2, 2, transfer=transfer)
    assert caught.value.field == "transfer" and caught.value.value is transfer
