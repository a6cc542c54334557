"""tfdist.pipeline.agreement: processes given different split points,
settings or models refuse to start, each naming the field and the other
process; over real links on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.models.pipeline_models import make_model
from tests.transport.test_p2p import connect_chain

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")

NAMES = ["stage 0", "stage 1", "stage 2"]


def _plans(points: list[list[str]], model_name: str = "mlp", **settings):
    from tfdist.pipeline import split_model
    from tfdist.pipeline.agreement import plan_of

    model = make_model(model_name)
    base = {"schedule": "1f1b", "microbatches": 4, **settings}
    return [plan_of(split_model(model, p), p, **base) for p in points]


def _agree(plans: list[dict]) -> list:
    """check_agreement on each stage of a chain at once: None or the error."""
    from tfdist.pipeline.agreement import check_agreement

    chain = connect_chain(len(plans))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(plans)) as pool:
            futures = [
                pool.submit(check_agreement, plan, links, NAMES, "test", 10.0)
                for plan, links in zip(plans, chain)
            ]
            return [f.exception(timeout=30) for f in futures]
    finally:
        for links in chain:
            for link in links.values():
                link.close()


def test_processes_given_the_same_plan_start():
    assert _agree(_plans([["d3", "d4"]] * 3)) == [None, None, None]


def test_split_points_that_differ_are_refused_by_both_neighbours():
    from tfdist.errors import ConfigError

    plans = _plans([["d3", "d4"], ["d3", "d4"], ["d2", "d4"]])
    first, middle, last = _agree(plans)
    assert first is None  # Stage 0 agrees with stage 1; stage 1 refuses.
    assert isinstance(middle, ConfigError) and isinstance(last, ConfigError)
    assert middle.field == "split_points" and middle.value == ["d3", "d4"]
    assert "stage 2 was given ['d2', 'd4']" in str(middle)
    assert last.value == ["d2", "d4"] and "stage 1 was given ['d3', 'd4']" in str(last)


def test_settings_and_models_that_differ_are_refused_naming_the_field():
    import keras

    from tfdist.errors import ConfigError
    from tfdist.pipeline import split_model
    from tfdist.pipeline.agreement import plan_of

    plans = _plans([["d3"], ["d3"]])
    other = _plans([["d3"]], microbatches=8)[0]
    errors = _agree([plans[0], other])
    assert [e.field for e in errors] == ["microbatches", "microbatches"]
    assert [e.value for e in errors] == [4, 8]

    # The same layer names, one width changed: the same split, another model.
    wider = keras.Sequential(
        [keras.Input((24,)), keras.layers.Dense(33, name="d1"), keras.layers.Dense(10, name="d3")]
    )
    narrow = keras.Sequential(
        [keras.Input((24,)), keras.layers.Dense(32, name="d1"), keras.layers.Dense(10, name="d3")]
    )
    settings = {"schedule": "1f1b", "microbatches": 4}
    a, b = (plan_of(split_model(m, ["d3"]), ["d3"], **settings) for m in (narrow, wider))
    errors = _agree([a, b])
    assert all(isinstance(e, ConfigError) and e.field == "model" for e in errors)
    assert "another model (its stages' layers or weight shapes differ)" in str(errors[0])


def test_the_plan_of_the_same_model_built_twice_is_the_same():
    from tfdist.pipeline import split_model
    from tfdist.pipeline.agreement import plan_of

    def plan(point: str) -> dict:
        return plan_of(split_model(make_model("llama"), [point]), [])

    assert plan("transformer_layer_2") == plan("transformer_layer_2")
    one, three = plan("transformer_layer_2"), plan("transformer_layer_1")
    assert three["model"] != one["model"]


def test_a_process_that_sends_no_plan_fails_its_neighbour_in_time():
    from tfdist.pipeline.agreement import check_agreement
    from tfdist.transport.p2p import PeerError

    a, b = connect_chain(2)
    try:
        b[0].close()  # Stage 1 dies before it sends its plan.
        with pytest.raises(PeerError, match="stage 1"):
            check_agreement(_plans([["d3"]])[0], a, NAMES, "test", 10.0)
    finally:
        a[1].close()
