"""A pipeline's weights file, written and read by stage.

Keras writes and reads a ``.weights.h5`` file by walking the model's layers;
``objects_to_skip`` (Keras 3.10 to 3.15: ``saving_lib.save_weights_only``
and ``Model.load_weights``) leaves a layer and its sublayers out of the walk.
Each pipeline process writes the layers that hold its weights to a part file,
and the first process joins the parts into one file, dataset by dataset
(:func:`join_parts`): the file Keras writes for the whole model, and no
process holds more than its own weights. Reading, a process skips the layers
of the others, and reads only its own weights.

A layer whose own weights two processes train (keras-hub's
``ReversibleEmbedding`` holds the first stage's embeddings and, untied, the
last stage's output projection) is written by the first of them: the others'
weights of it travel down the pipeline to it before the write (:class:`Plan`).

Paths may be local or any URL ``tf.io.gfile`` opens (``gs://``, ``hdfs://``,
``ram://``), as Keras's own ``save``/``save_weights`` take: h5py and zipfile
work on a local copy (:func:`local_copy`), and a finished file reaches its
URL whole or not at all (:func:`published`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from tfdist.compat.keras_private import flatten_layers
from tfdist.compat.keras_src import file_utils
from tfdist.errors import ConfigError

__all__ = [
    "WEIGHTS_SUFFIX",
    "Plan",
    "plan_for",
    "part_file",
    "join_parts",
    "write_state",
    "read_state",
    "local_copy",
    "published",
    "makedirs_for",
    "remove",
]

#: What Keras's weights file name ends with (``save_weights`` refuses others).
WEIGHTS_SUFFIX = ".weights.h5"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Who writes and reads what, for one process of a pipeline.

    Attributes:
        skip_save: Layers this process leaves out of its part file.
        skip_load: Layers this process does not read (no weight of theirs
            is one it computes with).
        load: The weights this process reads (their values are made first).
        sent: Per process ``i > 0``, the weights it sends to process
            ``i - 1`` before the write: its own and those it passes on, for
            layers an earlier process writes. In ``model.weights`` order.
        taken: The weights this process takes from what it receives (it
            writes their layer).
    """

    skip_save: list[Any]
    skip_load: list[Any]
    load: list[Any]
    sent: dict[int, list[Any]]
    taken: list[Any]


def plan_for(model: Any, reads: Sequence[Sequence[Any]], process: int) -> Plan:
    """The write and read plan of ``process``.

    Args:
        model: The whole model (every process builds the same).
        reads: Per pipeline process, the variables its stages compute with.
        process: This process's place in the pipeline.
    """
    owner: dict[int, int] = {}  # The first process that computes with it trains it.
    for k in reversed(range(len(reads))):
        owner.update((id(v), k) for v in reads[k])
    layers = flatten_layers(model)
    direct = {id(layer): _direct_weights(layer) for layer in layers}
    # A layer's own weights are written by the first process that trains one.
    writer = {
        id(layer): min(owner.get(id(v), 0) for v in direct[id(layer)])
        for layer in layers
        if direct[id(layer)]
    }
    held_by = {id(v): id(layer) for layer in layers for v in direct[id(layer)]}
    mine = {id(v) for v in reads[process]}
    skip_save, skip_load, load = [], [], []
    for layer in layers:
        below = [layer, *flatten_layers(layer)]
        writers = {writer[id(x)] for x in below if id(x) in writer}
        if writers and process not in writers:
            skip_save.append(layer)
        if layer.weights and not any(id(v) in mine for v in layer.weights):
            skip_load.append(layer)
        elif direct[id(layer)]:
            load.extend(direct[id(layer)])
    sent = {
        i: [
            v
            for v in model.weights
            if id(v) in held_by and writer[held_by[id(v)]] < i <= owner.get(id(v), 0)
        ]
        for i in range(1, len(reads))
    }
    taken = [
        v
        for v in model.weights
        if id(v) in held_by and writer[held_by[id(v)]] == process and owner.get(id(v), 0) != process
    ]
    return Plan(skip_save, skip_load, load, sent, taken)


def _direct_weights(layer: Any) -> list[Any]:
    """The layer's weights that none of its sublayers holds."""
    below = {id(v) for sub in flatten_layers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in below]


def part_file(filepath: Any, process: int) -> str:
    """Where ``process`` writes its part of the weights file ``filepath``."""
    path = os.fspath(filepath)
    return f"{path[: -len(WEIGHTS_SUFFIX)]}.part{process}{WEIGHTS_SUFFIX}"


# Files, local or at a URL: through Keras's file_utils (tf.io.gfile for what
# it counts as remote: URLs, /gcs, ...), as Keras's own save goes.


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """``path`` itself if local; else a local copy of it, removed after."""
    if not file_utils.is_remote_path(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="tfdist-pipeline-") as tmp:
        local = os.path.join(tmp, os.path.basename(path))
        file_utils.copy(path, local)
        yield local


@contextlib.contextmanager
def published(target: str) -> Iterator[str]:
    """A local path to write ``target``'s content to: once the block ends
    without error, it becomes ``target`` (renamed, or uploaded then renamed
    at the URL), so ``target`` appears whole or not at all; after an error
    nothing is left."""
    if file_utils.is_remote_path(target):
        import tensorflow as tf  # Keras's file_utils has no rename.

        with tempfile.TemporaryDirectory(prefix="tfdist-pipeline-") as tmp:
            local = os.path.join(tmp, os.path.basename(target))
            yield local
            file_utils.copy(local, target + ".partial")
            tf.io.gfile.rename(target + ".partial", target, overwrite=True)
        return
    partial = target + ".partial"
    try:
        yield partial
        os.replace(partial, target)  # A crash never leaves half a file.
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def makedirs_for(path: str) -> None:
    """Makes the directory ``path`` goes in, if it has one (several
    processes may make it at once)."""
    directory = os.path.dirname(path)
    if not directory:
        return
    if file_utils.is_remote_path(directory):
        file_utils.makedirs(directory)  # tf.io.gfile's: there already is fine.
    else:
        os.makedirs(directory, exist_ok=True)


def remove(path: str) -> None:
    """Removes the file ``path`` if it exists."""
    if file_utils.exists(path):
        file_utils.remove(path)


def join_parts(parts: Sequence[str], target: str) -> None:
    """Joins the processes' part files into ``target``, dataset by dataset
    (the first part to hold a path wins; a path is in one part but for the
    groups above the datasets), then removes the parts. ``target`` appears
    whole or not at all.

    Raises:
        FileNotFoundError: A part is not there, naming it: the processes
            do not share the path's file system.
    """
    import h5py

    missing = [
        f"{part} (process {k})" for k, part in enumerate(parts) if not file_utils.exists(part)
    ]
    if missing:
        raise FileNotFoundError(
            f"the part files of the weights {target} are not all there: missing "
            f"{', '.join(missing)}. Each process writes its part beside the target and the "
            "first process joins them, so every process must reach the path (a shared file "
            "system, or a URL such as gs://)"
        )
    with published(target) as partial, h5py.File(partial, "w") as out:
        for part in parts:
            with local_copy(part) as local, h5py.File(local, "r") as src:
                _join(src, out)
    for part in parts:
        remove(part)


def _join(src: Any, out: Any) -> None:
    import h5py

    for key, value in src.attrs.items():
        if key not in out.attrs:
            out.attrs[key] = value
    for name, item in src.items():
        if isinstance(item, h5py.Group):
            _join(item, out.require_group(name))
        elif name not in out:
            src.copy(item, out, name=name)


def write_state(path: str, variables: Sequence[Any]) -> None:
    """The variables' values to the ``.npz`` file ``path``, one at a time
    (``np.savez`` takes them all at once: Adam's moments of a stage are twice
    its weights), whole or not at all. A variable laid out over a mesh (an
    optimizer's slot of a split weight) is written whole."""
    import zipfile

    import numpy as np

    from tfdist.parallel import sharding

    makedirs_for(path)  # Stage 0 may not have yet.
    with published(path) as partial, zipfile.ZipFile(partial, "w", allowZip64=True) as zf:
        for i, variable in enumerate(variables):
            with zf.open(f"v{i}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, sharding.full_value(variable))


def read_state(path: str, variables: Sequence[Any], what: str, source: str) -> None:
    """Assigns the values saved in ``path`` (if it exists) to ``variables``,
    one at a time, once every saved shape is known to fit.

    Raises:
        ConfigError: The saved values do not fit the variables (another
            optimizer, compression setting or model), naming the file; no
            variable is changed then.
    """
    if not file_utils.exists(path):
        return
    with local_copy(path) as local:
        _read_state(local, path, variables, what, source)


def _read_state(local: str, path: str, variables: Sequence[Any], what: str, source: str) -> None:
    import zipfile

    import numpy as np

    with zipfile.ZipFile(local) as zf:
        names = sorted(zf.namelist(), key=lambda n: int(n[1:].split(".")[0]))
        saved = []
        for name in names:
            with zf.open(name) as f:
                major, _ = np.lib.format.read_magic(f)
                read = (
                    np.lib.format.read_array_header_1_0
                    if major == 1
                    else np.lib.format.read_array_header_2_0
                )
                saved.append(tuple(read(f)[0]))
    from tfdist.parallel import sharding

    shapes = [_full_shape(v) for v in variables]
    if saved != shapes:
        raise ConfigError(
            "filepath",
            path,
            f"{len(shapes)} variables of {what} shaped as this process's, "
            f"{shapes[:4]}{'...' if len(shapes) > 4 else ''}",
            source=source,
            received=f"{path}: {len(saved)} variables shaped "
            f"{saved[:4]}{'...' if len(saved) > 4 else ''}",
        )
    with np.load(local) as values:
        for i, variable in enumerate(variables):
            sharding.assign_full(variable, values[f"v{i}"])  # Each device its block.


def _full_shape(variable: Any) -> tuple:
    """A variable's shape, whole if it is laid out over a mesh."""
    from tfdist.parallel import sharding

    spec = sharding.spec_of(variable)
    return tuple(variable.shape) if spec is None else tuple(spec.full_shape)
