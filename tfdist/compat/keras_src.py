"""Every Keras internal (``keras.src``) tfdist uses, by one name each.

tfdist patches and reads Keras 3 below its public API; those locations move
between Keras versions. This table is the only place that knows where they
are: tfdist code imports by table name,

    from tfdist.compat.keras_src import TFOptimizer

and the name resolves on first use (PEP 562 ``__getattr__``) to the first
candidate location that exists, then stays cached. Importing this module
imports no Keras; importing a name imports only that name's module.

A location is ``"module.path:attr"`` (``attr`` may be dotted) or
``"module.path"`` for a whole module. Version notes below were checked
against Keras 3.3.3, 3.4.1, 3.8.0, 3.10.0, 3.12.0, 3.15.1 and keras-nightly
3.16.0.dev2026102704. A name that resolves nowhere raises
:class:`InternalNotFound` naming the name, every location tried and the
installed versions; :func:`unresolved` lists such names without raising.
"""

from __future__ import annotations

from typing import Any

from tfdist.compat._locate import InternalNotFound, Table

__all__ = ["InternalNotFound", "LOCATIONS", "unresolved"]

# Entries: tfdist name -> candidates, tried in order: the older Keras layout
# first, then newer layouts, then a public name that is the same object.
# Keep each comment: what tfdist uses it for.
LOCATIONS: dict[str, tuple[str, ...]] = {
    # --- whole modules -------------------------------------------------------
    # The backend namespace: name_scope, Variable (loops, keras_hook, horovod).
    # Keras 3.16 trimmed it to the public keras.backend names: standardize_dtype
    # and the mask helpers are separate entries below.
    "backend": ("keras.src.backend",),
    # The TF backend's core module: its Variable is patched (loops, ps_patches,
    # parallel.saving). Keras <= 3.15: backend/tensorflow/core.py; Keras 3.16
    # (the pluggable-backend refactor) moved it to backend/tensorflow/ops/core.py.
    "tf_core_module": (
        "keras.src.backend.tensorflow.core",
        "keras.src.backend.tensorflow.ops.core",
    ),
    # The TF trainer module: steps swaps its module-global ``tf`` to inline
    # the step; profiling wraps TensorFlowTrainer through it.
    "tf_trainer_module": ("keras.src.backend.tensorflow.trainer",),
    # The backend-independent trainer module (distribution.guard wraps Trainer.compile).
    "trainer_module": ("keras.src.trainers.trainer",),
    # accumulation replaces this module's global ``ops`` (Keras < 3.16) or
    # ``backend`` (3.16, which calls ``backend.ops.cond``); ps_patches calls
    # BaseOptimizer through it.
    "base_optimizer_module": ("keras.src.optimizers.base_optimizer",),
    # Keras's tree utilities (tree.flatten) in the PS train step.
    "tree": ("keras.src.tree",),
    # Keras's tree backend: horovod.compat registers a pytree node class.
    "tree_api": ("keras.src.tree.tree_api",),
    # unscale_loss_for_distribution in the PS train step.
    "loss_module": ("keras.src.losses.loss",),
    # data_adapter_utils.unpack_x_y_sample_weight in the PS train step.
    "data_adapters": ("keras.src.trainers.data_adapters",),
    # train_validation_split, for validation_split in the PS fit loop.
    "array_slicing": ("keras.src.trainers.data_adapters.array_slicing",),
    # is_remote_path and its gfile-or-os file calls: chief_save and the pipeline's
    # saving treat remote paths (gs://) as Keras does.
    "file_utils": ("keras.src.utils.file_utils",),
    # Keras's distribution API: tfdist.distribution wraps set_distribution.
    "distribution_lib": ("keras.src.distribution.distribution_lib",),
    # Its TensorFlow backend ("DO NOT USE"): Keras < 3.15 calls num_processes there.
    "tf_distribution_lib": ("keras.src.backend.tensorflow.distribution_lib",),
    # The legacy .h5 writer/reader, wrapped for sharded and chief-only saves.
    "legacy_h5_format": ("keras.src.legacy.saving.legacy_h5_format",),
    # The .keras saver, wrapped so that only the chief writes.
    "saving_lib": ("keras.src.saving.saving_lib",),
    # Keras's legacy backend (set_value, batch_set_value) for Horovod-era code.
    "legacy_backend": ("keras.src.legacy.backend",),
    # tf.keras.backend as TF >= 2.16 exports it, patched with legacy_backend.
    "tf_keras_backend": ("keras._tf_keras.keras.backend",),
    # --- classes ---------------------------------------------------------------
    # The TF backend Variable class: loops wraps _initialize; ps_patches
    # patches assign_add/numpy/...; parallel.saving its checkpoint hooks.
    # Same move as tf_core_module (Keras 3.16: ops/core.py).
    "KerasVariable": (
        "keras.src.backend.tensorflow.core:Variable",
        "keras.src.backend.tensorflow.ops.core:Variable",
    ),
    # The TF optimizer base: gradient all-reduce is wrapped (compression,
    # parallel.grads), accumulation reads its methods, ps_patches its update.
    "TFOptimizer": ("keras.src.backend.tensorflow.optimizer:TFOptimizer",),
    # Every Keras optimizer's base: build/apply/save hooks, isinstance checks.
    "BaseOptimizer": ("keras.src.optimizers.base_optimizer:BaseOptimizer",),
    # fit/evaluate/predict/_make_function, wrapped by training and profiling
    # (_make_function exists from Keras 3.7 on). keras-nightly 3.16 renamed
    # the class to Trainer in the same module.
    "TensorFlowTrainer": (
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer",
        "keras.src.backend.tensorflow.trainer:Trainer",
    ),
    # The backend-independent trainer (compile), wrapped by horovod.optimizer
    # and distribution.guard. keras-nightly 3.16 renamed it BaseTrainer.
    "Trainer": ("keras.src.trainers.trainer:Trainer", "keras.src.trainers.trainer:BaseTrainer"),
    # check_finite is wrapped so every replica agrees on a skipped step. The
    # public name is the same class.
    "LossScaleOptimizer": (
        "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer",
        "keras:optimizers.LossScaleOptimizer",
    ),
    # get_weights/set_weights of sharded layers (parallel.saving).
    "Layer": ("keras.src.layers.layer:Layer", "keras:Layer"),
    # Preemption-aware fit and chief-only saving wrap its methods.
    "BackupAndRestore": (
        "keras.src.callbacks.backup_and_restore:BackupAndRestore",
        "keras:callbacks.BackupAndRestore",
    ),
    # Chief-only saving wraps _save_model.
    "ModelCheckpoint": (
        "keras.src.callbacks.model_checkpoint:ModelCheckpoint",
        "keras:callbacks.ModelCheckpoint",
    ),
    # --- functions -------------------------------------------------------------
    # Keras's global state: whether a layer's call is running (current_call_ctx),
    # where a keras.distribution layout's weight is gathered whole.
    "global_state": ("keras.src.backend.common.global_state",),
    # A model built without its weights' values (tfdist.compat.deferred).
    "StatelessScope": ("keras.src.backend.common.stateless_scope:StatelessScope",),
    # Skips tfdist's PS variable patches while Keras traces statelessly.
    "in_stateless_scope": ("keras.src.backend.common.stateless_scope:in_stateless_scope",),
    # Skips them (and serves zeros for sharded weights) during symbolic builds.
    # Keras >= 3.5 (3.3 and 3.4 have no symbolic scope).
    "in_symbolic_scope": ("keras.src.backend.common.symbolic_scope:in_symbolic_scope",),
    # The dtype name of a variable (compression and Horovod state). Defined
    # here in every Keras 3; keras.src.backend re-exports it only up to 3.15.
    "standardize_dtype": ("keras.src.backend.common.variables:standardize_dtype",),
    # Keras masks on tensors (parallel.attention's sharded MHA). Keras >= 3.6;
    # keras.src.backend re-exports them only up to 3.15.
    "get_keras_mask": ("keras.src.backend.common.masking:get_keras_mask",),
    "set_keras_mask": ("keras.src.backend.common.masking:set_keras_mask",),
    # MultiHeadAttention's einsum helpers, so the sharded MHA builds the same
    # projections as Keras's.
    "mha_build_proj_equation": (
        "keras.src.layers.attention.multi_head_attention:_build_proj_equation",
    ),
    "mha_output_shape": ("keras.src.layers.attention.multi_head_attention:_get_output_shape",),
    # EinsumDense's equation parser (sharded EinsumDense shapes).
    "analyze_einsum_string": ("keras.src.layers.core.einsum_dense:_analyze_einsum_string",),
}

_table = Table(__name__, LOCATIONS)


def __getattr__(name: str) -> Any:
    """Resolves a table name on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not in :data:`LOCATIONS`.
        InternalNotFound: No candidate location exists on this Keras.
    """
    return _table.resolve(name)


def __dir__() -> list[str]:
    return _table.dir(globals())


def unresolved() -> dict[str, str]:
    """Table names that resolve nowhere on the installed Keras, with why.

    Imports Keras (and TensorFlow). Empty when tfdist supports this Keras.
    """
    return _table.unresolved()
