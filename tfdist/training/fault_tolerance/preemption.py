"""Preemption: a signal becomes one agreed step at which every worker saves.

Spot VMs, Slurm (``--signal``, ``KillWait``) and Kubernetes evictions send
SIGTERM, then SIGKILL after a grace period. Once a task has joined a
multi-worker cluster, TensorFlow's coordination service installs its own
SIGTERM handler, which only records the notice: the task trains on until the
SIGKILL and nothing is saved. :class:`PreemptionWatcher` takes the signal
back for the time of a training loop and turns it into a step at which every
worker stops, so that a backup there is consistent:

* **Agreement** is TensorFlow's own protocol, the one of
  ``tf.distribute.experimental.PreemptionCheckpointHandler``, over the same
  coordination-service key-value store. Synchronous workers are at most one
  step apart, so the first worker to see a signal after finishing step N
  publishes "stop after step N+1" and waits until every worker's watcher
  thread acknowledged it; no worker can finish step N+1 before that, so all
  of them stop after exactly N+1.
* **Why not the handler itself:** it saves only a ``tf.train.Checkpoint``
  and exits from inside ``run``; its keys are fixed for the cluster's
  lifetime, so a second training loop in the same process (a second
  ``fit``) cannot be preempted; and it refuses ParameterServerStrategy.
  Here the keys are per loop (a per-process counter that every worker
  advances alike) and the caller saves what it saves: Keras weights with a
  backup pointer, a ``CheckpointManager``, or anything else.
* One process (Mirrored, one worker, the coordinator of a parameter-server
  job) needs no agreement: it stops after the step it is in.

After saving, :meth:`PreemptionWatcher.exit` writes a status record for the
launcher (``$TFDIST_JOB_DIR/preempted/TASK.json``) and exits with
:data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from absl import logging

from tfdist.errors import ConfigError, TfdistError

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "PreemptionError",
    "PreemptionWatcher",
    "preemption_signal",
    "status_dir",
]

#: A preempted task's exit code: 128 + SIGTERM. Kubeflow's TFJob
#: ``restartPolicy: ExitCode`` retries 128-255 (and not 1-127), and TF's own
#: handler exits with it on GCE.
PREEMPTED_EXIT_CODE = 143
_STOP_WATCHING = "tfdist-stop-watching"
_RUNS = itertools.count()
#: Watchers started and not stopped yet, oldest first (see :func:`running`).
_RUNNING: list[PreemptionWatcher] = []


def running() -> list[PreemptionWatcher]:
    """The watchers of this process that were started and not stopped yet,
    oldest first."""
    return list(_RUNNING)


def _grace() -> float | None:
    """The grace period the launcher announced (``TFDIST_GRACE``), if any."""
    try:
        return float(os.environ["TFDIST_GRACE"])
    except (KeyError, ValueError):
        return None


def ack_timeout() -> float:
    """Seconds the first signalled worker waits for every worker's
    acknowledgement: half the grace period (``TFDIST_GRACE``), at least 5 s,
    15 s without one. Watcher threads answer within milliseconds; a worker
    that does not is gone, and the rest of the grace period is the save's."""
    grace = _grace()
    return 15.0 if grace is None else max(5.0, grace / 2)


class PreemptionError(TfdistError, RuntimeError):
    """The workers could not agree on a step to stop at."""


class Preempted(SystemExit):
    """Raised by :meth:`PreemptionWatcher.exit`: a ``SystemExit`` with
    :data:`PREEMPTED_EXIT_CODE`, after the state was saved."""

    def __init__(self, record: dict) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.record = record


def preemption_signal(value: Any = None) -> signal.Signals:
    """The signal that means "preempted": ``value``, else
    ``$TFDIST_PREEMPT_SIGNAL``, else SIGTERM.

    Raises:
        ConfigError: Not a signal name or number.
    """
    source = "PreemptionWatcher(signals=...)"
    if value is None:
        value = os.environ.get("TFDIST_PREEMPT_SIGNAL") or "SIGTERM"
        source = "TFDIST_PREEMPT_SIGNAL"
    try:
        if isinstance(value, str):
            name = value.strip().upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(value)
    except (KeyError, ValueError):
        raise ConfigError(
            "signal",
            value,
            "a signal name such as 'SIGTERM' or 'USR1', or its number",
            source=source,
        ) from None


def status_dir() -> str | None:
    """Where status records go: ``$TFDIST_JOB_DIR/preempted``, or None."""
    job = os.environ.get("TFDIST_JOB_DIR")
    return os.path.join(job, "preempted") if job else None


def _cluster_of(strategy: Any) -> tuple[str, int, int]:
    """(task name, id among the training tasks, number of training tasks)."""
    from tfdist.training.callbacks.workers import cluster  # The callbacks import TensorFlow.

    spec, task_type, task_id = cluster(strategy)
    trainers = [(job, i) for job in ("chief", "worker") for i in range(len(spec.get(job, [])))]
    if task_type is None or (task_type, task_id) not in trainers:
        return f"{task_type or 'worker'}:{task_id or 0}", 0, 1
    return f"{task_type}:{task_id}", trainers.index((task_type, task_id)), len(trainers)


class PreemptionWatcher:
    """Catches the preemption signal; every worker stops after the same step.

    Use it around a training loop, and call :meth:`should_stop` after every
    step (on every worker, with the number of steps done since the loop
    started)::

        with tfdist.PreemptionWatcher(strategy) as watcher:
            for step in range(start, total):
                train_step(next(iterator))
                if watcher.should_stop(step + 1 - start):
                    manager.save(checkpoint_number=step + 1)
                    watcher.exit({"step": step + 1})

    ``tfdist.BackupAndRestore`` (and Keras's BackupAndRestore under a tfdist
    strategy) do this inside ``fit``.

    Args:
        strategy: The training strategy (default: the current one). Under a
            multi-worker MultiWorkerMirrored the workers agree through the
            coordination service; otherwise the process stops alone.
        signals: The signal (or signals) meaning "preempted": names or
            numbers. Default: ``$TFDIST_PREEMPT_SIGNAL``, else SIGTERM.
        name: Names the loop in logs and keys.
        fast_exit: After :meth:`exit`, end the process with
            :data:`PREEMPTED_EXIT_CODE` at interpreter exit, skipping
            TensorFlow's own shutdown: with a peer already gone its
            coordination service took up to 60 s here, past a 30 s grace
            period. The backup and the status record are on disk by then;
            ``finally`` blocks still run, later ``atexit`` handlers do not.
        task: This task's name, for jobs without a tf.distribute strategy
            (``tfdist.horovod``); default: from the strategy's cluster.
        index: This task's index among the training tasks; default, as
            ``task``.
        workers: The number of training tasks; default, as ``task``.

    Attributes:
        signal_time: ``time.time()`` of the first signal seen here, or None.
        stopped_at: The agreed step, once known.
    """

    def __init__(
        self,
        strategy: Any = None,
        signals: Any = None,
        name: str = "loop",
        *,
        fast_exit: bool = True,
        task: str | None = None,
        index: int | None = None,
        workers: int | None = None,
    ) -> None:
        if signals is None or isinstance(signals, (str, int)):
            signals = [signals]
        self.signals = [preemption_signal(s) for s in signals]
        if not self.signals:
            raise ConfigError("signals", signals, "at least one signal", source="PreemptionWatcher")
        if not isinstance(fast_exit, bool):
            raise ConfigError("fast_exit", fast_exit, "True or False", source="PreemptionWatcher")
        self.name = name
        self.fast_exit = fast_exit
        self._strategy = strategy
        self.signal_time: float | None = None
        self.stopped_at: int | None = None
        self._own = threading.Event()
        self._agreed = threading.Event()
        self._previous: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._published = False
        self._running = False
        self._held = 0
        self._topology = (task, index, workers) if workers is not None else None
        self.task, self.index, self.workers = "worker:0", 0, 1
        self._prefix = ""

    # -- life cycle ----------------------------------------------------------

    def start(self) -> PreemptionWatcher:
        """Installs the signal handler and, with several workers, the watcher
        thread. Call it in the main thread, at the same point on every worker."""
        import tensorflow as tf

        if self._topology is not None:
            task, index, workers = self._topology
            self.index, self.workers = index or 0, workers
            self.task = task or f"worker:{self.index}"
        else:
            strategy = self._strategy or tf.distribute.get_strategy()
            self.task, self.index, self.workers = _cluster_of(strategy)
            if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
                self.workers = 1  # Only the coordinator runs the loop.
        attempt = os.environ.get("TFDIST_LAUNCH_ATTEMPT", "0")
        self._prefix = f"tfdist_preempt/{attempt}/{next(_RUNS)}-{self.name}"
        self._running = True
        _RUNNING.append(self)
        self._install()
        if self.workers > 1:
            self._thread = threading.Thread(
                target=self._watch, daemon=True, name="tfdist-preemption-watcher"
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Restores the previous handlers and ends the watcher thread."""
        if not self._running:
            return
        self._running = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._previous.clear()
        if self._thread is not None:
            # The thread blocks on the key; a value ends it. Another worker may
            # have set it already (a real notice): then it has ended, or will.
            self._set(self._key("stop_after"), _STOP_WATCHING, exists_ok=True)
            self._thread.join(10.0)
            self._thread = None
        if self._own.is_set() and self.stopped_at is None:
            logging.warning(
                "tfdist: %s was signalled (%s) after its last step; the loop "
                "finished, nothing more to save.",
                self.task,
                self.name,
            )

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- signals -------------------------------------------------------------

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            # TensorFlow's coordination service may have put its own C++
            # handler there after ours (it starts with the first collective):
            # installing again each time is one syscall.
            previous = signal.signal(signum, self._on_signal)
            if previous is not self._on_signal and signum not in self._previous:
                self._previous[signum] = previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._own.is_set():
            self.signal_time = time.time()
            logging.warning(
                "tfdist: %s received %s: the workers will save at the next "
                "step boundary and exit with code %d.",
                self.task,
                signal.Signals(signum).name,
                PREEMPTED_EXIT_CODE,
            )
        self._own.set()

    def notify(self) -> None:
        """Acts as if this process received the preemption signal."""
        self._on_signal(self.signals[0], None)

    @property
    def requested(self) -> bool:
        """A preemption was signalled here or agreed by the job."""
        return self._own.is_set() or self._agreed.is_set()

    # -- agreement -----------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    @staticmethod
    def _set(key: str, value: str, exists_ok: bool = False) -> bool:
        """Sets a key; False if it existed already (and exists_ok)."""
        import tensorflow as tf

        from tfdist.compat.tf_python import eager_context as context

        try:
            context.context().set_config_key_value(key, value)
            return True
        except tf.errors.AlreadyExistsError:
            if exists_ok:
                return False
            raise
        except tf.errors.OpError as error:
            if exists_ok:
                logging.warning("tfdist: could not set %s: %s", key, error)
                return False
            raise

    def _watch(self) -> None:
        """Waits for the agreed step, records it, acknowledges it."""
        from tfdist.compat.tf_python import eager_context as context

        try:
            value = context.context().get_config_key_value(self._key("stop_after"))
        except Exception as error:  # noqa: BLE001 - the job is ending.
            logging.info("tfdist: preemption watcher ended: %s", error)
            return
        if value == _STOP_WATCHING:
            return
        self.stopped_at = int(value)
        self._agreed.set()
        self._set(self._key(f"ack/{self.index}"), "1", exists_ok=True)

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop now.

        Args:
            step: Steps completed since :meth:`start`, counted alike on every
                worker (a call of a multi-step ``train_function`` is one).

        Returns:
            True on every worker after the same step, once some worker was
            signalled; then save, and call :meth:`exit`.

        Raises:
            PreemptionError: A worker did not acknowledge the notice within
                :func:`ack_timeout` seconds (it is gone).
        """
        if not self._running or self._held:
            return False
        self._install()
        if self._agreed.is_set():
            return step >= self.stopped_at
        if not self._own.is_set():
            return False
        if self.workers == 1:
            self.stopped_at = step
            self._agreed.set()
            return True
        if not self._published:
            self._published = True
            # Peers may already be inside step+1, none beyond it.
            if self._set(self._key("stop_after"), str(step + 1), exists_ok=True):
                logging.info(
                    "tfdist: %s asks every worker to stop after step %d", self.task, step + 1
                )
                self._wait_for_acks()
        # Another worker's notice (ours came second): its value arrives through
        # the watcher before that worker lets step+1 run.
        return self._agreed.is_set() and step >= self.stopped_at

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """:meth:`should_stop` answers False meanwhile: for batch ends that
        are no step boundary (a parameter-server coordinator with later
        steps still in flight). A signal meanwhile is acted on after."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    def _wait_for_acks(self) -> None:
        from tfdist.compat.tf_python import eager_context as context

        timeout = ack_timeout()
        deadline = time.monotonic() + timeout
        for i in range(self.workers):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                context.context().get_config_key_value(self._key(f"ack/{i}"), left)
            except Exception as error:  # DeadlineExceeded, Unavailable.
                raise PreemptionError(
                    f"{self.task}: training task {i} of {self.workers} did not acknowledge "
                    f"the preemption notice within {timeout:g} s ({error}); it is gone, "
                    "so no consistent backup can be taken."
                ) from error
        self._agreed.wait(timeout)

    # -- exit ----------------------------------------------------------------

    def _wait_for_writer(self) -> None:
        """Training task 0 (the chief, rank 0) writes the backup; the others
        leave only once it has, so that a launcher or scheduler that kills
        the rest of a job at its first exit cannot cut that save short."""
        if self.workers == 1 or self._prefix == "":
            return
        from tfdist.compat.tf_python import eager_context as context

        if self.index == 0:
            self._set(self._key("saved"), "1", exists_ok=True)
            return
        timeout = ack_timeout()
        try:
            context.context().get_config_key_value(self._key("saved"), int(timeout * 1000))
        except Exception as error:  # noqa: BLE001 - exit anyway: the grace period runs.
            logging.warning(
                "tfdist: %s: the chief did not confirm its backup within %g s "
                "(%s); exiting anyway.",
                self.task,
                timeout,
                error,
            )

    def record(self, **fields: Any) -> dict:
        """The status record: task, attempt, signal time and ``fields``."""
        return {
            "task": self.task,
            "attempt": int(os.environ.get("TFDIST_LAUNCH_ATTEMPT", 0)),
            "signal_time": self.signal_time,
            "stopped_after": self.stopped_at,
            **fields,
        }

    def exit(self, record: dict | None = None) -> NoReturn:
        """Writes the status record and raises :class:`Preempted` (exit code
        :data:`PREEMPTED_EXIT_CODE`). Call it after saving."""
        record = self.record(**(record or {}))
        self._wait_for_writer()
        record["exit_time"] = time.time()
        write_status(record)
        self.stop()
        since = (
            f" {record['exit_time'] - self.signal_time:.2f} s after the signal"
            if self.signal_time
            else ""
        )
        where = f"step {record['step']}" if "step" in record else f"step {self.stopped_at}"
        logging.warning("tfdist: %s saved at %s and exits (preempted)%s.", self.task, where, since)
        grace = _grace()
        if (
            grace is not None
            and self.signal_time is not None
            and record["exit_time"] - self.signal_time > grace
        ):
            logging.warning(
                "tfdist: that took longer than the grace period (%g s): a SIGKILL "
                "may have come first on a real preemption. Save less often "
                "elsewhere, or ask for a longer grace period.",
                grace,
            )
        print(
            f"tfdist: preempted: {self.task} saved at {where}; exiting with code "
            f"{PREEMPTED_EXIT_CODE}{since}",
            file=sys.stderr,
            flush=True,
        )
        if self.fast_exit:
            # Registered last, so it runs first at exit.
            atexit.register(_exit_now)
        raise Preempted(record)


def _exit_now() -> None:
    """Ends a preempted process without TensorFlow's shutdown."""
    try:
        logging.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(PREEMPTED_EXIT_CODE)


def write_status(record: dict) -> str | None:
    """Writes ``record`` to ``$TFDIST_JOB_DIR/preempted/TASK.json``
    atomically; returns the path (None without ``TFDIST_JOB_DIR``)."""
    directory = status_dir()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, record["task"].replace(":", "-") + ".json")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
