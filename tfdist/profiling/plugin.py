"""The profiler's part in a strategy's life (see :mod:`tfdist.plugins`):
``TFDIST_TIMELINE`` (HOROVOD_TIMELINE's counterpart) gives every fit a
StepProfile.
"""

from __future__ import annotations

import os
from typing import Any


def install(strategy: Any) -> None:
    if os.environ.get("TFDIST_TIMELINE", "").strip():
        from tfdist.profiling.callback import install_timeline

        install_timeline()
