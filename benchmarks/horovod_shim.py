"""Numbers for ``tfdist.horovod``: the Horovod API against tfdist's own strategy.

Reproduce (about 5 minutes on 2 cores; the recorded run)::

    flock /tmp/tfdist-heavy.lock python benchmarks/horovod_shim.py --pairs=10
    python benchmarks/horovod_shim.py --mode=numbers      # checks only, two jobs (~30 s)
    python benchmarks/horovod_shim.py --mode=overhead --pairs=4

Results: ``benchmarks/results/horovod_shim.{json,md}``.

Every job is 2 worker processes on 127.0.0.1, started as
``benchmarks/overhead.py`` starts its workers (one TF_CONFIG each, as
``tfdist launch --workers 2`` gives them).

``--mode=numbers`` is two jobs: one trains through the Horovod API
(``hvd.init()`` comes first, no strategy, each rank fed its half of each
global batch), the other through ``tfdist.strategy_from_config()``
(MultiWorkerMirrored, ``distribute_datasets_from_function`` handing worker
*i* the same half); the weights are compared afterwards. It measures:

1. gradients: the largest weight difference between
   ``hvd.DistributedOptimizer`` and MultiWorkerMirrored after the same steps
   of ``model.fit`` (SGD, Adam), and between a ``hvd.DistributedGradientTape``
   loop and a ``strategy.run`` loop; as a control, how far a rank training
   alone on its half ends up (what the check would see if nothing were
   averaged);
2. broadcast: the largest difference between the ranks' variables (model and
   optimizer) before and after ``hvd.broadcast_variables`` from different
   initialisations (and ``BroadcastGlobalVariablesCallback`` when
   ``tfdist.horovod.callbacks`` exists);
3. bytes: ``tfdist.compression.step_traffic`` of a fit step with
   ``Compression.none``, ``Compression.fp16`` and PowerSGD through
   ``hvd.DistributedOptimizer(compression=...)``, against what the
   optimizer's collectives really carried (``Comm.reduced/gathered``);
4. ``MetricAverageCallback`` (when ``tfdist.horovod.callbacks`` exists): the
   logged loss against the mean of the ranks' own losses.

``--mode=overhead`` times a Horovod-API ``fit`` (``--arm=hvd``) against the
same model under tfdist's MultiWorkerMirrored ``fit`` (``--arm=mwms``), each
run a new 2-process job, interleaved (ABC CBA ...); the ratio is the median
over rounds of the per-run median step times (goal: <= 1.02). A third arm,
``hvd_logs``, is the Horovod script whose ``train_step`` also averages its
logs over the ranks every step, as ``fit`` under MultiWorkerMirrored does
(one more all-reduce per step; Horovod's logs are per rank): the
like-for-like comparison of the gradient path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import overhead  # noqa: E402 - benchmarks/ is not a package; reuse its pure pieces.
from benchlib import results as results_lib  # noqa: E402
from benchlib.timing import step_timer  # noqa: E402

ARMS = ("hvd", "hvd_logs", "mwms")
GOAL = overhead.GOAL
TOLERANCE = 1e-5

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum(
        "mode",
        "all",
        ["all", "numbers", "overhead", "numbers_worker", "overhead_worker"],
        "What to run; *_worker is one process of a job.",
    )
    flags.DEFINE_integer("pairs", 8, "Interleaved rounds (one job per arm) of overhead jobs.")
    flags.DEFINE_integer("steps", 30, "Timed steps per overhead run.")
    flags.DEFINE_integer("warmup_steps", 5, "Untimed steps first (tracing).")
    flags.DEFINE_integer("global_batch", 128, "Global batch of the overhead runs.")
    flags.DEFINE_integer("hidden", 2048, "Width of the overhead MLP's two hidden layers.")
    flags.DEFINE_integer("check_steps", 8, "Steps of each numbers check.")
    flags.DEFINE_enum("arm", "hvd", list(ARMS), "The arm of one overhead worker.")
    flags.DEFINE_enum("side", "hvd", ["hvd", "mwms"], "The side of one numbers worker.")
    flags.DEFINE_string("out", None, "Where one worker writes its JSON.")
    flags.DEFINE_float("job_timeout", 300, "Seconds a numbers job may take before it is killed.")
    flags.DEFINE_string("results_dir", str(RESULTS), "Where results are written.")
    flags.DEFINE_string("name", "horovod_shim", "Base name of the result files.")


# ---------------------------------------------------------------- pure pieces


def round_order(i: int) -> tuple[str, ...]:
    """The arms' order in round ``i``, reversed every other round as in
    overhead.py's ABBA order (ABC CBA ...), so that a first-run effect cancels."""
    return ARMS if overhead.pair_order(i)[0] == overhead.ARMS[0] else ARMS[::-1]


def rank_rows(examples: int, global_batch: int, rank: int, size: int) -> list[int]:
    """The rows rank ``rank`` trains on: its contiguous share of each global batch."""
    if global_batch % size:
        raise ValueError(
            f"Expected a global batch divisible by {size} ranks. "
            f"Received: global_batch={global_batch}"
        )
    share = global_batch // size
    return [
        start + rank * share + i
        for start in range(0, examples - global_batch + 1, global_batch)
        for i in range(share)
    ]


def max_abs_diff(a: list, b: list) -> float:
    """The largest |a - b| over lists of equally shaped arrays."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"Expected as many arrays on both sides. Received: {len(a)} and {len(b)}")
    return max(
        (
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(a, b)
            if np.size(x)
        ),
        default=0.0,
    )


def spread(values: list[float]) -> str:
    """``min-max`` of a list, for the table."""
    return f"{min(values):.3f}-{max(values):.3f}"


def markdown(results: dict) -> str:
    """The tables, with the conditions of the run."""
    meta = results["meta"]
    lines = [
        "# tfdist.horovod: the Horovod API against tfdist's MultiWorkerMirrored",
        "",
        f"`{meta['command']}` — {meta['when']} UTC; {meta['cpus']} cores shared with other "
        f"jobs; load average (1 min) before / after: {meta['load_before']:.1f} / "
        f"{meta['load_after']:.1f}. 2 worker processes on 127.0.0.1 per job. "
        f"Code: {meta.get('code', 'unknown')}.",
        "",
    ]
    numbers = results.get("numbers")
    if numbers:
        m = numbers["meta"]
        lines += [
            "## Correctness and bytes",
            "",
            f"MLP 64-{m['hidden']}-{m['hidden']}-10 ({m['params']:,} parameters), global "
            f"batch {m['global_batch']} (each rank its contiguous half), "
            f"{m['steps']} steps; TensorFlow {m['tf']}, Keras {m['keras']}.",
            "",
            "| check | measured | goal | pass |",
            "|---|---|---|:---:|",
        ]
        for row in numbers["rows"]:
            lines.append(
                f"| {row['check']} | {row['measured']} | {row['goal']} "
                f"| {'yes' if row['ok'] else '**no**'} |"
            )
        lines += [""] + [f"- {note}" for note in numbers["notes"]] + [""]
    over = results.get("overhead")
    if over:
        m = over["meta"]
        lines += [
            "## Overhead: Horovod-API fit against MultiWorkerMirrored fit",
            "",
            f"MLP 64-{m['hidden']}-{m['hidden']}-10 ({m['params']:,} parameters, "
            f"float32), global batch {m['global_batch']} ({m['global_batch'] // 2} per "
            f"rank), SGD with momentum, {m['steps']} timed steps per run after "
            f"{m['warmup_steps']}, {m['pairs']} interleaved rounds (ABC CBA ...), each "
            "run a new 2-process job. Load average (1 min) before / after: "
            f"{m['load_before']:.1f} / {m['load_after']:.1f}, after each run "
            f"{min(m['loads']):.1f}-{max(m['loads']):.1f} (other jobs share the "
            "2 cores).",
            "",
            "| arm | median step (ms) | per-run medians (ms) |",
            "|---|---:|---|",
        ]
        for arm, label in (
            ("hvd", "Horovod API: `hvd.DistributedOptimizer`, no strategy"),
            ("hvd_logs", "Horovod API, logs averaged every step (as MWMS)"),
            ("mwms", "`tfdist.strategy_from_config()` (MultiWorkerMirrored)"),
        ):
            runs = ", ".join(f"{1e3 * s:.1f}" for s in over[f"{arm}_s"])
            lines.append(f"| {label} | {1e3 * statistics.median(over[f'{arm}_s']):.2f} | {runs} |")
        lines += [
            "",
            "| ratio | median over rounds | per round | spread | goal ≤ 1.02 |",
            "|---|---:|---|---|:---:|",
        ]
        for arm, label in (
            ("hvd", "Horovod script / MWMS"),
            ("hvd_logs", "Horovod script with averaged logs / MWMS"),
        ):
            ratios, med = over["ratios"][arm], over["median_ratio"][arm]
            lines.append(
                f"| {label} | **{med:.3f}** | "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + f" | {spread(ratios)} | {'yes' if med <= GOAL else '**no**'} |"
            )
        fc = (numbers or {}).get("ranks", [{}])[0].get("fit_collectives")
        if fc:
            gap = 1 - over["median_ratio"]["hvd_logs"]
            lines += [
                "",
                f"Why the Horovod path is not slower: per `fit` step it issues "
                f"{len(fc['hvd'])} collective(s) and MultiWorkerMirrored "
                f"{len(fc['mwms'])} (traced, above): the extra one is the all-reduce of "
                "the logged loss (Keras's `reduce_per_replica(..., 'mean')`), which "
                "Horovod scripts skip (logs stay per rank; `MetricAverageCallback` "
                "averages them once per epoch). With that all-reduce added (`hvd_logs`) "
                f"the Horovod step is still {100 * gap:.0f}% shorter, with the same "
                "gradient collective (count, dtype, bytes): the rest of the gap is "
                "outside the collectives, in Keras's step under a `tf.distribute` "
                "strategy (not profiled further; `benchmarks/results/overhead.md` "
                "puts tfdist's strategy level with TensorFlow's own).",
            ]
        lines += [""] + [f"- {note}" for note in over.get("notes", [])]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- jobs


def run_job(worker_args: list[str], work: Path, timeout: float = 600) -> list[dict]:
    """Runs this script's worker as a 2-process job on 127.0.0.1; each rank's JSON.

    Started as benchmarks/overhead.py starts its workers: one TF_CONFIG each.
    """
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs, outs, logs = [], [], []
    for rank, (_, _, config) in enumerate(spec_lib.all_task_configs(local_spec(2))):
        outs.append(work / f"rank{rank}.json")
        logs.append(work / f"rank{rank}.log")
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps(config),
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        with open(logs[-1], "w") as stream:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, *worker_args, f"--out={outs[-1]}"],
                    env=env,
                    stdout=stream,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:  # Only the processes started here.
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes is None:
        raise SystemExit(
            f"workers {worker_args} still running after {timeout:g} s; "
            + "; ".join(f"rank {i}'s log:\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
        )
    if any(codes):
        bad = next(i for i, c in enumerate(codes) if c)
        raise SystemExit(
            f"workers {worker_args} exited with {codes}; rank {bad}'s log:\n"
            + logs[bad].read_text()[-4000:]
        )
    return [json.loads(out.read_text()) for out in outs]


def _mlp(keras, hidden: int, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _params(hidden: int) -> int:
    return 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10


def _rank_dataset(tf, x, y, global_batch: int, rank: int, size: int):
    rows = rank_rows(len(x), global_batch, rank, size)
    return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(global_batch // size)


def collectives_in(graph) -> list[tuple[str, tuple, str]]:
    """(op type, input shape, input dtype) of every collective a traced graph
    issues, nested functions included: what goes on the wire."""
    found, seen = [], set()

    def walk(g):
        if id(g) in seen:
            return
        seen.add(id(g))
        for op in g.get_operations():
            if op.type in (
                "CollectiveReduceV2",
                "CollectiveGatherV2",
                "CollectiveReduce",
                "CollectiveGather",
                "CollectiveBcastSendV2",
                "CollectiveAllToAllV2",
            ):
                t = op.inputs[0]
                found.append((op.type, tuple(t.shape.as_list()), t.dtype.name))
        for fn in getattr(g, "_functions", {}).values():
            inner = getattr(fn, "graph", None)
            if inner is not None:
                walk(inner)

    walk(graph)
    return found


def fit_step_collectives(model, data) -> list[tuple[str, tuple, str]]:
    """The collectives of one ``fit`` step of ``model`` on ``data`` (a batch, or
    a distributed one), traced as Keras's ``one_step_on_data`` builds it: the
    step under the model's strategy, then the logs reduced ("auto")."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    strategy = model.distribute_strategy

    @tf.function
    def one_step(batch):
        outputs = strategy.run(model.train_step, args=(batch,))
        return reduce_per_replica(outputs, strategy, reduction="auto")

    return collectives_in(one_step.get_concrete_function(data).graph)


# ---------------------------------------------------------------- numbers

CHECK_HIDDEN = 64
CHECK_BATCH = 64


def numbers_worker() -> None:
    """One rank of a numbers job: the Horovod API (``--side=hvd``) or
    MultiWorkerMirrored (``--side=mwms``), on the same model and halves.

    The two sides run as separate jobs: ``hvd.init()`` followed by
    ``tfdist.strategy_from_config()`` in one process hung in the strategy's
    first ``fit`` in 2 of 9 runs.
    """
    if FLAGS.side == "hvd":
        import tfdist.horovod as hvd

        hvd.init()  # Before any TensorFlow work, as Horovod scripts do.

    import keras
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.compression import PowerSGD, step_traffic
    from tfdist.compression.keras_hook import state_by_key
    from tfdist.compression.traffic import all_gather_bytes, all_reduce_bytes, nbytes, wire_nbytes

    if FLAGS.side == "hvd":
        rank, size = hvd.rank(), hvd.size()
    else:
        strategy = tfdist.strategy_from_config()
        rank, size = (
            json.loads(os.environ["TF_CONFIG"])["task"]["index"],
            strategy.num_replicas_in_sync,
        )
    steps, batch = FLAGS.check_steps, CHECK_BATCH
    x, y = overhead._data(steps * batch)  # The overhead benchmark's data.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out: dict = {"rank": rank, "size": size, "tf": tf.__version__, "keras": keras.__version__}
    weights: dict[str, list] = {}

    def model_():
        return _mlp(keras, CHECK_HIDDEN, seed=1)

    def mine():
        return _rank_dataset(tf, x, y, batch, rank, size)

    optimizers = {
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }

    if FLAGS.side == "hvd":
        # 1. Gradients, Horovod side: fit, and a DistributedGradientTape loop.
        for name, make in optimizers.items():
            model = model_()
            weights["init"] = model.get_weights()
            model.compile(optimizer=hvd.DistributedOptimizer(make()), loss=loss)
            model.fit(mine(), epochs=1, verbose=0)
            weights[f"hvd_fit_{name}"] = model.get_weights()
            if name == "sgd":
                out["fit_collectives"] = {"hvd": fit_step_collectives(model, next(iter(mine())))}
            # Control: the same rank alone (no all-reduce).
            alone = model_()
            alone.compile(optimizer=make(), loss=loss)
            alone.fit(mine(), epochs=1, verbose=0)
            weights[f"alone_fit_{name}"] = alone.get_weights()

        model, opt = model_(), optimizers["adam"]()

        @tf.function
        def tape_step(xb, yb):
            with tf.GradientTape() as tape:
                value = loss(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return value

        for xb, yb in mine():
            tape_step(xb, yb)
        weights["hvd_tape_adam"] = model.get_weights()

        # 2. Broadcast from different initialisations (model and optimizer).
        model = _mlp(keras, CHECK_HIDDEN, seed=100 + rank)
        opt = optimizers["adam"]()
        model.compile(optimizer=opt, loss=loss)
        model.train_on_batch(x[:8], y[:8])  # This rank's own Adam moments.
        before = [np.array(v) for v in model.variables + opt.variables]
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
        after = [np.array(v) for v in model.variables + opt.variables]
        out["broadcast"] = {"variables": len(before)}
        np.savez(
            Path(FLAGS.out).with_suffix(".bcast.npz"),
            **{f"before_{i}": a for i, a in enumerate(before)},
            **{f"after_{i}": a for i, a in enumerate(after)},
        )
        callbacks = getattr(hvd, "callbacks", None)
        if callbacks is not None:
            model = _mlp(keras, CHECK_HIDDEN, seed=100 + rank)
            model.compile(optimizer=hvd.DistributedOptimizer(optimizers["sgd"]()), loss=loss)
            start = model.get_weights()
            model.fit(
                mine().take(1),
                epochs=1,
                verbose=0,
                callbacks=[callbacks.BroadcastGlobalVariablesCallback(0)],
            )
            np.savez(
                Path(FLAGS.out).with_suffix(".bcast_cb.npz"),
                **{f"before_{i}": a for i, a in enumerate(start)},
                **{f"after_{i}": a for i, a in enumerate(model.get_weights())},
            )

        # 3. Bytes through hvd.DistributedOptimizer(compression=...).
        out["traffic"] = {}
        settings = {
            "none": hvd.Compression.none,
            "fp16": hvd.Compression.fp16,
            "powersgd": PowerSGD(rank=2, warmup_steps=1),
        }
        for name, compression in settings.items():
            model = model_()
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression)
            model.compile(optimizer=opt, loss=loss)
            model.fit(mine().take(3), epochs=1, verbose=0)  # PowerSGD: 1 dense, 2 compressed.
            traffic = step_traffic(model.optimizer)
            # The step fit ran, traced again: the collectives it issues.
            xb, yb = next(iter(mine()))
            wire = collectives_in(
                tf.function(model.train_step).get_concrete_function((xb, yb)).graph
            )
            comm = hvd.optimizer.last_comm(model.optimizer)
            state = state_by_key(model.optimizer)
            residuals = [np.array(s["residual"]) for s in state.values() if "residual" in s]
            row = {
                "sent": traffic.sent,
                "dense_sent": traffic.dense_sent,
                "ratio": traffic.ratio,
                "replicas": traffic.num_replicas,
                "comm": None,
                "state": sorted({k for s in state.values() for k in s}),
                "residual_abs_sum": float(sum(np.abs(r).sum() for r in residuals)),
                "residual_tensors": len(residuals),
                "wire": wire,
                "wire_bytes": sum(nbytes(shape, dtype) for _, shape, dtype in wire),
            }
            if comm is not None:
                # What the traced step handed to the collectives. PowerSGD's
                # warm-up cond traces both branches: keep the compressed one.
                reduced, gathered = list(comm.reduced), list(comm.gathered)
                row["comm"] = {
                    "reduced": reduced,
                    "gathered": gathered,
                    "dtypes": sorted({d for _, d in reduced + gathered}),
                }
                payload = sum(nbytes(s, d) for s, d in reduced)
                gather = sum(wire_nbytes(s, d) for s, d in gathered)
                row["comm"]["all_reduce_payload"] = payload
                row["comm"]["all_reduce_sent"] = all_reduce_bytes(payload, size)
                row["comm"]["all_gather_sent"] = all_gather_bytes(gather, size)
            out["traffic"][name] = row

        # 3b. The same through DistributedGradientTape, which keeps its Comm.
        out["tape_traffic"] = {}
        for name in ("none", "fp16"):
            model, opt, kept = model_(), keras.optimizers.SGD(0.1), {}

            @tf.function
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    value = loss(yb, model(xb, training=True))  # noqa: B023 - traced at once, in this iteration
                tape = hvd.DistributedGradientTape(tape, compression=settings[name])  # noqa: B023 - traced at once, in this iteration
                grads = tape.gradient(value, model.trainable_variables)  # noqa: B023 - traced at once, in this iteration
                kept["comm"] = hvd.tape.last_comm(tape)  # noqa: B023 - traced at once; keeps what the trace sent.
                opt.apply_gradients(zip(grads, model.trainable_variables))  # noqa: B023 - traced at once, in this iteration
                return value

            xb, yb = next(iter(mine()))
            step(xb, yb)
            comm = kept["comm"]
            wire = collectives_in(step.get_concrete_function(xb, yb).graph)
            out["tape_traffic"][name] = {
                "reduced": comm.reduced,
                "gathered": comm.gathered,
                "sent": comm.traffic(
                    dense=sum(nbytes(tuple(v.shape), "float32") for v in model.trainable_variables)
                ).sent,
                "wire": wire,
                "wire_bytes": sum(nbytes(shape, dtype) for _, shape, dtype in wire),
            }
            if hasattr(hvd, "tape_traffic"):  # The tape's step_traffic.
                out["tape_traffic"][name]["counted"] = hvd.tape_traffic(
                    model.trainable_variables, compression=settings[name]
                ).sent

        # 4. MetricAverageCallback: the logged loss is the ranks' mean.
        if callbacks is not None and hasattr(callbacks, "MetricAverageCallback"):
            logged = []
            for average in (False, True):
                model = model_()
                model.compile(optimizer=hvd.DistributedOptimizer(optimizers["sgd"]()), loss=loss)
                cbs = [callbacks.MetricAverageCallback()] if average else []
                history = model.fit(mine(), epochs=1, verbose=0, callbacks=cbs)
                logged.append(float(history.history["loss"][-1]))
            out["metric_average"] = {"own": logged[0], "logged": logged[1]}

    else:
        # 1. Gradients, MultiWorkerMirrored side: same model, same halves.
        out["strategy"] = repr(strategy)

        def halves(ctx):
            assert ctx.get_per_replica_batch_size(batch) == batch // size
            return _rank_dataset(tf, x, y, batch, ctx.input_pipeline_id, size)

        for name, make in optimizers.items():
            with strategy.scope():
                model = model_()
                model.compile(optimizer=make(), loss=loss)
            model.fit(
                strategy.distribute_datasets_from_function(halves),
                epochs=1,
                steps_per_epoch=steps,
                verbose=0,
            )
            weights[f"mwms_fit_{name}"] = model.get_weights()
            if name == "sgd":
                out["fit_collectives"] = {
                    "mwms": fit_step_collectives(
                        model, next(iter(strategy.distribute_datasets_from_function(halves)))
                    )
                }

        with strategy.scope():
            model, opt = model_(), optimizers["adam"]()
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        @tf.function
        def mwms_step(iterator):
            def step(xb, yb):
                with tf.GradientTape() as tape:
                    value = tf.nn.compute_average_loss(
                        per_example(yb, model(xb, training=True)), global_batch_size=batch
                    )
                grads = tape.gradient(value, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return value

            return strategy.run(step, args=next(iterator))

        iterator = iter(strategy.distribute_datasets_from_function(halves))
        for _ in range(steps):
            mwms_step(iterator)
        weights["mwms_tape_adam"] = model.get_weights()

    np.savez(
        Path(FLAGS.out).with_suffix(".weights.npz"),
        **{f"{k}_{i}": a for k, ws in weights.items() for i, a in enumerate(ws)},
    )
    Path(FLAGS.out).write_text(json.dumps(out))


def _load_arrays(path: Path, prefix: str) -> list:
    import numpy as np

    with np.load(path) as data:
        keys = sorted(
            (k for k in data.files if k.startswith(prefix + "_")),
            key=lambda k: int(k.rsplit("_", 1)[1]),
        )
        return [data[k] for k in keys]


def numbers(work: Path) -> dict:
    """Runs the numbers job and turns both ranks' reports into rows."""
    from tfdist.compression.traffic import all_reduce_bytes

    sides = {}
    for side in ("hvd", "mwms"):
        (work / side).mkdir()
        sides[side] = run_job(
            ["--mode=numbers_worker", f"--side={side}", f"--check_steps={FLAGS.check_steps}"],
            work / side,
            timeout=FLAGS.job_timeout,
        )
    ranks = []
    for i, (h, m) in enumerate(zip(sides["hvd"], sides["mwms"])):
        assert h["rank"] == m["rank"] == i and h["size"] == m["size"], (h, m)
        hw, mw = work / "hvd" / f"rank{i}.weights.npz", work / "mwms" / f"rank{i}.weights.npz"

        def diff(a, pa, b, pb):
            return max_abs_diff(_load_arrays(pa, a), _load_arrays(pb, b))

        opts = ("sgd", "adam")
        ranks.append(
            {
                **h,
                "strategy": m["strategy"],
                "fit_collectives": {**h["fit_collectives"], **m["fit_collectives"]},
                "diff": {
                    **{f"fit_{n}": diff(f"hvd_fit_{n}", hw, f"mwms_fit_{n}", mw) for n in opts},
                    "tape_adam": diff("hvd_tape_adam", hw, "mwms_tape_adam", mw),
                    **{
                        f"alone_fit_{n}": diff(f"alone_fit_{n}", hw, f"mwms_fit_{n}", mw)
                        for n in opts
                    },
                    **{f"moved_fit_{n}": diff("init", hw, f"mwms_fit_{n}", mw) for n in opts},
                },
            }
        )
    r0 = ranks[0]
    rows, notes = [], []

    def add(check, measured, goal, ok):
        rows.append({"check": check, "measured": measured, "goal": goal, "ok": bool(ok)})

    worst = {k: max(r["diff"][k] for r in ranks) for k in r0["diff"]}
    for key, label in (
        ("fit_sgd", "`model.fit`, SGD (momentum 0.9)"),
        ("fit_adam", "`model.fit`, Adam"),
        ("tape_adam", "`DistributedGradientTape` loop, Adam"),
    ):
        add(
            f"gradients: {label}, hvd vs MWMS, max abs weight diff (both ranks)",
            f"{worst[key]:.2e}",
            f"≤ {TOLERANCE:g}",
            worst[key] <= TOLERANCE,
        )
    for name in ("sgd", "adam"):
        add(
            f"control ({name}): one rank alone on its half vs MWMS",
            f"{worst[f'alone_fit_{name}']:.2e} (weights moved {worst[f'moved_fit_{name}']:.2e} "
            "from init)",
            "≫ 1e-5 (the check can fail)",
            worst[f"alone_fit_{name}"] > 100 * TOLERANCE,
        )
    # Both ranks end identical.
    w = [work / "hvd" / f"rank{i}.weights.npz" for i in range(2)]
    for key in ("hvd_fit_sgd", "hvd_fit_adam", "hvd_tape_adam"):
        d = max_abs_diff(_load_arrays(w[0], key), _load_arrays(w[1], key))
        add(f"ranks agree: `{key}`, rank 0 vs rank 1", f"{d:.2e}", "0", d == 0.0)

    b = [work / "hvd" / f"rank{i}.bcast.npz" for i in range(2)]
    before = max_abs_diff(_load_arrays(b[0], "before"), _load_arrays(b[1], "before"))
    after = max_abs_diff(_load_arrays(b[0], "after"), _load_arrays(b[1], "after"))
    root = max_abs_diff(_load_arrays(b[0], "before"), _load_arrays(b[1], "after"))
    add(
        f"broadcast: `hvd.broadcast_variables` of model + Adam variables "
        f"({r0['broadcast']['variables']}), rank 0 vs 1, before → after",
        f"{before:.2e} → {after:.2e} (rank 1 vs root's before: {root:.2e})",
        "> 0 → 0",
        before > 0 and after == 0.0 and root == 0.0,
    )
    cb = work / "hvd" / "rank0.bcast_cb.npz"
    if cb.exists():
        c = [work / "hvd" / f"rank{i}.bcast_cb.npz" for i in range(2)]
        before = max_abs_diff(_load_arrays(c[0], "before"), _load_arrays(c[1], "before"))
        after = max_abs_diff(_load_arrays(c[0], "after"), _load_arrays(c[1], "after"))
        add(
            "broadcast: `BroadcastGlobalVariablesCallback(0)` in a 1-step fit, rank 0 vs 1",
            f"{before:.2e} → {after:.2e}",
            "> 0 → 0",
            before > 0 and after == 0.0,
        )
    else:
        notes.append(
            "`BroadcastGlobalVariablesCallback` and `MetricAverageCallback`: "
            "`tfdist.horovod.callbacks` is not on this branch; "
            "`hvd.broadcast_variables` (what the callback calls) is measured instead, "
            "and the metric average is not measured."
        )

    t = {
        name: max((r["traffic"][name] for r in ranks), key=lambda row: row["sent"])
        for name in r0["traffic"]
    }
    none, fp16, psgd = t["none"], t["fp16"], t["powersgd"]
    add(
        "bytes: `step_traffic`, Compression.none, sent per rank per step",
        f"{none['sent']:,.0f} B ({none['replicas']} replicas)",
        "= dense fp32 all-reduce",
        none["sent"] == none["dense_sent"] and none["replicas"] == 2,
    )
    ratio = none["sent"] / fp16["sent"] if fp16["sent"] else float("inf")
    add(
        "bytes: `step_traffic`, Compression.fp16, sent per rank per step",
        f"{fp16['sent']:,.0f} B; none / fp16 = {ratio:.3f}",
        "ratio 2",
        ratio == 2.0,
    )
    for name, row in (("none", none), ("fp16", fp16)):
        kinds = sorted({f"{op} {dtype}" for op, _, dtype in row["wire"]})
        add(
            f"bytes: collectives in the traced fit step ({name}): all-reduce sent per rank",
            f"{len(row['wire'])} collective(s), {', '.join(kinds)}, payload "
            f"{row['wire_bytes']:,} B → {all_reduce_bytes(row['wire_bytes'], 2):,.0f} B",
            "= step_traffic",
            all_reduce_bytes(row["wire_bytes"], 2) == row["sent"],
        )
        comm = row["comm"]
        if comm is not None:
            add(
                f"bytes: the optimizer's Comm record ({name})",
                f"{len(comm['reduced'])} tensors, {'/'.join(comm['dtypes'])}, "
                f"{comm['all_reduce_sent']:,.0f} B sent",
                "= step_traffic",
                comm["all_reduce_sent"] == row["sent"] and not comm["gathered"],
            )
    wire_ratio = none["wire_bytes"] / fp16["wire_bytes"] if fp16["wire_bytes"] else 0.0
    add(
        "bytes: traced fit step, none / fp16 payload; fp16 carries only float16",
        f"{wire_ratio:.3f}; fp16 dtypes {sorted({d for _, _, d in fp16['wire']})}",
        "2; ['float16']",
        wire_ratio == 2.0 and {d for _, _, d in fp16["wire"]} == {"float16"},
    )
    if none["comm"] is None:
        notes.append(
            "`hvd.DistributedOptimizer` keeps no record of its Comm (the tape keeps "
            "one); what its step sent is read from the collectives of its "
            "traced `train_step` instead, and the Comm record from the tape below."
        )
    tape = {
        name: max((r["tape_traffic"][name] for r in ranks), key=lambda row: row["sent"])
        for name in r0["tape_traffic"]
    }
    for name in ("none", "fp16"):
        row = tape[name]
        dtypes = sorted({d for _, d in row["reduced"]})
        add(
            f"bytes: `DistributedGradientTape(compression={name})`, its Comm record vs "
            "the traced collectives",
            f"{len(row['reduced'])} tensors {'/'.join(dtypes)}, {row['sent']:,.0f} B sent; "
            f"collectives: {all_reduce_bytes(row['wire_bytes'], 2):,.0f} B",
            "equal",
            row["sent"] == all_reduce_bytes(row["wire_bytes"], 2) and not row["gathered"],
        )
        if "counted" in row:
            add(
                f"bytes: `hvd.tape_traffic` ({name}) vs the tape's Comm record",
                f"{row['counted']:,.0f} B vs {row['sent']:,.0f} B",
                "equal",
                row["counted"] == row["sent"],
            )
    tape_ratio = tape["none"]["sent"] / tape["fp16"]["sent"] if tape["fp16"]["sent"] else 0.0
    add("bytes: tape none / fp16", f"{tape_ratio:.3f}", "2", tape_ratio == 2.0)
    add(
        "bytes: PowerSGD (rank 2, 1 warm-up step) through `hvd.DistributedOptimizer`, "
        "`step_traffic` at step 3",
        f"{psgd['sent']:,.0f} B; {psgd['ratio']:.2f}x fewer than dense",
        "< dense",
        psgd["sent"] < psgd["dense_sent"],
    )
    add(
        "PowerSGD error feedback: state variables on the optimizer, non-zero after 3 steps",
        f"{', '.join(psgd['state'])}; {psgd['residual_tensors']} residuals, "
        f"sum |residual| = {psgd['residual_abs_sum']:.3g}",
        "residual present, ≠ 0",
        "residual" in psgd["state"] and psgd["residual_abs_sum"] > 0,
    )
    if psgd["comm"]:
        notes.append(
            "PowerSGD's recorded collectives include both branches of its warm-up "
            "`cond` (both are traced), so they over-count a step: "
            f"{len(psgd['comm']['reduced'])} all-reduced tensors recorded; "
            "`step_traffic` counts the branch the step took."
        )

    fc = r0["fit_collectives"]
    add(
        "collectives per `fit` step (traced as Keras builds it): hvd vs MWMS",
        "; ".join(
            f"{arm}: {len(ops)} ({', '.join(f'{t} {list(sh)} {d}' for t, sh, d in ops)})"
            for arm, ops in fc.items()
        ),
        "(profile)",
        True,
    )

    if "metric_average" in r0:
        own = [r["metric_average"]["own"] for r in ranks]
        logged = [r["metric_average"]["logged"] for r in ranks]
        mean = sum(own) / len(own)
        # The ranks' own losses differ, so logging either one would fail.
        ok = (
            all(abs(v - mean) <= 1e-6 * max(1.0, abs(mean)) for v in logged)
            and abs(own[0] - own[1]) > 1e-4
        )
        add(
            "`MetricAverageCallback`: logged epoch loss vs mean of the ranks' own",
            f"own {own[0]:.6f} / {own[1]:.6f}, mean {mean:.6f}; logged "
            f"{logged[0]:.6f} / {logged[1]:.6f}",
            "logged = mean on every rank",
            ok,
        )

    h = CHECK_HIDDEN
    return {
        "meta": {
            "hidden": h,
            "params": _params(h),
            "global_batch": CHECK_BATCH,
            "steps": FLAGS.check_steps,
            "tf": r0["tf"],
            "keras": r0["keras"],
            "strategy": r0["strategy"],
        },
        "rows": rows,
        "notes": notes,
        "ranks": ranks,
    }


# ---------------------------------------------------------------- overhead


def overhead_worker() -> None:
    """One rank of an overhead run: ``fit`` through one arm, step times."""
    if FLAGS.arm.startswith("hvd"):
        import tfdist.horovod as hvd

        hvd.init()
    import keras
    import tensorflow as tf

    import tfdist

    size = 2
    batch = FLAGS.global_batch
    total = FLAGS.warmup_steps + FLAGS.steps
    x, y = overhead._data(total * batch)
    make = lambda: keras.optimizers.SGD(0.01, momentum=0.9)  # noqa: E731
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if FLAGS.arm.startswith("hvd"):
        data = _rank_dataset(tf, x, y, batch, hvd.rank(), size)
        model = _mlp(keras, FLAGS.hidden, seed=1)
        if FLAGS.arm == "hvd_logs":
            step = model.train_step

            def train_step(data):
                # What fit does under MultiWorkerMirrored: the logs' mean over ranks.
                return {k: hvd.allreduce(v) for k, v in step(data).items()}

            model.train_step = train_step
        model.compile(optimizer=hvd.DistributedOptimizer(make()), loss=loss)
    else:
        strategy = tfdist.strategy_from_config(register_timeout=120)
        data = strategy.distribute_datasets_from_function(
            lambda ctx: _rank_dataset(tf, x, y, batch, ctx.input_pipeline_id, size)
        )
        with strategy.scope():
            model = _mlp(keras, FLAGS.hidden, seed=1)
            model.compile(optimizer=make(), loss=loss)
    times: list[float] = []

    model.fit(data, epochs=1, steps_per_epoch=total, verbose=0, callbacks=[step_timer(times)])
    Path(FLAGS.out).write_text(json.dumps({"times": times[FLAGS.warmup_steps :]}))


def bench_overhead(work: Path) -> dict:
    """Interleaved 2-process jobs, one arm per job (as overhead.py's workers mode)."""
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}
    load_before = overhead._load()
    loads = []
    for i in range(FLAGS.pairs):
        for arm in round_order(i):
            ranks = run_job(
                [
                    "--mode=overhead_worker",
                    f"--arm={arm}",
                    f"--steps={FLAGS.steps}",
                    f"--warmup_steps={FLAGS.warmup_steps}",
                    f"--global_batch={FLAGS.global_batch}",
                    f"--hidden={FLAGS.hidden}",
                ],
                work,
            )
            medians[arm].append(statistics.median(ranks[0]["times"]))
            loads.append(overhead._load())
            print(
                f"overhead round {i} {arm}: {medians[arm][-1] * 1e3:.2f} ms (load {loads[-1]:.1f})",
                flush=True,
            )
    return {
        "meta": {
            "pairs": FLAGS.pairs,
            "steps": FLAGS.steps,
            "warmup_steps": FLAGS.warmup_steps,
            "global_batch": FLAGS.global_batch,
            "hidden": FLAGS.hidden,
            "params": _params(FLAGS.hidden),
            "load_before": load_before,
            "load_after": overhead._load(),
            "loads": loads,
        },
        **{f"{arm}_s": medians[arm] for arm in ARMS},
        "ratios": {
            arm: overhead.pair_ratios(medians[arm], medians["mwms"]) for arm in ("hvd", "hvd_logs")
        },
        "median_ratio": {
            arm: overhead.median_ratio(medians[arm], medians["mwms"]) for arm in ("hvd", "hvd_logs")
        },
        "notes": [],
    }


def _code() -> str:
    """The commit measured, and whether hvd.callbacks was there."""
    head = results_lib.commit()
    callbacks = (REPO / "tfdist" / "horovod" / "callbacks.py").exists()
    return f"{head}; tfdist.horovod.callbacks {'present' if callbacks else 'absent'}"


def main(argv) -> None:
    del argv
    sys.path.insert(0, str(REPO))
    if FLAGS.mode == "numbers_worker":
        numbers_worker()
        return
    if FLAGS.mode == "overhead_worker":
        overhead_worker()
        return
    results_dir = Path(FLAGS.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    command = (
        "python benchmarks/horovod_shim.py"
        + (f" --mode={FLAGS.mode}" if FLAGS.mode != "all" else "")
        + (f" --pairs={FLAGS.pairs}" if FLAGS.pairs != 8 else "")
    )
    results: dict = {
        "meta": {
            "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "cpus": os.cpu_count(),
            "command": command,
            "code": _code(),
            "load_before": overhead._load(),
        }
    }
    with tempfile.TemporaryDirectory(prefix="hvd_shim_") as tmp:
        if FLAGS.mode in ("all", "numbers"):
            results["numbers"] = numbers(Path(tmp))
        if FLAGS.mode in ("all", "overhead"):
            results["overhead"] = bench_overhead(Path(tmp))
    results["meta"]["load_after"] = overhead._load()
    (results_dir / f"{FLAGS.name}.json").write_text(json.dumps(results, indent=1))
    (results_dir / f"{FLAGS.name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
