"""The rank side of :func:`tfdist.horovod.run`: load the call, run it, write the outcome.

Each rank runs ``python -c WORKER_CODE DIRECTORY``. This module sits outside
the ``tfdist.horovod`` package so that a rank imports TensorFlow only when
``func`` does. ``DIRECTORY`` holds ``header.json`` (the caller's
``sys.path``, how to load its ``__main__``, the serializer) and ``call.pkl``
(``func, args, kwargs``); each rank writes ``attempt-N/rank-R.result`` (its
pickled return value) or ``attempt-N/rank-R.error`` (JSON: type, message,
traceback).
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import sys
import traceback
import types
from pathlib import Path
from typing import Any

#: What each rank runs (``python -c``); argv[1] is the call directory.
WORKER_CODE = (
    "import sys; from tfdist.engines.worker.hvd_worker import main; sys.exit(main(sys.argv[1]))"
)
#: True while a rank loads the caller's ``__main__`` (the pickle path): a
#: ``run()`` call at the script's top level would start ranks from ranks.
LOADING_MAIN = False


def _major(module: Any) -> int:
    version = getattr(module, "__version__", "0")
    return int(version.split(".")[0]) if version.split(".")[0].isdigit() else 0


def pickler(choice: str | None = None) -> tuple[str, Any]:
    """The serializer: cloudpickle if importable, else :mod:`pickle`.

    cloudpickle 3 or newer first, standalone or pyspark's copy: cloudpickle
    2 loses the fields of a dataclass defined in ``__main__`` (and of the
    caller's own class when a result comes back), so it is used only when
    nothing newer is installed.

    Args:
        choice: ``"pickle"`` to use :mod:`pickle` whatever is installed.

    Returns:
        ``("cloudpickle", module)`` or ``("pickle", pickle)``.
    """
    if choice == "pickle":
        return "pickle", pickle
    found = []
    try:
        import cloudpickle

        found.append(cloudpickle)
    except ImportError:
        pass
    if not found or _major(found[0]) < 3:
        try:
            from pyspark import cloudpickle as spark_cloudpickle

            found.insert(0, spark_cloudpickle)
        except ImportError:
            pass
    if found:
        return "cloudpickle", max(found, key=_major)
    return "pickle", pickle


def _rank() -> int:
    config = json.loads(os.environ["TF_CONFIG"])
    return int(config["task"]["index"])


def _load_main(main: dict[str, str]) -> None:
    """Loads the parent's script as ``__mp_main__`` (its guarded code does not run)."""
    global LOADING_MAIN
    module = types.ModuleType("__mp_main__")
    LOADING_MAIN = True
    try:
        if "module" in main:
            namespace = runpy.run_module(main["module"], run_name="__mp_main__", alter_sys=False)
        else:
            namespace = runpy.run_path(main["path"], run_name="__mp_main__")
    finally:
        LOADING_MAIN = False
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _write(path: Path, data: bytes) -> None:
    """Writes a file whole or not at all (a killed rank leaves no half file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def main(directory: str) -> int:
    """Body of each worker: load the call, run it, write the result or the error."""
    rank = _rank()
    out = Path(directory) / f"attempt-{os.environ.get('TFDIST_LAUNCH_ATTEMPT', '0')}"
    out.mkdir(exist_ok=True)
    try:
        header = json.loads((Path(directory) / "header.json").read_text(encoding="utf-8"))
        # The caller's import path: func's module is found as it was there.
        sys.path[:] = header["sys_path"] + [p for p in sys.path if p not in header["sys_path"]]
        if header["main"]:
            _load_main(header["main"])
        func, args, kwargs = pickle.loads((Path(directory) / "call.pkl").read_bytes())
        value = func(*args, **kwargs)
        name, module = pickler(header["serializer"])
        try:
            data = module.dumps(value)
        except Exception as error:  # noqa: BLE001
            raise TypeError(
                f"func's return value on rank {rank} cannot be pickled "
                f"({name}): {type(value).__name__}: {error}"
            ) from None
        _write(out / f"rank-{rank}.result", data)
        return 0
    except SystemExit as error:
        # sys.exit(N) in func ends the rank with N, as in a script; 0 leaves no result.
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
        if code:
            _write_error(out / f"rank-{rank}.error", error)
        return code
    except BaseException as error:  # noqa: BLE001 - the caller gets every failure
        _write_error(out / f"rank-{rank}.error", error)
        traceback.print_exc()
        return 1


def _write_error(path: Path, error: BaseException) -> None:
    info = {
        "type": type(error).__qualname__,
        "message": str(error),
        "traceback": traceback.format_exc(),
    }
    _write(path, json.dumps(info).encode("utf-8"))
