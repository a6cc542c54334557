"""Where a distributed step's time goes: per-step phases, a timeline, stragglers.

See :mod:`tfdist.profiling.records` for what is measured.
"""

from tfdist.profiling.records import PHASES, Span, StepRecord, mean_phases, phases

__all__ = ["PHASES", "Span", "StepRecord", "mean_phases", "phases"]
