"""PeerWatchdog's decisions, with a fake probe and clock (no TensorFlow).

The real thing (two processes, one of them stopped) is in test_multi_worker.py.
"""

from __future__ import annotations

import threading

import pytest

from tfdist.strategies.watchdog import PeerWatchdog


class FakeTF:
    """A clock the probes advance, and peers that answer or not."""

    def __init__(self, silent=(), restarted=()):
        self.now = 0.0
        self.silent, self.restarted = set(silent), set(restarted)
        self.probes: list[tuple[str, float]] = []
        self.aborted: list[str] = []

    def probe(self, peer, timeout_s):
        self.probes.append((peer, timeout_s))
        if peer in self.restarted:
            raise type("FailedPreconditionError", (Exception,), {})("incarnation changed")
        if peer in self.silent:
            self.now += timeout_s  # A hung peer: the probe waits out its deadline.
            raise type("DeadlineExceededError", (Exception,), {})("Deadline Exceeded")
        self.now += 0.001

    def clock(self):
        return self.now


PEERS = ["/job:worker/replica:0/task:1", "/job:worker/replica:0/task:2"]


def watchdog(fake, timeout=30.0):
    return PeerWatchdog(
        PEERS, timeout, probe=fake.probe, abort=fake.aborted.append, clock=fake.clock
    )


def test_peers_that_answer_are_left_alone():
    fake = FakeTF()
    dog, last_ok = watchdog(fake), {}
    for _ in range(100):
        assert dog.check_once(last_ok) is None
    assert {p for p, _ in fake.probes} == set(PEERS)
    assert not fake.aborted


def test_a_silent_peer_is_named_once_it_has_been_silent_for_the_timeout():
    fake = FakeTF(silent={PEERS[1]})
    dog, last_ok = watchdog(fake, timeout=30.0), {}
    messages = []
    while not messages and fake.now < 100:
        message = dog.check_once(last_ok)
        if message:
            messages.append(message)
    assert len(messages) == 1
    assert PEERS[1] in messages[0] and PEERS[0] not in messages[0]
    assert "collective_timeout=30" in messages[0]
    # Probes never wait past the timeout, nor longer than 10 s each.
    assert all(t <= 10.0 for _, t in fake.probes)
    assert 30.0 <= fake.now <= 31.0


def test_a_restarted_peer_is_reported_at_once():
    fake = FakeTF(restarted={PEERS[0]})
    message = watchdog(fake, timeout=600).check_once({})
    assert message is not None and "restarted" in message and PEERS[0] in message


def test_the_thread_aborts_with_the_message_and_stops():
    fake = FakeTF(silent={PEERS[0]})
    done = threading.Event()
    aborted = []

    def abort(message):
        aborted.append(message)
        done.set()

    dog = PeerWatchdog(
        PEERS, 2.0, interval=0.0, probe=fake.probe, abort=abort, clock=fake.clock
    ).start()
    assert done.wait(10)
    dog.stop()
    assert aborted == [dog.failure] and PEERS[0] in aborted[0]


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_a_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match=f"Received: {timeout}"):
        PeerWatchdog(PEERS, timeout)


def test_a_peer_that_exits_first_is_not_warned_about_until_half_the_timeout(caplog):
    fake = FakeTF(silent={PEERS[0]})
    dog, last_ok = watchdog(fake, timeout=60.0), {}
    with caplog.at_level("WARNING", logger="tfdist.strategies.watchdog"):
        while fake.now < 15:  # Probes of 10 s: 20 s of silence.
            assert dog.check_once(last_ok) is None
        assert not caplog.records  # A job's normal end: the peer left first.
        while fake.now < 45:
            assert dog.check_once(last_ok) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and PEERS[0] in warned[0]
