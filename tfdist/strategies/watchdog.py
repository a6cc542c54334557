"""Fails a multi-worker job's collectives when a peer stops answering.

TensorFlow's own collective timeout (``CommunicationOptions(timeout_seconds=)``)
starts one detached thread per collective op that sleeps for the whole
timeout (``Env::SchedClosureAfter``). Training runs a few collectives per
step, so with a 600 s timeout a worker holds ``collectives per second x
600`` sleeping threads: measured on TF 2.21, 300 all-reduces left 600 more
threads, and a fast top-k job passed 16,000 threads in a minute and aborted
with "Resource temporarily unavailable".

:class:`PeerWatchdog` guards against a hung peer with one thread: it asks
every peer's server whether it answers
(``check_collective_ops_peer_health``, the probe TensorFlow's own
pre-coordination-service health check used) and, when a peer has not
answered for ``timeout`` seconds, or has restarted, aborts this process's
collectives with a message that names the peer. A killed peer is caught
earlier by TensorFlow's coordination service (about 10 s); this catches a
hung one (stopped, swapping, wedged in the kernel). A peer whose server
still answers but that never reaches the collective (a Python deadlock, an
input pipeline that never yields) is not caught.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["PeerWatchdog"]

log = logging.getLogger("tfdist.strategies.watchdog")

#: Longest single probe; a peer gets several probes within its timeout.
MAX_PROBE_SECONDS = 10.0


def _tf_probe(peer: str, timeout_s: float) -> None:
    from tfdist.compat.tf_python import eager_context as context

    context.context().check_collective_ops_peer_health(
        peer, timeout_in_ms=max(1, int(timeout_s * 1000))
    )


def _tf_abort(message: str) -> None:
    from tfdist.compat.tf_python import eager_context as context, framework_errors as errors

    context.context().abort_collective_ops(errors.UNAVAILABLE, message)


class PeerWatchdog:
    """One daemon thread that aborts collectives when a peer goes silent.

    Args:
        peers: Device names of the other tasks, e.g.
            ``"/job:worker/replica:0/task:1"``.
        timeout: Seconds a peer may go without answering before this
            process's collectives are aborted.
        interval: Seconds between rounds of probes. Defaults to a quarter
            of ``timeout``, at most ``MAX_PROBE_SECONDS``.
        probe: ``probe(peer, timeout_s)`` raises when the peer does not
            answer (TensorFlow's peer health check by default).
        abort: ``abort(message)`` fails the collectives (TensorFlow's
            ``abort_collective_ops`` by default).
        clock: Monotonic time source.
    """

    def __init__(
        self,
        peers: Sequence[str],
        timeout: float,
        *,
        interval: float | None = None,
        probe: Callable[[str, float], None] = _tf_probe,
        abort: Callable[[str], None] = _tf_abort,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"Expected a timeout > 0 seconds. Received: {timeout!r}")
        self.peers = list(peers)
        self.timeout = float(timeout)
        self.interval = (
            min(MAX_PROBE_SECONDS, self.timeout / 4) if interval is None else float(interval)
        )
        self._probe, self._abort, self._clock = probe, abort, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The message collectives were aborted with; None while all is well.
        self.failure: str | None = None
        self._warned: set[str] = set()

    def start(self) -> PeerWatchdog:
        """Starts the thread (once); returns self."""
        if self._thread is None and self.peers:
            self._thread = threading.Thread(
                target=self._run, name="tfdist-peer-watchdog", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread; collectives are left as they are."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=MAX_PROBE_SECONDS + 5)

    def check_once(self, last_ok: dict[str, float]) -> str | None:
        """Probes every peer once; returns the abort message, or None.

        ``last_ok`` maps each peer to when it last answered; answers update it.
        """
        for peer in self.peers:
            now = self._clock()
            waited = now - last_ok.setdefault(peer, now)
            budget = max(0.001, min(MAX_PROBE_SECONDS, self.timeout - waited))
            try:
                self._probe(peer, budget)
            except Exception as error:  # noqa: BLE001 - every failure is a missed answer
                text = str(error).strip().splitlines()[0] if str(error).strip() else ""
                kind = type(error).__name__
                if kind == "FailedPreconditionError":  # A new incarnation: it restarted.
                    return (
                        f"tfdist: peer {peer} restarted (TensorFlow: {kind}: {text}); "
                        "aborting this worker's collectives, which would wait for "
                        "the old process forever"
                    )
                waited = self._clock() - last_ok[peer]
                if waited >= self.timeout:
                    return (
                        f"tfdist: peer {peer} has not answered for {waited:.0f} s "
                        f"(collective_timeout={self.timeout:g}); it is hung or gone, "
                        f"so this worker's collectives are aborted. Last probe: "
                        f"{kind}: {text}"
                    )
                # Once per silence, and only past half the timeout: a peer
                # that finished first and exited is silent too.
                if peer not in self._warned and waited >= self.timeout / 2:
                    self._warned.add(peer)
                    log.warning(
                        "tfdist: peer %s has not answered for %.0f s (%s); "
                        "collectives fail after %g s of silence",
                        peer,
                        waited,
                        kind,
                        self.timeout,
                    )
            else:
                last_ok[peer] = self._clock()
                self._warned.discard(peer)
        return None

    def _run(self) -> None:
        last_ok: dict[str, float] = {}
        while not self._stop.is_set():
            message = self.check_once(last_ok)
            if message is not None and not self._stop.is_set():
                self.failure = message
                log.error("%s", message)
                self._abort(message)
                return
            self._stop.wait(self.interval)
