"""Where a process sits in the job: ranks, hosts and addresses.

Horovod took ranks from MPI or Gloo. ``tfdist.horovod`` and
``tfdist.pipeline`` take them from the environment a launcher gives each
process, in this order:

1. ``TF_CONFIG`` (``tfdist launch``, a TFJob, any per-host TF_CONFIG): the
   chief (if any) is rank 0, then the workers in order, the order
   MultiWorkerMirroredStrategy numbers replicas in.
2. A Slurm job step (``srun``): ``SLURM_PROCID`` and the step's node list,
   with ports as :mod:`tfdist.strategies.slurm` places them.
3. Horovod's (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``...)
   or Open MPI's (``OMPI_COMM_WORLD_RANK``...) variables. They give ranks but
   no addresses: every rank on this host (``local_size == size``) listens on
   127.0.0.1 at ``TFDIST_PORT_BASE + rank``; for several hosts
   ``TFDIST_HOSTS=host1:slots,host2:slots`` says where each rank runs
   (ranks fill the hosts in order, as ``horovodrun -H`` does).
4. None of these: one process, ``size() == 1``.

Nothing here imports TensorFlow except the Slurm case.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping

from tfdist.errors import ConfigError

__all__ = ["Topology", "discover", "WORKER_JOBS"]

#: The jobs whose tasks are ranks; the chief comes first.
WORKER_JOBS = ("chief", "worker")

#: TFDIST_PORT_BASE default range (as tfdist.strategies.slurm: below the ephemeral ports).
_PORT_LOW, _PORT_HIGH, _PORT_SPAN = 20000, 32768, 256

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """This process's place in the job.

    Attributes:
        rank, size: Global rank and number of processes.
        local_rank, local_size: Rank among, and number of, the processes on
            this host.
        cross_rank, cross_size: Rank among, and number of, the processes
            with this ``local_rank`` (one per host in a regular job).
        cluster: TensorFlow cluster: job name -> ``host:port`` per task; ``{}``
            for one process.
        task_type, task_id: This process's task in ``cluster``.
        source: Where it came from: ``"TF_CONFIG"``, ``"Slurm"``,
            ``"HOROVOD_*"``, ``"OMPI_*"``, ``"PMI_*"`` or ``"single process"``.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    cluster: dict = dataclasses.field(default_factory=dict)
    task_type: str | None = None
    task_id: int | None = None
    source: str = "single process"

    @property
    def tasks(self) -> list[tuple[str, int, str]]:
        """``(job, index, address)`` of every rank, in rank order."""
        return [
            (job, i, addr)
            for job in WORKER_JOBS
            for i, addr in enumerate(self.cluster.get(job, ()))
        ]

    @property
    def leader(self) -> str:
        """TensorFlow's name of rank 0's task."""
        job, index, _ = self.tasks[0]
        return f"/job:{job}/replica:0/task:{index}"


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return "127.0.0.1" if host in _LOCAL_NAMES or host.startswith("127.") else host


def _from_hosts(rank: int, hosts: list[str], source: str, **given: int) -> Topology:
    """Fills in local and cross ranks from the host of every rank.

    ``given`` may carry launcher-provided local_rank/local_size; they must
    agree with the hosts, or the cluster is not what the launcher thinks.
    """
    size = len(hosts)
    mine = hosts[rank]
    same_host = [r for r, h in enumerate(hosts) if h == mine]
    local_rank = same_host.index(rank)
    local = {r: [q for q, h in enumerate(hosts) if h == hosts[r]].index(r) for r in range(size)}
    cross = [r for r in range(size) if local[r] == local_rank]
    topo = dict(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=len(same_host),
        cross_rank=cross.index(rank),
        cross_size=len(cross),
    )
    for name, value in given.items():
        if value is not None and value != topo[name]:
            raise ConfigError(
                name,
                value,
                f"{topo[name]} (from the hosts of the {size} ranks: {', '.join(hosts)})",
                source=source,
            )
    return Topology(**topo, source=source)


def _int(env: Mapping[str, str], name: str, source: str, minimum: int = 0) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, "an integer", source=source) from None
    if value < minimum:
        raise ConfigError(name, raw, f"an integer >= {minimum}", source=source)
    return value


def _from_tf_config(env: Mapping[str, str]) -> Topology | None:
    from tfdist import spec as spec_lib

    raw = env.get("TF_CONFIG", "")
    if not raw.strip():
        return None
    cfg = spec_lib.parse(env=env)
    if not cfg.cluster:
        return None
    extra = sorted(set(cfg.cluster) - set(WORKER_JOBS))
    if extra:
        raise ConfigError(
            "cluster",
            sorted(cfg.cluster),
            "only 'chief' and 'worker' jobs: Horovod's model is one all-reduce ring of equal ranks",
            source="TF_CONFIG",
            received=f"jobs {sorted(cfg.cluster)}",
            hint=f"Drop the {', '.join(repr(j) for j in extra)} job(s), or use "
            "tfdist.strategy_from_config() for parameter-server training.",
        )
    if cfg.task_type not in WORKER_JOBS:
        raise ConfigError("task.type", cfg.task_type, "'chief' or 'worker'", source="TF_CONFIG")
    cluster = {job: list(cfg.cluster[job]) for job in WORKER_JOBS if job in cfg.cluster}
    order = [(job, i) for job in WORKER_JOBS for i in range(len(cluster.get(job, ())))]
    rank = order.index((cfg.task_type, cfg.task_index))
    hosts = [_host(cluster[job][i]) for job, i in order]
    topo = _from_hosts(rank, hosts, "TF_CONFIG")
    return dataclasses.replace(
        topo, cluster=cluster, task_type=cfg.task_type, task_id=cfg.task_index
    )


def _from_slurm(env: Mapping[str, str]) -> Topology | None:
    from tfdist.spec.detect import slurm_step_tasks

    tasks = slurm_step_tasks(env)
    if not tasks or tasks < 2:
        return None
    from tfdist.strategies.slurm import SlurmClusterResolver

    # auto_set_gpu=False: Horovod scripts pick their GPU with local_rank();
    # narrowing CUDA_VISIBLE_DEVICES here would make gpus[local_rank] fail.
    resolver = SlurmClusterResolver(auto_set_gpu=False)
    spec = resolver.cluster_spec().as_dict()
    addresses = list(spec["worker"])
    rank = resolver.task_id
    topo = _from_hosts(
        rank, [_host(a) for a in addresses], "Slurm", local_rank=_int(env, "SLURM_LOCALID", "Slurm")
    )
    return dataclasses.replace(
        topo, cluster={"worker": addresses}, task_type="worker", task_id=rank
    )


#: Launchers that set rank variables but no addresses: (source, rank, size,
#: local rank, local size, a job id to derive ports from).
_RANK_VARIABLES = (
    (
        "HOROVOD_*",
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_GLOO_RENDEZVOUS_PORT",
    ),
    (
        "OMPI_*",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "OMPI_MCA_ess_base_jobid",
    ),
    ("PMI_*", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_JOBID"),
)


def parse_hosts(text: str, field: str = "TFDIST_HOSTS", source: str = "environment") -> list[str]:
    """``"host1:2,host2:2"`` -> the host of each slot, in order."""
    slots: list[str] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, count = entry.rpartition(":")
        if not sep:
            host, count = entry, "1"
        try:
            n = int(count)
        except ValueError:
            n = 0
        if not host or n < 1:
            raise ConfigError(
                field,
                text,
                "host:slots entries separated by commas, slots >= 1, e.g. 'node1:2,node2:2'",
                source=source,
                received=repr(entry),
            )
        slots += [_host(host + ":0")] * n
    if not slots:
        raise ConfigError(field, text, "at least one host:slots entry", source=source)
    return slots


def port_base(env: Mapping[str, str], job_id: str | None, source: str) -> int:
    """``TFDIST_PORT_BASE``, or one derived from the launcher's job id so
    that two jobs on a host rarely collide."""
    given = _int(env, "TFDIST_PORT_BASE", source, minimum=1)
    if given is not None:
        if given + _PORT_SPAN > 65535:
            raise ConfigError(
                "TFDIST_PORT_BASE", given, f"a port <= {65535 - _PORT_SPAN}", source=source
            )
        return given
    key = (job_id or "tfdist").encode()
    return _PORT_LOW + zlib.crc32(key) % (_PORT_HIGH - _PORT_SPAN - _PORT_LOW + 1)


def _from_rank_variables(env: Mapping[str, str]) -> Topology | None:
    for source, rank_v, size_v, lrank_v, lsize_v, job_v in _RANK_VARIABLES:
        if rank_v not in env or size_v not in env:
            continue
        rank = _int(env, rank_v, source)
        size = _int(env, size_v, source, minimum=1)
        if rank >= size:
            raise ConfigError(
                rank_v, env[rank_v], f"a rank in [0, {size - 1}] ({size_v}={size})", source=source
            )
        if size == 1:
            return None
        local_rank = _int(env, lrank_v, source)
        local_size = _int(env, lsize_v, source, minimum=1)
        if "TFDIST_HOSTS" in env:
            hosts = parse_hosts(env["TFDIST_HOSTS"])
            if len(hosts) != size:
                raise ConfigError(
                    "TFDIST_HOSTS",
                    env["TFDIST_HOSTS"],
                    f"{size} slots in all ({size_v}={size})",
                    source=source,
                    received=f"{len(hosts)} slots",
                )
        elif local_size is not None and local_size == size:
            hosts = ["127.0.0.1"] * size
        else:
            raise ConfigError(
                "TFDIST_HOSTS",
                None,
                "the hosts of the ranks ('host1:slots,host2:slots') "
                f"for a job of {size} ranks that spans several hosts",
                source=source,
                received=f"{lsize_v}={env.get(lsize_v)!r}",
                hint="Launch with `tfdist launch` or `tfdist horovodrun` (which set "
                "TF_CONFIG), or export TFDIST_HOSTS in every rank.",
            )
        base = port_base(env, env.get(job_v), source)
        topo = _from_hosts(rank, hosts, source, local_rank=local_rank, local_size=local_size)
        # Ports count per host, so that every host's ranks get base, base+1...
        addresses = [
            f"{h}:{base + [q for q, g in enumerate(hosts) if g == h].index(r)}"
            for r, h in enumerate(hosts)
        ]
        return dataclasses.replace(
            topo, cluster={"worker": addresses}, task_type="worker", task_id=rank
        )
    return None


def discover(environ: Mapping[str, str] | None = None) -> Topology:
    """Reads this process's :class:`Topology` from the environment.

    Args:
        environ: The environment; defaults to ``os.environ``.

    Returns:
        The topology; one process when no launcher variable is set.

    Raises:
        ConfigError: A variable is malformed or the variables disagree; the
            message names the variable and the value received.
    """
    env = os.environ if environ is None else environ
    for reader in (_from_tf_config, _from_slurm, _from_rank_variables):
        topo = reader(env)
        if topo is not None:
            return topo
    return Topology()


def describe(topo: Topology) -> str:
    """One line for logs: ``rank 1 of 2 (local 1 of 2) from TF_CONFIG``."""
    return (
        f"rank {topo.rank} of {topo.size} (local {topo.local_rank} of {topo.local_size}, "
        f"cross {topo.cross_rank} of {topo.cross_size}) from {topo.source}"
    )


def dumps(topo: Topology) -> str:
    """The topology as JSON (for worker logs and tests)."""
    return json.dumps(dataclasses.asdict(topo), sort_keys=True)
