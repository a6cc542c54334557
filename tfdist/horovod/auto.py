"""``compression="auto"`` between Horovod's ranks: measure the link once, then
reduce with the aggregator it chose, as :mod:`tfdist.compression.auto` does
under a strategy."""

from __future__ import annotations

import statistics
import time

import tensorflow as tf

from tfdist.compression import auto
from tfdist.compression.aggregate import CompressorAggregator
from tfdist.compression.identity import NoneCompressor as Identity
from tfdist.horovod import collectives, runtime
from tfdist.transport.traffic import all_reduce_bytes

__all__ = ["measure_link", "resolved"]


def measure_link(repeats: int = 3):
    """Times all-reduces between the ranks, as ``compression="auto"`` does
    under a strategy (:func:`tfdist.compression.auto.measure_link`): every
    rank calls it at the same point, eagerly; all get the slowest rank's
    figures."""

    def seconds(entries: int) -> float:
        x = tf.ones([entries], tf.float32)
        times = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            collectives.sum_dense([x])[0].numpy()
            if i:  # The first call sets the group up.
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    small, large = auto.SMALL_PROBE, auto.LARGE_PROBE
    small_s, large_s = seconds(small), seconds(large)
    seconds(small)  # Line the ranks up again before timing compute.
    scale = auto.reference_pass() / auto.REFERENCE_PASS_S_PER_ENTRY
    rows = collectives.gather_rows(tf.constant([[small_s, large_s, scale]], tf.float64))
    small_s, large_s, scale = (float(v) for v in tf.reduce_max(rows, axis=0).numpy())
    n = runtime.size()
    sent = all_reduce_bytes(4 * large, n) - all_reduce_bytes(4 * small, n)
    bandwidth = sent / max(large_s - small_s, sent / 1e12)
    return auto.LinkEstimate(
        bandwidth=bandwidth,
        latency=small_s,
        num_replicas=n,
        compute_scale=min(max(scale, 0.1), 100.0),
    )


class _Ranks:
    """What AutoCompression.resolve reads of a strategy: the replica count."""

    def __init__(self, n: int):
        self.num_replicas_in_sync = n


def resolved(aggregator, variables: list):
    """The aggregator to reduce with: ``"auto"`` chooses (once, measuring the
    link eagerly between the ranks) and may choose plain all-reduce."""
    if not hasattr(aggregator, "resolve"):
        return aggregator
    if not aggregator.resolved:
        with tf.init_scope():  # A custom loop builds inside its tf.function.
            if aggregator.link is None and runtime.size() > 1:
                aggregator.link = measure_link(aggregator.repeats)
            aggregator.resolve(_Ranks(runtime.size()), variables)
    return CompressorAggregator(Identity()) if aggregator.passthrough else aggregator
