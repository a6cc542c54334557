"""The straggler rule on per-worker summaries (pure Python)."""

from __future__ import annotations

import statistics

import pytest

from tfdist.errors import ConfigError
from tfdist.profiling.records import Span, StepRecord, mean_phases
from tfdist.profiling.stragglers import check_factor, find_stragglers


def _step(worker, step, busy, wait):
    """A step of ``busy`` seconds of compute then ``wait`` seconds of waiting."""
    t0 = 1000.0 + step
    return StepRecord(
        worker,
        step,
        0,
        t0,
        t0,
        t0 + busy,
        t0 + busy + wait,
        t0 + busy + wait + 0.001,
        t0 + busy + wait + 0.001,
        t0 + busy + wait + 0.001,
        [Span("all_reduce", t0 + busy + wait, t0 + busy + wait + 0.001, 8.0)],
    )


def _summary(busy_by_worker):
    slowest = max(busy_by_worker.values())
    records = [_step(w, s, b, slowest - b) for w, b in busy_by_worker.items() for s in range(4)]
    return mean_phases(records)


def test_the_slow_worker_is_named_with_its_figures():
    summary = _summary({0: 0.02, 1: 0.20, 2: 0.021, 3: 0.019})
    found = find_stragglers(summary, 1.3)
    assert [s.worker for s in found] == [1]
    s = found[0]
    busy = [summary[w]["busy"] for w in summary]
    assert s.median == pytest.approx(statistics.median(busy))
    assert s.factor == pytest.approx(summary[1]["busy"] / s.median)
    # The others waited for it about the difference of busy times.
    assert s.peers_wait == pytest.approx(statistics.fmean(summary[w]["wait"] for w in (0, 2, 3)))
    text = str(s)
    assert "worker 1 is a straggler" in text and f"{s.busy * 1e3:.1f} ms" in text


def test_two_workers_one_slow_is_found_at_the_default_factor():
    # With two workers the median is their mean, so a worker twice as busy
    # stands at 1.33x of it.
    found = find_stragglers(_summary({0: 0.05, 1: 0.10}), 1.3)
    assert [s.worker for s in found] == [1]


def test_even_workers_and_a_single_worker_name_no_one():
    assert find_stragglers(_summary({0: 0.05, 1: 0.055, 2: 0.05}), 1.3) == []
    assert find_stragglers(_summary({0: 0.5}), 1.3) == []


@pytest.mark.parametrize("bad", [1.0, 0, -2, "x", None, True, float("nan")])
def test_check_factor_names_the_field(bad):
    with pytest.raises(ConfigError, match="straggler_factor"):
        check_factor(bad)
    assert check_factor("1.5") == 1.5
