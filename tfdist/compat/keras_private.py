"""Keras objects' private attributes that tfdist reads or sets, by name.

Keras 3.10 to 3.15 keep these only under a private name (no public API gives
the same thing). Every such reach outside tfdist/compat goes through a
function here, so a renamed attribute fails in one place. The objects are
taken as arguments: importing this module imports no Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # For the annotations only: this module imports no Keras.
    import keras

__all__ = [
    "autocast_value",
    "backup_paths",
    "backup_position",
    "call_has_training_arg",
    "compute_loss",
    "deferred_initializer",
    "flatten_layers",
    "functional_nodes",
    "initial_epoch",
    "loss_tracker",
    "optimizer_trainable_variables",
    "optimizer_variable_index",
    "own_kernel",
    "previous_backup_paths",
    "result_logs",
    "rmsprop_momentums",
    "set_backup_paths",
    "set_deferred_initializer",
    "set_initial_epoch",
    "should_eval",
    "symbolic_build",
    "write_keras_archive",
]


# Layers.


def functional_nodes(model: keras.Model) -> list:
    """A functional model's own call nodes, in an order that computes each
    tensor before it is used (Keras keeps them by depth, deepest first)."""
    by_depth = model._nodes_by_depth
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]]


def flatten_layers(layer: keras.layers.Layer, include_self: bool = False) -> list:
    """Every layer nested in ``layer`` (and ``layer`` itself if asked), once each."""
    # Keras has no public walk over nested layers.
    return layer._flatten_layers(include_self=include_self)


def own_kernel(layer: keras.layers.Layer) -> Any:
    """An ``EinsumDense``'s kernel variable itself."""
    # The variable itself: EinsumDense.kernel may be a LoRA sum.
    return layer._kernel


def deferred_initializer(variable: keras.Variable) -> Callable[[], None]:
    """The hook Keras calls to create a variable made in a symbolic trace."""
    # Keras creates a variable made in a symbolic trace only through this hook.
    return variable._deferred_initialize


def set_deferred_initializer(variable: keras.Variable, hook: Callable[[], None]) -> None:
    """Replaces that hook (to mark and fill the variable once created)."""
    # Wraps that hook to mark and fill the variable once created.
    variable._deferred_initialize = hook


def autocast_value(variable: keras.Variable) -> Any:
    """The variable's local value as Keras reads it: its tf.Variable, autocast."""
    import tensorflow as tf

    # The local block as Keras reads it: its tf.Variable, autocast.
    return variable._maybe_autocast(tf.convert_to_tensor(variable._value))


# Models: what Keras's fit, train_step and evaluate do.


def initial_epoch(model: keras.Model) -> int | None:
    """The epoch Keras's fit starts from, as its BackupAndRestore sets it."""
    # Keras's fit starts from _initial_epoch, as its BackupAndRestore sets it.
    return model._initial_epoch


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Sets the epoch Keras's next fit starts from (None: its own argument)."""
    # Keras's fit starts from _initial_epoch, as its BackupAndRestore sets it;
    # Keras 3 leaves it set for the next fit.
    model._initial_epoch = epoch


def result_logs(model: keras.Model, logs: Any) -> dict:
    """The logs exactly as Keras's fit and evaluate make them."""
    # The epoch logs exactly as Keras's fit makes them.
    return model._get_metrics_result_or_logs(logs)


def should_eval(model: keras.Model, epoch: int, validation_freq: Any) -> bool:
    """Whether Keras's fit validates after ``epoch``."""
    # Keras's own validation_freq rule.
    return model._should_eval(epoch, validation_freq)


def symbolic_build(model: keras.Model, data_batch: Any) -> None:
    """Builds ``model`` (and its optimizer and metrics) from one batch."""
    # How Keras's fit builds a model from a batch; no public form.
    model._symbolic_build(data_batch=data_batch)


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether the model's ``call`` takes ``training``."""
    # Calls the model as Keras's train_step does.
    return model._call_has_training_arg


def compute_loss(
    model: keras.Model, *, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """Keras's train_step loss, with its scaling."""
    # Keras's train_step loss, with its scaling.
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def loss_tracker(model: keras.Model) -> Any:
    """The loss metric Keras's train_step updates."""
    # The loss metric Keras's train_step updates.
    return model._loss_tracker


# Optimizers.


def optimizer_variable_index(
    optimizer: keras.optimizers.Optimizer, variable: keras.Variable
) -> Any:
    """The key Keras gives ``variable``'s state in ``optimizer``."""
    # Keras keys optimizer state by this index; no public lookup.
    return optimizer._get_variable_index(variable)


def optimizer_trainable_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables a built optimizer was built for."""
    # What Keras built it for; no public accessor.
    return optimizer._trainable_variables


def rmsprop_momentums(optimizer: keras.optimizers.Optimizer) -> list:
    """A Keras RMSprop's momentum buffers."""
    # Keras's RMSprop keeps its momentum buffers only here.
    return optimizer._momentums


# BackupAndRestore.


def backup_paths(callback: keras.callbacks.BackupAndRestore) -> tuple[str, str]:
    """A BackupAndRestore's latest backup: (weights file, metadata file)."""
    # Keras's BackupAndRestore keeps its file paths only here.
    return callback._weights_path, callback._training_metadata_path


def previous_backup_paths(callback: keras.callbacks.BackupAndRestore) -> tuple[str, str]:
    """Its previous backup (``double_checkpoint``): (weights file, metadata file)."""
    # Keras's BackupAndRestore keeps its file paths only here.
    return callback._prev_weights_path, callback._prev_training_metadata_path


def set_backup_paths(
    callback: keras.callbacks.BackupAndRestore, weights: str, metadata: str
) -> None:
    """Points its latest backup (what it saves and loads) at these files."""
    # BackupAndRestore loads from these paths: pointed at a slot, or put back.
    callback._weights_path, callback._training_metadata_path = weights, metadata


def backup_position(callback: keras.callbacks.BackupAndRestore) -> tuple[int, int]:
    """Its position in the fit, as it records it: (epoch, batch)."""
    # BackupAndRestore's position in the fit, as it records it.
    return callback._current_epoch, callback._last_batch_seen


# Saving.


def write_keras_archive(model: keras.Model, weights_file: str, target: str) -> None:
    """Writes ``model`` as a ``.keras`` archive at ``target`` whose weights are
    the ``.weights.h5`` file ``weights_file`` (the file ``save_weights``
    writes for ``model``), copied into it from disk.

    Keras's ``saving_lib._save_model_to_fileobj`` (3.10 to 3.15, and 3.16's
    nightly) writes ``metadata.json`` and ``config.json`` from
    ``_serialize_model_as_json``, then walks the model with a weights store
    and an assets store (``_save_state``) into the zip. This does the same
    with no weights store, so that the walk reads no weight, and adds the
    weights file as Keras adds its temporary one (``model.weights.h5``): a
    pipeline writes that file by stage (tfdist.pipeline.saving), so no
    process holds the whole model.
    """
    import zipfile

    from tfdist.compat.keras_src import saving_lib

    config_json, metadata_json = saving_lib._serialize_model_as_json(model)
    with zipfile.ZipFile(target, "w") as zf:
        with zf.open(saving_lib._METADATA_FILENAME, "w") as f:
            f.write(metadata_json.encode())
        with zf.open(saving_lib._CONFIG_FILENAME, "w") as f:
            f.write(config_json.encode())
        assets = saving_lib.DiskIOStore(saving_lib._ASSETS_DIRNAME, archive=zf, mode="w")
        try:
            saving_lib._save_state(
                model,
                weights_store=None,
                assets_store=assets,
                inner_path="",
                visited_saveables=set(),
            )
        finally:
            assets.close()
        zf.write(weights_file, saving_lib._VARS_FNAME_H5)
