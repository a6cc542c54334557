"""generate() under a ModelParallel across processes (tfdist.distribution.generation).

A process of one device runs the sampling loop with ``strategy.run``: the
4-process job of tests/distribution/test_model_parallel.py checks it
(greedy, seeded top-k and stop tokens against one device). A process of
several devices (a host's GPUs) runs each replica's loop on a thread of its
own. MultiWorkerMirrored gives each CPU process one device, so that path is
checked here in one process of 4 logical CPUs, taken as if its replicas
spanned processes: real collectives between the 4 replicas, against the
tokens of the same model on one device.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tfdist.distribution import generation

keras_hub = pytest.importorskip("keras_hub")
from tiny_lms import causal_lm, generations  # noqa: E402


def test_each_local_replica_samples_on_its_own_thread(keras_mod, monkeypatch):
    """A (2, 2) mesh: each replica is in a tensor group and a data group."""
    keras = keras_mod
    keras.utils.set_random_seed(3)
    twin = causal_lm(keras, "llama")
    weights = twin.get_weights()
    want = generations(twin)

    dist = keras.distribution
    mesh = dist.DeviceMesh((2, 2), ["batch", "model"], dist.list_devices("cpu")[:4])
    layout = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    dist.set_distribution(dist.ModelParallel(layout_map=layout, batch_dim_name="batch"))
    lm = causal_lm(keras, "llama")
    lm.set_weights(weights)
    strategy = lm.distribute_strategy
    assert len(strategy.extended.worker_devices) == 4

    # As if the replicas spanned processes: the one-process path would read
    # each weight whole, outside any replica.
    monkeypatch.setattr(generation, "spanning_strategy", lambda model: strategy)
    names = set()
    start = threading.Thread.start

    def start_and_record(thread):
        names.add(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_and_record)
    got = generations(lm)

    assert {f"tfdist-generate-{i}" for i in range(4)} <= names, names
    for name in ("greedy", "top_k", "stop", "stop_mask"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # The stop tokens ended every row before the width.
    assert not np.asarray(got["stop_mask"])[:, -1].any()
