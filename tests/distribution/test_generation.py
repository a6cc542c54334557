"""generate() under a ModelParallel across processes (tfdist.distribution.generation).

The replica path itself runs in the 4-process job of
tests/distribution/test_model_parallel.py (greedy, seeded top-k and stop
tokens against one device), where each process's one device passes the
check. Here: the check refuses a process of several devices before the
sampling loop could hang.
"""

from __future__ import annotations

import pytest

from tfdist.distribution import generation
from tfdist.errors import ConfigError


@pytest.mark.parametrize("local, replicas", [(2, 8), (4, 4), (0, 4)])
def test_a_process_of_several_devices_is_refused_before_generating(local, replicas):
    with pytest.raises(ConfigError) as info:
        generation.check_devices(local, replicas)
    text = str(info.value)
    assert "devices per process" in text and f"Received: {local}" in text, text
    assert f"{replicas} processes of one device each" in text, text
    assert info.value.field == "devices per process" and info.value.value == local
