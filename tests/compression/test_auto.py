"""compression="auto": the decision (pure) and a fit on 2 logical CPUs."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tfdist
from tfdist.compression import parse_compression
from tfdist.compression.traffic import all_reduce_bytes
from tfdist.record import record_of

#: The slow-network benchmark's MLP, 256-2048-2048-512-10 (5.8M parameters).
MLP = [
    ((256, 2048), "float32"),
    ((2048,), "float32"),
    ((2048, 2048), "float32"),
    ((2048,), "float32"),
    ((2048, 512), "float32"),
    ((512,), "float32"),
    ((512, 10), "float32"),
    ((10,), "float32"),
]
MBIT = 1e6 / 8  # bytes per second


@pytest.fixture(scope="module")
def auto():
    from tfdist.compression import auto as module

    return module


def link(auto, mbit_per_s, latency=1e-3, n=2):
    return auto.LinkEstimate(bandwidth=mbit_per_s * MBIT, latency=latency, num_replicas=n)


def test_slow_link_big_model_picks_powersgd(auto):
    decision = auto.choose(link(auto, 50), MLP)  # 100 Mbit/s shared by 2 workers
    assert decision.choice == "powersgd:4"
    assert decision.costs["powersgd:4"] < decision.costs["bf16"] < decision.costs["none"]
    assert decision.entries == sum(math.prod(s) for s, _ in MLP)


def test_very_fast_link_picks_none(auto):
    decision = auto.choose(link(auto, 1e6, latency=1e-5), MLP)  # 1 Tbit/s
    assert decision.choice == "none"


def test_one_replica_picks_none_without_a_link(auto):
    assert auto.choose(None, MLP).choice == "none"
    assert auto.choose(link(auto, 1, n=1), MLP).choice == "none"


def test_no_float_gradients_picks_none(auto):
    assert auto.choose(link(auto, 1), [((100,), "int32")]).choice == "none"


def test_candidates_restrict_the_choice(auto):
    decision = auto.choose(link(auto, 50), MLP, candidates=("bf16",))
    assert decision.choice == "bf16"
    assert set(decision.costs) == {"none", "bf16"}  # none is always a candidate


def test_vectors_cannot_use_powersgd(auto):
    # PowerSGD sends 1-D gradients dense, so it saves nothing on them.
    decision = auto.choose(
        link(auto, 50), [((4_000_000,), "float32")], candidates=("none", "bf16", "powersgd:4")
    )
    assert decision.choice == "bf16"
    assert decision.costs["powersgd:4"] > decision.costs["bf16"]


def test_cost_is_the_traffic_formula_over_the_bandwidth(auto):
    one = link(auto, 80, latency=0.0)
    costs = auto.predict_costs(one, MLP, ("none", "bf16"))
    dense = 4 * sum(math.prod(s) for s, _ in MLP)
    assert costs["none"] == pytest.approx(all_reduce_bytes(dense, 2) / (80 * MBIT))
    entries = dense // 4
    bf16 = (
        all_reduce_bytes(dense // 2, 2) / (80 * MBIT) + auto.COMPUTE_S_PER_ENTRY["bf16"] * entries
    )
    assert costs["bf16"] == pytest.approx(bf16)


def test_latency_counts_per_collective(auto):
    slow_calls = auto.predict_costs(link(auto, 1e6, latency=1.0), MLP, ("none", "powersgd:4"))
    # One all-reduce for none; two rounds for PowerSGD, times its step factor.
    assert slow_calls["none"] == pytest.approx(1.0, rel=1e-3)
    assert slow_calls["powersgd:4"] == pytest.approx(2.0 * auto.STEP_FACTOR["powersgd"], rel=1e-2)


def test_more_workers_make_all_gather_dearer(auto):
    two = auto.predict_costs(link(auto, 50, n=2), MLP, ("topk:0.01",))["topk:0.01"]
    eight = auto.predict_costs(link(auto, 50, n=8), MLP, ("topk:0.01",))["topk:0.01"]
    assert eight > two


def test_a_slow_cpu_makes_compression_dearer(auto):
    import dataclasses

    fast = link(auto, 2000, latency=1e-4)
    assert auto.choose(fast, MLP).choice == "powersgd:4"
    slow_cpu = dataclasses.replace(fast, compute_scale=50.0)
    costs = auto.predict_costs(slow_cpu, MLP, ("none", "powersgd:4"))
    base = auto.predict_costs(fast, MLP, ("none", "powersgd:4"))
    assert costs["none"] == base["none"]  # nothing to compute
    assert costs["powersgd:4"] > base["powersgd:4"]
    assert auto.choose(slow_cpu, MLP).choice == "none"
    with pytest.raises(tfdist.ConfigError):
        dataclasses.replace(fast, compute_scale=0.0)


def test_a_small_gain_is_not_worth_compressing(auto):
    # Make bf16 1% cheaper than none: below MIN_GAIN, none stays.
    entries = sum(math.prod(s) for s, _ in MLP)
    bw = 1000 * MBIT
    none_cost = all_reduce_bytes(4 * entries, 2) / bw
    per_entry = (0.99 * none_cost - all_reduce_bytes(2 * entries, 2) / bw) / entries
    decision = auto.choose(
        link(auto, 1000, latency=0.0),
        MLP,
        candidates=("bf16",),
        compute_per_entry={"none": 0.0, "bf16": per_entry},
    )
    assert decision.costs["bf16"] < decision.costs["none"]
    assert decision.choice == "none"


def test_powersgd_object_candidate(auto):
    from tfdist.compression import PowerSGD

    decision = auto.choose(link(auto, 50), MLP, candidates=(PowerSGD(2, warmup_steps=0),))
    assert decision.choice == "powersgd:2"
    assert isinstance(decision.candidate, PowerSGD)


def test_powersgd_warms_up_in_bfloat16_where_bf16_pays(auto):
    from tfdist.compression import PowerSGD

    slow = auto.choose(link(auto, 100), MLP)
    assert slow.choice == "powersgd:4" and isinstance(slow.candidate, PowerSGD)
    assert slow.costs["bf16"] <= auto.MIN_GAIN * slow.costs["none"]
    assert slow.candidate.warmup_dtype == "bfloat16"
    assert slow.candidate.warmup_steps == 10  # The default, kept.
    # Where the wire is so fast that bf16's cast costs more than it saves,
    # PowerSGD (cheapest thanks to its tiny compute here) warms up exactly.
    fast = auto.choose(
        link(auto, 10_000, latency=1e-5),
        MLP,
        candidates=("bf16", "powersgd:4"),
        compute_per_entry={"none": 0.0, "bf16": 2e-9, "powersgd": 1e-12},
    )
    assert fast.choice == "powersgd:4"
    assert fast.costs["bf16"] > auto.MIN_GAIN * fast.costs["none"]
    assert fast.candidate.warmup_dtype == "float32"
    # A PowerSGD object gets auto's warm-up precision on a copy, unless it
    # was given one.
    loose = PowerSGD(4, warmup_steps=3)
    chosen = auto.choose(link(auto, 100), MLP, candidates=(loose,)).candidate
    assert chosen is not loose and loose.warmup_dtype == "float32"
    assert (chosen.warmup_dtype, chosen.warmup_steps) == ("bfloat16", 3)
    given = PowerSGD(4, warmup_steps=3, warmup_dtype="float32")
    assert auto.choose(link(auto, 100), MLP, candidates=(given,)).candidate is given
    assert given.warmup_dtype == "float32"


def test_decision_text_names_link_and_costs(auto):
    text = str(auto.choose(link(auto, 50), MLP))
    assert text.startswith("powersgd:4 (")
    assert "Mbit/s" in text and "ms per collective" in text and "bf16" in text


def test_auto_setting_parses_and_shows_its_choice():
    setting = parse_compression("auto")
    assert setting.name == "auto" and setting.enabled
    assert str(setting) == "auto"
    import dataclasses

    assert str(dataclasses.replace(setting, resolved="powersgd:4")) == "auto -> powersgd:4"
    with pytest.raises(tfdist.ConfigError) as info:
        parse_compression("auto:3")
    assert info.value.field == "compression" and "'auto:3'" in str(info.value)


def test_auto_is_not_a_stateless_compressor_and_takes_no_error_feedback():
    from tfdist.compression import AutoCompression, make_aggregator, make_compressor

    assert isinstance(make_aggregator("auto"), AutoCompression)
    with pytest.raises(tfdist.ConfigError) as info:
        make_compressor("auto")
    assert info.value.field == "compression"
    with pytest.raises(tfdist.ConfigError) as info:
        make_aggregator("auto", error_feedback=True)
    assert info.value.field == "error_feedback"


def test_bad_candidates_fail_early():
    from tfdist.compression import AutoCompression

    for bad in (["auto"], ["topk:2"], []):
        with pytest.raises(tfdist.ConfigError):
            AutoCompression(candidates=bad)


def test_unresolved_auto_refuses_to_aggregate():
    from tfdist.compression import AutoCompression

    with pytest.raises(RuntimeError, match="has not chosen yet"):
        AutoCompression().state_specs((4, 4), "float32", 0)


def test_auto_is_refused_where_nothing_is_all_reduced():
    from tfdist.strategies import compression_for

    with pytest.raises(tfdist.ConfigError) as info:
        compression_for("parameter_server", "auto")
    assert info.value.field == "compression"


# ------------------------------------------------------------------ with TF


def _fit(strategy, keras, steps=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * steps, 16)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=0, shuffle=False)
    return model, history.history["loss"]


def test_fit_with_auto_measures_and_shows_its_choice(tf_cpus):
    import keras

    from tfdist.compression.auto import label

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="auto")
    assert str(strategy.compression) == "auto"
    model, losses = _fit(strategy, keras)
    aggregator = record_of(strategy).aggregator
    decision = aggregator.decision
    assert decision is not None and decision.link is not None
    assert decision.link.num_replicas == 2 and decision.link.bandwidth > 0
    assert decision.link.compute_scale > 0
    assert decision.choice in {label(c) for c in aggregator.candidates} | {"none"}
    assert str(strategy.compression) == f"auto -> {decision.choice}"
    assert "chosen from" in strategy.describe() and "ms per collective" in strategy.describe()
    assert losses[-1] < losses[0]


def test_fit_with_auto_on_a_known_slow_link_uses_powersgd(tf_cpus):
    import keras

    from tfdist.compression import AutoCompression, LinkEstimate
    from tfdist.compression.keras_hook import state_variables

    slow = LinkEstimate(bandwidth=1e5, latency=1e-3, num_replicas=2)
    strategy = tfdist.strategy_from_config(
        cpu_replicas=2, compression=AutoCompression(candidates=("none", "powersgd:2"), link=slow)
    )
    model, losses = _fit(strategy, keras)
    assert str(strategy.compression).endswith("-> powersgd:2")
    assert "PowerSGD(rank=2" in strategy.describe()
    names = [v.name for v in state_variables(model.optimizer)]
    assert any("q" in n for n in names) and any("residual" in n for n in names)
    assert losses[-1] < losses[0]


def test_fit_with_auto_on_a_fast_link_runs_keras_all_reduce(tf_cpus):
    import keras

    from tfdist.compression import AutoCompression, LinkEstimate
    from tfdist.compression.keras_hook import state_variables, strategy_aggregator

    fast = LinkEstimate(bandwidth=1e13, latency=1e-6, num_replicas=2)
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=AutoCompression(link=fast))
    model, losses = _fit(strategy, keras)
    assert str(strategy.compression).endswith("-> none")
    assert strategy_aggregator(strategy) is None  # Keras's own path
    assert state_variables(model.optimizer) == []
    plain, plain_losses = _fit(tfdist.strategy_from_config(cpu_replicas=2), keras)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)


def test_one_replica_auto_picks_none(tf_cpus):
    import keras

    strategy = tfdist.strategy_from_config(
        strategy="mirrored", devices=["/cpu:0"], compression="auto"
    )
    assert strategy.num_replicas_in_sync == 1
    _fit(strategy, keras, steps=2)
    assert str(strategy.compression) == "auto -> none"
    assert record_of(strategy).aggregator.decision.link is None
