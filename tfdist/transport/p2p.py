"""Point-to-point links between the stages of a pipeline-parallel job.

Stage ``k`` of ``p`` sends activations to stage ``k + 1`` and receives
gradients from it, over one TCP connection per pair of neighbouring stages
(what gloo's ``send``/``recv`` are to PyTorch's pipelines). Each
:class:`Link` carries tagged messages of numpy arrays in both directions:

    links = connect_stages(stage, ["host0:29500", "host1:29500"])
    links[stage + 1].send(("F", step, microbatch), [activations])
    (grad,) = links[stage + 1].recv(("B", step, microbatch))

A receiver thread per link drains the socket into a mailbox as messages
arrive, so :meth:`Link.send` never waits for the peer's program to call
``recv``, and two stages sending each other large messages at once do not
deadlock. :meth:`Link.recv` takes the message with the tag asked for; others
wait in the mailbox, those of one tag in the order they were sent.
:meth:`Link.post` hands a message to a sender thread and returns at once (as
gloo's ``isend``), so a stage computes its next micro-batch while its last
one's activations are written; :meth:`Link.flush` waits until every posted
message is in the kernel, and raises the first failure.

Wire format, after a handshake (``MAGIC``, then a length-prefixed JSON hello
giving the sender's stage and the count of stages): each message is a 4-byte
big-endian header length, a JSON header ``{"tag": [...], "arrays": [[dtype,
shape], ...]}``, then each array's raw C-order bytes. Dtypes travel as
``dtype.str`` (byte order included), and ml_dtypes' types (bfloat16, float8)
by name. A peer that dies (EOF, reset) fails every pending and later ``recv``
at once with :class:`PeerError`; a silent one fails it after ``recv_timeout``.

The lower stage of each pair connects and the higher one accepts, so stage 0
listens on nothing. :func:`connect_peers` links a process with any set of
others the same way (the lower rank of each pair connects): pipeline replicas
on a grid, where a process links to its pipeline neighbours and to the same
stage in the other replicas (:mod:`tfdist.transport.ring` runs collectives
over such links). This module imports no TensorFlow.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tfdist.errors import ConfigError, TfdistError

__all__ = ["MAGIC", "Link", "PeerError", "connect_peers", "connect_stages"]

#: Opens every connection's handshake; the suffix is the protocol version.
MAGIC = b"tfdist-p2p/1\n"
#: Arrays up to this size are batched with the header into one sendall.
SMALL_BYTES = 64 * 1024
#: Large payloads go out in sendall calls of this size, so that the socket's
#: timeout bounds a stall (no progress), not the time a whole array takes.
CHUNK_BYTES = 4 * 1024 * 1024
#: Received arrays start at a multiple of this many bytes: TensorFlow reads
#: CPU tensors with aligned loads (EIGEN_MAX_ALIGN_BYTES), so it can take an
#: aligned array's memory without copying it (tfdist.pipeline.runtime.as_tensor).
ALIGN_BYTES = 64
#: A header longer than this is a corrupt stream, not a message.
MAX_HEADER_BYTES = 16 * 1024 * 1024
#: Seconds between attempts to reach a stage that is not listening yet.
RETRY_SECONDS = 0.1
#: Seconds between checks for an abort while waiting for a connection.
POLL_SECONDS = 0.2
#: TCP keepalive (idle, interval, probes): a vanished host (no FIN, no RST)
#: breaks the link after about a minute instead of only at ``recv_timeout``.
KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))

_ML_PREFIX = "ml_dtypes."
_LENGTH = struct.Struct("!I")

#: A message's tag: a small tuple of str and int, e.g. ``("F", step, microbatch)``.
Tag = tuple


class PeerError(TfdistError, RuntimeError):
    """A peer stage died, stayed silent too long, or never came up.

    Attributes:
        stage: This process's stage, when known.
        peer: The other stage, when known.
        tag: The message's tag, for errors of one send or recv.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        peer: int | None = None,
        tag: Tag | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.peer = peer
        self.tag = tag

    def __reduce__(self):
        return (_peer_error, (type(self), str(self), self.stage, self.peer, self.tag))


def _peer_error(
    cls: type, message: str, stage: int | None, peer: int | None, tag: Tag | None
) -> PeerError:
    """Pickle helper: PeerError's arguments after the message are keyword-only."""
    return cls(message, stage=stage, peer=peer, tag=tag)


class _Eof(Exception):
    """The peer closed its side of the connection."""


class _NotAPeer(Exception):
    """What connected (or answered) is not a tfdist p2p stage."""


class _Aborted(Exception):
    """Another job of the same connect call failed; this one gives up."""


# --- Messages ---------------------------------------------------------------


def _check_tag(tag: object) -> Tag:
    """Tags are tuples of str and int (not bool): they go through JSON unchanged."""
    if not isinstance(tag, tuple) or not all(
        isinstance(part, (str, int)) and not isinstance(part, bool) for part in tag
    ):
        raise ConfigError("tag", tag, "a tuple of str and int, e.g. ('F', step, microbatch)")
    return tag


def _dtype_code(dtype: np.dtype) -> str:
    """``dtype.str`` keeps the byte order; ml_dtypes' types show there only as ``<V2``."""
    if dtype.type.__module__.split(".")[0] == "ml_dtypes":
        return _ML_PREFIX + dtype.name
    return dtype.str


def _dtype_from_code(code: str) -> np.dtype:
    if code.startswith(_ML_PREFIX):
        import ml_dtypes  # Only a peer that sent one needs it.

        return np.dtype(getattr(ml_dtypes, code[len(_ML_PREFIX) :]))
    return np.dtype(code)


def _prepare(arrays: Iterable[object]) -> list[np.ndarray]:
    """C-contiguous arrays of plain dtypes (a non-contiguous one is copied once)."""
    if isinstance(arrays, (np.ndarray, str, bytes)):
        raise ConfigError(
            "arrays", arrays, "a sequence of numpy arrays (wrap a single array in a list)"
        )
    out = []
    for i, item in enumerate(arrays):
        arr = np.asarray(item)
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            raise ConfigError(
                f"arrays[{i}]", arr.dtype, "an array of a plain dtype (no objects, no records)"
            )
        out.append(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))
    return out


def _encode_header(tag: Tag, arrays: Sequence[np.ndarray]) -> bytes:
    meta = {"tag": list(tag), "arrays": [[_dtype_code(a.dtype), list(a.shape)] for a in arrays]}
    body = json.dumps(meta, separators=(",", ":")).encode()
    return _LENGTH.pack(len(body)) + body


def _decode_header(body: bytes) -> tuple[Tag, list[tuple[np.dtype, tuple[int, ...]]]]:
    meta = json.loads(body)
    specs = [
        (_dtype_from_code(code), tuple(int(n) for n in shape)) for code, shape in meta["arrays"]
    ]
    return tuple(meta["tag"]), specs


def _aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialized bytes starting at a multiple of ALIGN_BYTES."""
    raw = np.empty(nbytes + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start : start + nbytes]


def _byte_view(arr: np.ndarray) -> memoryview:
    """The array's own buffer as bytes: no copy (uint8 view works for every dtype)."""
    return arr.reshape(-1).view(np.uint8).data


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on small messages; keepalive to notice a vanished host."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE:
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


# --- Link -------------------------------------------------------------------


class Link:
    """One connection to one peer stage.

    :meth:`send` never blocks on the peer's reading (a receiver thread per
    connection drains the socket into a mailbox); :meth:`recv` waits for the
    message with a given tag. Built by :func:`connect_stages` and
    :func:`connect_peers`.

    Args:
        sock: A connected TCP socket, handshake done; the link owns it.
        stage: This process's stage (its rank, for :func:`connect_peers`).
        peer: The stage (rank) at the other end.
        recv_timeout: Default seconds a :meth:`recv` waits, and seconds a
            :meth:`send` may make no progress, before :class:`PeerError`.
            None waits forever.
        name: How messages name this process; default ``f"stage {stage}"``.
        peer_name: How messages name the peer; default ``f"stage {peer}"``.

    Attributes:
        stage, peer: As given.
        name, peer_name: As given, or their defaults.
        bytes_sent, bytes_received: Payload bytes (the arrays' ``nbytes``)
            of the messages sent and fully received; headers not counted.
    """

    def __init__(
        self,
        sock: socket.socket,
        stage: int,
        peer: int,
        *,
        recv_timeout: float | None = 600.0,
        name: str | None = None,
        peer_name: str | None = None,
    ) -> None:
        self.stage = stage
        self.peer = peer
        self.name = f"stage {stage}" if name is None else name
        self.peer_name = f"stage {peer}" if peer_name is None else peer_name
        self.bytes_sent = 0
        self.bytes_received = 0
        self._sock = sock
        self._recv_timeout = recv_timeout
        self._mailbox: dict[Tag, collections.deque] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._broken: str | None = None  # Why no more messages can arrive.
        self._closing = False
        # Posted messages: one sender thread, so they leave in post order.
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._posted: collections.deque[concurrent.futures.Future] = collections.deque()
        _tune(sock)
        # The receiver's reads wake on this timeout too, and ignore it.
        sock.settimeout(recv_timeout)
        self._thread = threading.Thread(
            target=self._receive_loop, name=f"tfdist-p2p-recv-{stage}<-{peer}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        state = f"broken: {self._broken}" if self._broken else "open"
        return f"Link(stage={self.stage}, peer={self.peer}, {state})"

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Sending.

    def send(self, tag: Tag, arrays: Sequence[np.ndarray]) -> None:
        """Sends ``arrays`` under ``tag``; returns once the kernel has them all.

        Raises:
            ConfigError: A tag that is not a tuple of str/int, or arrays
                that are not plain numpy arrays.
            PeerError: The peer is gone, or took in nothing for
                ``recv_timeout`` seconds; the link is unusable after it.
        """
        tag = _check_tag(tag)
        arrays = _prepare(arrays)
        header = _encode_header(tag, arrays)
        with self._send_lock:
            if self._broken is not None:
                raise self._send_error(tag, self._broken)
            try:
                self._write(header, arrays)
            except TimeoutError:
                reason = f"{self.peer_name} took in nothing for {self._recv_timeout:g} s"
                raise self._fail_send(tag, reason) from None
            except OSError as e:
                raise self._fail_send(tag, f"sending failed ({e})") from e
            self.bytes_sent += sum(a.nbytes for a in arrays)

    def post(self, tag: Tag, arrays: Sequence[np.ndarray]) -> None:
        """Sends ``arrays`` under ``tag`` from a sender thread; returns at once.

        Posted messages leave in the order they were posted. The arrays must
        not change until :meth:`flush` returns (they are written from their
        own memory). Call :meth:`flush` before relying on the peer having
        them, e.g. at the end of a training step.

        Raises:
            ConfigError: As :meth:`send`, at once.
            PeerError: The link is closed or broken (as :meth:`send`), or an
                earlier posted message failed.
        """
        tag = _check_tag(tag)
        arrays = _prepare(arrays)
        self._raise_failed_posts()
        if self._broken is not None:  # Closed, or the peer is gone: as send says.
            raise self._send_error(tag, self._broken)
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"tfdist-p2p-send-{self.stage}->{self.peer}"
            )
        try:
            self._posted.append(self._sender.submit(self.send, tag, arrays))
        except RuntimeError:  # close() shut the sender down meanwhile.
            raise self._send_error(tag, self._broken or f"{self.name} closed the link") from None

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every posted message is in the kernel.

        Args:
            timeout: Seconds to wait; None: as long as the sends take (each
                fails by itself after ``recv_timeout`` seconds without
                progress).

        Raises:
            PeerError: A posted message failed, or they were not all sent
                within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._posted:
            future = self._posted[0]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.result(remaining)
            except concurrent.futures.TimeoutError:
                raise PeerError(
                    f"{self.name} could not send {len(self._posted)} posted message(s) to "
                    f"{self.peer_name} within {timeout:g} s",
                    stage=self.stage,
                    peer=self.peer,
                ) from None
            finally:
                if future.done():
                    self._posted.popleft()

    def _raise_failed_posts(self) -> None:
        """Forgets the posted messages already sent; raises the first failure."""
        while self._posted and self._posted[0].done():
            self._posted.popleft().result()

    def _write(self, header: bytes, arrays: Sequence[np.ndarray]) -> None:
        """Small arrays ride with the header; large ones go from their own buffer."""
        batch: list[bytes | memoryview] = [header]
        for arr in arrays:
            if arr.nbytes == 0:
                continue
            view = _byte_view(arr)
            if arr.nbytes <= SMALL_BYTES:
                batch.append(view)
                continue
            self._sock.sendall(b"".join(batch))
            batch = []
            for start in range(0, len(view), CHUNK_BYTES):
                self._sock.sendall(view[start : start + CHUNK_BYTES])
        if batch:
            self._sock.sendall(b"".join(batch))

    def _fail_send(self, tag: Tag, reason: str) -> PeerError:
        """A half-sent message leaves the stream out of step: the link is over."""
        with self._cond:
            if self._broken is None:
                self._broken = reason
            elif self._closing:
                # Closed here while the write ran (a posted message): the
                # close is the cause, not the broken pipe it made.
                reason = self._broken
            self._cond.notify_all()
        self._shutdown()
        return self._send_error(tag, reason)

    def _send_error(self, tag: Tag, reason: str) -> PeerError:
        return PeerError(
            f"{self.name} cannot send {tag!r} to {self.peer_name}: {reason}",
            stage=self.stage,
            peer=self.peer,
            tag=tag,
        )

    # Receiving.

    def recv(self, tag: Tag, timeout: float | None = None) -> list[np.ndarray]:
        """Returns the arrays of the next message tagged ``tag``.

        Messages with other tags stay in the mailbox for later calls.

        Args:
            tag: The tag to wait for.
            timeout: Seconds to wait; None: the link's ``recv_timeout``; 0: take
                only a message already in the mailbox.

        Raises:
            PeerError: The peer died (at once) or sent nothing tagged ``tag``
                within the timeout. Messages that arrived before the peer died
                are still returned.
        """
        tag = _check_tag(tag)
        limit = self._recv_timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        with self._cond:
            while True:
                queue = self._mailbox.get(tag)
                if queue:
                    arrays = queue.popleft()
                    if not queue:
                        del self._mailbox[tag]
                    return arrays
                if self._broken is not None:
                    message = f"{self._broken} while {self.name} waited for {tag!r}"
                    raise PeerError(message, stage=self.stage, peer=self.peer, tag=tag)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._silent_error(tag, limit)
                self._cond.wait(remaining)

    def _silent_error(self, tag: Tag, limit: float) -> PeerError:
        waiting = sorted(map(repr, self._mailbox))
        shown = ", ".join(waiting[:5]) + (", ..." if len(waiting) > 5 else "")
        return PeerError(
            f"{self.peer_name} sent nothing tagged {tag!r} to {self.name} within "
            f"{limit:g} s (recv_timeout); tags waiting in the mailbox: [{shown}]",
            stage=self.stage,
            peer=self.peer,
            tag=tag,
        )

    def _receive_loop(self) -> None:
        """Runs in the receiver thread until EOF, an error or close()."""
        try:
            while True:
                tag, arrays, nbytes = self._read_message()
                with self._cond:
                    self._mailbox.setdefault(tag, collections.deque()).append(arrays)
                    self.bytes_received += nbytes
                    self._cond.notify_all()
        except _Eof as e:
            reason = f"{self.peer_name} closed the connection ({e})"
        except ConnectionResetError as e:
            reason = f"{self.peer_name} reset the connection ({e.strerror or e})"
        except OSError as e:
            reason = f"the connection to {self.peer_name} failed ({e})"
        except Exception as e:  # noqa: BLE001 - a bad frame must still wake the waiting recv.
            reason = f"{self.peer_name} sent a message {self.name} cannot read ({e!r})"
            self._shutdown()  # The stream is out of step: nothing after it can be read.
        with self._cond:
            if self._broken is None:
                self._broken = reason
            self._cond.notify_all()

    def _read_message(self) -> tuple[Tag, list[np.ndarray], int]:
        (length,) = _LENGTH.unpack(self._read_bytes(_LENGTH.size, boundary=True))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        tag, specs = _decode_header(self._read_bytes(length))
        arrays, total = [], 0
        for dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            # Read straight into the array's memory: no intermediate bytes object.
            buf = _aligned_empty(nbytes)
            if nbytes:
                self._fill(memoryview(buf))
            arrays.append(buf.view(dtype).reshape(shape))
            total += nbytes
        return tag, arrays, total

    def _read_bytes(self, n: int, *, boundary: bool = False) -> bytes:
        buf = bytearray(n)
        self._fill(memoryview(buf), boundary=boundary)
        return bytes(buf)

    def _fill(self, view: memoryview, *, boundary: bool = False) -> None:
        """Fills ``view`` from the socket; EOF before a message is a clean close."""
        started = False
        while view:
            try:
                n = self._sock.recv_into(view)
            except TimeoutError:
                if self._closing:
                    raise _Eof("closed") from None
                continue  # A quiet peer is fine here; recv() applies the timeout.
            if n == 0:
                raise _Eof("EOF" if boundary and not started else "EOF in the middle of a message")
            started = True
            view = view[n:]

    # Closing.

    def close(self) -> None:
        """Closes the connection and joins the receiver thread; idempotent.

        The peer sees EOF: its pending and later ``recv`` raise PeerError.
        """
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        with self._cond:
            if self._broken is None:
                self._broken = f"{self.name} closed its link to {self.peer_name}"
            self._cond.notify_all()
        self._shutdown()  # Wakes the receiver's blocking read with EOF.
        if self._sender is not None:
            # Posted messages not yet written fail at once on the closed socket.
            self._sender.shutdown(wait=True, cancel_futures=True)
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._sock.close()

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # Already shut down, or the peer reset it first.


# --- Connecting -------------------------------------------------------------


@dataclass(frozen=True)
class _Words:
    """How one entry point's messages name its arguments and processes."""

    source: str  # Where a ConfigError comes from: the function called.
    rank: str  # The argument that gives this process's number.
    one: str  # A process, in "an address no other stage has".
    many: str  # Processes, in "the count of stages".
    peer_of: str  # Who a connection was expected from: "1, the neighbour of stage 2".


_STAGE_WORDS = _Words("connect_stages()", "stage", "stage", "stages", "the neighbour of")
_PEER_WORDS = _Words("connect_peers()", "rank", "process", "processes", "a peer of")


@dataclass
class _Plan:
    """What one connect call needs in its jobs (accepting, and each connecting)."""

    rank: int
    addresses: list[str]
    hosts: list[tuple[str, int]]
    names: list[str]
    words: _Words
    timeout: float
    recv_timeout: float | None
    deadline: float
    abort: threading.Event

    def remaining(self) -> float:
        if self.abort.is_set():
            raise _Aborted
        return self.deadline - time.monotonic()

    def name(self, rank: int) -> str:
        """Rank ``rank``'s name (a rank from a peer given another count: a number)."""
        if 0 <= rank < len(self.names):
            return self.names[rank]
        return f"{self.words.one} {rank}"

    def link(self, sock: socket.socket, peer: int) -> Link:
        return Link(
            sock,
            self.rank,
            peer,
            recv_timeout=self.recv_timeout,
            name=self.name(self.rank),
            peer_name=self.name(peer),
        )


def _parse_address(index: int, value: object, source: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) -> ``(host, port)``."""
    field = f"addresses[{index}]"
    expected = "'host:port' with a port in [1, 65535] (IPv6 hosts in brackets: '[::1]:29500')"
    if not isinstance(value, str):
        raise ConfigError(field, value, expected, source=source)
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    valid = (
        sep
        and host
        and not any(c.isspace() for c in host)
        and (bracketed or ":" not in host)
        and port.isascii()
        and port.isdigit()
        and 1 <= int(port) <= 65535
    )
    if not valid:
        raise ConfigError(field, value, expected, source=source)
    return host, int(port)


def _check_addresses(addresses: object, words: _Words) -> list[tuple[str, int]]:
    source = words.source
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
        raise ConfigError(
            "addresses", addresses, "a sequence of 'host:port' strings", source=source
        )
    if not addresses:
        raise ConfigError("addresses", addresses, "at least one 'host:port'", source=source)
    hosts = [_parse_address(i, value, source) for i, value in enumerate(addresses)]
    seen: dict[tuple[str, int], int] = {}
    for i, (host, port) in enumerate(hosts):
        first = seen.setdefault((host.lower(), port), i)
        if first != i:
            expected = f"an address no other {words.one} has (addresses[{first}] is the same)"
            raise ConfigError(f"addresses[{i}]", addresses[i], expected, source=source)
    return hosts


def _check_seconds(field: str, value: object, *, optional: bool, source: str) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        expected = "a number of seconds > 0" + (" or None" if optional else "")
        raise ConfigError(field, value, expected, source=source)


def _is_index(value: object, n: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < n


def _check_args(
    rank: object,
    addresses: Sequence[str],
    timeout: float,
    recv_timeout: float | None,
    words: _Words,
) -> list[tuple[str, int]]:
    """Every argument both entry points share, checked before any socket is opened."""
    hosts = _check_addresses(addresses, words)
    n = len(addresses)
    if not _is_index(rank, n):
        expected = f"an integer in [0, {n - 1}] (len(addresses) is {n})"
        raise ConfigError(words.rank, rank, expected, source=words.source)
    _check_seconds("timeout", timeout, optional=False, source=words.source)
    _check_seconds("recv_timeout", recv_timeout, optional=True, source=words.source)
    return hosts


def _check_peers(peers: object, rank: int, n: int) -> set[int]:
    """The ranks to link with, in ``[0, n)``; ``rank`` itself is dropped."""
    source = _PEER_WORDS.source
    if isinstance(peers, (str, bytes)) or not isinstance(peers, Iterable):
        expected = "an iterable of ranks (integers), e.g. {rank - 1, rank + 1}"
        raise ConfigError("peers", peers, expected, source=source)
    peers = list(peers)
    for peer in peers:
        if not _is_index(peer, n):
            raise ConfigError(
                "peers",
                peer,
                f"ranks: integers in [0, {n - 1}] (len(addresses) is {n})",
                source=source,
                received=f"{peer!r} in peers={peers!r}",
            )
    return set(peers) - {rank}


def _check_names(names: object, n: int) -> list[str]:
    """``names[i]`` names rank ``i`` in messages; default ``"stage i"``."""
    if names is None:
        return [f"stage {i}" for i in range(n)]
    if (
        isinstance(names, (str, bytes))
        or not isinstance(names, Sequence)
        or len(names) != n
        or not all(isinstance(name, str) and name for name in names)
    ):
        expected = f"None or {n} non-empty strings, one per address (len(addresses) is {n})"
        raise ConfigError("names", names, expected, source=_PEER_WORDS.source)
    return list(names)


def _hello(plan: _Plan) -> bytes:
    # The keys say "stage" for every caller: the wire format of protocol 1.
    body = json.dumps({"stage": plan.rank, "stages": len(plan.addresses)}).encode()
    return MAGIC + _LENGTH.pack(len(body)) + body


def _exchange_hellos(sock: socket.socket, plan: _Plan) -> dict:
    """Both sides send first, then read: hellos are small, neither blocks."""
    sock.settimeout(max(plan.remaining(), 0.01))
    try:
        sock.sendall(_hello(plan))
        magic = _recv_exact(sock, len(MAGIC))
        if magic != MAGIC:
            raise _NotAPeer(f"it answered {magic!r}, not a tfdist p2p handshake")
        (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
        if length > 4096:
            raise _NotAPeer(f"its hello is {length} bytes long")
        hello = json.loads(_recv_exact(sock, length))
        if not isinstance(hello, dict) or not all(
            isinstance(hello.get(key), int) for key in ("stage", "stages")
        ):
            raise _NotAPeer(f"its hello lacks stage numbers: {hello!r}")
        return hello
    except (OSError, ValueError) as e:  # socket.timeout is an OSError; bad JSON a ValueError.
        raise _NotAPeer(f"the handshake failed ({e!r})") from e


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise _NotAPeer("it closed the connection during the handshake")
        data += chunk
    return data


def _check_count(plan: _Plan, hello: dict, where: str) -> None:
    """Both sides must agree on the count of processes."""
    n = len(plan.addresses)
    if hello["stages"] != n:
        raise ConfigError(
            "len(addresses)",
            hello["stages"],
            f"{n}, the count of {plan.words.many} that {plan.name(plan.rank)} was given",
            source=plan.words.source,
            received=f"{hello['stages']!r} from {plan.name(hello['stage'])} ({where})",
        )


def _wrong_rank(plan: _Plan, hello: dict, expected: Sequence[int], where: str) -> ConfigError:
    """The peer's hello gives a rank other than the one(s) this side expects."""
    ranks = str(expected[0]) if len(expected) == 1 else f"one of {list(expected)}"
    return ConfigError(
        plan.words.rank,
        hello["stage"],
        f"{ranks}, {plan.words.peer_of} {plan.name(plan.rank)} ({where})",
        source=plan.words.source,
        received=f"{hello['stage']!r}, the {plan.words.rank} that process was given",
    )


def _connect_upper(plan: _Plan, peer: int) -> dict[int, Link]:
    """Reaches the higher rank ``peer``, retrying until it listens or time is up."""
    address, last = plan.addresses[peer], "nothing tried"
    while (remaining := plan.remaining()) > 0:
        try:
            sock = socket.create_connection(plan.hosts[peer], timeout=min(remaining, 5.0))
        except OSError as e:  # Refused: not listening yet; keep trying until the deadline.
            last = repr(e)
        else:
            try:
                hello = _exchange_hellos(sock, plan)
                where = f"listening on addresses[{peer}] = {address!r}"
                _check_count(plan, hello, where)
                if hello["stage"] != peer:
                    raise _wrong_rank(plan, hello, [peer], where)
                return {peer: plan.link(sock, peer)}
            except _NotAPeer as e:
                sock.close()
                last = str(e)
            except BaseException:
                sock.close()
                raise
        time.sleep(min(RETRY_SECONDS, max(plan.deadline - time.monotonic(), 0)))
    raise PeerError(
        f"{plan.name(plan.rank)} could not connect to {plan.name(peer)} at {address} within "
        f"{plan.timeout:g} s (last attempt: {last})",
        stage=plan.rank,
        peer=peer,
    )


def _listen(plan: _Plan, backlog: int) -> socket.socket:
    address = plan.addresses[plan.rank]
    host, port = plan.hosts[plan.rank]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=max(backlog, 8))
    except OSError as e:
        raise ConfigError(
            f"addresses[{plan.rank}]",
            address,
            f"an address {plan.name(plan.rank)} can listen on (a free port of this host)",
            source=plan.words.source,
            received=f"{address!r}, which failed: {e}",
        ) from e


def _accept_one(
    plan: _Plan, sock: socket.socket, lower: set[int], links: dict[int, Link]
) -> Link | None:
    """The link to the lower peer that connected on ``sock``, or None to drop it.

    A stray connection (a port scan, a health check) and a second hello from
    a rank already linked are dropped; a rank not among ``lower`` is refused.
    """
    where = f"which connected to addresses[{plan.rank}] = {plan.addresses[plan.rank]!r}"
    try:
        hello = _exchange_hellos(sock, plan)
    except _NotAPeer:
        return None
    _check_count(plan, hello, where)
    if hello["stage"] in links:
        return None
    if hello["stage"] not in lower:
        raise _wrong_rank(plan, hello, sorted(lower - set(links)), where)
    return plan.link(sock, hello["stage"])


def _accept_lower(plan: _Plan, listener: socket.socket, lower: set[int]) -> dict[int, Link]:
    """Waits for every rank in ``lower`` to connect; on failure closes those that did."""
    links: dict[int, Link] = {}
    listener.settimeout(POLL_SECONDS)  # Short waits, so an abort is seen promptly.
    try:
        while len(links) < len(lower) and plan.remaining() > 0:
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                link = _accept_one(plan, sock, lower, links)
            except BaseException:
                sock.close()
                raise
            if link is None:
                sock.close()
            else:
                links[link.peer] = link
    except BaseException:
        for link in links.values():
            link.close()
        raise
    if len(links) < len(lower):
        for link in links.values():
            link.close()
        raise _never_connected(plan, sorted(lower - set(links)))
    return links


def _never_connected(plan: _Plan, missing: list[int]) -> PeerError:
    shown = [f"{plan.name(peer)} (addresses[{peer}] = {plan.addresses[peer]})" for peer in missing]
    who = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    return PeerError(
        f"{plan.name(plan.rank)} listened on {plan.addresses[plan.rank]} for "
        f"{plan.timeout:g} s, and {who} never connected",
        stage=plan.rank,
        peer=missing[0],
    )


def _run_all(jobs: list[Callable[[], dict[int, Link]]], abort: threading.Event) -> dict[int, Link]:
    """Runs the jobs at once (none waits on another's peer); one failing stops all.

    Returns:
        Every job's links, merged. On a failure the links made are closed and
        the first real error (not another job's abort) is raised.
    """
    if len(jobs) < 2:
        return {peer: link for job in jobs for peer, link in job().items()}
    pool = concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="tfdist-p2p-connect")
    with pool:
        futures = [pool.submit(job) for job in jobs]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            abort.set()  # The others stop within POLL_SECONDS (RETRY_SECONDS).
    errors = [f.exception() for f in futures if f.exception() is not None]
    links = {
        peer: link for f in futures if f.exception() is None for peer, link in f.result().items()
    }
    if errors:
        for link in links.values():
            link.close()
        raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])
    return links


def _connect(
    rank: int,
    addresses: Sequence[str],
    hosts: list[tuple[str, int]],
    peers: set[int],
    names: list[str],
    words: _Words,
    timeout: float,
    recv_timeout: float | None,
) -> dict[int, Link]:
    """Listens for the lower peers and connects to the higher ones, all at once."""
    deadline, abort = time.monotonic() + timeout, threading.Event()
    plan = _Plan(rank, list(addresses), hosts, names, words, timeout, recv_timeout, deadline, abort)
    lower = {peer for peer in peers if peer < rank}
    listener = _listen(plan, len(lower)) if lower else None
    try:
        jobs: list[Callable[[], dict[int, Link]]] = []
        if listener is not None:
            jobs.append(lambda: _accept_lower(plan, listener, lower))
        for peer in sorted(peers - lower):
            jobs.append(functools.partial(_connect_upper, plan, peer))
        return _run_all(jobs, abort)
    finally:
        if listener is not None:
            listener.close()


def connect_stages(
    stage: int,
    addresses: Sequence[str],
    *,
    timeout: float = 60.0,
    recv_timeout: float | None = 600.0,
) -> dict[int, Link]:
    """Connects stage ``stage`` of ``len(addresses)`` to its neighbouring stages.

    The lower stage of each pair connects (retrying until ``timeout``) to the
    higher one's address, which listens there; stage 0 listens on nothing.
    A handshake checks that both sides agree on the count of stages and on
    each other's stage numbers. :func:`connect_peers` with the peers
    ``{stage - 1, stage + 1}``.

    Args:
        stage: This process's stage, in ``[0, len(addresses))``.
        addresses: ``"host:port"`` of every stage, the same list in every stage.
        timeout: Seconds to wait for the neighbours to come up.
        recv_timeout: The links' default for :meth:`Link.recv` (and the
            seconds a send may make no progress); None waits forever.

    Returns:
        ``{stage - 1: Link, stage + 1: Link}``, those that exist.

    Raises:
        ConfigError: A malformed or duplicate address, a stage out of range,
            an address this stage cannot listen on, or a neighbour given
            another count of stages or another stage number.
        PeerError: A neighbour did not come up within ``timeout``.
    """
    hosts = _check_args(stage, addresses, timeout, recv_timeout, _STAGE_WORDS)
    n = len(addresses)
    peers = {peer for peer in (stage - 1, stage + 1) if 0 <= peer < n}
    names = [f"stage {i}" for i in range(n)]
    return _connect(stage, addresses, hosts, peers, names, _STAGE_WORDS, timeout, recv_timeout)


def connect_peers(
    rank: int,
    addresses: Sequence[str],
    peers: Iterable[int],
    *,
    timeout: float = 60.0,
    recv_timeout: float | None = 600.0,
    names: Sequence[str] | None = None,
) -> dict[int, Link]:
    """Links process ``rank`` of ``len(addresses)`` with each rank in ``peers``.

    For each pair the lower rank connects (retrying until ``timeout``) to the
    higher one's address; the higher one listens there and accepts every
    lower peer it expects (a stray connection, or a second one from a rank
    already linked, is dropped). Accepting and connecting run at once, and
    one failing stops the others. A handshake checks that both sides agree
    on the count of processes and on each other's ranks. Every process must
    be given a symmetric set: if ``j`` is among rank ``i``'s peers, ``i`` is
    among rank ``j``'s. E.g. pipeline replicas on a grid: rank ``replica *
    stages + stage`` links with its pipeline neighbours and with the same
    stage in the other replicas.

    Args:
        rank: This process's rank, in ``[0, len(addresses))``.
        addresses: ``"host:port"`` of every rank, the same list in every process.
        peers: The ranks to link with; ``rank`` itself is ignored.
        timeout: Seconds to wait for the peers to come up.
        recv_timeout: The links' default for :meth:`Link.recv` (and the
            seconds a send may make no progress); None waits forever.
        names: How messages name each rank, e.g. ``"stage 1 of replica 0"``;
            default ``"stage i"``.

    Returns:
        ``{peer: Link}`` for every peer.

    Raises:
        ConfigError: A malformed or duplicate address, a rank or peer out of
            range, names not one string per address, an address this rank
            cannot listen on, or a peer given another count of processes or
            another rank.
        PeerError: A peer did not come up within ``timeout``.
    """
    hosts = _check_args(rank, addresses, timeout, recv_timeout, _PEER_WORDS)
    n = len(addresses)
    peer_set = _check_peers(peers, rank, n)
    labels = _check_names(names, n)
    return _connect(rank, addresses, hosts, peer_set, labels, _PEER_WORDS, timeout, recv_timeout)
