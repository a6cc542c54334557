"""tfdist.record: one typed record per strategy, one slot per kind on other objects,
and the ``_tfdist_`` attribute names left outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tfdist import record
from tfdist.record import StrategyRecord, attach, detach, record_of, slot

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\b_tfdist_\w+")

#: ``_tfdist_`` names that stay, and why.
KEPT = {
    # Set on tfdist.horovod's own optimizer subclass, where Keras tracks it:
    # tf.train.Checkpoint keys the variable by this name
    # ("optimizer/_tfdist_hvd_count/.ATTRIBUTES/VARIABLE_VALUE"), so renaming
    # it would make the checkpoints saved before unreadable.
    "_tfdist_hvd_count": {"tfdist/horovod/optimizer.py"},
}


def _names_in_source() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tfdist").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "tfdist/record.py" or relative.startswith("tfdist/compat/"):
            continue
        for name in NAME.findall(path.read_text()):
            found.setdefault(name, set()).add(relative)
    return found


def test_no_new_tfdist_attribute_is_spelt_outside_the_record():
    found = _names_in_source()
    listed = KEPT
    new = {name: files - listed.get(name, set()) for name, files in found.items()}
    new = {name: files for name, files in new.items() if files}
    assert not new, f"keep these in a record (tfdist.record.attach/record_of): {new}"
    moved = {
        name: sorted(files - found.get(name, set()))
        for name, files in listed.items()
        if files - found.get(name, set())
    }
    assert not moved, f"no longer in these files; drop them from KEPT: {moved}"


def test_the_strategy_fields_have_no_attribute_of_their_own():
    # What tfdist used to set on a strategy, one attribute each.
    fields = {f"_tfdist_{field}" for field in StrategyRecord.__dataclass_fields__}
    fields |= {"_tfdist_parallel", "_tfdist_profiler", "_tfdist_init", "_tfdist_attach"}
    assert not fields & set(_names_in_source())


class Plain:
    pass


def test_a_strategy_record_is_made_once_and_kept():
    holder = Plain()
    first = record_of(holder)
    assert first == StrategyRecord() and first.model_parallel == 1
    first.choice = "chosen"
    assert record_of(holder) is first and record_of(Plain()) is not first
    assert list(vars(holder)) == [record.ATTRIBUTE]


def test_slots_hold_one_record_per_kind_and_copies_do_not_share_later_ones():
    class Mark:
        pass

    holder = Plain()
    assert slot(holder, Mark) is None
    mark = attach(holder, Mark())
    twin = Plain()
    twin.__dict__.update(holder.__dict__)  # As tfdist.horovod builds its tapes.
    later = attach(twin, "text", kind=str)
    assert slot(twin, Mark) is mark and slot(twin, str) is later
    assert slot(holder, str) is None, "a record attached to the copy reached the original"
    detach(holder, Mark)
    assert slot(holder, Mark) is None and slot(twin, Mark) is mark
    detach(holder, Mark)  # Twice: nothing to drop.
    assert slot(None, Mark) is None and slot(3, Mark) is None  # No __dict__: nothing kept.


def test_a_record_on_a_keras_object_is_not_tracked_by_keras(keras_mod):
    keras = keras_mod
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    extra = keras.Variable([1.0], name="not_a_weight")
    attach(layer, [extra], kind=list)
    assert slot(layer, list) == [extra]
    assert extra.path not in [w.path for w in layer.weights]


def test_the_concrete_parts_fit_the_protocols():
    pytest.importorskip("tensorflow")
    from tfdist.compression import make_aggregator
    from tfdist.compression.aggregate import CompressorAggregator
    from tfdist.profiling.instrument import Profiler
    from tfdist.transport.mpi import MpiTransport

    assert isinstance(make_aggregator("topk:0.1"), record.Aggregator)
    assert issubclass(CompressorAggregator, record.Aggregator)
    assert issubclass(MpiTransport, record.Transport)
    assert issubclass(Profiler, record.Observer)
    assert not isinstance(object(), record.Aggregator)


def test_a_built_strategy_carries_only_its_record(tf_cpus):
    import tfdist

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="bf16", model_parallel=2)
    kept = record_of(strategy)
    assert str(kept.compression) == "bf16" and strategy.compression is kept.compression
    assert kept.choice is strategy.choice and kept.choice.name == "mirrored"
    assert isinstance(kept.aggregator, record.Aggregator)
    assert "BF16" in kept.aggregator.describe()
    assert isinstance(kept.mesh, record.MeshRuntime) and strategy.model_parallel == 2
    assert kept.transport is None and kept.observer is None
    assert [k for k in vars(strategy) if "tfdist" in k] == [record.ATTRIBUTE]
