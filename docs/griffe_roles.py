"""A griffe extension for tfdist's API reference (``extensions:`` in ``mkdocs.yml``).

tfdist's docstrings are Google style but name other objects with Sphinx roles
(:func:`parse_compression`, :class:`~tfdist.compat.patching.Patch`), which
Markdown would show with the role's name. This turns each role into inline code
of the name Sphinx would show (``~`` keeps the last component), so the reference
reads as the source means it. The source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const|term):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
    short, target = match.group(1), match.group(2).strip()
    if "<" in target and target.endswith(">"):  # :func:`text <target>`
        return f"`{target.split('<', 1)[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Replaces Sphinx cross-reference roles in docstrings by inline code."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
