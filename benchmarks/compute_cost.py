"""Calibrates the compute cost per gradient entry that ``compression="auto"`` uses.

Times each candidate aggregator's own work (compress, decompress, error
feedback, PowerSGD's matrix products and QR) on one replica
(:class:`~tfdist.transport.comm.LocalComm`: the collectives are
identities), for the gradients of an MLP, and prints the extra seconds per
float32 gradient entry over the uncompressed aggregation. The constants in
:data:`tfdist.compression.auto.COMPUTE_S_PER_ENTRY` came from this script
(one intra-op thread, as a worker gets on a shared 2-core machine), and so
did :data:`~tfdist.compression.auto.REFERENCE_PASS_S_PER_ENTRY`, the pass
``auto`` times at run time to scale them to the machine it runs on.

Usage::

    python benchmarks/compute_cost.py                 # the 5.8M-parameter MLP
    python benchmarks/compute_cost.py --layers=64,1024,1024,10
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
CANDIDATES = ["none", "bf16", "fp16", "topk:0.01", "powersgd:1", "powersgd:4", "powersgd:8"]


def define_flags() -> None:
    flags.DEFINE_list("layers", ["256", "2048", "2048", "512", "10"], "MLP layer widths.")
    flags.DEFINE_list("candidates", CANDIDATES, "Settings to time.")
    flags.DEFINE_integer("repeats", 7, "Timed calls per setting (median taken).")
    flags.DEFINE_integer("threads", 1, "Intra-op threads (0: TensorFlow's default).")


def mlp_shapes(widths: list[int]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of the kernels and biases of an MLP with these widths."""
    shapes = []
    for a, b in zip(widths[:-1], widths[1:]):
        shapes += [((a, b), "float32"), ((b,), "float32")]
    return shapes


def time_aggregate(setting: str, shapes, repeats: int) -> float:
    """Median seconds of one aggregation of gradients of ``shapes`` on one replica."""
    import tensorflow as tf

    from tfdist.compression import PowerSGD, make_aggregator
    from tfdist.compression.aggregate import Item
    from tfdist.transport.comm import LocalComm

    if setting.startswith("powersgd"):
        rank = int(setting.partition(":")[2] or 4)
        aggregator = PowerSGD(rank, warmup_steps=0)
    else:
        aggregator = make_aggregator(setting)
    grads = [tf.random.normal(s) for s, _ in shapes]
    states = []
    for i, (shape, dtype) in enumerate(shapes):
        states.append(
            {
                spec.name: tf.Variable(
                    spec.initializer(spec.shape, spec.dtype)
                    if callable(spec.initializer)
                    else tf.zeros(spec.shape, spec.dtype)
                )
                for spec in aggregator.state_specs(shape, dtype, i)
            }
        )

    @tf.function
    def run(step):
        items = [Item(g, i, s) for i, (g, s) in enumerate(zip(grads, states))]
        out = aggregator.aggregate(items, step, LocalComm())
        return tf.add_n([tf.reduce_sum(o) for o in out])

    run(tf.constant(100, tf.int64)).numpy()  # Trace.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(tf.constant(100, tf.int64)).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv) -> None:
    del argv
    import tensorflow as tf

    if FLAGS.threads:
        tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    shapes = mlp_shapes([int(w) for w in FLAGS.layers])
    entries = sum(max(1, len(s) and __import__("math").prod(s)) for s, _ in shapes)
    from tfdist.compression.auto import reference_pass

    # The reference pass is timed next to every setting: on a loaded machine
    # both slow down alike, and their ratio is what auto uses.
    references = [reference_pass(repeats=FLAGS.repeats)]
    base = time_aggregate("none", shapes, FLAGS.repeats)
    rows = {}
    for setting in FLAGS.candidates:
        t = base if setting == "none" else time_aggregate(setting, shapes, FLAGS.repeats)
        references.append(reference_pass(repeats=FLAGS.repeats))
        reference = statistics.median(references[-2:])
        extra = (t - base) / entries
        rows[setting] = {
            "seconds": t,
            "extra_s_per_entry": extra,
            "reference_s_per_entry": reference,
            "relative_to_reference": extra / reference,
        }
        print(
            f"{setting:>12}: {t * 1e3:8.2f} ms  extra {extra:.3e} s per entry  "
            f"= {extra / reference:6.2f} x the reference pass ({reference:.2e})",
            flush=True,
        )
    print(json.dumps({"entries": entries, "rows": rows}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
