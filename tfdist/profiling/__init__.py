"""Where a distributed step's time goes: per-step phases, a timeline, stragglers.

* :class:`StepProfile` (a Keras callback) measures every step of every
  worker inside the step (:mod:`~tfdist.profiling.instrument`), gathers the
  records to the chief each epoch, and reports the phases in the logs and in
  TensorBoard, names stragglers and compressors that do not pay, and writes
  the timeline (:mod:`~tfdist.profiling.timeline`).
* :class:`StepRecord` and :func:`phases` (:mod:`~tfdist.profiling.records`)
  are the measured instants and what they mean, without TensorFlow.

``TFDIST_TIMELINE=path`` (or ``tfdist launch --timeline path``) turns the
profiler on for every ``fit`` under a tfdist strategy.

It sits above the Keras integration: it imports training, parallel, the
strategies, compression and the spec layer, never horovod, the engines or the
CLI.
"""

from tfdist.profiling.records import PHASES, Span, StepRecord, mean_phases, phases

__all__ = ["PHASES", "Span", "StepRecord", "mean_phases", "phases", "StepProfile", "LoopProfile"]


def __getattr__(name):
    # The callbacks import TensorFlow and Keras; the records do not.
    if name in ("StepProfile", "LoopProfile"):
        from tfdist.profiling import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'tfdist.profiling' has no attribute {name!r}")
