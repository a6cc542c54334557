"""A Keras model trained in pipeline stages, with ``fit`` kept.

Every process of the job builds the same model and wraps it::

    model = make_model()  # The same seed, or the same weights, everywhere.
    pipe = tfdist.pipeline.PipelineModel(
        model, split_points=["dense_2"], microbatches=4, schedule="1f1b"
    )
    pipe.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    pipe.fit(x, y, batch_size=32, epochs=2)  # The same data on every process.
    pipe.save("model.keras")  # Stage 0 writes the whole model, unpipelined.

Process ``k`` runs stage ``k`` (with replicas, process ``replica * P +
stage``; with the interleaved schedule, stages ``k, k + P, ...``): its
place and every process's address (``host:port``) come from its launcher
unless given: TF_CONFIG (``tfdist launch --workers P``, a chief first if the
cluster has one), a Slurm step (``srun -n P``) or MPI's ranks (``mpiexec -n
P``) (:func:`stage_from_environment`). Each process trains only
its stage's weights; ``save_weights`` to a ``.weights.h5`` file writes by
stage (:mod:`~tfdist.pipeline.saving`), ``save`` first gathers every stage's
weights into stage 0's model: either file holds the trained model, which
loads as an ordinary Keras model. ``fit``, ``evaluate`` and
``predict`` log and return the same numbers on every process (the loss and
outputs travel back from the last stage).

Keras runs the steps eagerly (``run_eagerly``): the stage's passes and its
messages interleave in Python, as PyTorch's pipelining does.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from tfdist.compat.deferred import borrowed, deferred_build, materialize
from tfdist.compat.keras_private import loss_tracker, write_keras_archive
from tfdist.compat.keras_src import saving_lib
from tfdist.errors import ConfigError
from tfdist.pipeline.agreement import check_agreement, plan_of
from tfdist.pipeline.backup import stage_callbacks
from tfdist.pipeline.balancing import Balance
from tfdist.pipeline.laid_out import (
    build_stage,
    components,
    owners_of,
    strategy_for,
)
from tfdist.pipeline.replicas import Grid, StageReplicas, aggregator_for, check_replicas
from tfdist.pipeline.runtime import StageRunner
from tfdist.pipeline.saving import (
    WEIGHTS_SUFFIX,
    Plan,
    join_parts,
    local_copy,
    makedirs_for,
    part_file,
    plan_for,
    published,
    read_state,
    remove,
    write_state,
)
from tfdist.pipeline.schedule import SCHEDULES, actions
from tfdist.pipeline.split import split_model
from tfdist.transport.p2p import connect_peers
from tfdist.transport.ring import RingGroup

__all__ = ["PipelineModel", "stage_from_environment"]

SOURCE = "tfdist.pipeline.PipelineModel"


def stage_from_environment(environ: Any = None) -> tuple[int, list[str]]:
    """``(rank, addresses)`` of this process, from what its launcher set:

    1. TF_CONFIG (``tfdist launch``, a TFJob): the chief (if any) then the
       workers, in order;
    2. a Slurm job step (``srun``): ``SLURM_PROCID`` and the step's nodes,
       with ports as tfdist's Slurm resolver places them;
    3. Open MPI's, PMI's or Horovod's rank variables (``mpiexec``,
       ``horovodrun``): ranks on this host listen on 127.0.0.1 at
       ``TFDIST_PORT_BASE + rank``; ``TFDIST_HOSTS`` lists several hosts
       (see :mod:`tfdist.strategies.topology`).

    Raises:
        ConfigError: None of these, a TF_CONFIG task that is neither chief
            nor worker, or a malformed launcher variable (named).
    """
    env = os.environ if environ is None else environ
    text = env.get("TF_CONFIG")
    if text:
        return _from_tf_config(text)
    from tfdist.strategies.topology import discover

    topo = discover(env)
    if topo.size < 2:
        raise ConfigError(
            "stage",
            None,
            "a stage and addresses, or a launcher that names every process: TF_CONFIG "
            "(`tfdist launch --workers P`), a Slurm step (`srun -n P`) or MPI's ranks "
            "(`mpiexec -n P`)",
            source=SOURCE,
        )
    return topo.rank, [address for _, _, address in topo.tasks]


def _from_tf_config(text: str) -> tuple[int, list[str]]:
    config = json.loads(text)
    cluster, task = config.get("cluster", {}), config.get("task", {})
    addresses = list(cluster.get("chief", [])) + list(cluster.get("worker", []))
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in ("chief", "worker"):
        raise ConfigError(
            "task.type", kind, "'chief' or 'worker' (each runs one stage)", source="TF_CONFIG"
        )
    offset = len(cluster.get("chief", [])) if kind == "worker" else 0
    return offset + int(index), addresses


class PipelineModel(keras.Model):
    """``model`` cut into stages at ``split_points``; this process runs one.

    Args:
        model: A functional or Sequential Keras model (nested functional
            models, such as a keras-hub backbone, are opened up), or a
            function that builds it. Given the function, this process makes
            only its stage's weights (see "Memory" in the pipeline guide):
            the model is built without values, and only this stage's
            weights are given theirs, the same as a full build's with the
            same seed.
        split_points: Names of the layers each stage after the first begins
            with (see :func:`~tfdist.pipeline.split_model`), or the
            :class:`~tfdist.pipeline.Balance` that :func:`~tfdist.pipeline.balance`
            found.
        microbatches: Micro-batches per batch; it must divide the batch size.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (Megatron's
            interleaved 1F1B: give ``chunks``).
        chunks: Stages per process with the interleaved schedule: the
            model is cut into ``P * chunks`` stages (``split_points`` names
            ``P * chunks - 1`` layers), and process ``k`` runs stages ``k,
            k + P, ...``; ``microbatches`` must be a multiple of ``P``.
        replicas: Copies of the pipeline, trained data-parallel: process
            ``replica * P + stage`` of ``replicas * P`` runs ``stage`` of
            ``replica``. Each replica takes ``1 / replicas`` of every batch,
            and each stage's gradients are averaged over its replicas.
        compression: What the replicas' all-reduce sends: a tfdist
            compression setting (``"fp16"``, ``"topk:0.01"``, a compressor
            object...), as ``strategy_from_config``'s; None sends float32.
        error_feedback: The compression's error feedback (None: its default).
        stage: This process's stage (default: from TF_CONFIG's task).
        replica: This process's replica (default: from TF_CONFIG's task;
            0 when ``stage`` is given).
        addresses: Every process's ``host:port``, by rank (default: from
            TF_CONFIG).
        timeout: Seconds the stages have to connect.
        recv_timeout: Seconds a stage waits for a neighbour's message before
            failing, naming it (a dead neighbour fails it at once).
        distribution: A ``keras.distribution`` over this process's devices
            (tfdist's ``ModelParallel`` or ``DataParallel``): each process
            lays its stage's weights out over its own devices as the layout
            map says, and runs the stage's passes and update on them
            (:mod:`~tfdist.pipeline.laid_out`). ``model`` must then be the
            function that builds it. With ``replicas``, each device's
            gradient is averaged over the replicas' same devices.
    """

    def __init__(
        self,
        model: keras.Model | Callable[[], keras.Model],
        split_points: Sequence[str] | Balance,
        *,
        microbatches: int,
        schedule: str = "1f1b",
        chunks: int = 1,
        replicas: int = 1,
        compression: Any = None,
        error_feedback: bool | None = None,
        stage: int | None = None,
        replica: int | None = None,
        addresses: Sequence[str] | None = None,
        timeout: float = 120.0,
        recv_timeout: float | None = 600.0,
        distribution: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if schedule not in SCHEDULES:
            raise ConfigError("schedule", schedule, f"one of {SCHEDULES}", source=SOURCE)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ConfigError("microbatches", microbatches, "an integer >= 1", source=SOURCE)
        # After the checks that need no TensorFlow: this makes the mesh's strategy.
        self._strategy = _stage_strategy(distribution, model)
        self._distribution = distribution
        deferred: list = []
        if callable(model) and not isinstance(model, keras.Model):
            model, deferred = deferred_build(model)
        self.whole = model
        if isinstance(split_points, Balance):
            split_points = list(split_points.split_points)
        self.stages = split_model(model, split_points)
        self.grid = Grid(_processes(len(self.stages), chunks), check_replicas(replicas), chunks)
        actions(schedule, 0, self.grid.stages, microbatches, chunks)  # Checks the counts.
        self._aggregator = aggregator_for(compression, error_feedback)
        if self._aggregator is not None and replicas == 1:
            raise ConfigError(
                "compression",
                compression,
                "None with replicas=1: compression applies to the all-reduce between "
                "pipeline replicas (the stages send activations as they are)",
                source=SOURCE,
            )
        rank, addresses = self._place(stage, replica, addresses)
        if len(addresses) != self.grid.size:
            raise ConfigError(
                "addresses",
                list(addresses),
                f"one address per process: {len(self.stages)} stages (split_points="
                f"{list(split_points)}) / {chunks} chunks x {replicas} replicas = "
                f"{self.grid.size}; run as many workers",
                source=SOURCE,
            )
        self.rank = rank
        self.replica, self.stage_index = self.grid.place(rank)
        self.own = [s for s in self.stages if self._owner(s) == self.stage_index]
        # Before this stage's weights are laid out: then their shapes are blocks.
        settings = {"schedule": schedule, "microbatches": microbatches, "chunks": chunks}
        settings.update(replicas=replicas, compression=_described(compression))
        plan = plan_of(self.stages, split_points, **settings)
        self._make_own(deferred)
        self.schedule = schedule
        self.microbatches = microbatches
        links = self._all_links = self._connect(addresses, plan, timeout, recv_timeout)
        self._links = {s: links[r] for s, r in self.grid.pipeline_peers(rank).items()}
        ring = {r: links[k] for r, k in self.grid.ring_peers(rank).items()}
        self._group = RingGroup(self.replica, replicas, ring, name="dp") if ring else None
        self._runner: StageRunner | None = None
        self._trace: Any = None
        self._steps = {"T": 0, "E": 0, "P": 0, "W": 0}
        self.built = model.built  # Its weights are the model's (BackupAndRestore asks).

    def _connect(
        self,
        addresses: Sequence[str],
        plan: dict[str, object],
        timeout: float,
        recv_timeout: float | None,
    ) -> dict[int, Any]:
        """Links this process with its peers, which must have been given the
        same plan (:mod:`~tfdist.pipeline.agreement`)."""
        names = self.grid.names()
        links = connect_peers(
            self.rank,
            list(addresses),
            self.grid.peers(self.rank),
            timeout=timeout,
            recv_timeout=recv_timeout,
            names=names,
        )
        try:
            check_agreement(plan, links, names, SOURCE, timeout=timeout)
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    @property
    def trace(self) -> Any:
        """A :class:`~tfdist.pipeline.trace.Trace` recording this process's
        passes, receives, sends and update in each training step, to
        measure the bubble with :func:`~tfdist.pipeline.trace.breakdown`
        (None, the default: nothing is timed). Set it before or after
        ``compile``."""
        return self._trace

    @trace.setter
    def trace(self, value: Any) -> None:
        self._trace = value
        if self._runner is not None:
            self._runner.trace = value

    def _make_own(self, deferred: list) -> None:
        """Makes the deferred values of this stage's weights (under the
        distribution, if given), and of state that is no stage's weight."""
        others = {
            id(v) for s in self.stages if self._owner(s) != self.stage_index for v in s.variables
        }
        mine = {id(v) for s in self.own for v in s.variables}
        laid = self._distribution is not None
        for variable in deferred:
            if id(variable) not in others and not (laid and id(variable) in mine):
                materialize(variable)
        if laid:
            made = [v for v in deferred if id(v) in mine]
            build_stage(self._distribution, made, owners_of(self.whole))

    def _owner(self, stage: Any) -> int:
        """The place in the pipeline of the process that runs ``stage``."""
        return stage.index % self.grid.stages

    def _place(
        self, stage: int | None, replica: int | None, addresses: Sequence[str] | None
    ) -> tuple[int, list[str]]:
        """This process's rank and every process's address."""
        rank = None
        if stage is None or addresses is None:
            rank, found = stage_from_environment()
            addresses = found if addresses is None else addresses
        if stage is not None:
            for field, value, bound in (
                ("stage", stage, self.grid.stages),
                ("replica", replica or 0, self.grid.replicas),
            ):
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
                    raise ConfigError(field, value, f"an integer in [0, {bound})", source=SOURCE)
            rank = self.grid.rank(replica or 0, stage)
        return rank, list(addresses)

    def call(self, inputs: Any, training: bool = False) -> Any:
        return self.whole(inputs, training=training)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, **kwargs: Any) -> None:
        """Keras's compile, run eagerly (the stages' passes are Python).

        ``metrics`` and ``weighted_metrics`` are computed where the outputs
        are: in training, on the last stage over the whole batch (over every
        replica's share, their states summed), and sent back to every stage;
        in ``evaluate``, on every stage, which has the outputs. Every stage
        logs the same numbers.

        Raises:
            ConfigError: No loss.
        """
        if loss is None:
            raise ConfigError(
                "loss", loss, "a Keras loss (the last stage computes it)", source=SOURCE
            )
        kwargs["run_eagerly"] = True
        if self._strategy is not None:
            optimizer = _made_in(self._strategy, optimizer)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._runner = StageRunner(
            self.own,
            len(self.stages),
            self._links,
            self.schedule,
            self.microbatches,
            _as_loss(loss),
            self.optimizer,
            strategy=self._strategy,
        )
        self._runner.keep_outputs = bool(kwargs.get("metrics") or kwargs.get("weighted_metrics"))
        self._runner.trace = self._trace
        if self._group is not None:
            variables = self._runner.variables
            if self._strategy is not None:  # Each device's gradient, reduced over replicas.
                variables = components(self._strategy, variables)
            self._runner.replicas = StageReplicas(self._group, variables, self._aggregator)
        # Built for this stage's weights only: it keeps no state for the rest
        # (on a mesh, in its scope: each slot laid out as its weight).
        scope = self._strategy.scope() if self._strategy else contextlib.nullcontext()
        with scope:
            self.optimizer.build(self._runner.variables)

    def _next(self, kind: str) -> int:
        step = self._steps[kind]
        self._steps[kind] += 1
        return step

    def fit(self, *args: Any, callbacks: Any = None, **kwargs: Any) -> Any:
        """Keras's fit. A ``keras.callbacks.BackupAndRestore`` works as on one
        device: stage 0 writes the backup, and every stage resumes from it
        (the workers share a file system)."""
        callbacks = stage_callbacks(callbacks, self.rank)
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def train_step(self, data: Any) -> dict:
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        flat = keras.tree.flatten(x)
        step = self._next("T")
        loss = self._runner.train_step(step, flat, y, weight)
        self._log(loss, flat)
        if self._runner.keep_outputs:
            self._training_metrics(step, y)
        return self.get_metrics_result()

    def test_step(self, data: Any) -> dict:
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        flat = keras.tree.flatten(x)
        loss, outputs = self._runner.forward_step("E", self._next("E"), flat, y, weight)
        self._log(loss, flat)
        if self._runner.keep_outputs:  # Every stage has the outputs here.
            self.compute_metrics(x, y, outputs[0] if len(outputs) == 1 else outputs, weight)
        return self.get_metrics_result()

    def _log(self, loss: float, flat: list) -> None:
        """Keras's loss metric takes the batch's loss, weighted by its size as
        Keras's own train_step does: the logs are its running mean."""
        tracker = loss_tracker(self)
        tracker.update_state(loss, sample_weight=int(flat[0].shape[0]))

    def _training_metrics(self, step: int, y: Any) -> None:
        """Updates the compiled metrics after a training step: the last stage
        from its outputs, every other stage by taking the last stage's
        metric state (sums and counts: a few numbers), so that every stage
        logs the same, within steps and at the end of an epoch."""
        tag = ("M", step)
        if self._runner.last:
            y_share, y_pred, weight = self._runner.last_batch
            if self._group is None:
                self.compute_metrics(None, y_share, y_pred, weight)
            else:
                self._update_over_replicas(y_share, y_pred, weight)
        else:
            if not self._metric_state():
                self._build_metrics(y)
            values = self._links[self.stage_index + 1].recv(tag)
            state = self._metric_state()
            if len(values) != len(state):
                raise RuntimeError(
                    f"stage {self.stage_index} has {len(state)} metric variables and stage "
                    f"{self.stage_index + 1} sent {len(values)}: the stages compiled other metrics"
                )
            for variable, value in zip(state, values):
                variable.assign(value)
        if self.stage_index > 0:
            own = [np.asarray(v.numpy()) for v in self._metric_state()]
            self._links[self.stage_index - 1].send(tag, own)

    def _metric_state(self) -> list:
        """The compiled metrics' variables (the loss tracker's left out)."""
        tracker = loss_tracker(self)
        return [v for m in self.metrics if m is not tracker for v in m.variables]

    def _build_metrics(self, y: Any) -> None:
        """Builds the compiled metrics on a stage without the outputs, from
        the targets and zeros shaped as the model's output (which Keras
        reads to choose, say, sparse or categorical accuracy)."""
        shapes = [[1 if d is None else d for d in o.shape] for o in self.whole.outputs]
        zeros = [np.zeros(shape, o.dtype) for shape, o in zip(shapes, self.whole.outputs)]
        first = keras.tree.map_structure(lambda t: t[:1], y)
        self.compute_metrics(None, first, zeros[0] if len(zeros) == 1 else zeros, None)

    def _update_over_replicas(self, y: Any, y_pred: Any, weight: Any) -> None:
        """Updates the metrics with every replica's share: each replica's
        change of state (a Keras metric's state is sums and counts) is summed
        over the replicas, so every last stage holds the whole batch's."""
        before = [np.asarray(v.numpy()) for v in self._metric_state()]
        self.compute_metrics(None, y, y_pred, weight)
        state = self._metric_state()
        if len(before) != len(state):  # Built by this first update: its state started at 0.
            before = [np.zeros(v.shape, v.dtype) for v in state]
        changes = [np.asarray(v.numpy()) - b for v, b in zip(state, before)]
        for variable, old, change in zip(state, before, self._group.allreduce(*changes)):
            variable.assign(old + change)

    def predict_step(self, data: Any) -> Any:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        _, outputs = self._runner.forward_step("P", self._next("P"), keras.tree.flatten(x))
        return outputs[0] if len(outputs) == 1 else outputs

    # Saving: each stage writes its own weights; stage 0 joins the parts.

    def gather_weights(self, before_sending: Any = None) -> None:
        """Copies every stage's weights into stage 0's model, to keep (a
        collective: every stage calls it). ``before_sending()`` runs on each
        stage once the later stages are done, before its weights go on: when
        stage 0 has them all, every stage has run it."""
        with self._gathered(before_sending, keep=True):
            pass

    @contextlib.contextmanager
    def _gathered(self, before_sending: Any = None, keep: bool = False) -> Iterator[None]:
        """Inside, stage 0's model has every stage's weights (as
        :meth:`gather_weights`); after, unless ``keep``, a stage whose model
        was built by stage holds only its own weights again."""
        tag = ("W", self._next("W"))
        later = [
            v
            for k in range(self.stage_index + 1, self.grid.stages)
            for s in self.stages
            if self._owner(s) == k
            for v in s.variables
        ]
        arrays: list[np.ndarray] = []
        if self.stage_index < self.grid.stages - 1:
            arrays = self._links[self.stage_index + 1].recv(tag)
        if keep:
            for variable, value in zip(later, arrays):
                materialize(variable, value)
        with contextlib.nullcontext() if keep else borrowed(later, arrays):
            if before_sending is not None:
                before_sending()
            if self.stage_index > 0:
                own = [np.asarray(v.numpy()) for s in self.own for v in s.variables]
                self._links[self.stage_index - 1].send(tag, own + list(arrays))
            yield

    def save(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Writes the whole trained model as an ordinary Keras model (every
        stage must call it).

        A ``.keras`` file is written by stage: its weights as
        :meth:`save_weights` writes them (a part per process, joined by stage
        0, beside ``filepath``), then stage 0 writes the archive around them
        (Keras's config, metadata and assets), so that no process holds more
        than its own weights. With other arguments, stage 0 gathers every
        weight and Keras writes the file.
        """
        path = os.fspath(filepath)
        if args or kwargs or not path.endswith(".keras"):
            with self._gathered():
                if self.rank == 0:
                    self.whole.save(filepath, *args, **kwargs)
            return
        weights = path + ".tmp" + WEIGHTS_SUFFIX
        self._write_by_stage(weights, states=False)
        if self.rank != 0:
            return
        try:
            with local_copy(weights) as joined, published(path) as partial:
                write_keras_archive(self.whole, joined, partial)
        finally:
            remove(weights)

    def save_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """The whole model's weights to ``filepath``, the file Keras writes
        for one device, and each stage's optimizer state beside it
        (``FILEPATH.stageK.npz``). Every stage calls it.

        A ``.weights.h5`` file is written by stage: each process writes its
        own layers to a part file beside it, and stage 0 joins the parts
        (:mod:`tfdist.pipeline.saving`), so that no process holds more than
        its own weights (every process reaches the path: a shared file
        system, or a URL tf.io.gfile opens, e.g. ``gs://``). Other files, or Keras's
        sharded weights (``max_shard_size``), are written by stage 0 once
        every weight is copied to it."""
        if args or kwargs or not os.fspath(filepath).endswith(WEIGHTS_SUFFIX):
            with self._gathered(before_sending=lambda: self._save_optimizer(filepath)):
                if self.rank == 0:
                    self.whole.save_weights(filepath, *args, **kwargs)
            return
        self._write_by_stage(filepath, states=True)

    def _write_by_stage(self, filepath: Any, states: bool) -> None:
        """Writes the ``.weights.h5`` file by stage (and, if ``states``, the
        optimizer's and compression's states beside it). The file is rank
        0's ``filepath``: as with Keras under a strategy, the chief's path
        counts, whatever path the other processes gave."""
        plan = self._plan()
        process = self.stage_index
        tag = ("W", self._next("W"))
        filepath = self._path_of_rank_0(tag, os.fspath(filepath))

        def write_part() -> None:
            if self.replica == 0:
                part = part_file(filepath, process)
                makedirs_for(part)  # Before stage 0 does.
                saving_lib.save_weights_only(self.whole, part, objects_to_skip=plan.skip_save)
            if states:
                self._save_optimizer(filepath)

        # Each process has written its part (and its optimizer state) before
        # the one below it goes on: once stage 0 has, the parts are all there.
        self._pass_down(tag, plan, after_receiving=write_part)
        if self.rank == 0:
            parts = [part_file(filepath, k) for k in range(self.grid.stages)]
            join_parts(parts, os.fspath(filepath))
        # No process returns before the file is whole: it may read it next.
        if process == 0 and self._group is not None:
            self._group.allreduce(np.zeros(1, np.float32))  # Stage 0's replicas wait for rank 0.
        if process > 0:
            self._links[process - 1].recv((*tag, "joined"))
        if process < self.grid.stages - 1:
            self._links[process + 1].send((*tag, "joined"), [])

    def _path_of_rank_0(self, tag: tuple, path: str) -> str:
        """Stage 0's ``path``, passed up its pipeline (a replica's stage 0
        passes its own: the replicas run the same script)."""
        process = self.stage_index
        if process > 0:
            (data,) = self._links[process - 1].recv((*tag, "path"))
            path = data.tobytes().decode()
        if process < self.grid.stages - 1:
            data = np.frombuffer(path.encode(), np.uint8)
            self._links[process + 1].send((*tag, "path"), [data])
        return path

    def _plan(self) -> Plan:
        reads = [
            [v for s in self.stages if self._owner(s) == k for v in s.variables]
            for k in range(self.grid.stages)
        ]
        return plan_for(self.whole, reads, self.stage_index)

    def _pass_down(self, tag: tuple, plan: Plan, after_receiving: Callable[[], None]) -> None:
        """Sends down the pipeline the weights earlier processes write
        (:attr:`Plan.sent`), taking this process's; ``after_receiving()``
        runs between the two."""
        process = self.stage_index
        arrays = self._links[process + 1].recv(tag) if process < self.grid.stages - 1 else []
        values = {id(v): a for v, a in zip(plan.sent.get(process + 1, []), arrays)}
        with borrowed(plan.taken, [values[id(v)] for v in plan.taken]):
            after_receiving()
        if process > 0:
            mine = {id(v) for s in self.own for v in s.variables}
            own = [
                np.asarray(v.numpy()) if id(v) in mine else values[id(v)]
                for v in plan.sent[process]
            ]
            self._links[process - 1].send(tag, own)

    def _save_optimizer(self, filepath: Any) -> None:
        # The replicas' optimizer states are equal: replica 0 writes. The
        # compression's state (error-feedback residuals) is each replica's own.
        if self.optimizer is not None and self.optimizer.built and not self.replica:
            write_state(_optimizer_file(filepath, self.stage_index), self.optimizer.variables)
        compression = self._compression_state()
        if compression:
            write_state(_replica_file(filepath, self.stage_index, self.replica), compression)

    def _compression_state(self) -> list:
        """The compression's state variables of this replica's stage, in order."""
        replicas = None if self._runner is None else self._runner.replicas
        if replicas is None:
            return []
        return [
            replicas.state[i][name]
            for i in sorted(replicas.state)
            for name in sorted(replicas.state[i])
        ]

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """The whole model's weights (every stage reads the file: a shared
        file system or a URL), and this stage's optimizer state if saved
        beside it.

        Raises:
            ConfigError: The saved optimizer state does not fit this
                optimizer (another optimizer, or another model).
        """
        if args or kwargs or not os.fspath(filepath).endswith(WEIGHTS_SUFFIX):
            for variable in self.whole.weights:  # A model built by stage: all of it, to read.
                materialize(variable)
            self.whole.load_weights(filepath, *args, **kwargs)
        else:
            # Only the layers this stage computes with: a model built by
            # stage makes and reads only its own weights.
            plan = self._plan()
            with borrowed(plan.load):  # Another stage's weight of a shared layer: not kept.
                self.whole.load_weights(filepath, objects_to_skip=plan.skip_load)
        if self.optimizer is not None and self.optimizer.built:
            side = _optimizer_file(filepath, self.stage_index)
            read_state(side, self.optimizer.variables, "optimizer state", SOURCE)
        compression = self._compression_state()
        if compression:
            side = _replica_file(filepath, self.stage_index, self.replica)
            read_state(side, compression, "compression state (error-feedback residuals)", SOURCE)

    def sent_to_replicas(self) -> int:
        """Bytes this process has sent to its stage's other replicas (the
        data-parallel all-reduce and the logged loss); 0 with one replica."""
        return 0 if self._group is None else int(sum(self._group.sent.values()))

    def close(self) -> None:
        """Closes the links to the neighbouring stages and replicas."""
        for link in self._all_links.values():
            link.close()


def _described(compression: object) -> object:
    """``compression`` as every process describes it alike: a compressor
    object's repr holds its address, so its class stands for it."""
    if compression is None or isinstance(compression, str):
        return compression
    return type(compression).__name__


def _processes(stages: int, chunks: Any) -> int:
    """The processes a pipeline of ``stages`` stages, ``chunks`` a process, takes.

    Raises:
        ConfigError: ``chunks`` is not an integer >= 1 dividing ``stages``.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or stages % chunks:
        raise ConfigError(
            "chunks",
            chunks,
            f"an integer >= 1 dividing the {stages} stages the split points make",
            source=SOURCE,
        )
    return stages // chunks


def _stage_strategy(distribution: Any, model: Any) -> Any:
    """The strategy the stages run on under ``distribution`` (None: none).

    Raises:
        ConfigError: A distribution tfdist does not honour, or a built model
            (its weights were made without the layouts).
    """
    if distribution is None:
        return None
    if isinstance(model, keras.Model):
        raise ConfigError(
            "model",
            model.name,
            "the function that builds the model, with distribution=: each stage makes its "
            "weights under the distribution's layouts (a built model's are made already)",
            source=SOURCE,
        )
    return strategy_for(distribution)


def _made_in(strategy: Any, optimizer: Any) -> Any:
    """``optimizer`` made again, from its config, in ``strategy``'s scope
    (Keras's TensorFlow optimizer keeps the strategy it was made in)."""
    given = keras.optimizers.get(optimizer)
    if given.built:
        raise ConfigError(
            "optimizer",
            type(given).__name__,
            "an optimizer not built yet (the stage builds it for its laid-out weights)",
            source=SOURCE,
        )
    with strategy.scope():
        return type(given).from_config(given.get_config())


def _optimizer_file(filepath: Any, stage: int) -> str:
    """Where stage ``stage`` keeps its optimizer state beside ``filepath``."""
    return f"{os.fspath(filepath)}.stage{stage}.npz"


def _replica_file(filepath: Any, stage: int, replica: int) -> str:
    """Where a replica of stage ``stage`` keeps its compression state."""
    return f"{os.fspath(filepath)}.stage{stage}.replica{replica}.npz"


class _FunctionLoss(keras.losses.Loss):
    """A loss function as a Loss object, as Keras's compile wraps one: the
    mean over the batch, with sample weights."""

    def __init__(self, fn: Any) -> None:
        super().__init__(name=getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


def _as_loss(loss: Any) -> keras.losses.Loss:
    """``compile``'s ``loss`` as a Loss object the last stage calls.

    Raises:
        ConfigError: A loss per output (a dict or list): one output for now.
    """
    if isinstance(loss, keras.losses.Loss):
        return loss
    if isinstance(loss, str) or callable(loss):
        return _FunctionLoss(keras.losses.get(loss) if isinstance(loss, str) else loss)
    raise ConfigError(
        "loss",
        loss,
        "one Keras loss: a name, a function or a keras.losses.Loss (a loss per output "
        "is not supported yet)",
        source=SOURCE,
    )
