"""One change tfdist makes to Keras or TensorFlow, as data: :class:`Patch`.

The registry (:mod:`tfdist.compat.registry`) lists them; the patching
machinery (:mod:`tfdist.compat.patching`) reads that list and applies them.
"""

from __future__ import annotations

import dataclasses

from tfdist.compat import versions as versions_lib

__all__ = ["Patch"]


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change tfdist makes to Keras or TensorFlow.

    Attributes:
        name: Unique, ``feature.what`` (e.g. ``"steps.inline_step"``).
        target: ``"module.path:Owner.attribute"`` or ``"module.path:function"``
            (an attribute of the module). For a dynamic patch, a description
            of the owners (``"subclasses of ...:BaseOptimizer.variables"``).
        wrapper: ``"tfdist.module:function"``: takes the original value and
            returns the replacement. Imported when the patch is installed.
        feature: The feature the patch belongs to (a key of ``FEATURES``).
        why: The upstream issue or behaviour worked around, with its link.
        needed: Version clauses where the patch applies, e.g.
            ``"keras<3.9"`` or ``"keras>=3.10,tensorflow<2.20"``; empty:
            every supported version.
        params: The leading parameter names the wrapper relies on, checked
            against the original's signature (``"*"``: a positional
            parameter whose name may differ); None when the target is not
            called through (a property, a module, a constant).
        kind: ``"function"``, ``"property"``, ``"module"`` or ``"value"``:
            what the target must be.
        dynamic: Applied per owner at run time with :func:`apply_to`.
        canary: The test showing that stock Keras/TF still needs the patch
            (``tests/...::test_name``), or why there is none.
    """

    name: str
    target: str
    wrapper: str
    feature: str
    why: str
    needed: str = ""
    params: tuple[str, ...] | None = None
    kind: str = "function"
    dynamic: bool = False
    canary: str = ""

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.target.partition(":")[2].split("."))

    def applies(self, versions: dict[str, str | None]) -> bool:
        """Whether the installed versions need this patch."""
        if not self.needed:
            return True
        by_package: dict[str, list[str]] = {}
        for clause in self.needed.split(","):
            clause = clause.strip()
            package = next(p for p in ("tensorflow", "keras") if clause.startswith(p))
            by_package.setdefault(package, []).append(clause[len(package) :])
        for package, clauses in by_package.items():
            have = versions.get(package)
            if have is not None and not versions_lib.satisfies(have, ",".join(clauses)):
                return False
        return True
