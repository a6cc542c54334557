"""Every change tfdist makes to Keras and TensorFlow, in one table.

Each :class:`~tfdist.compat.patch.Patch` names its target, the wrapper
that builds the replacement (in the feature's own module, imported only when
the feature is installed), the feature, the upstream issue, the versions
that need it and the test that shows stock Keras/TF still does. Patches of
one target compose in the order listed here: the first is closest to
Keras's original. ``tfdist info`` prints this table with each target's
check on the installed versions.

A feature marked ``required`` is part of what a tfdist strategy is: if a
target changed, creating the strategy fails with the target named. The
others switch off with a warning, and using them raises ConfigError.
"""

from __future__ import annotations

from tfdist.compat.patch import Patch

#: Feature -> what it is, and whether tfdist can run without it.
FEATURES: dict[str, dict] = {
    "compression": {"description": "gradient compression in Keras fit", "required": True},
    "inline_steps": {"description": "steps_per_execution > 1 under Mirrored", "required": True},
    "loops": {"description": "custom training loops under Mirrored", "required": True},
    "accumulation": {"description": "gradient_accumulation_steps under Mirrored", "required": True},
    "on_batch": {"description": "train/test/predict_on_batch under Mirrored", "required": True},
    "preemption_handler": {
        "description": "TF's PreemptionCheckpointHandler exit",
        "required": True,
    },
    "saving": {"description": "multi-worker saving (chief writes)", "required": True},
    "fit_preemption": {"description": "BackupAndRestore on preemption", "required": True},
    "parameter_server": {
        "description": "Keras training under ParameterServerStrategy",
        "required": True,
    },
    "distribution_guard": {"description": "the keras.distribution guard", "required": True},
    "tensor_parallel": {"description": "tensor parallelism (tfdist.parallel)", "required": False},
    "layouts": {
        "description": "keras.distribution.ModelParallel layouts on TensorFlow",
        "required": False,
    },
    "profiling": {"description": "the step profiler (tfdist.profiling)", "required": False},
    "timeline": {"description": "TFDIST_TIMELINE's automatic StepProfile", "required": False},
    "xla": {"description": "jit_compile under Mirrored and MultiWorkerMirrored", "required": True},
    "horovod": {"description": "tfdist.horovod's Keras fixes", "required": False},
    "horovod_spellings": {
        "description": "Horovod-era Keras spellings (tfdist.horovod)",
        "required": False,
    },
}

#: Targets name their owner through the table of Keras internals
#: (:mod:`tfdist.compat.keras_src`), which knows where each lives in each
#: supported Keras.
_K = "tfdist.compat.keras_src:"
_TFT = f"{_K}TensorFlowTrainer"
_TFO = f"{_K}TFOptimizer"
_BASE_OPT = f"{_K}BaseOptimizer"
_BACKUP = f"{_K}BackupAndRestore"
_LAYER = f"{_K}Layer"
_H5 = f"{_K}legacy_h5_format"
_LSO = f"{_K}LossScaleOptimizer"
_VARIABLE = f"{_K}KerasVariable"

_COMPRESSION_WHY = (
    "Keras 3 all-reduces gradients in exactly one place, "
    "TFOptimizer._all_reduce_sum_gradients; tfdist's compression "
    "replaces that all-reduce (no upstream hook exists)"
)
_SAVING_WHY = (
    "every worker of MultiWorkerMirrored writes the same files: h5py 'unable "
    "to lock file', interleaved .keras zips (TF's documented pattern: the "
    "chief writes, the others write to a scratch location)"
)
_BACKUP_WHY = (
    "Keras's BackupAndRestore never sees the preemption signal and resumes "
    "an epoch from its first batch"
)
_SAVING_CANARY = (
    "no upstream bug: Keras writes from every worker by design, TF documents "
    "the chief-writes pattern (tests/tutorials/test_tutorials_multi_worker.py)"
)
_PS_WHY = (
    "Keras 3 under ParameterServerStrategy: model.fit is unsupported "
    "(keras-team/keras#18624), assign_add is a read then a write (lost "
    "increments), ShardedVariable has no handle"
)
_TP_WHY = (
    "tfdist.parallel's sharded weights: Keras reads a MirroredVariable from "
    "its first component, so saving and get_weights would keep shard 0 alone"
)

_ON_BATCH_WHY = (
    "train_on_batch and test_on_batch under Mirrored hand every replica the "
    "whole batch (fit splits it): an embedding's IndexedSlices gradient holds "
    "each lookup once per replica and Adam's second moment, which squares the "
    "slices before summing duplicates, trains differently from fit; no "
    "upstream issue found"
)
_ON_BATCH_CANARY = (
    "tests/parallel/test_on_batch.py::test_stock_keras_hands_every_replica_the_whole_batch"
)

_XLA_WHY = (
    "compile(jit_compile=True) under Mirrored compiles strategy.run whole: 'Trying "
    "to access resource .../replica_1/... located in device CPU:1 from device "
    "CPU:0'; under MultiWorkerMirrored on CPU 'Collectives are not yet implemented "
    "for CPU devices when compiling with XLA' (keras-team/keras#20763, #21366, "
    "#18666): tfdist compiles each replica's step and all-reduces outside XLA"
)
_XLA_CANARY = "tests/training/test_xla.py::test_stock_keras_fails_with_jit_compile_under_mirrored"

#: Every patch, grouped by feature; within one target, innermost first.
PATCHES: tuple[Patch, ...] = (
    # --- gradient aggregation -------------------------------------------------
    Patch(
        "compression.reduce",
        f"{_TFO}._all_reduce_sum_gradients",
        "tfdist.compression.keras_hook:wrap_reduce",
        "compression",
        _COMPRESSION_WHY,
        params=("self", "grads_and_vars"),
        canary="no upstream bug: a hook point; tests/compression/test_compression_fit.py",
    ),
    Patch(
        "tensor_parallel.reduce",
        f"{_TFO}._all_reduce_sum_gradients",
        "tfdist.parallel.grads:wrap_reduce",
        "tensor_parallel",
        "a shard's gradient is summed over its data-parallel group only, outside compression",
        params=("self", "grads_and_vars"),
        canary="no upstream bug: tfdist's own sharding",
    ),
    Patch(
        "compression.build",
        f"{_BASE_OPT}.build",
        "tfdist.compression.keras_hook:wrap_build",
        "compression",
        "compression state (residuals, PowerSGD's Q) is created with the optimizer's variables",
        params=("self", "variables"),
        canary="no upstream bug: a hook point",
    ),
    Patch(
        "compression.save",
        f"{_BASE_OPT}.save_own_variables",
        "tfdist.compression.keras_hook:wrap_save",
        "compression",
        "model.save stores the compression state after the optimizer's variables",
        params=("self", "store"),
        canary="no upstream bug: a hook point",
    ),
    Patch(
        "compression.load",
        f"{_BASE_OPT}.load_own_variables",
        "tfdist.compression.keras_hook:wrap_load",
        "compression",
        "load_model restores the compression state, or ignores it with a warning",
        params=("self", "store"),
        canary="no upstream bug: a hook point",
    ),
    Patch(
        "tensor_parallel.save_optimizer",
        f"{_BASE_OPT}.save_own_variables",
        "tfdist.parallel.saving:wrap_save",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
        canary="no upstream bug: tfdist's own sharding",
    ),
    Patch(
        "tensor_parallel.load_optimizer",
        f"{_BASE_OPT}.load_own_variables",
        "tfdist.parallel.saving:wrap_load",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
        canary="no upstream bug: tfdist's own sharding",
    ),
    # --- the fit and loop fixes -----------------------------------------------
    Patch(
        "inline_steps.make_function",
        f"{_TFT}._make_function",
        "tfdist.training.steps:wrap_make_function",
        "inline_steps",
        "compile(steps_per_execution>1) under Mirrored fails with 'You must feed a value "
        "for placeholder tensor' (keras-team/keras#19246); while it builds the function "
        "the wrapper also swaps the trainer module's `tf` for one whose tf.function "
        "leaves the one-step function inline, and puts it back",
        params=("self", "step_function"),
        canary="tests/training/test_keras_steps.py::"
        "test_stock_keras_fails_with_several_steps_per_execution_under_mirrored",
    ),
    Patch(
        "on_batch.make_function",
        f"{_TFT}._make_function",
        "tfdist.training.on_batch:wrap_make_function",
        "on_batch",
        _ON_BATCH_WHY,
        params=("self", "step_function"),
        canary=_ON_BATCH_CANARY,
    ),
    Patch(
        "on_batch.predict_function",
        f"{_TFT}.make_predict_function",
        "tfdist.training.on_batch:wrap_make_predict_function",
        "on_batch",
        "predict_on_batch under Mirrored returns each row once per replica (the same cause)",
        params=("self", "force"),
        canary=_ON_BATCH_CANARY,
    ),
    Patch(
        "profiling.make_function",
        f"{_TFT}._make_function",
        "tfdist.profiling.instrument:wrap_make_function",
        "profiling",
        "the profiler's in-graph timestamps wrap Keras's step",
        params=("self", "step_function"),
        canary="no upstream bug: instrumentation",
    ),
    Patch(
        "loops.initialize",
        f"{_VARIABLE}._initialize",
        "tfdist.training.loops:wrap_initialize",
        "loops",
        "variables created inside a traced step under Mirrored fail with 'You must feed "
        "a value for placeholder tensor' (keras-team/keras#23085)",
        params=("self", "value"),
        canary="tests/training/test_custom_loop.py::"
        "test_tensorflows_mirrored_fails_on_the_tutorial_loop",
    ),
    Patch(
        "loops.apply",
        f"{_BASE_OPT}.apply",
        "tfdist.training.loops:wrap_apply",
        "loops",
        "the first apply of an unbuilt optimizer under a compressing strategy builds "
        "it in cross-replica context",
        params=("self", "grads", "trainable_variables"),
        canary="no upstream bug: tfdist's compression state",
    ),
    Patch(
        "accumulation.ops",
        f"{_K}base_optimizer_module.ops",
        "tfdist.training.accumulation:wrap_ops",
        "accumulation",
        "gradient_accumulation_steps under Mirrored fails with 'merge_call called while "
        "defining a new graph' (keras-team/keras#20582; fix in keras PR #23592, not "
        "released)",
        kind="module",
        needed="keras<3.16",
        canary="tests/training/test_grad_accumulation.py::"
        "test_stock_mirrored_fails_with_gradient_accumulation",
    ),
    Patch(
        "accumulation.backend",
        f"{_K}base_optimizer_module.backend",
        "tfdist.training.accumulation:wrap_backend",
        "accumulation",
        "the same bug; Keras 3.16 calls backend.ops.cond in the optimizer",
        kind="module",
        needed="keras>=3.16",
        canary="tests/training/test_grad_accumulation.py::"
        "test_stock_mirrored_fails_with_gradient_accumulation",
    ),
    Patch(
        "preemption_handler.init",
        "tensorflow:distribute.experimental.PreemptionCheckpointHandler.__init__",
        "tfdist.training.fault_tolerance.tf_handler:wrap_init",
        "preemption_handler",
        "off Google Cloud the handler's default exit is sys.exit(42), an ordinary "
        "failure to launchers",
        params=(
            "self",
            "cluster_resolver",
            "checkpoint_or_checkpoint_manager",
            "checkpoint_dir",
            "termination_config",
        ),
        canary="no upstream bug: TF's documented default",
    ),
    # --- multi-worker saving and preemption ----------------------------------
    Patch(
        "saving.manager_save",
        "tensorflow:train.CheckpointManager.save",
        "tfdist.training.saving:wrap_manager_save",
        "saving",
        _SAVING_WHY,
        params=("self",),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.save_model",
        f"{_K}saving_lib.save_model",
        "tfdist.training.saving:wrap_save_model",
        "saving",
        _SAVING_WHY,
        params=("model", "filepath"),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.save_weights",
        f"{_K}saving_lib.save_weights_only",
        "tfdist.training.saving:wrap_save_weights",
        "saving",
        _SAVING_WHY,
        params=("model", "filepath"),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.save_h5",
        f"{_H5}.save_model_to_hdf5",
        "tfdist.training.saving:wrap_save_h5",
        "saving",
        _SAVING_WHY,
        params=("model", "filepath"),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.checkpoint",
        f"{_K}ModelCheckpoint._save_model",
        "tfdist.training.saving:wrap_checkpoint_save",
        "saving",
        _SAVING_WHY,
        params=("self", "epoch", "batch", "logs"),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.backup_save",
        f"{_BACKUP}._save_model",
        "tfdist.training.fault_tolerance.backup_writes:wrap_backup_save",
        "saving",
        _SAVING_WHY,
        params=("self",),
        canary=_SAVING_CANARY,
    ),
    Patch(
        "saving.backup_begin",
        f"{_BACKUP}.on_train_begin",
        "tfdist.training.fault_tolerance.backup_writes:wrap_backup_begin",
        "saving",
        _SAVING_WHY,
        params=("self", "logs"),
    ),
    Patch(
        "saving.backup_end",
        f"{_BACKUP}.on_train_end",
        "tfdist.training.fault_tolerance.backup_writes:wrap_backup_end",
        "saving",
        _SAVING_WHY,
        params=("self", "logs"),
    ),
    Patch(
        "fit_preemption.train_begin",
        f"{_BACKUP}.on_train_begin",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_begin",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self", "logs"),
        canary="no upstream bug: Keras's callback does not handle preemption by design "
        "(tests/training/test_preempt_fit.py tests tfdist's)",
    ),
    Patch(
        "fit_preemption.epoch_begin",
        f"{_BACKUP}.on_epoch_begin",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_epoch_begin",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self", "epoch", "logs"),
    ),
    Patch(
        "fit_preemption.batch_end",
        f"{_BACKUP}.on_train_batch_end",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_batch_end",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self", "batch", "logs"),
    ),
    Patch(
        "fit_preemption.epoch_end",
        f"{_BACKUP}.on_epoch_end",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_epoch_end",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self", "epoch", "logs"),
    ),
    Patch(
        "fit_preemption.save",
        f"{_BACKUP}._save_model",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_save",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self",),
    ),
    Patch(
        "fit_preemption.train_end",
        f"{_BACKUP}.on_train_end",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_end",
        "fit_preemption",
        _BACKUP_WHY,
        params=("self", "logs"),
    ),
    Patch(
        "fit_preemption.fit",
        f"{_TFT}.fit",
        "tfdist.training.fault_tolerance.fit_preemption:wrap_fit",
        "fit_preemption",
        "a fit that raises never calls on_train_end, where BackupAndRestore stops its "
        "preemption watcher: the watcher's SIGTERM handler, which only records the "
        "signal, would outlive the fit",
        params=("self",),
        canary="no upstream bug: Keras calls on_train_end only when fit returns",
    ),
    # --- parameter servers ----------------------------------------------------
    Patch(
        "parameter_server.assign_add",
        f"{_VARIABLE}.assign_add",
        "tfdist.training.ps.patches:wrap_assign_add",
        "parameter_server",
        _PS_WHY,
        params=("self", "value"),
        canary="none: lost increments need concurrent workers; measured once (200 steps "
        "left iterations at 160), the fix tested in tests/training/"
        "test_parameter_server.py",
    ),
    Patch(
        "parameter_server.assign_sub",
        f"{_VARIABLE}.assign_sub",
        "tfdist.training.ps.patches:wrap_assign_sub",
        "parameter_server",
        _PS_WHY,
        params=("self", "value"),
    ),
    Patch(
        "parameter_server.numpy",
        f"{_VARIABLE}.numpy",
        "tfdist.training.ps.patches:wrap_numpy",
        "parameter_server",
        _PS_WHY,
        params=("self",),
    ),
    Patch(
        "parameter_server.array",
        f"{_VARIABLE}.__array__",
        "tfdist.training.ps.patches:wrap_array",
        "parameter_server",
        _PS_WHY,
        params=("self",),
    ),
    Patch(
        "parameter_server.update_step",
        f"{_TFO}._distributed_tf_update_step",
        "tfdist.training.ps.patches:wrap_update_step",
        "parameter_server",
        _PS_WHY,
        params=("self", "distribution", "grads_and_vars", "learning_rate"),
    ),
    Patch(
        "parameter_server.slot",
        f"{_TFO}.add_variable_from_reference",
        "tfdist.training.ps.patches:wrap_slot_from_reference",
        "parameter_server",
        _PS_WHY,
        params=("self", "reference_variable"),
    ),
    Patch(
        "parameter_server.fit",
        f"{_TFT}.fit",
        "tfdist.training.ps.fit:wrap_fit",
        "parameter_server",
        _PS_WHY,
        params=("self",),
        canary="tests/compat/test_canaries.py::"
        "test_stock_keras_fit_fails_under_tensorflows_parameter_server_strategy",
    ),
    Patch(
        "parameter_server.evaluate",
        f"{_TFT}.evaluate",
        "tfdist.training.ps.fit:wrap_evaluate",
        "parameter_server",
        _PS_WHY,
        params=("self",),
    ),
    Patch(
        "parameter_server.predict",
        f"{_TFT}.predict",
        "tfdist.training.ps.fit:wrap_predict",
        "parameter_server",
        _PS_WHY,
        params=("self",),
    ),
    Patch(
        "parameter_server.tape",
        "tensorflow:GradientTape.gradient",
        "tfdist.training.ps.patches:wrap_tape_gradient",
        "parameter_server",
        _PS_WHY,
        params=("self", "target", "sources", "output_gradients"),
    ),
    # --- keras.distribution guard ---------------------------------------------
    Patch(
        "distribution_guard.set_distribution",
        "modules re-exporting keras.src.distribution.distribution_lib:set_distribution",
        "tfdist.distribution.guard:wrap_set_distribution",
        "distribution_guard",
        "keras.distribution on the TF backend is a prototype ('DO NOT USE'): layouts "
        "are ignored and the model trains unsharded (keras-team/keras#20585)",
        params=("value",),
        dynamic=True,
        canary="tests/distribution/test_guard.py::test_a_fresh_process_in_the_order_users_write_it",
    ),
    Patch(
        "distribution_guard.initialize",
        "modules re-exporting keras.src.distribution.distribution_lib:initialize",
        "tfdist.distribution.guard:wrap_initialize",
        "distribution_guard",
        "Keras's TensorFlow backend has no initialize (keras-team/keras#18983): the "
        "public function raises AttributeError; tfdist joins the job as a "
        "MultiWorkerMirrored worker",
        params=("job_addresses", "num_processes", "process_id"),
        dynamic=True,
        canary="tests/distribution/test_initialize.py::test_stock_initialize_fails_on_tensorflow",
    ),
    Patch(
        "distribution_guard.list_devices",
        "modules re-exporting keras.src.distribution.distribution_lib:list_devices",
        "tfdist.distribution.guard:wrap_list_devices",
        "distribution_guard",
        "after initialize() a mesh spans every process's devices; Keras's TensorFlow "
        "list_devices names them 'cpu:0', one process's, with no task",
        params=("device_type",),
        dynamic=True,
        canary="no upstream bug: follows tfdist's initialize",
    ),
    Patch(
        "distribution_guard.num_processes",
        f"{_K}tf_distribution_lib.num_processes",
        "tfdist.distribution.guard:new_num_processes",
        "distribution_guard",
        "Keras 3.10-3.14's Distribution calls its TensorFlow backend's num_processes and "
        "process_id, which do not exist: no keras.distribution can be built on "
        "TensorFlow. tfdist answers 1 and 0, so that the strategy, not Keras, shards the "
        "data, as on Keras 3.15 (which checks for them)",
        needed="keras<3.15",
        kind="new",
        canary="tests/distribution/test_guard.py::test_keras_before_3_15_lacks_the_process_count",
    ),
    Patch(
        "distribution_guard.process_id",
        f"{_K}tf_distribution_lib.process_id",
        "tfdist.distribution.guard:new_process_id",
        "distribution_guard",
        "the same",
        needed="keras<3.15",
        kind="new",
        canary="tests/distribution/test_guard.py::test_keras_before_3_15_lacks_the_process_count",
    ),
    Patch(
        "distribution_guard.distribute_tensor",
        f"{_K}tf_distribution_lib.distribute_tensor",
        "tfdist.distribution.guard:new_distribute_tensor",
        "distribution_guard",
        "keras.distribution.distribute_tensor calls its TensorFlow backend's "
        "distribute_tensor, which does not exist: keras-hub's CausalLM.generate "
        "fails with AttributeError under any distribution. tfdist's strategy places "
        "the data, so a tensor is returned as it is",
        kind="new",
        canary="tests/distribution/test_lora_recipe.py::test_stock_tensorflow_backend_lacks_distribute_tensor",
    ),
    Patch(
        "distribution_guard.compile",
        f"{_K}Trainer.compile",
        "tfdist.distribution.guard:wrap_entry",
        "distribution_guard",
        "the same, when a distribution is set after the strategy",
        params=("self",),
    ),
    Patch(
        "distribution_guard.fit",
        f"{_TFT}.fit",
        "tfdist.distribution.guard:wrap_entry",
        "distribution_guard",
        "the same, when a distribution is set after the strategy",
        params=("self",),
    ),
    Patch(
        "layouts.initialize",
        f"{_VARIABLE}._initialize",
        "tfdist.distribution.layouts:wrap_initialize",
        "layouts",
        "Keras's TensorFlow variables never ask the distribution for their layout "
        "(its JAX backend does, in JaxVariable._initialize_layout): a ModelParallel's "
        "weights stay whole on one device (keras-team/keras#20585)",
        params=("self", "value"),
        canary="tests/distribution/test_guard.py::test_a_fresh_process_in_the_order_users_write_it",
    ),
    Patch(
        "layouts.preset_loader",
        "keras-hub's KerasPresetLoader.load_backbone (keras_hub.src.utils.preset_utils)",
        "tfdist.distribution.layouts:wrap_load_backbone",
        "layouts",
        "keras-hub's from_preset builds every weight whole with its initializer, then "
        "loads the preset over it (keras-team/keras#21634: out of memory for models that "
        "need sharding); under a layout tfdist builds only each device's blocks when the "
        "weights are loaded next",
        params=("self", "cls", "load_weights"),
        dynamic=True,
        canary="no upstream bug: Keras's TensorFlow backend has no layouts; follows tfdist's",
    ),
    Patch(
        "layouts.generate_function",
        "keras-hub's CausalLM.make_generate_function (keras_hub.src.models.causal_lm)",
        "tfdist.distribution.generation:wrap_make_generate_function",
        "layouts",
        "keras-hub compiles generate_step as a plain tf.function, called outside any "
        "replica context; across processes a sharded weight's other blocks are reachable "
        "only from a replica, so under tfdist the step runs on every replica",
        params=("self",),
        dynamic=True,
        canary="no upstream bug: Keras's TensorFlow backend has no layouts; follows tfdist's",
    ),
    Patch(
        "layouts.load_model",
        f"{_K}saving_lib.load_model",
        "tfdist.distribution.layouts:wrap_load_model",
        "layouts",
        "keras.models.load_model builds the model from its config with every weight's "
        "initializer, then reads the file over it (keras-team/keras#21634 for presets); "
        "under a layout tfdist builds only each device's blocks, the file loaded next",
        params=("filepath",),
        canary="no upstream bug: Keras's TensorFlow backend has no layouts; follows tfdist's",
    ),
    Patch(
        "layouts.local_initial_values",
        "tfdist's subclass of tf_python's CollectiveAllReduceExtended (while "
        "tfdist.distribution.local_values.created_locally is open)"
        "._get_variable_creator_initial_value",
        "tfdist.distribution.local_values:wrap_initial_value",
        "layouts",
        "MultiWorkerMirrored broadcasts every new variable's initial value from worker 0 "
        "over gRPC; a weight block a preset overwrites next is zeros on every worker, and "
        "the broadcast's buffers were most of a process's peak while loading (issue 38)",
        params=("self", "replica_id", "device", "primary_var"),
        dynamic=True,
        canary="no upstream bug: TF's broadcast is right for values that differ; tfdist "
        "skips it only for values a file overwrites next",
    ),
    # --- tensor parallelism ---------------------------------------------------
    Patch(
        "tensor_parallel.check_finite",
        f"{_LSO}.check_finite",
        "tfdist.parallel.grads:wrap_check_finite",
        "tensor_parallel",
        "a shard's overflow must stop every replica's step",
        params=("self", "grads"),
    ),
    Patch(
        "tensor_parallel.get_weights",
        f"{_LAYER}.get_weights",
        "tfdist.parallel.saving:wrap_get_weights",
        "tensor_parallel",
        _TP_WHY,
        params=("self",),
    ),
    Patch(
        "tensor_parallel.set_weights",
        f"{_LAYER}.set_weights",
        "tfdist.parallel.saving:wrap_set_weights",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "weights"),
    ),
    Patch(
        "tensor_parallel.slot",
        f"{_BASE_OPT}.add_variable_from_reference",
        "tfdist.parallel.saving:wrap_slot",
        "tensor_parallel",
        "an optimizer slot of a sharded weight is sharded like it",
        params=("self", "reference_variable"),
    ),
    Patch(
        "tensor_parallel.serialize",
        f"{_VARIABLE}._serialize_to_tensors",
        "tfdist.parallel.saving:wrap_serialize",
        "tensor_parallel",
        _TP_WHY,
        params=("self",),
    ),
    Patch(
        "tensor_parallel.restore",
        f"{_VARIABLE}._restore_from_tensors",
        "tfdist.parallel.saving:wrap_restore",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "restored_tensors"),
    ),
    Patch(
        "tensor_parallel.optimizer_set_weights",
        f"{_BASE_OPT}.set_weights",
        "tfdist.parallel.saving:wrap_optimizer_set",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "weights"),
    ),
    Patch(
        "tensor_parallel.h5_subset",
        f"{_H5}.save_subset_weights_to_hdf5_group",
        "tfdist.parallel.saving:wrap_legacy_subset",
        "tensor_parallel",
        _TP_WHY,
        params=("*", "weights"),
    ),  # Keras 3.8 names it f, 3.15 group.
    Patch(
        "tensor_parallel.h5_optimizer",
        f"{_H5}.save_optimizer_weights_to_hdf5_group",
        "tfdist.parallel.saving:wrap_legacy_optimizer",
        "tensor_parallel",
        _TP_WHY,
        params=("*", "optimizer"),
    ),  # hdf5_group in Keras 3.8.
    Patch(
        "tensor_parallel.h5_set",
        f"{_H5}._set_weights",
        "tfdist.parallel.saving:wrap_legacy_set",
        "tensor_parallel",
        _TP_WHY,
        params=("instance", "symbolic_weights", "weight_values", "name"),
    ),
    Patch(
        "tensor_parallel.save_layer",
        f"{_LAYER}.save_own_variables",
        "tfdist.parallel.saving:wrap_save",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
    ),
    Patch(
        "tensor_parallel.load_layer",
        f"{_LAYER}.load_own_variables",
        "tfdist.parallel.saving:wrap_load",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
    ),
    Patch(
        "tensor_parallel.save_subclass",
        "subclasses of Layer with their own save_own_variables",
        "tfdist.parallel.saving:wrap_save",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
        dynamic=True,
    ),
    Patch(
        "tensor_parallel.load_subclass",
        "subclasses of Layer with their own load_own_variables",
        "tfdist.parallel.saving:wrap_load",
        "tensor_parallel",
        _TP_WHY,
        params=("self", "store"),
        dynamic=True,
    ),
    # --- profiling ------------------------------------------------------------
    Patch(
        "timeline.fit",
        f"{_TFT}.fit",
        "tfdist.profiling.callback:wrap_fit",
        "timeline",
        "TFDIST_TIMELINE adds a StepProfile to every fit",
        params=("self",),
        canary="no upstream bug: instrumentation",
    ),
    # --- XLA ------------------------------------------------------------------
    # After inline_steps and profiling: the outermost wrapper of _make_function,
    # so the steps those wrap are already the replica's XLA step.
    Patch(
        "xla.make_function",
        f"{_TFT}._make_function",
        "tfdist.training.xla:wrap_make_function",
        "xla",
        _XLA_WHY,
        params=("self", "step_function"),
        canary=_XLA_CANARY,
    ),
    Patch(
        "xla.predict_function",
        f"{_TFT}.make_predict_function",
        "tfdist.training.xla:wrap_make_predict_function",
        "xla",
        "Keras 3.10 hands strategy.run its jit-compiled predict step itself, which "
        "strategy.run compiles around every replica ('Trying to access resource "
        ".../replica_1/...'); there predict runs without XLA",
        params=("self", "force"),
        canary=_XLA_CANARY,
    ),
    Patch(
        "xla.compile",
        f"{_K}Trainer.compile",
        "tfdist.training.xla:wrap_compile",
        "xla",
        "jit_compile=True where XLA cannot work (parameter servers, TPU, layers without "
        "XLA, collectives in the forward pass) must fail at compile, not deep in a graph",
        params=("self",),
        canary="no upstream bug: tfdist's refusals",
    ),
    Patch(
        "xla.resolve_auto",
        f"{_K}Trainer._resolve_auto_jit_compile",
        "tfdist.training.xla:wrap_resolve_auto",
        "xla",
        "Keras resolves jit_compile='auto' to False whenever a strategy is set",
        params=("self",),
        canary="none: Keras chooses XLA only where a GPU is visible (untested here); "
        "tests/training/test_xla.py checks the CPU resolution",
    ),
    Patch(
        "xla.apply_gradients",
        f"{_BASE_OPT}.apply_gradients",
        "tfdist.training.xla:wrap_apply_gradients",
        "xla",
        "inside the replica's XLA step the apply is recorded and run after it, outside "
        "XLA (the all-reduce cannot be compiled)",
        params=("self", "grads_and_vars"),
        canary=_XLA_CANARY,
    ),
    Patch(
        "xla.apply",
        f"{_BASE_OPT}.apply",
        "tfdist.training.xla:wrap_apply",
        "xla",
        "the same, for a train_step that calls optimizer.apply",
        params=("self", "grads", "trainable_variables"),
        canary=_XLA_CANARY,
    ),
    Patch(
        "xla.loss_scale_apply",
        f"{_LSO}.apply",
        "tfdist.training.xla:wrap_apply",
        "xla",
        "the same, for LossScaleOptimizer's own apply",
        params=("self", "grads", "trainable_variables"),
        canary=_XLA_CANARY,
    ),
    # After XLA's: the outermost wrappers, so that every step's error passes them.
    Patch(
        "tensor_parallel.uneven_batch",
        f"{_TFT}._make_function",
        "tfdist.parallel.batches:wrap_make_function",
        "tensor_parallel",
        "a batch that splits unevenly inside a tensor group fails deep in TF's collective "
        "('Shape mismatch in the collective instance'): a ConfigError says what to change",
        params=("self", "step_function"),
        canary="no upstream bug: tfdist's message",
    ),
    Patch(
        "tensor_parallel.uneven_fit",
        f"{_TFT}.fit",
        "tfdist.parallel.batches:wrap_entry",
        "tensor_parallel",
        "arrays whose batches split unevenly inside a tensor group are "
        "refused before any step (predict on a (2, 2) mesh crashed TF 2.21)",
        params=("self", "x", "y", "batch_size"),
        canary="no upstream bug: tfdist's message",
    ),
    Patch(
        "tensor_parallel.uneven_evaluate",
        f"{_TFT}.evaluate",
        "tfdist.parallel.batches:wrap_entry",
        "tensor_parallel",
        "the same, for evaluate",
        params=("self", "x", "y", "batch_size"),
        canary="no upstream bug: tfdist's message",
    ),
    Patch(
        "tensor_parallel.uneven_predict",
        f"{_TFT}.predict",
        "tfdist.parallel.batches:wrap_entry",
        "tensor_parallel",
        "the same, for predict",
        params=("self", "x", "batch_size"),
        canary="no upstream bug: tfdist's message",
    ),
    Patch(
        "tensor_parallel.uneven_batch_predict",
        f"{_TFT}.make_predict_function",
        "tfdist.parallel.batches:wrap_make_predict_function",
        "tensor_parallel",
        "the same, for predict",
        params=("self", "force"),
        canary="no upstream bug: tfdist's message",
    ),
    # --- tfdist.horovod -------------------------------------------------------
    Patch(
        "horovod.check_finite",
        f"{_LSO}.check_finite",
        "tfdist.horovod.optimizer:wrap_check_finite",
        "horovod",
        "under mixed precision every rank must skip the same steps",
        params=("self", "grads"),
        canary="no upstream bug: Horovod's own semantics (tests/horovod/test_horovod_numbers.py)",
    ),
    Patch(
        "horovod.compile",
        f"{_K}Trainer.compile",
        "tfdist.horovod.optimizer:wrap_compile",
        "horovod",
        "jit_compile with a DistributedOptimizer fails in merge_call (keras-team/keras#18666)",
        params=("self",),
        canary="none yet: the bug needs XLA collectives, which CPUs lack (issue 29, XLA "
        "under strategies, adds one)",
    ),
    Patch(
        "horovod_spellings.compile",
        f"{_K}Trainer.compile",
        "tfdist.horovod.compat:wrap_compile",
        "horovod_spellings",
        "Keras 3 rejects compile(experimental_run_tf_function=...) of Horovod-era scripts",
        params=("self",),
        canary="tests/horovod/test_horovod_compat.py",
    ),
    Patch(
        "horovod_spellings.variables",
        "subclasses of BaseOptimizer defining variables",
        "tfdist.horovod.compat:wrap_variables",
        "horovod_spellings",
        "opt.variables() of Horovod-era scripts: a list property in Keras 3",
        kind="property",
        dynamic=True,
        canary="tests/horovod/test_horovod_compat.py",
    ),
    Patch(
        "horovod_spellings.init_subclass",
        f"{_BASE_OPT}.__init_subclass__",
        "tfdist.horovod.compat:wrap_init_subclass",
        "horovod_spellings",
        "optimizer classes made later get the callable variables too",
        kind="value",
    ),
    Patch(
        "horovod_spellings.lr",
        f"{_BASE_OPT}.lr",
        "tfdist.horovod.compat:wrap_lr",
        "horovod_spellings",
        "opt.lr of Horovod-era scripts (Keras 3 has only learning_rate)",
        kind="new",
        dynamic=True,
    ),
    Patch(
        "horovod_spellings.set_value",
        "modules exporting keras.src.legacy.backend:set_value",
        "tfdist.horovod.compat:wrap_set_value",
        "horovod_spellings",
        "K.set_value on a Keras 3 variable",
        params=("x", "value"),
        dynamic=True,
    ),
    Patch(
        "horovod_spellings.batch_set_value",
        "modules exporting keras.src.legacy.backend:batch_set_value",
        "tfdist.horovod.compat:wrap_batch_set_value",
        "horovod_spellings",
        "K.batch_set_value on Keras 3 variables",
        params=("tuples",),
        dynamic=True,
    ),
)
