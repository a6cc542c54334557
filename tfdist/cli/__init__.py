"""The ``tfdist`` command (:func:`main`): the top layer, which may import every other.

Its spec commands (``check``, ``generate``, ``hosts``, ``explain``) and
``launch`` import no TensorFlow.
"""

from __future__ import annotations

from tfdist.cli.commands import main

__all__ = ["main"]
