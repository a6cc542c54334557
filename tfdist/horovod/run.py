"""``horovod.run(func, np=...)`` on tfdist's launcher.

:func:`run` starts ``np`` worker processes on this machine through
:func:`tfdist.engines.launch.launch` (each with its ``TF_CONFIG``: worker ``i`` is
rank ``i``), calls ``func(*args, **kwargs)`` in each and returns the return
values ordered by rank, as ``horovod.run`` does::

    import tfdist.horovod as horovod

    def train(lr):
        import tfdist.horovod as hvd
        hvd.init()
        ...
        return hvd.rank()

    if __name__ == "__main__":
        print(horovod.run(train, args=(0.1,), np=2))   # [0, 1]

``func`` and its arguments travel to the workers through a file, pickled
with cloudpickle when it is importable (a function defined in the script's
``__main__`` or a notebook goes by value), else with :mod:`pickle`. Without
cloudpickle a ``__main__`` function goes by name: each worker loads the
script as ``__mp_main__`` first, as :mod:`multiprocessing` does, so the call
to ``run`` must sit under ``if __name__ == "__main__":``.

Each rank runs :mod:`tfdist.engines.worker.hvd_worker`, which imports TensorFlow only
when ``func`` does (``hvd.init()`` inside it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tfdist.engines import horovodrun
from tfdist.engines.worker import hvd_worker as _hvd_worker
from tfdist.errors import ConfigError, TfdistError

__all__ = ["run", "RunError"]

_SOURCE = "tfdist.horovod.run()"
#: Seconds between SIGTERM and SIGKILL when the other ranks are stopped.
_STOP_TIMEOUT = 5.0
#: "cloudpickle" (default when importable) or "pickle".
_PICKLER: str | None = None


class RunError(TfdistError, RuntimeError):
    """A rank of :func:`run` failed; the message has its error and traceback.

    Attributes:
        rank: The rank whose failure stopped the job.
        exit_code: Its exit code (128 + N for a signal N).
        error_type: The exception's class name, or None if the process died
            without raising (killed, ``os._exit``).
        error_message: ``str()`` of the exception, or None.
        details: The rank's traceback, or its last lines of output.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        exit_code: int,
        error_type: str | None,
        error_message: str | None,
        details: str,
    ) -> None:
        self.rank, self.exit_code = rank, exit_code
        self.error_type, self.error_message, self.details = error_type, error_message, details
        what = (
            f"{error_type}: {error_message}"
            if error_type
            else f"the process exited with code {exit_code} without a Python error"
        )
        self._args = (rank, size, exit_code, error_type, error_message, details)
        super().__init__(
            f"{_SOURCE}: rank {rank} of {size} failed: {what}\n"
            f"--- rank {rank} ---\n{details.rstrip()}"
        )

    def __reduce__(self):
        return (type(self), self._args)


def _main_source() -> dict[str, str] | None:
    """How a worker can load this process's ``__main__``: by module name or path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        return {"module": spec.name}
    path = getattr(main, "__file__", None)
    return {"path": os.path.abspath(path)} if path else None


def _check_options(
    np: Any, num_proc: Any, use_gloo: Any, use_mpi: Any, elastic: Mapping[str, Any], kwargs: Any
) -> int:
    for name, value in elastic.items():
        if value is not None:
            raise ConfigError(
                name,
                value,
                "None: tfdist.horovod.run() starts a fixed number of processes",
                source=_SOURCE,
                hint="Use np=N; a failed rank "
                "stops the job, and with max_restarts=K it restarts from the "
                "script's last commit (tfdist.horovod.elastic).",
            )
    if np is not None and num_proc is not None and np != num_proc:
        raise ConfigError(
            "np", np, f"the same as num_proc ({num_proc!r}), or only one of them", source=_SOURCE
        )
    count = 1 if np is None and num_proc is None else (num_proc if np is None else np)
    if use_gloo and use_mpi:
        raise ConfigError(
            "use_mpi", use_mpi, "not True together with use_gloo=True", source=_SOURCE
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigError("kwargs", kwargs, "None or a dict of keyword arguments", source=_SOURCE)
    return count


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: Any = None,
    hosts: str | Sequence[str] | None = None,
    hostfile: str | os.PathLike | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | os.PathLike | None = None,
    verbose: int | bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` in ``np`` local processes; returns their results.

    Horovod's ``horovod.run`` on :func:`tfdist.engines.launch.launch`: each process
    gets its ``TF_CONFIG`` (worker ``i`` is rank ``i``), so ``hvd.init()``
    inside ``func`` finds its rank. Every rank's output is shown, prefixed
    with ``[worker:RANK]``.

    Args:
        func: The function each rank calls. Sent to the workers with
            cloudpickle when importable (functions of ``__main__``, lambdas
            and closures work), else with :mod:`pickle` (module-level
            functions; those of ``__main__`` need the ``run`` call under
            ``if __name__ == "__main__":``).
        args: Positional arguments of ``func`` (pickled too).
        kwargs: Keyword arguments of ``func``.
        num_proc: Number of processes (Horovod's name); default 1.
        min_num_proc: Horovod's elastic mode: not supported, must be None
            (a ConfigError says what to use instead); so must
            ``max_num_proc``, ``slots``, ``reset_limit``, ``cooldown_range``,
            ``min_np`` and ``max_np``.
        max_num_proc: As ``min_num_proc``.
        slots: As ``min_num_proc``.
        reset_limit: As ``min_num_proc``.
        cooldown_range: As ``min_num_proc``.
        min_np: As ``min_num_proc``.
        max_np: As ``min_num_proc``.
        hosts: ``"localhost:2"`` style slots. Every rank must land on
            localhost or 127.0.0.1: ``run`` starts processes on this machine
            only. For other hosts, ``tfdist horovodrun -np N -H ... python
            script.py`` prints each host's command.
        hostfile: A host file (``host slots=N`` lines), as ``hosts``.
        start_timeout: Seconds for every rank to join; passed to the ranks
            as ``TFDIST_REGISTER_TIMEOUT``.
        ssh_port: Accepted for Horovod's signature; no effect (no SSH, no
            MPI: the processes are local); so are ``ssh_identity_file``,
            ``disable_cache``, ``mpi_args`` and ``network_interface``.
        ssh_identity_file: As ``ssh_port``.
        disable_cache: As ``ssh_port``.
        mpi_args: As ``ssh_port``.
        network_interface: As ``ssh_port``.
        output_filename: Keep each rank's full log under this directory
            (``DIR/attempt-N/worker-RANK.log``).
        verbose: Also show TensorFlow's start-up messages.
        use_gloo: Accepted; no effect (TensorFlow's collectives carry the
            all-reduces). With ``use_mpi`` also True, an error, as in Horovod.
        use_mpi: As ``use_gloo``.
        executable: The Python interpreter of the workers (default: this one).
        np: Horovod's older name of ``num_proc``.
        max_restarts: (tfdist) Restart every rank up to this many times after
            a failure; results come from the run that finished.
        env: (tfdist) Extra environment variables for the workers.

    Returns:
        The return values of ``func``, index = rank.

    Raises:
        RunError: A rank failed (after ``max_restarts`` restarts): its
            exception's type, message and traceback. The other ranks were
            stopped.
        ConfigError: Bad arguments: ``np`` < 1 or above the slots, hosts
            other than this machine, elastic options, both ``use_gloo`` and
            ``use_mpi``, or ``func`` that cannot be pickled.
        KeyboardInterrupt: Ctrl-C; every rank was stopped.
    """
    from tfdist.engines import launch as launch_lib

    if _hvd_worker.LOADING_MAIN:
        raise TfdistError(
            f"{_SOURCE} was called while a worker loaded the script's __main__ to find func "
            "(cloudpickle is not installed, so functions of __main__ go by name). Put the "
            'call under `if __name__ == "__main__":`, or install cloudpickle.'
        )
    elastic = {
        "min_num_proc": min_num_proc,
        "max_num_proc": max_num_proc,
        "slots": slots,
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
        "min_np": min_np,
        "max_np": max_np,
    }
    count = _check_options(np, num_proc, use_gloo, use_mpi, elastic, kwargs)
    _check_local(count, hosts, hostfile, "np" if num_proc is None else "num_proc")
    task_env = _task_env(env, start_timeout)
    with tempfile.TemporaryDirectory(prefix="tfdist-hvd-run-") as directory:
        _write_call(Path(directory), func, tuple(args), dict(kwargs or {}))
        result = launch_lib.launch(
            ["-c", _hvd_worker.WORKER_CODE],
            [directory],
            workers=count,
            max_restarts=max_restarts,
            show_all=True,
            env=task_env,
            python=executable,
            log_dir=output_filename,
            verbose=bool(verbose),
            stop_timeout=_STOP_TIMEOUT,
        )
        return _results(result, Path(directory), count)


def _check_local(count: int, hosts: object, hostfile: object, field: str) -> None:
    """Refuses ranks on another machine: run() starts local processes only."""
    ranks = horovodrun.rank_hosts(
        count, horovodrun.read_hosts(hosts, hostfile, source=_SOURCE), source=_SOURCE, field=field
    )
    if not horovodrun.is_local(ranks):
        others = sorted({h for h in ranks if h.lower() not in horovodrun.LOCAL_HOSTS})
        raise ConfigError(
            "hosts" if hostfile is None else "hostfile",
            hosts if hostfile is None else hostfile,
            "only this machine's hosts (localhost, 127.0.0.1): run() launches locally",
            source=_SOURCE,
            received=f"ranks on {', '.join(others)}",
            hint="For several hosts put the training in a script and run `tfdist horovodrun "
            "-np N -H host1:slots,host2:slots python script.py`: it prints each host's "
            "TF_CONFIG and command.",
        )


def _task_env(env: Mapping[str, str] | None, start_timeout: object) -> dict[str, str]:
    """The ranks' extra environment, with ``start_timeout`` as their
    registration timeout."""
    if start_timeout is not None and (
        isinstance(start_timeout, bool)
        or not isinstance(start_timeout, (int, float))
        or start_timeout <= 0
    ):
        raise ConfigError(
            "start_timeout", start_timeout, "None or a number of seconds > 0", source=_SOURCE
        )
    task_env = dict(env or {})
    if start_timeout is not None:
        task_env["TFDIST_REGISTER_TIMEOUT"] = str(start_timeout)
    return task_env


def _results(result: Any, directory: Path, count: int) -> list[Any]:
    """The ranks' return values, or the error of the run that failed."""
    # Attempts are numbered from 0; every failure (a restart or a port
    # relaunch) started the next one.
    if result.ok:
        return _read_results(directory / f"attempt-{len(result.attempts)}", count)
    if result.failure is None:  # Stopped by a signal.
        if result.exit_code == 130:
            raise KeyboardInterrupt
        raise TfdistError(
            f"{_SOURCE}: stopped (exit code {result.exit_code}); every rank was stopped"
        )
    raise _rank_error(directory / f"attempt-{len(result.attempts) - 1}", result.failure, count)


def _write_call(directory: Path, func: Any, args: tuple, kwargs: dict) -> None:
    """Writes ``header.json`` (how to unpickle) and ``call.pkl`` (what to call)."""
    name, module = _hvd_worker.pickler(_PICKLER)
    try:
        payload = module.dumps((func, args, kwargs))
    except Exception as error:  # noqa: BLE001 - any pickling failure means the same
        hint = (
            "Install cloudpickle to send lambdas, closures and functions of __main__."
            if name == "pickle"
            else None
        )
        raise ConfigError(
            "func",
            func,
            "a function that can be pickled, with picklable args and kwargs",
            source=_SOURCE,
            received=f"{func!r} ({type(error).__name__}: {error})",
            hint=hint,
        ) from None
    main = None
    if name == "pickle" and b"__main__" in payload:
        main = _main_source()
        if main is None:
            raise ConfigError(
                "func",
                func,
                "a function the workers can import",
                source=_SOURCE,
                hint="It is defined in an interactive __main__ (no script "
                "file); install cloudpickle, or move it to a module.",
            )
    header = {
        "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
        "main": main,
        "serializer": name,
    }
    (directory / "header.json").write_text(json.dumps(header), encoding="utf-8")
    (directory / "call.pkl").write_bytes(payload)


def _read_results(attempt: Path, count: int) -> list[Any]:
    results = []
    with _main_alias():
        for rank in range(count):
            path = attempt / f"rank-{rank}.result"
            if not path.exists():
                raise TfdistError(
                    f"{_SOURCE}: rank {rank} exited with code 0 but left no "
                    "result (did func call os._exit or sys.exit(0)?)"
                )
            results.append(pickle.loads(path.read_bytes()))
    return results


def _rank_error(attempt: Path, failure: Any, count: int) -> RunError:
    job, _, index = failure.task.partition(":")
    rank = int(index) if job == "worker" and index.isdigit() else -1
    error_file = attempt / f"rank-{rank}.error"
    if error_file.exists():
        info = json.loads(error_file.read_text(encoding="utf-8"))
        return RunError(
            rank, count, failure.exit_code, info["type"], info["message"], info["traceback"]
        )
    tail = "\n".join(failure.tail[-15:]) or "(no output)"
    return RunError(
        rank, count, failure.exit_code, None, None, f"{failure.how}. Its last lines:\n{tail}"
    )


@contextlib.contextmanager
def _main_alias() -> Iterator[None]:
    """Lets pickle find ``__mp_main__`` (the ranks' name for the script) in this process."""
    added = "__mp_main__" not in sys.modules and "__main__" in sys.modules
    if added:
        sys.modules["__mp_main__"] = sys.modules["__main__"]
    try:
        yield
    finally:
        if added:
            sys.modules.pop("__mp_main__", None)
