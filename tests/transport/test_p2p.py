"""Point-to-point links between pipeline stages (tfdist.transport.p2p), over
real TCP sockets on 127.0.0.1: stages in threads of this process, and one in
its own process (tests/workers/p2p_peer.py) that is SIGKILLed mid-recv."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from conftest import REPO, result_line, subprocess_env
from tfdist.engines.net import free_ports
from tfdist.errors import ConfigError, TfdistError
from tfdist.transport import p2p

try:
    import ml_dtypes
except ImportError:  # bfloat16 is tested only where ml_dtypes is installed.
    ml_dtypes = None

PEER = REPO / "tests" / "workers" / "p2p_peer.py"
#: Long enough that a test that passes never meets it; short enough that a
#: bug (a lost message) fails the test instead of hanging it.
RECV_TIMEOUT = 20.0


PeerError = p2p.PeerError


def free_addresses(n: int) -> list[str]:
    """``n`` distinct free ports on 127.0.0.1, as ``host:port``."""
    return [f"127.0.0.1:{port}" for port in free_ports(n)]


def run_stages(calls: list[tuple[int, list[str]]], timeout: float = 10.0, **kwargs) -> list:
    """connect_stages for each ``(stage, addresses)`` in its own thread, all at
    once: each one's links, or the exception it raised."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [
            pool.submit(p2p.connect_stages, stage, addresses, timeout=timeout, **kwargs)
            for stage, addresses in calls
        ]
        concurrent.futures.wait(futures, timeout=timeout + 10)
    return [f.exception() or f.result() for f in futures]


def connect_chain(n: int, recv_timeout: float | None = RECV_TIMEOUT) -> list[dict]:
    addresses = free_addresses(n)
    outcomes = run_stages([(k, addresses) for k in range(n)], recv_timeout=recv_timeout)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def connect_pair(recv_timeout: float | None = RECV_TIMEOUT):
    """Stage 0's link to stage 1 and stage 1's link to stage 0."""
    links = connect_chain(2, recv_timeout)
    return links[0][1], links[1][0]


@pytest.fixture
def pair():
    a, b = connect_pair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def shared_pair():
    a, b = connect_pair()
    yield a, b
    a.close()
    b.close()


def assert_same(received: list[np.ndarray], sent: list[np.ndarray]) -> None:
    """Same dtype, shape and bytes (NaNs included) as sent, in C order."""
    assert len(received) == len(sent)
    for got, want in zip(received, sent):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert got.tobytes() == want.tobytes()


# --- Round trips ------------------------------------------------------------

DTYPES = ["float32", "float16", "float64", "int8", "int32", "int64", "uint8", "bool"]
DTYPES += ["complex64", ">f4", ">i8"] + (["bfloat16"] if ml_dtypes is not None else [])
_TAGS = itertools.count()


@st.composite
def array_strategy(draw) -> np.ndarray:
    name = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    if name == "bfloat16":
        floats = st.floats(-1e4, 1e4, width=32)
        arr = draw(hnp.arrays(np.float32, shape, elements=floats)).astype(ml_dtypes.bfloat16)
    else:
        arr = draw(hnp.arrays(np.dtype(name), shape))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T  # Not C-contiguous: the link sends a C-order copy.
    return arr


@settings(max_examples=25, deadline=None)
@given(arrays=st.lists(array_strategy(), max_size=4), backwards=st.booleans())
def test_arrays_round_trip_with_dtype_and_shape(shared_pair, arrays, backwards):
    sender, receiver = shared_pair[::-1] if backwards else shared_pair
    tag = ("H", next(_TAGS), "round trip")
    sender.send(tag, arrays)
    got = receiver.recv(tag)
    assert_same(got, arrays)
    # Aligned, so that TensorFlow can take them without a copy.
    assert all(a.size == 0 or a.ctypes.data % p2p.ALIGN_BYTES == 0 for a in got)


def test_edge_arrays_round_trip(pair):
    a, b = pair
    grid = np.arange(24, dtype=np.float64).reshape(4, 6)
    sent = [
        np.array(2.5, np.float32),  # 0-d
        np.array(True),  # 0-d bool
        np.zeros((3, 0, 2), np.int64),  # zero-size
        np.zeros((0,), np.float16),
        grid[:, ::2],  # a strided view
        np.asfortranarray(grid),
        np.array(["ab", "cde"]),  # '<U3'
        np.frombuffer(b"abcdefgh", "V4"),  # plain void
        np.arange(-5, 5, dtype=np.int32),
    ]
    if ml_dtypes is not None:
        sent.append(np.linspace(-2, 2, 7, dtype=np.float32).astype(ml_dtypes.bfloat16))
        sent.append(np.array([0.5, -1.0], ml_dtypes.float8_e4m3fn))
    a.send(("F", 0, 0), sent)
    a.send(("F", 0, 1), [])  # A message of no arrays.
    got = b.recv(("F", 0, 0))
    assert_same(got, sent)
    assert np.array_equal(got[4], grid[:, ::2]) and got[4].flags.c_contiguous
    assert b.recv(("F", 0, 1)) == []
    got[0][...] = 7  # What recv returns is the caller's to write.
    assert float(got[0]) == 7.0


def test_other_tags_wait_in_the_mailbox(pair):
    a, b = pair
    b.send(("B", 1, 0), [np.full(3, 1.0)])
    b.send(("B", 0, 0), [np.full(3, 0.0)])
    # ("B", 1, 0) was sent first, on the same stream: it is in the mailbox by now.
    (first,) = a.recv(("B", 0, 0))
    (later,) = a.recv(("B", 1, 0), timeout=0)
    assert first.tolist() == [0.0] * 3
    assert later.tolist() == [1.0] * 3
    with pytest.raises(PeerError, match=r"tags waiting in the mailbox: \[\]"):
        a.recv(("B", 1, 0), timeout=0)  # Taken once, gone.


def test_messages_of_one_tag_come_in_order(pair):
    a, b = pair
    for i in range(40):
        a.send(("F", 7), [np.array([i, 2 * i], np.int64)])
        a.send(("other", i % 3), [np.array(-i)])
    got = [b.recv(("F", 7))[0].tolist() for _ in range(40)]
    assert got == [[i, 2 * i] for i in range(40)]
    others = [int(b.recv(("other", i % 3))[0]) for i in range(40)]
    assert others == [-i for i in range(40)]


def test_big_messages_both_ways_at_once_do_not_deadlock(pair):
    a, b = pair
    n = 16 * 1024 * 1024  # 64 MB of float32 each way, far above the sockets' buffers.
    forward = np.arange(n, dtype=np.float32)
    backward = -forward
    errors = []

    def send(link, tag, array):
        try:
            link.send(tag, [array])
        except BaseException as e:  # noqa: BLE001 - reported by the assert below.
            errors.append(e)

    threads = [
        threading.Thread(target=send, args=(a, ("F", 0), forward)),
        threading.Thread(target=send, args=(b, ("B", 0), backward)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "sends deadlocked"
    assert errors == []
    (got_forward,) = b.recv(("F", 0))
    (got_backward,) = a.recv(("B", 0))
    assert np.array_equal(got_forward, forward)
    assert np.array_equal(got_backward, backward)
    assert a.bytes_sent == b.bytes_received == forward.nbytes == 64 * 1024 * 1024


def test_byte_counts_are_the_payloads(pair):
    a, b = pair
    forward = [[np.ones((5, 7), np.float32), np.zeros(3, np.int8)], [], [np.array(1.5)]]
    backward = [[np.ones((100, 100), np.float16)], [np.zeros((2, 0), np.int64)]]
    for i, arrays in enumerate(forward):
        a.send(("F", i), arrays)
    for i, arrays in enumerate(backward):
        b.send(("B", i), arrays)
    for i in range(len(forward)):
        b.recv(("F", i))
    for i in range(len(backward)):
        a.recv(("B", i))
    expected_forward = sum(x.nbytes for arrays in forward for x in arrays)
    expected_backward = sum(x.nbytes for arrays in backward for x in arrays)
    assert (expected_forward, expected_backward) == (5 * 7 * 4 + 3 + 8, 100 * 100 * 2)
    assert a.bytes_sent == b.bytes_received == expected_forward
    assert b.bytes_sent == a.bytes_received == expected_backward


def test_three_stages_pass_activations_up_and_gradients_down():
    links = connect_chain(3)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)

    def first():
        links[0][1].send(("F", 0, 0), [x])
        return links[0][1].recv(("B", 0, 0))[0]

    def middle():
        (h,) = links[1][0].recv(("F", 0, 0))
        links[1][2].send(("F", 0, 0), [h * 2])
        (g,) = links[1][2].recv(("B", 0, 0))
        links[1][0].send(("B", 0, 0), [g + 1])

    def last():
        (h,) = links[2][1].recv(("F", 0, 0))
        links[2][1].send(("B", 0, 0), [np.full_like(h, h.sum())])

    try:
        assert [sorted(stage_links) for stage_links in links] == [[1], [0, 2], [1]]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(f) for f in (first, middle, last)]
            grad = futures[0].result(timeout=30)
            for future in futures[1:]:
                future.result(timeout=30)
    finally:
        for stage_links in links:
            for link in stage_links.values():
                link.close()
    assert np.array_equal(grad, np.full((3, 4), (x * 2).sum() + 1, np.float32))
    assert links[1][0].bytes_received == links[1][2].bytes_sent == x.nbytes


# --- Dead and silent peers --------------------------------------------------


def test_sigkilled_peer_fails_the_waiting_recv_at_once():
    addresses = free_addresses(2)
    proc = subprocess.Popen(
        [sys.executable, str(PEER), "1", ",".join(addresses)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        proc.send_signal(signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    link = None
    try:
        link = p2p.connect_stages(0, addresses, timeout=30, recv_timeout=60)[1]
        x = np.arange(10, dtype=np.float32)
        link.send(("F", 0, 0), [x])
        (doubled,) = link.recv(("B", 0, 0))
        assert np.array_equal(doubled, 2 * x)
        timer.start()  # Kills the peer while the recv below waits.
        with pytest.raises(PeerError) as caught:
            link.recv(("B", 3, 0))
        waited = time.monotonic() - killed_at[0]
        with pytest.raises(PeerError, match="stage 0 cannot send .* to stage 1"):
            link.send(("F", 3, 0), [x])
        out, err = proc.communicate(timeout=30)
    finally:
        timer.cancel()
        if link is not None:
            link.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    message = str(caught.value)
    assert waited < 5, f"PeerError came {waited:.1f} s after the kill: {message}"
    assert "stage 1" in message and "stage 0 waited for ('B', 3, 0)" in message
    assert (caught.value.stage, caught.value.peer, caught.value.tag) == (0, 1, ("B", 3, 0))
    assert proc.returncode == -signal.SIGKILL, err
    assert result_line(out) == {"stage": 1, "peers": [0], "sums": [float(x.sum())]}


def test_closed_peer_fails_recv_but_earlier_messages_still_arrive(pair):
    a, b = pair
    b.send(("B", 2, 0), [np.array([4, 5])])
    threading.Timer(0.3, b.close).start()
    start = time.monotonic()
    with pytest.raises(PeerError) as caught:
        a.recv(("B", 3, 0))
    assert time.monotonic() - start < 5  # At once, not after RECV_TIMEOUT.
    assert str(caught.value) == (
        "stage 1 closed the connection (EOF) while stage 0 waited for ('B', 3, 0)"
    )
    assert isinstance(caught.value, TfdistError) and isinstance(caught.value, RuntimeError)
    # What arrived before the peer closed is still there.
    assert a.recv(("B", 2, 0))[0].tolist() == [4, 5]


def test_silent_peer_times_out_after_recv_timeout():
    a, b = connect_pair(recv_timeout=1.0)
    try:
        b.send(("F", 9), [np.zeros(2)])  # Another tag: not what a waits for.
        start = time.monotonic()
        with pytest.raises(PeerError) as caught:
            a.recv(("B", 3, 0))
        waited = time.monotonic() - start
        assert 0.95 <= waited < 5
        message = str(caught.value)
        assert "stage 1 sent nothing tagged ('B', 3, 0) to stage 0 within 1 s" in message
        assert "[('F', 9)]" in message  # The tags that did come.
        copy = pickle.loads(pickle.dumps(caught.value))
        assert (str(copy), copy.peer, copy.tag) == (message, 1, ("B", 3, 0))
        # A timeout is not a broken link: the message still comes when sent.
        b.send(("B", 3, 0), [np.ones(2)])
        assert a.recv(("B", 3, 0))[0].tolist() == [1.0, 1.0]
        start = time.monotonic()
        with pytest.raises(PeerError, match=r"within 0\.2 s"):
            a.recv(("B", 4, 0), timeout=0.2)  # The call's own timeout wins.
        assert time.monotonic() - start < 5
    finally:
        a.close()
        b.close()


def test_a_malformed_message_breaks_the_link_at_once(pair):
    a, b = pair
    b._sock.sendall(struct.pack("!I", 9) + b"not json!")  # A header that is no header.
    start = time.monotonic()
    with pytest.raises(PeerError, match="stage 1 sent a message stage 0 cannot read"):
        a.recv(("B", 0, 0))
    assert time.monotonic() - start < 5


def _socket_fds() -> int:
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # The listing's own fd, closed by now.
    return sum(link.startswith("socket:") for link in links)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_close_is_idempotent_and_leaves_no_thread_or_socket():
    before, threads_before = _socket_fds(), set(threading.enumerate())
    a, b = connect_pair()
    a.post(("F", 0), [np.zeros(1024)])  # Starts a's sender thread.
    threads = [a._thread, b._thread]
    assert all(thread.is_alive() for thread in threads)
    assert _socket_fds() == before + 2
    for link in (a, b, a, b):
        link.close()
    assert not any(thread.is_alive() for thread in threads)
    assert set(threading.enumerate()) - threads_before == set()
    assert _socket_fds() == before
    with pytest.raises(PeerError, match="stage 0 closed its link to stage 1"):
        a.recv(("B", 0))
    with pytest.raises(PeerError, match="stage 1 cannot send"):
        b.send(("B", 0), [np.zeros(1)])
    with pytest.raises(PeerError, match="stage 0 cannot send.*closed its link"):
        a.post(("F", 1), [np.zeros(1)])


def test_bad_tags_and_arrays_are_refused_before_sending(pair):
    a, b = pair
    cases = [
        (["F", 1], [np.zeros(1)], "tag"),
        (("F", 1.5), [np.zeros(1)], "tag"),
        (("F", True), [np.zeros(1)], "tag"),
        (("F", 1), np.zeros(3), "arrays"),
        (("F", 1), [np.zeros(1), np.array([object()])], "arrays[1]"),
    ]
    for tag, arrays, field in cases:
        with pytest.raises(ConfigError) as caught:
            a.send(tag, arrays)
        assert caught.value.field == field
    a.send(("F", 1), [np.arange(3)])  # The link is intact: nothing half-sent.
    assert b.recv(("F", 1))[0].tolist() == [0, 1, 2]
    assert b.bytes_received == np.arange(3).nbytes


# --- Posted sends -------------------------------------------------------------


def _link_to_a_reader_that_never_reads() -> tuple[p2p.Link, socket.socket]:
    """A Link whose peer is a bare TCP socket nobody reads from."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return p2p.Link(sender, 0, 1, recv_timeout=RECV_TIMEOUT), peer


def test_post_returns_before_the_peer_reads_and_flush_waits_for_it():
    link, peer = _link_to_a_reader_that_never_reads()
    try:
        # 64 MB: far more than the sockets' buffers hold, so a send would
        # block until the peer reads; a post does not.
        big = np.ones(16 * 1024 * 1024, np.float32)
        link.post(("F", 0, 1, 0), [big])
        link.post(("F", 0, 1, 1), [big[:10]])
        with pytest.raises(
            PeerError,
            match=r"stage 0 could not send 2 posted message\(s\) to "
            r"stage 1 within 0\.5 s",
        ):
            link.flush(timeout=0.5)
        assert link.bytes_sent == 0
        peer.close()  # The peer goes away with the messages unread.
        with pytest.raises(PeerError, match=r"stage 0 cannot send \('F', 0, 1, 0\) to stage 1"):
            link.flush()
        with pytest.raises(PeerError, match="stage 0 cannot send"):
            link.post(("F", 1, 1, 0), [big[:10]])  # Later posts fail at once.
    finally:
        link.close()
        peer.close()


def test_closing_a_link_while_its_sender_writes_names_the_close():
    # The sender thread is inside a write (64 MB to a peer that never reads)
    # when the link is closed: the posted message and every later post fail
    # naming the close, not the broken pipe the close made.
    link, peer = _link_to_a_reader_that_never_reads()
    try:
        link.post(("F", 0, 1, 0), [np.ones(16 * 1024 * 1024, np.float32)])
        with pytest.raises(PeerError, match="within 0.2 s"):
            link.flush(timeout=0.2)  # Still writing: the peer's buffers are full.
        link.close()
        for _ in range(2):
            with pytest.raises(PeerError, match=r"stage 0 cannot send .*stage 0 closed its link"):
                link.post(("F", 0, 1, 1), [np.zeros(1)])
    finally:
        link.close()
        peer.close()


def test_posted_messages_leave_in_post_order_beside_sends(pair):
    a, b = pair
    for i in range(40):
        a.post(("F", 7), [np.array([i, 2 * i], np.int64), np.full(20_000, i, np.float32)])
        a.send(("other", i % 3), [np.array(-i)])
    a.flush()
    got = [b.recv(("F", 7)) for _ in range(40)]
    assert [g[0].tolist() for g in got] == [[i, 2 * i] for i in range(40)]
    assert all(np.all(g[1] == i) for i, g in enumerate(got))
    assert [int(b.recv(("other", i % 3))[0]) for i in range(40)] == [-i for i in range(40)]
    assert a.bytes_sent == b.bytes_received == 40 * (16 + 80_000 + 8)


def test_bad_posts_are_refused_at_the_call(pair):
    a, b = pair
    with pytest.raises(ConfigError) as caught:
        a.post(("F", 1.5), [np.zeros(1)])
    assert caught.value.field == "tag"
    with pytest.raises(ConfigError) as caught:
        a.post(("F", 1), [np.array([object()])])
    assert caught.value.field == "arrays[0]"
    a.post(("F", 1), [np.arange(3)])  # Nothing half-sent: the link is intact.
    a.flush()
    assert b.recv(("F", 1))[0].tolist() == [0, 1, 2]


# --- Bad settings and handshakes --------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:http",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        ":29500",
        "::1:29500",
        "bad host:29500",
        29500,
        None,
    ],
)
def test_a_malformed_address_names_its_index(bad):
    addresses = [*free_addresses(1), bad]
    with pytest.raises(ConfigError) as caught:
        p2p.connect_stages(0, addresses, timeout=1)
    assert caught.value.field == "addresses[1]"
    assert caught.value.value == bad
    assert f"Received: {bad!r}" in str(caught.value)
    assert "'host:port'" in str(caught.value)


def test_a_duplicate_address_names_both_indexes():
    a0, a1 = free_addresses(2)
    with pytest.raises(ConfigError) as caught:
        p2p.connect_stages(0, [a0, a1, a0], timeout=1)
    assert (caught.value.field, caught.value.value) == ("addresses[2]", a0)
    assert "addresses[0]" in str(caught.value)


@pytest.mark.parametrize("stage", [-1, 2, True, "0", 1.0])
def test_a_stage_out_of_range_is_refused(stage):
    with pytest.raises(ConfigError) as caught:
        p2p.connect_stages(stage, free_addresses(2), timeout=1)
    assert (caught.value.field, caught.value.value) == ("stage", stage)
    assert "an integer in [0, 1]" in str(caught.value)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"recv_timeout": -1}, "recv_timeout"),
    ],
)
def test_bad_timeouts_are_refused(kwargs, field):
    with pytest.raises(ConfigError) as caught:
        p2p.connect_stages(0, free_addresses(2), **kwargs)
    assert (caught.value.field, caught.value.value) == (field, kwargs[field])


def test_addresses_as_one_string_is_refused():
    joined = ",".join(free_addresses(2))
    with pytest.raises(ConfigError) as caught:
        p2p.connect_stages(0, joined)
    assert (caught.value.field, caught.value.value) == ("addresses", joined)


def test_stages_given_different_counts_both_refuse():
    a0, a1, a2 = free_addresses(3)
    start = time.monotonic()
    low, high = run_stages([(0, [a0, a1, a2]), (1, [a0, a1])])
    assert time.monotonic() - start < 5  # Refused at the handshake, not at the timeout.
    assert isinstance(low, ConfigError) and isinstance(high, ConfigError)
    assert (low.field, low.value, high.field, high.value) == (
        "len(addresses)",
        2,
        "len(addresses)",
        3,
    )
    assert "expected 3" in str(low) and "Received: 2 from stage 1" in str(low)
    assert "expected 2" in str(high) and "Received: 3 from stage 0" in str(high)


def test_stages_given_different_orders_both_refuse():
    a0, a1, a2 = free_addresses(3)
    # Stage 0 reaches addresses[1] = a1, where a process that calls itself
    # stage 2 (its addresses[2] is a1) listens.
    low, high = run_stages([(0, [a0, a1, a2]), (2, [a0, a2, a1])])
    assert isinstance(low, ConfigError) and isinstance(high, ConfigError)
    assert (low.field, low.value, high.field, high.value) == ("stage", 2, "stage", 0)
    assert "expected 1" in str(low) and "expected 1" in str(high)


def test_a_peer_that_never_comes_up_is_named():
    a0, a1 = free_addresses(2)
    start = time.monotonic()
    with pytest.raises(PeerError) as caught:
        p2p.connect_stages(0, [a0, a1], timeout=1.0)
    assert 0.95 <= time.monotonic() - start < 5
    assert "stage 0 could not connect to stage 1 at " + a1 in str(caught.value)
    with pytest.raises(PeerError) as caught:
        p2p.connect_stages(1, [a0, a1], timeout=1.0)
    assert f"stage 0 (addresses[0] = {a0}) never connected" in str(caught.value)
    assert caught.value.peer == 0
