"""The Keras integration's part in a strategy's life (see
:mod:`tfdist.plugins`): the fit fixes each strategy installs.

Every strategy installs the ``steps_per_execution`` and custom-loop fixes
(:mod:`~tfdist.training.steps`, :mod:`~tfdist.training.loops`,
:mod:`~tfdist.training.accumulation`), the ``*_on_batch`` methods' split of the
batch (:mod:`~tfdist.training.on_batch`), TensorFlow's preempted exit
(:mod:`~tfdist.training.fault_tolerance.tf_handler`), and Keras's saves: chief-only
(:mod:`~tfdist.training.saving`, wrapped first) under BackupAndRestore's
save-on-preemption (:mod:`~tfdist.training.fault_tolerance.fit_preemption`), and
``jit_compile`` per replica (:mod:`~tfdist.training.xla`).
"""

from __future__ import annotations

from typing import Any

from tfdist.training import accumulation, loops, on_batch, saving, steps, xla
from tfdist.training.fault_tolerance import fit_preemption, tf_handler


def install(strategy: Any) -> None:
    steps.install()
    on_batch.install()
    loops.install()
    accumulation.install()
    tf_handler.install()
    saving.install()
    fit_preemption.install()
    xla.install()


def describe(strategy: Any) -> str | None:
    return xla.describe_line(strategy)


def multi_worker(strategy: Any) -> None:
    # Keras's own saves and checkpoint callbacks: the chief writes.
    saving.install()
    saving.set_job_strategy(strategy)


def parameter_server(strategy: Any) -> None:
    # Keras 3 loses concurrent increments and cannot differentiate sharded
    # variables under this strategy; see tfdist.training.ps.patches.
    from tfdist.training.ps import patches as ps_patches

    ps_patches.install()


def serve(task_type: str, task_index: int, server: Any) -> bool:
    from tfdist.training.ps import preemption as ps_preemption

    # Not server.join(): it never returns, so no Python signal handler runs.
    ps_preemption.serve_until_preempted(task_type, task_index, server)
    return True
