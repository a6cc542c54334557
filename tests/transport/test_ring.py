"""Links among any set of processes (tfdist.transport.p2p.connect_peers) and
the ring collectives over them (tfdist.transport.ring.RingGroup), over real
TCP sockets on 127.0.0.1, each process a thread of this one."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from tfdist.engines.net import free_ports
from tfdist.errors import ConfigError
from tfdist.transport import p2p, traffic
from tfdist.transport.ring import RingGroup, chunk_bounds

PeerError = p2p.PeerError
#: Long enough that a test that passes never meets it; short enough that a
#: bug (a lost message) fails the test instead of hanging it.
RECV_TIMEOUT = 20.0
SUMMABLE = ["float32", "float64", "int32", "int64"]


def free_addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{port}" for port in free_ports(n)]


def run_all(calls: list[Callable[[], object]], timeout: float = 15.0) -> list:
    """Each call in its own thread, all at once: its result or its exception."""
    with concurrent.futures.ThreadPoolExecutor(max(len(calls), 1)) as pool:
        futures = [pool.submit(call) for call in calls]
        concurrent.futures.wait(futures, timeout=timeout)
    return [f.exception() or f.result() for f in futures]


def connect_all(
    addresses: list[str], peers: dict[int, set[int]], **kwargs
) -> dict[int, dict | BaseException]:
    """connect_peers for each rank in ``peers`` (only those), at once."""
    kwargs = {"timeout": 5.0, "recv_timeout": RECV_TIMEOUT, **kwargs}
    ranks = sorted(peers)
    calls = [lambda r=r: p2p.connect_peers(r, addresses, peers[r], **kwargs) for r in ranks]
    return dict(zip(ranks, run_all(calls)))


def close_all(outcomes) -> None:
    for links in outcomes:
        if isinstance(links, dict):
            for link in links.values():
                link.close()


def raw_hello(rank: int, count: int) -> bytes:
    """The handshake a process of rank ``rank`` of ``count`` sends first."""
    body = json.dumps({"stage": rank, "stages": count}).encode()
    return p2p.MAGIC + len(body).to_bytes(4, "big") + body


# --- connect_peers ----------------------------------------------------------

#: A 2 x 2 grid: rank = replica * 2 + stage.
GRID_NAMES = [f"stage {s} of replica {r}" for r in range(2) for s in range(2)]


def grid_peers(rank: int) -> set[int]:
    """The pipeline neighbour, and the same stage in the other replica."""
    replica, stage = divmod(rank, 2)
    return {replica * 2 + (1 - stage), (1 - replica) * 2 + stage}


def test_a_grid_links_pipeline_neighbours_and_replicas():
    addresses = free_addresses(4)
    outcomes = connect_all(addresses, {r: grid_peers(r) for r in range(4)}, names=GRID_NAMES)
    try:
        for rank, links in outcomes.items():
            assert not isinstance(links, BaseException), links
            assert set(links) == grid_peers(rank)
            for peer, link in links.items():
                assert (link.stage, link.peer) == (rank, peer)
                assert (link.name, link.peer_name) == (GRID_NAMES[rank], GRID_NAMES[peer])
        for rank, links in outcomes.items():
            for peer, link in links.items():
                link.send(("hi", rank, peer), [np.array([rank, peer])])
        for rank, links in outcomes.items():
            for peer, link in links.items():
                assert link.recv(("hi", peer, rank))[0].tolist() == [peer, rank]
        # Rank 1 (stage 1 of replica 0) closes its link to rank 0.
        outcomes[1][0].close()
        with pytest.raises(PeerError) as caught:
            outcomes[0][1].recv(("B", 0, 0))
        assert str(caught.value) == (
            "stage 1 of replica 0 closed the connection (EOF) "
            "while stage 0 of replica 0 waited for ('B', 0, 0)"
        )
        assert (caught.value.stage, caught.value.peer) == (0, 1)
        with pytest.raises(PeerError, match="stage 1 of replica 0 cannot send .* to stage 0 of"):
            outcomes[1][0].send(("F", 0, 0), [np.zeros(1)])
        # The other links are intact.
        outcomes[0][2].send(("F", 1), [np.ones(2)])
        assert outcomes[2][0].recv(("F", 1))[0].tolist() == [1.0, 1.0]
    finally:
        close_all(outcomes.values())


@pytest.mark.parametrize("bad", [3, -1, True, "1", 1.0, None])
def test_a_peer_out_of_range_is_refused(bad):
    with pytest.raises(ConfigError) as caught:
        p2p.connect_peers(0, free_addresses(3), [1, bad], timeout=1)
    assert (caught.value.field, caught.value.value) == ("peers", bad)
    assert "connect_peers()" in str(caught.value)
    assert "integers in [0, 2]" in str(caught.value)
    assert f"Received: {bad!r} in peers=[1, {bad!r}]" in str(caught.value)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"rank": 3}, "rank"),
        ({"peers": "12"}, "peers"),
        ({"peers": 1}, "peers"),
        ({"names": ["a", "b"]}, "names"),
        ({"names": "abc"}, "names"),
        ({"names": ["a", "", "c"]}, "names"),
        ({"timeout": 0}, "timeout"),
    ],
)
def test_bad_arguments_are_refused(kwargs, field):
    args = {"rank": 0, "addresses": free_addresses(3), "peers": [1], **kwargs}
    with pytest.raises(ConfigError) as caught:
        p2p.connect_peers(**args)
    assert (caught.value.field, caught.value.value) == (field, kwargs[field])
    assert str(caught.value).startswith("connect_peers(): ")


def test_a_lower_peer_that_never_connects_is_named():
    addresses = free_addresses(3)
    names = ["first", "second", "third"]
    start = time.monotonic()
    # Rank 0 never runs: rank 2 waits for it, rank 1 (which connects) is linked.
    outcomes = connect_all(addresses, {2: {0, 1}, 1: {2}}, timeout=1.0, names=names)
    assert 0.95 <= time.monotonic() - start < 5
    error = outcomes[2]
    assert isinstance(error, PeerError), error
    assert str(error) == (
        f"third listened on {addresses[2]} for 1 s, and first (addresses[0] = {addresses[0]}) "
        "never connected"
    )
    assert (error.stage, error.peer) == (2, 0)
    # Rank 2 closed the link it had made: rank 1's fails at once.
    assert set(outcomes[1]) == {2}
    with pytest.raises(PeerError, match="third closed the connection"):
        outcomes[1][2].recv(("F", 0), timeout=5)
    close_all(outcomes.values())


def test_a_higher_peer_that_never_listens_is_named():
    addresses = free_addresses(3)
    names = ["first", "second", "third"]
    start = time.monotonic()
    with pytest.raises(PeerError) as caught:
        p2p.connect_peers(0, addresses, {2}, timeout=1.0, names=names)
    assert 0.95 <= time.monotonic() - start < 5
    assert f"first could not connect to third at {addresses[2]} within 1 s" in str(caught.value)
    assert caught.value.peer == 2


def test_one_failing_job_stops_the_others_at_once():
    addresses = free_addresses(4)
    start = time.monotonic()
    # Rank 1 accepts rank 0 and connects to ranks 2 and 3, which never come up:
    # rank 0, given another count of processes, fails the accepting job, and
    # both connecting jobs stop instead of retrying for 10 s.
    low, high = run_all(
        [
            lambda: p2p.connect_peers(0, addresses[:2], {1}, timeout=10),
            lambda: p2p.connect_peers(1, addresses, {0, 2, 3}, timeout=10),
        ]
    )
    assert time.monotonic() - start < 3
    assert isinstance(low, ConfigError) and isinstance(high, ConfigError)
    assert (high.field, high.value) == ("len(addresses)", 2)
    assert "the count of processes that stage 1 was given" in str(high)


def test_an_unexpected_rank_is_refused():
    addresses = free_addresses(3)
    start = time.monotonic()
    # Rank 0 says rank 2 is its peer; rank 2 expects only rank 1.
    outcomes = connect_all(addresses, {0: {2}, 2: {1}}, timeout=5.0)
    assert time.monotonic() - start < 3  # At the handshake, not at the timeout.
    error = outcomes[2]
    assert isinstance(error, ConfigError), error
    assert (error.field, error.value) == ("rank", 0)
    assert "expected 1, a peer of stage 2" in str(error)
    assert "the rank that process was given" in str(error)
    close_all(outcomes.values())


def test_strays_and_a_second_hello_from_a_linked_rank_are_dropped():
    addresses = free_addresses(3)
    host, port = addresses[2].rsplit(":", 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        upper = pool.submit(p2p.connect_peers, 2, addresses, {0, 1}, timeout=5.0)
        links0 = p2p.connect_peers(0, addresses, {2}, timeout=5.0)
        # A second hello from rank 0: rank 2 answers with its own, then closes.
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(raw_hello(0, 3))
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
            assert received == raw_hello(2, 3)
        # A stray: closed (reset, as rank 2 leaves part of it unread).
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                while sock.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        links1 = p2p.connect_peers(1, addresses, {2}, timeout=5.0)
        links2 = upper.result(timeout=10)
    try:
        assert set(links2) == {0, 1}
        links0[2].send(("F", 0), [np.arange(3)])
        assert links2[0].recv(("F", 0), timeout=5)[0].tolist() == [0, 1, 2]
    finally:
        close_all([links0, links1, links2])


# --- RingGroup --------------------------------------------------------------

SIZES = [1, 2, 3, 4]


def ring_peers(rank: int, size: int) -> set[int]:
    return {(rank - 1) % size, (rank + 1) % size} - {rank}


def connect_ring(size: int) -> list[RingGroup]:
    addresses = free_addresses(size)
    names = [f"member {r}" for r in range(size)]
    outcomes = connect_all(addresses, {r: ring_peers(r, size) for r in range(size)}, names=names)
    for links in outcomes.values():
        if isinstance(links, BaseException):
            close_all(outcomes.values())
            raise links
    return [RingGroup(r, size, outcomes[r]) for r in range(size)]


def close_rings(groups: list[RingGroup]) -> None:
    for group in groups:
        for link in {group._left, group._right} - {None}:
            link.close()


@pytest.fixture(scope="module")
def rings():
    groups = {size: connect_ring(size) for size in SIZES}
    yield groups
    for members in groups.values():
        close_rings(members)


def collective(groups: list[RingGroup], call: Callable[[RingGroup, int], object]) -> list:
    """``call(group, rank)`` on every member at once; the results in rank order."""
    outcomes = run_all([lambda g=g: call(g, g.rank) for g in groups], timeout=10)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


def member_input(rng: np.random.Generator, shape: tuple, dtype: str) -> np.ndarray:
    """float64: multiples of 1/4, whose sums are exact in any order."""
    if dtype == "float32":
        return rng.standard_normal(shape).astype(np.float32)
    if dtype == "float64":
        return rng.integers(-4000, 4000, shape) / 4.0
    return rng.integers(-(2**20), 2**20, shape).astype(dtype)


def expected_allreduce_sent(rank: int, size: int, arrays: list[np.ndarray]) -> int:
    """Each dtype's arrays are one flat buffer in ``size`` chunks; a member
    sends every chunk but one in the reduce-scatter and every chunk but one in
    the all-gather (it holds the sum of chunk rank + 1 when the scatter ends)."""
    if size == 1:
        return 0
    total = 0
    for dtype in {a.dtype for a in arrays}:
        length = sum(a.size for a in arrays if a.dtype == dtype)
        chunks = [len(c) for c in np.array_split(np.arange(length), size)]
        elements = 2 * length - chunks[(rank + 1) % size] - chunks[(rank + 2) % size]
        total += elements * dtype.itemsize
    return total


def payload_bytes(groups: list[RingGroup]) -> list[int]:
    return [g._right.bytes_sent if g._right is not None else 0 for g in groups]


@settings(max_examples=15, deadline=None)
@given(
    size=st.sampled_from(SIZES),
    specs=st.lists(
        st.tuples(
            hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=7),
            st.sampled_from(SUMMABLE),
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_allreduce_sums_and_every_member_gets_the_same_bits(rings, size, specs, seed):
    groups = rings[size]
    rng = np.random.default_rng(seed)
    inputs = [[member_input(rng, shape, dtype) for shape, dtype in specs] for _ in groups]
    sent_before = [g.sent["allreduce"] for g in groups]
    wire_before = payload_bytes(groups)
    outputs = collective(groups, lambda g, r: g.allreduce(*inputs[r]))
    for i, (shape, dtype) in enumerate(specs):
        want = np.sum(np.stack([member[i] for member in inputs]), axis=0, dtype=dtype)
        for output in outputs:
            got = output[i]
            assert (got.dtype, got.shape) == (np.dtype(dtype), shape)
            assert got.tobytes() == outputs[0][i].tobytes()  # Bitwise the same everywhere.
            if dtype == "float32":
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert np.array_equal(got, want)
    payload = sum(a.nbytes for a in inputs[0])
    for r, group in enumerate(groups):
        sent = group.sent["allreduce"] - sent_before[r]
        assert sent == expected_allreduce_sent(r, size, inputs[r])
        # Up to the chunks' rounding: under 2 elements per dtype off the ideal.
        slack = 2 * 8 * len({a.dtype for a in inputs[r]})
        assert abs(sent - traffic.all_reduce_bytes(payload, size)) < slack
        assert payload_bytes(groups)[r] - wire_before[r] == sent  # What the link counted.


def test_allreduce_of_arrays_smaller_than_the_group_and_empty_ones(rings):
    groups = rings[4]
    inputs = [
        [np.array([r + 1.0]), np.zeros((0, 3), np.float32), np.array(r, np.int32)] for r in range(4)
    ]
    outputs = collective(groups, lambda g, r: g.allreduce(*inputs[r]))
    for output in outputs:
        assert output[0].tolist() == [10.0]
        assert output[1].shape == (0, 3) and output[1].dtype == np.float32
        assert output[2].shape == () and int(output[2]) == 6 and output[2].dtype == np.int32
    assert collective(groups, lambda g, r: g.allreduce()) == [[]] * 4


@settings(max_examples=15, deadline=None)
@given(
    size=st.sampled_from(SIZES),
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5),
    dtype=st.sampled_from(["float32", "float16", "int8", "int64", "bool", ">f8"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_allgather_stacks_in_rank_order(rings, size, shape, dtype, seed):
    groups = rings[size]
    rng = np.random.default_rng(seed)
    inputs = [np.asarray(rng.standard_normal(shape) * 50).astype(dtype) for _ in groups]
    sent_before = [g.sent["allgather"] for g in groups]
    outputs = collective(groups, lambda g, r: g.allgather(inputs[r]))
    for r, output in enumerate(outputs):
        assert output.dtype == np.dtype(dtype) and output.shape == (size, *shape)
        assert np.array_equal(output, np.stack(inputs))  # np.stack: in native byte order.
        sent = groups[r].sent["allgather"] - sent_before[r]
        assert sent == traffic.all_gather_bytes(inputs[r].nbytes, size)


@settings(max_examples=15, deadline=None)
@given(
    size=st.sampled_from(SIZES),
    counts=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    rest=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),
    dtype=st.sampled_from(["float32", "int64", "uint8"]),
)
def test_allgatherv_concatenates_in_rank_order(rings, size, counts, rest, dtype):
    groups = rings[size]
    counts = counts[:size]
    inputs = [np.full((n, *rest), r + 1, dtype) for r, n in enumerate(counts)]
    sent_before = [g.sent["allgatherv"] for g in groups]
    outputs = collective(groups, lambda g, r: g.allgatherv(inputs[r]))
    want = np.concatenate(inputs)
    for r, output in enumerate(outputs):
        assert output.dtype == want.dtype and output.shape == want.shape
        assert np.array_equal(output, want)
        # Every block but that of the next rank, which is the last to need it.
        expected = sum(b.nbytes for b in inputs) - inputs[(r + 1) % size].nbytes
        assert groups[r].sent["allgatherv"] - sent_before[r] == (expected if size > 1 else 0)


def test_allgatherv_with_a_member_of_no_rows(rings):
    groups = rings[3]
    inputs = [np.arange(6.0).reshape(3, 2), np.zeros((0, 2)), np.ones((1, 2))]
    for output in collective(groups, lambda g, r: g.allgatherv(inputs[r])):
        assert output.tolist() == [[0, 1], [2, 3], [4, 5], [1, 1]]


def test_a_group_of_one_returns_copies():
    group = RingGroup(0, 1, {})
    x = np.arange(4.0)
    (total,) = group.allreduce(x)
    gathered = group.allgather(x)
    rows = group.allgatherv(x.reshape(2, 2))
    assert total.tolist() == x.tolist() and not np.shares_memory(total, x)
    assert gathered.shape == (1, 4) and not np.shares_memory(gathered, x)
    assert rows.tolist() == [[0, 1], [2, 3]] and not np.shares_memory(rows, x)
    assert group.sent == {"allreduce": 0, "allgather": 0, "allgatherv": 0}


@pytest.mark.parametrize("dtype", ["float16", "bool", "int8", "uint32", "complex64"])
def test_allreduce_refuses_a_dtype_it_cannot_sum(dtype):
    with pytest.raises(ConfigError) as caught:
        RingGroup(0, 1, {}).allreduce(np.zeros(2), np.zeros(3, dtype))
    assert (caught.value.field, caught.value.value) == ("arrays[1]", np.dtype(dtype))
    assert f"Received: an array of {dtype}" in str(caught.value)


def test_bad_group_settings_are_refused(rings):
    links = {1: rings[2][0]._right}
    for kwargs, field in [
        ({"rank": 2, "size": 2, "links": links}, "rank"),
        ({"rank": 0, "size": 0, "links": {}}, "size"),
        ({"rank": 0, "size": 3, "links": links}, "links"),
        ({"rank": 0, "size": 2, "links": links, "name": ""}, "name"),
    ]:
        with pytest.raises(ConfigError) as caught:
            RingGroup(**kwargs)
        assert caught.value.field == field


def test_members_that_pass_other_shapes_are_refused():
    groups = connect_ring(2)
    try:
        outcomes = run_all(
            [lambda: groups[0].allreduce(np.zeros(4)), lambda: groups[1].allreduce(np.zeros(6))]
        )
    finally:
        close_rings(groups)
    for outcome in outcomes:
        assert isinstance(outcome, ConfigError), outcome
        assert outcome.field == "arrays"
        assert "the same dtypes and shapes on every member of 'ring'" in str(outcome)


def test_other_traffic_and_other_groups_on_the_same_links_do_not_mix():
    groups = connect_ring(3)
    # A second group over the same links, under another name.
    other = [
        RingGroup(g.rank, 3, {(g.rank - 1) % 3: g._left, (g.rank + 1) % 3: g._right}, name="b")
        for g in groups
    ]
    try:
        groups[0]._right.send(("F", 0, 0), [np.array([7])])  # A pipeline's activation.

        def both(g: RingGroup, r: int) -> tuple:
            first = g.allreduce(np.full(5, r, np.int64))
            second = other[r].allreduce(np.full(5, 10 * r, np.int64))
            return first[0].tolist(), second[0].tolist()

        for first, second in collective(groups, both):
            assert (first, second) == ([3] * 5, [30] * 5)
        assert groups[1]._left.recv(("F", 0, 0), timeout=0)[0].tolist() == [7]
    finally:
        close_rings(groups)


@pytest.mark.parametrize("size", [3, 4])
def test_a_dead_member_fails_the_others_instead_of_hanging(size):
    groups = connect_ring(size)

    def member(g: RingGroup, r: int) -> object:
        if r == 0:  # Dies mid-call: its links close while the others wait for it.
            time.sleep(0.3)
            close_rings([g])
            return None
        try:
            return g.allreduce(np.ones(1000))
        except BaseException:
            close_rings([g])  # As a process that exits on the error does.
            raise

    start = time.monotonic()
    try:
        outcomes = run_all([lambda g=g: member(g, g.rank) for g in groups], timeout=10)
    finally:
        close_rings(groups)
    assert time.monotonic() - start < 2  # Not the links' 20 s recv_timeout.
    assert all(isinstance(outcome, PeerError) for outcome in outcomes[1:]), outcomes
    # Member 1 waited for member 0, its left neighbour.
    assert "member 0 closed the connection" in str(outcomes[1])
    assert "while member 1 waited for ('ring', 'allreduce', 0, " in str(outcomes[1])


def test_chunk_bounds_split_as_numpy_does():
    for length in range(12):
        for parts in range(1, 6):
            sizes = [stop - start for start, stop in chunk_bounds(length, parts)]
            assert sizes == [len(c) for c in np.array_split(np.arange(length), parts)]
