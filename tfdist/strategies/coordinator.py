"""Detaching a parameter-server coordinator from its servers before they stop.

Used by the local clusters of :mod:`tfdist.engines.worker.local_cluster` and by
:func:`tfdist.fit` on preemption. Imports TensorFlow only when this process
already has.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any


def _ports(addresses: Any) -> set[int]:
    return {int(str(a).rsplit(":", 1)[1]) for a in addresses}


def disconnect_coordinator(cluster: Mapping[str, Sequence[str]]) -> None:
    """Detaches this process's TensorFlow context from the servers, before
    they stop.

    A coordinator's context registers every function it runs on each
    server, and removes it from each when the function is deleted; at the
    latest, when the process exits. With the servers gone by then, that is
    one "Failed to remove function remotely ... Connection refused" error
    per function and server. Dropping the servers from the context's
    cluster first (keeping only this process's own job) ends those remote
    contexts while the servers still answer; later deletions stay local.
    """
    if "tensorflow" not in sys.modules:
        return  # This process never talked to the servers.
    from tfdist.compat.tf_python import eager_context as context

    ctx = context.context()
    server_def = ctx.get_server_def()
    if server_def is None:
        return
    ours = _ports(a for job, addrs in cluster.items() if job != "chief" for a in addrs)
    remote = [job for job in server_def.cluster.job if job.name != server_def.job_name]
    if not any(_ports(job.tasks.values()) & ours for job in remote):
        return  # Connected to some other cluster: not ours to change.
    local = type(server_def)()
    local.CopyFrom(server_def)
    del local.cluster.job[:]
    local.cluster.job.extend(
        job for job in server_def.cluster.job if job.name == server_def.job_name
    )
    try:
        ctx.update_server_def(local)
    except Exception as error:  # noqa: BLE001 - a dead server: stop anyway.
        print(
            f"tfdist: could not detach from the local cluster before stopping "
            f"it ({type(error).__name__}: {str(error).splitlines()[0][:200]})",
            file=sys.stderr,
        )
