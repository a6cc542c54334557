"""A pipeline step's spans and its bubble: breakdown reads back what the
schedule simulator laid out, and two real stages (threads linked over
127.0.0.1) record their passes in the schedule's order on one clock."""

from __future__ import annotations

import concurrent.futures

import pytest
from hypothesis import given, settings, strategies as st

from tfdist.engines.net import free_ports
from tfdist.errors import ConfigError
from tfdist.pipeline.schedule import actions, bubble, simulate
from tfdist.pipeline.trace import Span, Trace, breakdown, delivery, replay, replay_step

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def spans_of(timeline, step: int = 7, offset: float = 100.0) -> list[list[Span]]:
    """A simulated timeline as recorded spans, with a send after each pass
    and a receive before it (each half the gap to the pass before, if any)."""
    out = []
    for process in timeline.spans:
        spans, last = [], None
        for kind, _, start, end in process:
            if last is not None and start > last:
                spans.append(Span("recv", step, offset + last, offset + start))
            spans.append(Span(kind, step, offset + start, offset + end))
            last = end
        out.append(spans)
    return out


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    stages=st.integers(1, 5),
    rounds=st.integers(1, 4),
    chunks=st.integers(1, 3),
    data=st.data(),
)
def test_breakdown_and_replay_read_back_the_simulated_bubble(
    schedule, stages, rounds, chunks, data
):
    # Stages of unequal cost, as real splits have: the formula no longer
    # holds, the replay of the measured pass times does.
    times = st.lists(st.floats(0.1, 3.0), min_size=stages, max_size=stages)
    forward, backward = data.draw(times), data.draw(times)
    chunks = chunks if schedule == "interleaved" else 1
    m = rounds * stages
    timeline = simulate(schedule, stages, m, forward, backward, chunks)
    got = breakdown(spans_of(timeline), 7, chunks)
    assert got.window == pytest.approx(timeline.step)
    assert got.idle == pytest.approx(timeline.idle, abs=1e-9)
    assert got.forward == pytest.approx(forward) and got.backward == pytest.approx(backward)
    for k in range(stages):
        assert got.compute[k] + got.wait[k] <= 1 + 1e-9
    assert replay(schedule, m, [got], chunks).idle == pytest.approx(timeline.idle, abs=1e-9)
    late = simulate(schedule, stages, m, forward, backward, chunks, transfer=0.3)
    assert replay(schedule, m, [got], chunks, 0.3).idle == pytest.approx(late.idle, abs=1e-9)
    if len(set(forward)) == len(set(backward)) == 1:
        assert got.idle == pytest.approx((bubble(stages, m, chunks),) * stages, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    stages=st.integers(2, 4),
    rounds=st.integers(1, 3),
    data=st.data(),
)
def test_replaying_a_step_with_each_pass_s_own_time_gives_back_its_idle(
    schedule, stages, rounds, data
):
    """Passes of one stage that each take their own time (jitter): the
    replay of the recorded step is the step, where the medians' is not."""
    chunks = 2 if schedule == "interleaved" else 1
    m = rounds * stages
    plan = [(s, a) for s in range(stages) for a in actions(schedule, s, stages, m, chunks)]
    times = data.draw(st.lists(st.floats(0.1, 3.0), min_size=len(plan), max_size=len(plan)))
    durations = dict(zip(plan, times))
    timeline = simulate(schedule, stages, m, chunks=chunks, durations=durations)
    spans = spans_of(timeline)
    got = replay_step(schedule, m, spans, 7, chunks)
    assert got.idle == pytest.approx(timeline.idle, abs=1e-9)
    assert got.idle == pytest.approx(breakdown(spans, 7, chunks).idle, abs=1e-9)
    late = simulate(schedule, stages, m, chunks=chunks, transfer=0.2, durations=durations)
    assert replay_step(schedule, m, spans, 7, chunks, 0.2).idle == pytest.approx(late.idle)


def test_a_step_whose_passes_are_not_the_schedule_s_is_named():
    timeline = simulate("gpipe", 2, 2)
    spans = spans_of(timeline)
    with pytest.raises(ConfigError) as caught:
        replay_step("1f1b", 2, spans, 7)  # 1F1B's last stage alternates: FBFB.
    assert caught.value.field == "spans"
    assert "process 1: FFBB in step 7" in str(caught.value) and "FBFB" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        simulate("gpipe", 2, 2, durations={})
    assert caught.value.field == "durations" and "none for process 0's" in str(caught.value)


def test_spans_outside_the_window_or_of_other_steps_are_cut_off():
    spans = [
        [
            Span("recv", 2, 0.0, 4.0),  # The step before.
            Span("update", 2, 4.0, 5.0),
            Span("recv", 3, 1.0, 5.0),  # Half of it before the first forward.
            Span("F", 3, 5.0, 7.0),
            Span("send", 3, 7.0, 7.5),
            Span("B", 3, 10.0, 13.0),
            Span("update", 3, 13.0, 14.0),
        ],
        [Span("F", 3, 3.0, 5.0), Span("B", 3, 8.0, 10.0), Span("send", 3, 10.0, 11.0)],
    ]
    got = breakdown(spans, 3)
    assert got.window == 10.0  # 3.0 to 13.0
    assert got.compute == pytest.approx((0.5, 0.4)) and got.idle == pytest.approx((0.5, 0.6))
    assert got.wait == pytest.approx((0.2, 0.0)) and got.send == pytest.approx((0.05, 0.1))
    assert got.update == (1.0, 0.0)


def test_delivery_is_the_median_time_a_waiting_stage_took_to_get_its_message():
    first = [
        Span("F", 5, 0.0, 0.9),
        Span("send", 5, 0.9, 1.0, ("F", 1, 0)),
        Span("F", 5, 1.0, 1.9),
        Span("send", 5, 1.9, 2.0, ("F", 1, 1)),
        Span("recv", 5, 2.0, 3.5, ("B", 0, 0)),  # Waited from 2.0: 0.5 after the send.
        Span("send", 6, 9.0, 9.1, ("F", 1, 0)),  # Another step.
    ]
    second = [
        Span("recv", 5, 0.5, 1.3, ("F", 1, 0)),  # Waited from 0.5: 0.3 after the send.
        Span("recv", 5, 2.5, 2.6, ("F", 1, 1)),  # Began after the send: not a wait.
        Span("send", 5, 2.9, 3.0, ("B", 0, 0)),
        Span("recv", 6, 9.0, 9.2, ("F", 1, 0)),
    ]
    assert delivery([first, second], [5]) == pytest.approx(0.4)  # Of 0.3 and 0.5.
    assert delivery([first, second], [6]) == pytest.approx(0.1)
    assert delivery([first, second], [7]) is None
    assert delivery([[Span("F", 5, 0.0, 1.0)], [Span("recv", 5, 0.0, 2.0)]], [5]) is None


def test_a_process_without_a_pass_of_the_step_is_named():
    spans = [[Span("F", 1, 0.0, 1.0)], [Span("recv", 1, 0.0, 2.0)]]
    with pytest.raises(ConfigError, match=r"spans.*process 1: 1 spans of step 1"):
        breakdown(spans, 1)
    with pytest.raises(ConfigError, match=r"keep.*0"):
        Trace(keep=0)


def test_a_trace_keeps_its_last_steps():
    trace = Trace(keep=2)
    for step in range(5):
        trace.add("F", step, trace.add("recv", step, 0.0))
    assert trace.steps() == [3, 4]
    assert [s.kind for s in trace.spans] == ["recv", "F", "recv", "F"]
    assert all(s.end >= s.start for s in trace.spans)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_record_their_passes_in_the_schedule_s_order_on_one_clock(schedule):
    import keras
    import numpy as np

    from tfdist.pipeline import split_model
    from tfdist.pipeline.runtime import StageRunner
    from tfdist.transport.p2p import connect_stages

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,))] + [keras.layers.Dense(16, name=f"h{i}") for i in range(4)]
    )
    stages = split_model(model, ["h2"])
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    m, steps = 4, 3
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    y = np.zeros((8, 16), "float32")

    def run(k: int) -> Trace:
        links = connect_stages(k, addresses, timeout=30, recv_timeout=60)
        loss = keras.losses.MeanSquaredError()
        runner = StageRunner(stages[k], 2, links, schedule, m, loss, keras.optimizers.SGD(0.1))
        runner.trace = Trace()
        try:
            for step in range(steps):
                runner.train_step(step, [x], y)
        finally:
            runner.close()
        return runner.trace

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        traces = [f.result(timeout=120) for f in [pool.submit(run, k) for k in (0, 1)]]
    for k, trace in enumerate(traces):
        assert trace.steps() == list(range(steps))
        for step in range(steps):
            own = [s for s in trace.spans if s.step == step]
            passes = [s.kind for s in own if s.kind in ("F", "B")]
            assert passes == [a.kind for a in actions(schedule, k, 2, m)]
            # One update, last; a receive before every pass that needs the
            # neighbour, a send after every pass the neighbour needs.
            assert [s.kind for s in own].count("update") == 1 and own[-1].kind == "update"
            assert [s.kind for s in own].count("recv") == m
            assert [s.kind for s in own].count("send") == m
            assert all(a.end <= b.start for a, b in zip(own, own[1:]))
            # Sends and receives name their messages: to stage 1 forward, to 0 back.
            kinds = {"send": "F" if k == 0 else "B", "recv": "B" if k == 0 else "F"}
            for span in (s for s in own if s.kind in kinds):
                assert span.message[0] == kinds[span.kind]
                assert span.message[1] == (1 if span.message[0] == "F" else 0)
    for step in range(steps):
        # Every message one stage sent, the other received; never before the
        # sender began making its bytes.
        for sender, receiver in ((traces[0], traces[1]), (traces[1], traces[0])):
            sent = {s.message: s for s in sender.spans if s.kind == "send" and s.step == step}
            got = {s.message: s for s in receiver.spans if s.kind == "recv" and s.step == step}
            assert sorted(sent) == sorted(got) and len(sent) == m
            assert all(got[key].end >= sent[key].start for key in sent)
    for step in range(steps):
        first, last = ([s for s in t.spans if s.step == step] for t in traces)
        got = breakdown([first, last], step)
        # Stage 1's forward of micro-batch i waits for stage 0's; stage 0's
        # backward for stage 1's: on one clock, the window is stage 0's.
        f0 = [s for s in first if s.kind == "F"]
        f1 = [s for s in last if s.kind == "F"]
        assert all(a.end <= b.start for a, b in zip(f0, f1))
        passes0 = [s for s in first if s.kind in ("F", "B")]
        assert got.window == pytest.approx(passes0[-1].end - passes0[0].start)
        assert all(0 < i < 1 for i in got.idle)
