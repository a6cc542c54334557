"""Every touch of Keras and TensorFlow internals, in one checked, versioned place.

The lowest layer of tfdist. It owns:

* :mod:`~tfdist.compat.versions`: the supported TensorFlow/Keras ranges
  (what CI tests), the installed versions, the import-time check and the
  per-feature minimums;
* :mod:`~tfdist.compat.patching` and :mod:`~tfdist.compat.registry`: every
  change tfdist makes to a Keras or TF attribute, declared with its target,
  reason and versions, checked against the installed signature before it is
  applied, composed in a declared order and removable;
* :mod:`~tfdist.compat.keras_src` and :mod:`~tfdist.compat.tf_python`: every
  name tfdist takes from ``keras.src`` and ``tensorflow.python``, with the
  location it has in each supported version;
* :mod:`~tfdist.compat.keras_private`, :mod:`~tfdist.compat.tf_private` and
  :mod:`~tfdist.compat.spark_private`: every private attribute of a Keras,
  TensorFlow or PySpark object that tfdist reads or sets, behind a named
  function.

Nothing else in tfdist imports ``keras.src`` or ``tensorflow.python``, or
assigns to a Keras/TF attribute, and a private attribute access outside this
package is an exception tests/compat lists with its reason (tests/compat
checks it). This package
imports no other part of tfdist but :mod:`tfdist.errors`; the wrappers the
registry names live in their features' modules and are imported when a
feature is installed. Importing it imports no TensorFlow.
"""

from __future__ import annotations

from tfdist.compat.patching import (
    FeatureDisabledWarning,
    Patch,
    PatchError,
    active,
    apply_to,
    check,
    disabled,
    install,
    is_installed,
    pristine,
    require,
    uninstall,
)
from tfdist.compat.versions import (
    SUPPORTED,
    TESTED_PAIRS,
    UnsupportedVersionError,
    check_supported,
    installed,
)

__all__ = [
    "FeatureDisabledWarning",
    "Patch",
    "PatchError",
    "active",
    "apply_to",
    "check",
    "disabled",
    "install",
    "is_installed",
    "pristine",
    "require",
    "uninstall",
    "SUPPORTED",
    "TESTED_PAIRS",
    "UnsupportedVersionError",
    "check_supported",
    "installed",
]
