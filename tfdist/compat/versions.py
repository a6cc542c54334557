"""The TensorFlow and Keras versions tfdist supports, and what is installed.

The supported ranges are the ones CI tests (``.ci/run`` builds a virtual
environment for each pair in :data:`TESTED_PAIRS`); ``pyproject.toml``
declares the same ranges, and a test keeps the three equal.

Nothing here imports TensorFlow or Keras: ``import tfdist`` checks the
installed versions from the packages' files, so that a version outside the
range gets one clear error instead of an ImportError from deep inside TF.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import warnings
from pathlib import Path
from typing import NamedTuple

from tfdist.errors import ConfigError, TfdistError

__all__ = [
    "SUPPORTED",
    "TESTED_PAIRS",
    "FEATURE_MINIMUMS",
    "Version",
    "UnsupportedVersionError",
    "check_supported",
    "installed",
    "parse",
    "require",
    "satisfies",
    "SKIP_ENV",
]

#: Supported ranges, ``[minimum, first unsupported)``: what CI tests. Both
#: floors are measured (docs/versions.md):
#:
#: * TensorFlow 2.19: before it the coordination service has no
#:   ``cluster_register_with_barrier``, and a multi-worker task whose peer
#:   never starts waits forever (TF 2.16.2: still waiting after 120 s with a
#:   5 s register_timeout). On one host TF 2.16 + Keras 3.10 passes the
#:   quickstart and 654 of the 658 non-slow tests of the matrix subset.
#: * Keras 3.10: under TF's own MirroredStrategy on 2 logical CPUs, stock
#:   Keras 3.8 reports wrong metrics (fit's loss 0.963 and evaluate's 0.818
#:   where one device and Keras 3.10 give 1.018 and 0.976, from bit-identical
#:   weights); Keras 3.3 to 3.7 lack the trainer's ``_make_function`` too.
SUPPORTED: dict[str, tuple[str, str]] = {
    "tensorflow": ("2.19", "2.22"),
    "keras": ("3.10", "3.17"),
}

#: The (TensorFlow, Keras) pairs CI tests, oldest first. The last is what
#: ``pip install`` resolves today; the first is the floor. Keras 3.16 is
#: checked on demand against keras-nightly (``.ci/nightly``).
TESTED_PAIRS: tuple[tuple[str, str], ...] = (
    ("2.19.1", "3.10.0"),
    ("2.20.0", "3.12.0"),
    ("2.21.0", "3.15.1"),
)

#: Settings that need more than the floor: feature -> {package: minimum}.
#: ``strategy_from_config`` checks the strategy's name (``"mirrored"``,
#: ``"parameter_server"``, ...), ``"compression"`` and ``"model_parallel"``
#: before it builds anything (:func:`require`). Empty: on every supported
#: pair every feature works (measured, docs/versions.md).
FEATURE_MINIMUMS: dict[str, dict[str, str]] = {}

#: Set to 1 to turn the import-time version error into a warning (trying a
#: version before tfdist supports it, as ``.ci/nightly`` may).
SKIP_ENV = "TFDIST_SKIP_VERSION_CHECK"

#: Distributions that provide the ``tensorflow`` module, most common first.
_TF_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tf-nightly",
    "tf-nightly-cpu",
    "tensorflow-macos",
    "tensorflow-intel",
    "tensorflow-aarch64",
)
_KERAS_DISTRIBUTIONS = ("keras", "keras-nightly")


class Version(NamedTuple):
    """A release number, e.g. ``3.16.0.dev2026102704`` -> ``(3, 16, 0)``.

    Pre-releases and dev builds compare as their release: a keras-nightly of
    3.16 is Keras 3.16 for the supported range.
    """

    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.micro}"


def parse(text: str) -> Version:
    """Parses the release part of a version string.

    Raises:
        ValueError: ``text`` does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not match:
        raise ValueError(f"Expected a version like '2.19.1'. Received: {text!r}")
    return Version(int(match[1]), int(match[2]), int(match[3] or 0))


def satisfies(version: str, clauses: str) -> bool:
    """Whether ``version`` meets comma-separated clauses like ``">=3.8,<3.16"``.

    An empty string is met by every version.

    Raises:
        ValueError: A clause is not ``OP VERSION`` with OP one of
            ``>= > <= < == !=``.
    """
    have = parse(version)
    for clause in filter(None, (c.strip() for c in clauses.split(","))):
        match = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\S+)", clause)
        if not match:
            raise ValueError(f"Expected clauses like '>=3.8,<3.16'. Received: {clauses!r}")
        op, want = match[1], parse(match[2])
        ok = {
            ">=": have >= want,
            ">": have > want,
            "<=": have <= want,
            "<": have < want,
            "==": have == want,
            "!=": have != want,
        }[op]
        if not ok:
            return False
    return True


def _keras_version_from_files() -> str | None:
    """Keras's version from ``keras/src/version.py``, without importing Keras.

    The file belongs to whichever distribution provides the ``keras`` module
    (keras or keras-nightly), which metadata alone cannot tell when both are
    installed.
    """
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "src" / "version.py"
        if path.is_file():
            match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text())
            if match:
                return match[1]
    return None


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed() -> dict[str, str | None]:
    """The installed TensorFlow and Keras versions (None where absent).

    Imported modules answer first (their ``__version__`` is what runs);
    otherwise the packages' files, without importing them.
    """
    import sys

    found: dict[str, str | None] = {}
    tf = sys.modules.get("tensorflow")
    found["tensorflow"] = getattr(tf, "__version__", None) or (
        _distribution_version(_TF_DISTRIBUTIONS) if importlib.util.find_spec("tensorflow") else None
    )
    keras = sys.modules.get("keras")
    found["keras"] = (
        getattr(keras, "__version__", None)
        or _keras_version_from_files()
        or (
            _distribution_version(_KERAS_DISTRIBUTIONS)
            if importlib.util.find_spec("keras")
            else None
        )
    )
    return found


class UnsupportedVersionError(TfdistError, ImportError):
    """The installed TensorFlow or Keras is outside tfdist's supported range."""


def _range_text(package: str) -> str:
    low, high = SUPPORTED[package]
    return f">={low},<{high}"


def check_supported(versions: dict[str, str | None] | None = None) -> None:
    """Raises unless every installed package is in :data:`SUPPORTED`.

    A package that is not installed passes: tfdist's spec layer and CLI work
    without TensorFlow. With ``TFDIST_SKIP_VERSION_CHECK=1`` a version
    outside the range warns instead.

    Raises:
        UnsupportedVersionError: Names the package, the installed version,
            the supported range and the tested pairs.
    """
    versions = installed() if versions is None else versions
    problems = []
    for package, version in versions.items():
        if version is None or package not in SUPPORTED:
            continue
        if not satisfies(version, _range_text(package)):
            problems.append(f"{package} {version} (supported: {_range_text(package)})")
    if not problems:
        return
    pairs = ", ".join(f"TF {tf} + Keras {k}" for tf, k in TESTED_PAIRS)
    message = (
        f"tfdist {_tfdist_version()} does not support the installed "
        f"{' and '.join(problems)}. Tested pairs: {pairs}. Install a supported pair, "
        f"e.g. pip install 'tensorflow=={TESTED_PAIRS[-1][0]}' "
        f"'keras=={TESTED_PAIRS[-1][1]}', or set {SKIP_ENV}=1 to try anyway."
    )
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise UnsupportedVersionError(message)


def _tfdist_version() -> str:
    try:
        return importlib.metadata.version("tfdist")
    except importlib.metadata.PackageNotFoundError:
        return "(source tree)"


def require(feature: str, versions: dict[str, str | None] | None = None) -> None:
    """Raises if ``feature`` needs more than the installed versions give.

    Raises:
        ConfigError: Names the feature, the installed version and the
            minimum.
    """
    versions = installed() if versions is None else versions
    for package, minimum in FEATURE_MINIMUMS.get(feature, {}).items():
        have = versions.get(package)
        if have is not None and not satisfies(have, f">={minimum}"):
            raise ConfigError(
                feature,
                f"{package} {have}",
                f"{package}>={minimum}",
                source="tfdist",
                received=f"{package} {have}",
                hint=f"Upgrade {package}, or leave {feature} off on this version",
            )
