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

Wire format, after a handshake (``MAGIC``, then a length-prefixed JSON hello
giving the sender's stage and the count of stages): each message is a 4-byte
big-endian header length, a JSON header ``{"tag": [...], "arrays": [[dtype,
shape], ...]}``, then each array's raw C-order bytes. Dtypes travel as
``dtype.str`` (byte order included), and ml_dtypes' types (bfloat16, float8)
by name. A peer that dies (EOF, reset) fails every pending and later ``recv``
at once with :class:`PeerError`; a silent one fails it after ``recv_timeout``.

The lower stage of each pair connects and the higher one accepts, so stage 0
listens on nothing. This module imports no TensorFlow.
"""

from __future__ import annotations

import collections
import concurrent.futures
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

__all__ = ["MAGIC", "Link", "PeerError", "connect_stages"]

#: Opens every connection's handshake; the suffix is the protocol version.
MAGIC = b"tfdist-p2p/1\n"
#: Arrays up to this size are batched with the header into one sendall.
SMALL_BYTES = 64 * 1024
#: Large payloads go out in sendall calls of this size, so that the socket's
#: timeout bounds a stall (no progress), not the time a whole array takes.
CHUNK_BYTES = 4 * 1024 * 1024
#: A header longer than this is a corrupt stream, not a message.
MAX_HEADER_BYTES = 16 * 1024 * 1024
#: Seconds between attempts to reach a stage that is not listening yet.
RETRY_SECONDS = 0.1
#: Seconds between checks for an abort while waiting for a connection.
POLL_SECONDS = 0.2
#: TCP keepalive (idle, interval, probes): a vanished host (no FIN, no RST)
#: breaks the link after about a minute instead of only at ``recv_timeout``.
KEEPALIVE = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))

_SOURCE = "connect_stages()"
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
    """The other half of connect_stages failed; this half gives up."""


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
    message with a given tag. Built by :func:`connect_stages`.

    Args:
        sock: A connected TCP socket, handshake done; the link owns it.
        stage: This process's stage.
        peer: The stage at the other end.
        recv_timeout: Default seconds a :meth:`recv` waits, and seconds a
            :meth:`send` may make no progress, before :class:`PeerError`.
            None waits forever.

    Attributes:
        stage, peer: As given.
        bytes_sent, bytes_received: Payload bytes (the arrays' ``nbytes``)
            of the messages sent and fully received; headers not counted.
    """

    def __init__(
        self, sock: socket.socket, stage: int, peer: int, *, recv_timeout: float | None = 600.0
    ) -> None:
        self.stage = stage
        self.peer = peer
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
                reason = f"stage {self.peer} took in nothing for {self._recv_timeout:g} s"
                raise self._fail_send(tag, reason) from None
            except OSError as e:
                raise self._fail_send(tag, f"sending failed ({e})") from e
            self.bytes_sent += sum(a.nbytes for a in arrays)

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
            self._cond.notify_all()
        self._shutdown()
        return self._send_error(tag, reason)

    def _send_error(self, tag: Tag, reason: str) -> PeerError:
        return PeerError(
            f"stage {self.stage} cannot send {tag!r} to stage {self.peer}: {reason}",
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
                    message = f"{self._broken} while stage {self.stage} waited for {tag!r}"
                    raise PeerError(message, stage=self.stage, peer=self.peer, tag=tag)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._silent_error(tag, limit)
                self._cond.wait(remaining)

    def _silent_error(self, tag: Tag, limit: float) -> PeerError:
        waiting = sorted(map(repr, self._mailbox))
        shown = ", ".join(waiting[:5]) + (", ..." if len(waiting) > 5 else "")
        return PeerError(
            f"stage {self.peer} sent nothing tagged {tag!r} to stage {self.stage} within "
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
            reason = f"stage {self.peer} closed the connection ({e})"
        except ConnectionResetError as e:
            reason = f"stage {self.peer} reset the connection ({e.strerror or e})"
        except OSError as e:
            reason = f"the connection to stage {self.peer} failed ({e})"
        except Exception as e:  # noqa: BLE001 - a bad frame must still wake the waiting recv.
            reason = f"stage {self.peer} sent a message stage {self.stage} cannot read ({e!r})"
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
            buf = np.empty(nbytes, np.uint8)
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
                self._broken = f"stage {self.stage} closed its link to stage {self.peer}"
            self._cond.notify_all()
        self._shutdown()  # Wakes the receiver's blocking read with EOF.
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._sock.close()

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # Already shut down, or the peer reset it first.


# --- Connecting -------------------------------------------------------------


@dataclass
class _Plan:
    """What one connect_stages call needs in its two halves."""

    stage: int
    addresses: list[str]
    hosts: list[tuple[str, int]]
    timeout: float
    recv_timeout: float | None
    deadline: float
    abort: threading.Event

    def remaining(self) -> float:
        if self.abort.is_set():
            raise _Aborted
        return self.deadline - time.monotonic()


def _parse_address(index: int, value: object) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) -> ``(host, port)``."""
    field = f"addresses[{index}]"
    expected = "'host:port' with a port in [1, 65535] (IPv6 hosts in brackets: '[::1]:29500')"
    if not isinstance(value, str):
        raise ConfigError(field, value, expected, source=_SOURCE)
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
        raise ConfigError(field, value, expected, source=_SOURCE)
    return host, int(port)


def _check_addresses(addresses: object) -> list[tuple[str, int]]:
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
        raise ConfigError(
            "addresses", addresses, "a sequence of 'host:port' strings", source=_SOURCE
        )
    if not addresses:
        raise ConfigError("addresses", addresses, "at least one 'host:port'", source=_SOURCE)
    hosts = [_parse_address(i, value) for i, value in enumerate(addresses)]
    seen: dict[tuple[str, int], int] = {}
    for i, (host, port) in enumerate(hosts):
        first = seen.setdefault((host.lower(), port), i)
        if first != i:
            expected = f"an address no other stage has (addresses[{first}] is the same)"
            raise ConfigError(f"addresses[{i}]", addresses[i], expected, source=_SOURCE)
    return hosts


def _check_seconds(field: str, value: object, *, optional: bool) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        expected = "a number of seconds > 0" + (" or None" if optional else "")
        raise ConfigError(field, value, expected, source=_SOURCE)


def _check_args(
    stage: object, addresses: Sequence[str], timeout: float, recv_timeout: float | None
) -> list[tuple[str, int]]:
    """Every argument checked before any socket is opened."""
    hosts = _check_addresses(addresses)
    n = len(addresses)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
        expected = f"an integer in [0, {n - 1}] (len(addresses) is {n})"
        raise ConfigError("stage", stage, expected, source=_SOURCE)
    _check_seconds("timeout", timeout, optional=False)
    _check_seconds("recv_timeout", recv_timeout, optional=True)
    return hosts


def _hello(plan: _Plan) -> bytes:
    body = json.dumps({"stage": plan.stage, "stages": len(plan.addresses)}).encode()
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


def _check_hello(plan: _Plan, hello: dict, peer: int, where: str) -> None:
    """Both sides must agree on the count of stages and on who is who."""
    n = len(plan.addresses)
    if hello["stages"] != n:
        raise ConfigError(
            "len(addresses)",
            hello["stages"],
            f"{n}, the count of stages that stage {plan.stage} was given",
            source=_SOURCE,
            received=f"{hello['stages']!r} from stage {hello['stage']} ({where})",
        )
    if hello["stage"] != peer:
        raise ConfigError(
            "stage",
            hello["stage"],
            f"{peer}, the neighbour of stage {plan.stage} ({where})",
            source=_SOURCE,
            received=f"{hello['stage']!r}, the stage that process was given",
        )


def _connect_upper(plan: _Plan) -> Link:
    """Stage k reaches stage k + 1, retrying until it listens or time is up."""
    peer = plan.stage + 1
    address, last = plan.addresses[peer], "nothing tried"
    while (remaining := plan.remaining()) > 0:
        try:
            sock = socket.create_connection(plan.hosts[peer], timeout=min(remaining, 5.0))
        except OSError as e:  # Refused: not listening yet; keep trying until the deadline.
            last = repr(e)
        else:
            try:
                hello = _exchange_hellos(sock, plan)
                _check_hello(plan, hello, peer, f"listening on addresses[{peer}] = {address!r}")
                return Link(sock, plan.stage, peer, recv_timeout=plan.recv_timeout)
            except _NotAPeer as e:
                sock.close()
                last = str(e)
            except BaseException:
                sock.close()
                raise
        time.sleep(min(RETRY_SECONDS, max(plan.deadline - time.monotonic(), 0)))
    raise PeerError(
        f"stage {plan.stage} could not connect to stage {peer} at {address} within "
        f"{plan.timeout:g} s (last attempt: {last})",
        stage=plan.stage,
        peer=peer,
    )


def _listen(plan: _Plan) -> socket.socket:
    address = plan.addresses[plan.stage]
    host, port = plan.hosts[plan.stage]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=8)
    except OSError as e:
        raise ConfigError(
            f"addresses[{plan.stage}]",
            address,
            f"an address stage {plan.stage} can listen on (a free port of this host)",
            source=_SOURCE,
            received=f"{address!r}, which failed: {e}",
        ) from e


def _accept_lower(plan: _Plan, listener: socket.socket) -> Link:
    """Stage k waits for stage k - 1; a stray connection is dropped, not fatal."""
    peer = plan.stage - 1
    listener.settimeout(POLL_SECONDS)  # Short waits, so an abort is seen promptly.
    while plan.remaining() > 0:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        where = f"which connected to addresses[{plan.stage}] = {plan.addresses[plan.stage]!r}"
        try:
            hello = _exchange_hellos(sock, plan)
            _check_hello(plan, hello, peer, where)
            return Link(sock, plan.stage, peer, recv_timeout=plan.recv_timeout)
        except _NotAPeer:
            sock.close()  # A stray connection (a port scan, a health check): keep waiting.
        except BaseException:
            sock.close()
            raise
    raise PeerError(
        f"stage {plan.stage} listened on {plan.addresses[plan.stage]} for {plan.timeout:g} s, "
        f"and stage {peer} (addresses[{peer}] = {plan.addresses[peer]}) never connected",
        stage=plan.stage,
        peer=peer,
    )


def _run_both(jobs: dict[int, Callable[[], Link]], abort: threading.Event) -> dict[int, Link]:
    """Runs the connect and accept halves at once: neither waits on the other's peer."""
    if len(jobs) < 2:
        return {peer: job() for peer, job in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tfdist-p2p-connect") as ex:
        futures = {ex.submit(job): peer for peer, job in jobs.items()}
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception() is not None]
        if failed:
            abort.set()  # The other half stops within POLL_SECONDS.
            concurrent.futures.wait(futures)
    links = {futures[f]: f.result() for f in futures if not f.cancelled() and f.exception() is None}
    if failed:
        for link in links.values():
            link.close()
        raise failed[0].exception()
    return links


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
    each other's stage numbers.

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
    hosts = _check_args(stage, addresses, timeout, recv_timeout)
    abort = threading.Event()
    plan = _Plan(
        stage, list(addresses), hosts, timeout, recv_timeout, time.monotonic() + timeout, abort
    )
    listener = _listen(plan) if stage > 0 else None
    try:
        jobs: dict[int, Callable[[], Link]] = {}
        if listener is not None:
            jobs[stage - 1] = lambda: _accept_lower(plan, listener)
        if stage + 1 < len(addresses):
            jobs[stage + 1] = lambda: _connect_upper(plan)
        return _run_both(jobs, abort)
    finally:
        if listener is not None:
            listener.close()
