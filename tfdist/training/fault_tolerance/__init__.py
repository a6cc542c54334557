"""Fault tolerance: a job that loses a task, or is preempted, resumes where it
saved, losing no step.

The preemption signal and the save it triggers
(:mod:`~tfdist.training.fault_tolerance.preemption`, in ``fit``:
:mod:`~tfdist.training.fault_tolerance.fit_preemption`; TensorFlow's own
handler: :mod:`~tfdist.training.fault_tolerance.tf_handler`); Keras's
BackupAndRestore in a multi-worker job (which backup every task resumes from:
:mod:`~tfdist.training.fault_tolerance.backup_agreement`,
:mod:`~tfdist.training.fault_tolerance.backup_dirs`,
:mod:`~tfdist.training.fault_tolerance.backup_writes`, over
:mod:`~tfdist.training.fault_tolerance.task_exchange`); what a resume carries
beyond the weights and a resume at another size
(:mod:`~tfdist.training.fault_tolerance.resume`); and a checkpointable
distributed iterator for custom loops
(:mod:`~tfdist.training.fault_tolerance.resumable`).
"""
