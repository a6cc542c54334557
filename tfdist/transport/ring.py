"""Collectives among a group of processes over p2p links, in a ring.

A :class:`RingGroup` of ``size`` processes sums arrays (all-reduce) and
gathers them (all-gather, and all-gather of a varying count of rows) over
the :class:`~tfdist.transport.p2p.Link` each member has to its two ring
neighbours, group ranks ``rank - 1`` and ``rank + 1`` modulo ``size``
(links from :func:`~tfdist.transport.p2p.connect_peers`). E.g. the
data-parallel replicas of one pipeline stage sum their gradients:

    rank = replica * stages + stage  # On a grid of replicas x stages.
    left, right = (replica - 1) % replicas, (replica + 1) % replicas
    links = connect_peers(rank, addresses, {r * stages + stage for r in (left, right)})
    ring = RingGroup(replica, replicas, {r: links[r * stages + stage] for r in (left, right)})
    grads = ring.allreduce(*grads)

The all-reduce is a ring all-reduce: the arrays (flattened, concatenated per
dtype) are cut into ``size`` chunks as evenly as possible; a reduce-scatter
sums each chunk once, in ring order, on its way round; an all-gather then
passes the sums round. Each member sends ``2 (size - 1) / size`` of the
payload (:func:`tfdist.transport.traffic.all_reduce_bytes`, up to the chunks'
rounding), and every member gets the same bits: each sum is computed once
and copied, so data-parallel replicas keep identical weights.

Messages are tagged ``(name, kind, call, step)``: the group's name, the
collective, a count of the group's calls (the same on every member, which
call the collectives in the same order) and the ring step. Calls never mix,
and neither do messages of other code on the same links (a pipeline's
``("F", step, stage, microbatch)``). A member whose neighbour dies gets the link's
:class:`~tfdist.transport.p2p.PeerError` at once; a member that fails should
close its links (a process that exits does), so that the failure travels
round the ring instead of leaving the others waiting for ``recv_timeout``.

This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tfdist.errors import ConfigError
from tfdist.transport.p2p import Link

__all__ = ["SUMMABLE_DTYPES", "RingGroup"]

#: The dtypes :meth:`RingGroup.allreduce` sums (either byte order).
SUMMABLE_DTYPES = frozenset({"float32", "float64", "int32", "int64"})

_KINDS = ("allreduce", "allgather", "allgatherv")


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` slices of ``range(length)`` as even as can be (as np.array_split).

    The first ``length % parts`` slices are one longer than the others.
    """
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


class RingGroup:
    """Collectives of ``size`` processes over p2p Links in a ring.

    Each member builds one with its own ``rank`` and the same ``size`` and
    ``name``, then all call the same collectives in the same order. Not
    thread-safe: one collective at a time per group.

    Args:
        rank: This member's rank in the group, in ``[0, size)``.
        size: The count of members.
        links: Links to the ring neighbours, keyed by their group rank:
            ``(rank - 1) % size`` and ``(rank + 1) % size`` (one link when
            ``size == 2``, none when ``size == 1``). Other keys are ignored.
            The group does not own them: closing them is the caller's.
        name: Starts every message's tag; groups sharing a link need
            different names.

    Attributes:
        rank, size, name: As given.
        sent: Payload bytes this member sent on the wire per collective
            (``"allreduce"``, ``"allgather"``, ``"allgatherv"``).

    Raises:
        ConfigError: A rank out of range, a size < 1, a missing neighbour's
            link, or a name that is not a non-empty string.
    """

    def __init__(
        self, rank: int, size: int, links: Mapping[int, Link], *, name: str = "ring"
    ) -> None:
        source = "RingGroup()"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError("size", size, "an integer >= 1", source=source)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ConfigError("rank", rank, f"an integer in [0, {size - 1}]", source=source)
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty string", source=source)
        self.rank, self.size, self.name = rank, size, name
        self.sent = dict.fromkeys(_KINDS, 0)
        self._calls = 0
        self._left = self._right = None
        if size > 1:
            left, right = (rank - 1) % size, (rank + 1) % size
            missing = sorted({left, right} - set(links))
            if missing:
                expected = f"links keyed by the ring neighbours {sorted({left, right})}"
                received = f"keys {sorted(links)}, without {missing}"
                raise ConfigError("links", links, expected, source=source, received=received)
            self._left, self._right = links[left], links[right]

    def __repr__(self) -> str:
        return f"RingGroup(rank={self.rank}, size={self.size}, name={self.name!r})"

    def close(self) -> None:
        """Closes the links to the ring neighbours: their pending and later
        collectives fail at once, naming this member, instead of waiting."""
        for link in {id(k): k for k in (self._left, self._right) if k is not None}.values():
            link.close()

    # The collectives.

    def allreduce(self, *arrays: np.ndarray) -> list[np.ndarray]:
        """The elementwise sum of each array over the group.

        Every member passes arrays of the same shapes and dtypes, in the same
        order; each gets the same sums, bit for bit.

        Args:
            *arrays: Arrays of float32, float64, int32 or int64.

        Returns:
            One sum per array, of its shape and dtype.

        Raises:
            ConfigError: An array of another dtype, or members that passed
                other shapes or dtypes.
            PeerError: A neighbour died or stayed silent.
        """
        arrays = [_summable(i, a) for i, a in enumerate(arrays)]
        call = self._next_call()
        if self.size == 1 or not arrays:
            return [a.copy() for a in arrays]
        groups: dict[np.dtype, list[int]] = {}
        for i, arr in enumerate(arrays):
            groups.setdefault(arr.dtype.newbyteorder("="), []).append(i)
        # One working buffer per dtype: a copy, summed into in place.
        flats = [
            np.concatenate([arrays[i].reshape(-1) for i in members]).astype(dtype, copy=False)
            for dtype, members in groups.items()
        ]
        self._reduce_scatter(flats, call)
        self._gather_chunks(flats, call)
        out: dict[int, np.ndarray] = {}
        for flat, members in zip(flats, groups.values()):
            start = 0
            for i in members:
                arr = arrays[i]
                part = flat[start : start + arr.size].reshape(arr.shape)
                out[i] = part.astype(arr.dtype, copy=False)  # A view of ``flat`` unless swapped.
                start += arr.size
        return [out[i] for i in range(len(arrays))]

    def allgather(self, flat: np.ndarray) -> np.ndarray:
        """Every member's array, stacked in rank order.

        Args:
            flat: This member's array; every member passes the same shape and
                dtype.

        Returns:
            An array of shape ``(size, *flat.shape)``: row ``r`` from rank ``r``.

        Raises:
            ConfigError: Members that passed other shapes or dtypes.
            PeerError: A neighbour died or stayed silent.
        """
        flat = np.asarray(flat)
        call = self._next_call()
        out = np.empty((self.size, *flat.shape), flat.dtype)
        out[self.rank] = flat
        if self.size > 1:
            # Views (0-d ones too): what arrives lands in ``out``.
            rows = [out[r, ...] for r in range(self.size)]
            self._pass_round(rows, "allgather", call, exact=True)
        return out

    def allgatherv(self, rows: np.ndarray) -> np.ndarray:
        """Every member's rows, concatenated in rank order along axis 0.

        Args:
            rows: This member's rows, of shape ``(n_rank, *rest)``; ``n_rank``
                may differ between members (and be 0), ``rest`` and the dtype
                may not.

        Returns:
            An array of shape ``(sum of n_r, *rest)``.

        Raises:
            ConfigError: A 0-d array, or members whose ``rest`` or dtype differ.
            PeerError: A neighbour died or stayed silent.
        """
        rows = np.asarray(rows)
        if rows.ndim == 0:
            raise ConfigError(
                "rows", rows, "an array of at least 1 dimension", source="RingGroup.allgatherv()"
            )
        call = self._next_call()
        blocks = [rows] * self.size  # Each other rank's entry is replaced before it is sent.
        if self.size > 1:
            self._pass_round(blocks, "allgatherv", call, exact=False)
        return np.concatenate(blocks, axis=0)

    # The ring.

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls - 1

    def _step(
        self, kind: str, call: int, step: int, parts: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """Sends ``parts`` to the right neighbour; returns what the left one sent.

        Sending does not wait for the peer to read (its link drains the
        socket into a mailbox), so every member sending first cannot deadlock.
        """
        tag = (self.name, kind, call, step)
        self._right.send(tag, parts)
        self.sent[kind] += sum(part.nbytes for part in parts)
        return self._left.recv(tag)

    def _reduce_scatter(self, flats: list[np.ndarray], call: int) -> None:
        """After it, this member holds the group's sum of chunk ``rank + 1``."""
        n = self.size
        bounds = [chunk_bounds(len(flat), n) for flat in flats]
        for step in range(n - 1):
            send, recv = (self.rank - step) % n, (self.rank - step - 1) % n
            parts = [flat[slice(*b[send])] for flat, b in zip(flats, bounds)]
            got = self._step("allreduce", call, step, parts)
            wanted = [flat[slice(*b[recv])] for flat, b in zip(flats, bounds)]
            self._check("allreduce", got, wanted, exact=True)
            for mine, theirs in zip(wanted, got):
                mine += theirs  # In place, in ``flats``.

    def _gather_chunks(self, flats: list[np.ndarray], call: int) -> None:
        """Passes each chunk's sum round the ring: every member gets every sum."""
        n = self.size
        bounds = [chunk_bounds(len(flat), n) for flat in flats]
        for step in range(n - 1):
            send, recv = (self.rank + 1 - step) % n, (self.rank - step) % n
            parts = [flat[slice(*b[send])] for flat, b in zip(flats, bounds)]
            got = self._step("allreduce", call, n - 1 + step, parts)
            wanted = [flat[slice(*b[recv])] for flat, b in zip(flats, bounds)]
            self._check("allreduce", got, wanted, exact=True)
            for mine, theirs in zip(wanted, got):
                mine[...] = theirs

    def _pass_round(self, blocks: list[np.ndarray], kind: str, call: int, *, exact: bool) -> None:
        """Fills ``blocks[r]`` for every rank from this member's own block.

        Exact: the blocks are views of the result, written in place, and every
        block has the shape of this member's. Otherwise the received arrays
        are kept, and only their dtype and shape past axis 0 must match.
        """
        n, own = self.size, blocks[self.rank]
        for step in range(n - 1):
            send, recv = (self.rank - step) % n, (self.rank - step - 1) % n
            got = self._step(kind, call, step, [blocks[send]])
            self._check(kind, got, [own], exact=exact)
            if exact:
                blocks[recv][...] = got[0]
            else:
                blocks[recv] = got[0]

    def _check(
        self, kind: str, got: list[np.ndarray], wanted: list[np.ndarray], *, exact: bool
    ) -> None:
        """What the left neighbour sent fits what this member passed."""
        shapes = [(a.dtype, a.shape if exact else a.shape[1:]) for a in got]
        expected = [(a.dtype, a.shape if exact else a.shape[1:]) for a in wanted]
        if shapes != expected:
            raise ConfigError(
                "arrays",
                shapes,
                f"the same dtypes and shapes on every member of {self.name!r}: "
                f"{_show(expected)} as rank {self.rank} passed",
                source=f"RingGroup.{kind}()",
                received=f"{_show(shapes)} from rank {(self.rank - 1) % self.size}",
            )


def _summable(index: int, value: object) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.name not in SUMMABLE_DTYPES or arr.dtype.fields is not None:
        raise ConfigError(
            f"arrays[{index}]",
            arr.dtype,
            "an array of " + ", ".join(sorted(SUMMABLE_DTYPES)),
            source="RingGroup.allreduce()",
            received=f"an array of {arr.dtype}",
        )
    return arr


def _show(specs: list[tuple[np.dtype, tuple[int, ...]]]) -> str:
    return "[" + ", ".join(f"{dtype}{list(shape)}" for dtype, shape in specs) + "]"
