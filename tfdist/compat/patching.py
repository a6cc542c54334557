"""How tfdist changes Keras and TensorFlow: declared patches, checked, composed, removable.

A :class:`Patch` is a record: which attribute it replaces (``target``), the
function that builds the replacement from the original (``wrapper``), the
feature it belongs to, why it exists (the upstream issue) and the versions
that need it. Every record lives in :mod:`tfdist.compat.registry`.

Installing a feature (:func:`install`) first checks every target of the
feature: it must exist and, for a function, take the parameters the wrapper
relies on. Only then is anything replaced, so a feature is all in or all
out. A mismatch raises :class:`PatchError` for a feature tfdist cannot work
without, and otherwise warns and switches the feature off; using a switched
off feature raises :class:`tfdist.ConfigError` (:func:`require`). Nothing
is ever half-installed or silently skipped.

Several patches may target one attribute. The attribute then holds one
value that tfdist built from the pristine original by applying the active
patches in the registry's order (first listed = closest to the original),
so the result does not depend on which feature was installed first, and
removing one patch rebuilds the rest. :func:`uninstall` puts the pristine
original back.

Some targets are only known at run time (every subclass of a class, every
module that re-exports a function): their records have ``dynamic=True`` and
the feature applies them to each owner with :func:`apply_to`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import threading
import warnings
from typing import Any

from tfdist.compat import versions as versions_lib
from tfdist.compat.patch import Patch
from tfdist.errors import ConfigError, TfdistError

__all__ = [
    "Patch",
    "PatchError",
    "FeatureDisabledWarning",
    "install",
    "uninstall",
    "apply_to",
    "active",
    "disabled",
    "require",
    "check",
    "resolve_target",
    "is_installed",
    "pristine",
]

log = logging.getLogger("tfdist.compat")


class PatchError(TfdistError, RuntimeError):
    """A patch target is missing or changed in the installed Keras/TF."""


class FeatureDisabledWarning(UserWarning):
    """A feature was switched off because a patch target changed."""


@dataclasses.dataclass
class _Slot:
    """One patched attribute: its owner, its pristine value and what tfdist set."""

    owner: Any
    attribute: str
    pristine: Any
    own: bool  # Whether the owner itself defined it (else inherited).
    patches: list[Patch] = dataclasses.field(default_factory=list)
    installed: Any = None


_lock = threading.RLock()
_slots: dict[tuple[int, str], _Slot] = {}
_features: dict[str, bool] = {}  # Installed features -> True.
_disabled: dict[str, str] = {}  # Feature -> why it is off.


def _registry() -> tuple[tuple[Patch, ...], dict[str, dict[str, Any]]]:
    from tfdist.compat import registry

    return registry.PATCHES, registry.FEATURES


def _import_path(path: str) -> Any:
    module_name, _, attributes = path.partition(":")
    value = importlib.import_module(module_name)
    for part in filter(None, attributes.split(".")):
        value = getattr(value, part)
    return value


def resolve_target(patch: Patch) -> tuple[Any, str]:
    """``(owner, attribute)`` of a static patch's target.

    Raises:
        PatchError: The module or the owner does not exist.
    """
    try:
        owner = importlib.import_module(patch.module)
        for part in patch.path[:-1]:
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as error:
        raise PatchError(
            f"{patch.name}: target {patch.target} does not exist in {_versions_text()} ({error})"
        ) from None
    return owner, patch.path[-1]


def _versions_text() -> str:
    found = versions_lib.installed()
    return ", ".join(f"{package} {version}" for package, version in found.items())


class _Missing:
    """The pristine value of an attribute tfdist adds (``kind="new"``)."""

    def __repr__(self) -> str:
        return "<absent>"


MISSING = _Missing()


def _raw(owner: Any, attribute: str) -> tuple[Any, bool]:
    """The attribute as stored (a property object, not its value) and whether
    the owner defines it itself."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute], klass is owner
        raise AttributeError(attribute)
    return getattr(owner, attribute), True


def _where(owner: Any, attribute: str) -> str:
    """``keras.src.module.Class.attribute``: where the target really is."""
    if inspect.ismodule(owner):
        return f"{owner.__name__}.{attribute}"
    return f"{owner.__module__}.{owner.__qualname__}.{attribute}"


def _problem(patch: Patch, owner: Any, attribute: str) -> str | None:
    """Why ``patch`` cannot apply to ``owner.attribute``, or None."""
    slot = _slots.get((id(owner), attribute))
    try:
        value, _ = _raw(owner, attribute)
        if slot is not None and value is slot.installed:
            value = slot.pristine  # Ours: check what it wraps.
    except AttributeError:
        return None if patch.kind == "new" else f"{_where(owner, attribute)} does not exist"
    where = _where(owner, attribute)
    if patch.kind == "new":
        return None if value is MISSING else f"{where} exists already"
    if patch.kind == "value":
        return None
    if patch.kind == "property":
        return (
            None
            if isinstance(value, property)
            else (f"{where} is a {type(value).__name__}, expected a property")
        )
    if patch.kind == "module":
        return (
            None
            if inspect.ismodule(value)
            else (f"{where} is a {type(value).__name__}, expected a module")
        )
    if patch.kind == "function":
        function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if not callable(function):
            return f"{where} is a {type(value).__name__}, expected a function"
        if patch.params is not None:
            try:
                found = list(inspect.signature(function).parameters)
            except (TypeError, ValueError):
                return f"{where} has no signature to check"
            if len(found) < len(patch.params) or any(
                want not in ("*", have) for want, have in zip(patch.params, found)
            ):
                return (
                    f"{where} takes ({', '.join(found)}); tfdist's wrapper "
                    f"expects ({', '.join(patch.params)}, ...)"
                )
    return None


def check(feature: str | None = None) -> dict[str, str | None]:
    """Checks the targets of every static patch (of ``feature``) without installing.

    Returns:
        Patch name -> the problem, None when the target fits, or
        ``"not needed on this version"``.
    """
    patches, _ = _registry()
    versions = versions_lib.installed()
    report: dict[str, str | None] = {}
    for patch in patches:
        if feature is not None and patch.feature != feature:
            continue
        if not patch.applies(versions):
            report[patch.name] = "not needed on this version"
            continue
        if patch.dynamic:
            report[patch.name] = None
            continue
        try:
            owner, attribute = resolve_target(patch)
        except PatchError as error:
            report[patch.name] = str(error)
            continue
        report[patch.name] = _problem(patch, owner, attribute)
    return report


def _order(patch: Patch) -> int:
    """The patch's position in the registry (unknown patches last)."""
    patches, _ = _registry()
    return patches.index(patch) if patch in patches else len(patches)


def _rebuild(slot: _Slot) -> None:
    """Sets the attribute to the pristine value wrapped by its active patches,
    in registry order; back to the pristine value when none is left."""
    current, _ = _raw(slot.owner, slot.attribute) if _has(slot) else (MISSING, False)
    if slot.installed is not None and current is not slot.installed:
        # Someone else replaced our value since: wrap theirs, and say so.
        log.warning(
            "tfdist.compat: %s.%s was replaced outside tfdist; wrapping the new value",
            getattr(slot.owner, "__name__", slot.owner),
            slot.attribute,
        )
        slot.pristine = current
    if not slot.patches:
        if slot.own and slot.pristine is not MISSING:
            setattr(slot.owner, slot.attribute, slot.pristine)
        elif slot.attribute in vars(slot.owner):
            delattr(slot.owner, slot.attribute)
        slot.installed = None
        return
    value = slot.pristine
    ordered = sorted(slot.patches, key=_order)
    for patch in ordered:
        value = _import_path(patch.wrapper)(value)
    try:
        value.__tfdist_patches__ = tuple(p.name for p in ordered)
    except (AttributeError, TypeError):
        pass  # property objects and modules take no attributes.
    setattr(slot.owner, slot.attribute, value)
    slot.installed = value


def _has(slot: _Slot) -> bool:
    try:
        _raw(slot.owner, slot.attribute)
        return True
    except AttributeError:
        return False


def _add(patch: Patch, owner: Any, attribute: str) -> None:
    key = (id(owner), attribute)
    slot = _slots.get(key)
    if slot is None:
        try:
            pristine, own = _raw(owner, attribute)
        except AttributeError:  # kind="new": tfdist adds the attribute.
            pristine, own = MISSING, False
        slot = _slots[key] = _Slot(owner, attribute, pristine, own)
    if patch not in slot.patches:
        slot.patches.append(patch)
        _rebuild(slot)


def install(feature: str) -> bool:
    """Installs every patch of ``feature`` that the installed versions need.

    Idempotent. All targets are checked before any is replaced.

    Returns:
        True when the feature is on, False when it was switched off (a
        :class:`FeatureDisabledWarning` said why).

    Raises:
        PatchError: A target of a feature marked required is missing or
            changed; the message names the target, what was found and the
            installed versions.
    """
    patches, features = _registry()
    if feature not in features:
        raise ValueError(f"feature: expected one of {sorted(features)}. Received: {feature!r}")
    with _lock:
        if feature in _features:
            return True
        if feature in _disabled:
            return False
        versions = versions_lib.installed()
        mine = [p for p in patches if p.feature == feature and p.applies(versions)]
        targets = []
        problems = []
        for patch in mine:
            if patch.dynamic:
                continue
            try:
                owner, attribute = resolve_target(patch)
            except PatchError as error:
                problems.append(str(error))
                continue
            problem = _problem(patch, owner, attribute)
            if problem:
                problems.append(f"{patch.name}: {problem} in {_versions_text()}")
            targets.append((patch, owner, attribute))
        if problems:
            description = features[feature]["description"]
            message = f"tfdist cannot install {description} ({feature}): " + "; ".join(problems)
            if features[feature].get("required", True):
                raise PatchError(
                    message + ". Use a supported pair (tfdist info lists "
                    "them), or report the Keras/TF version at tfdist's tracker"
                )
            _disabled[feature] = message
            warnings.warn(
                message + f". {description} is switched off.", FeatureDisabledWarning, stacklevel=2
            )
            return False
        for patch, owner, attribute in targets:
            _add(patch, owner, attribute)
        _features[feature] = True
        return True


def apply_to(name: str, owner: Any, attribute: str | None = None) -> bool:
    """Applies the dynamic patch ``name`` to ``owner`` (e.g. one subclass).

    Returns:
        False when the owner does not fit the patch (the owner is left as
        it is; the feature's own code decides what that means), else True.
    """
    patches, _ = _registry()
    patch = next(p for p in patches if p.name == name)
    attribute = attribute or patch.path[-1]
    with _lock:
        if _problem(patch, owner, attribute):
            return False
        _add(patch, owner, attribute)
        return True


def uninstall(feature: str | None = None) -> None:
    """Removes the patches of ``feature`` (all when None), restoring the
    originals; the remaining patches of shared targets are rebuilt."""
    with _lock:
        for key, slot in list(_slots.items()):
            kept = [p for p in slot.patches if feature is not None and p.feature != feature]
            if kept != slot.patches:
                slot.patches = kept
                _rebuild(slot)
            if not slot.patches:
                del _slots[key]
        for name in list(_features):
            if feature is None or name == feature:
                del _features[name]
        for name in list(_disabled):
            if feature is None or name == feature:
                del _disabled[name]


def is_installed(feature: str) -> bool:
    """Whether the patches of ``feature`` (a registry feature name) are installed."""
    return feature in _features


def active() -> list[tuple[Patch, str]]:
    """``(patch, where)`` for every patch in place, in registry order."""
    found = []
    for slot in _slots.values():
        for patch in slot.patches:
            found.append((patch, _where(slot.owner, slot.attribute)))
    return sorted(found, key=lambda item: (_order(item[0]), item[1]))


def disabled() -> dict[str, str]:
    """Features switched off in this process -> why."""
    return dict(_disabled)


def require(feature: str, what: str | None = None) -> None:
    """Raises if ``feature`` was switched off by a changed patch target.

    Raises:
        ConfigError: Names the feature and why it is off.
    """
    if feature in _disabled:
        _, features = _registry()
        raise ConfigError(
            what or feature,
            feature,
            f"{features[feature]['description']} to be available",
            source="tfdist",
            received="switched off",
            hint=_disabled[feature],
        )


def pristine(owner: Any, attribute: str) -> Any:
    """The value ``owner.attribute`` had before tfdist patched it."""
    slot = _slots.get((id(owner), attribute))
    return _raw(owner, attribute)[0] if slot is None else slot.pristine
