"""Canaries: stock Keras/TF still has the bug a tfdist patch works around.

A canary runs the stock code (TensorFlow's own strategy, Keras's own method)
inside :func:`upstream_bug`. While the bug is there, the expected error is
raised and the canary passes. When an upstream release fixes it, the canary
fails and says which patch of ``tfdist/compat/registry.py`` can go for that
version (narrow its ``needed``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def upstream_bug(patch: str, error: type[BaseException], match: str) -> Iterator[None]:
    """Expects the stock code in the block to fail with ``error`` matching ``match``.

    Args:
        patch: The registry's name of the patch the bug justifies.
        error: The exception the bug raises.
        match: A regular expression its message contains.
    """
    from tfdist.compat import registry, versions

    record = next(p for p in registry.PATCHES if p.name == patch)
    found = versions.installed()
    try:
        yield
    except error as raised:
        assert re.search(match, str(raised)), (
            f"stock code fails differently than the bug {patch} works around: {raised}"
        )
        return
    pytest.fail(
        f"The upstream bug behind tfdist's patch '{patch}' looks fixed in keras "
        f"{found['keras']}, tensorflow {found['tensorflow']}: the stock code no longer "
        f"fails ({record.why}). The patch can go for these versions: narrow its `needed` "
        "in tfdist/compat/registry.py."
    )
