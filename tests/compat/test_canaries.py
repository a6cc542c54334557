"""Canaries kept beside the compat layer: stock Keras/TF still has the bugs
that tfdist's patches work around (tests/compat/canary.py). The others sit
beside the feature they justify; the registry names each one."""

from __future__ import annotations

import pytest

from canary import upstream_bug
from conftest import REPO, finish, result_line, start


@pytest.mark.slow
def test_stock_keras_fit_fails_under_tensorflows_parameter_server_strategy():
    """keras-team/keras#18624: Keras 3's own fit cannot feed a
    ParameterServerStrategy (tfdist routes fit to tfdist.fit instead)."""
    [(code, out, err)] = finish(
        [start([REPO / "tests" / "workers" / "stock_ps_fit.py"])], timeout=240
    )
    assert code == 0, err[-3000:]
    result = result_line(out)

    class StockFitError(Exception):
        pass

    with upstream_bug("parameter_server.fit", StockFitError, "create_per_worker_dataset"):
        if result["error"]:
            raise StockFitError(f"{result['error']}: {result['message']}")
