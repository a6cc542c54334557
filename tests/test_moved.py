"""Old import paths (before the packages by layer) still work, with a
DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Old module -> (new module, a public name, a private name users may reach
#: and the new module that defines it).
MOVED = {
    "tfdist.cluster": ("tfdist.spec", "parse", ("tfdist.spec.names", "_did_you_mean")),
    "tfdist.options": ("tfdist.spec.options", "make_options", ("tfdist.spec.options", "_STRATEGY_ALIASES")),
    "tfdist.detect": ("tfdist.spec.detect", "choose", None),
    "tfdist.launch": ("tfdist.engines.launch", "launch", ("tfdist.engines.launch_results", "_PORT_TAKEN")),
    "tfdist.launch_elastic": ("tfdist.engines.elastic", None, None),
    "tfdist.hosts": ("tfdist.engines.hosts", "host_commands", None),
    "tfdist.horovodrun": ("tfdist.engines.horovodrun", None, None),
    "tfdist.net": ("tfdist.engines.net", "free_ports", None),
    "tfdist.quiet": ("tfdist.engines.quiet", "NoiseFilter", None),
    "tfdist.ps_cluster": ("tfdist.engines.local_cluster", "local_cluster", None),
}


def _fresh(name: str):
    """Imports ``name`` anew, returning the module and the warnings raised."""
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_forwards_to_the_new_module(old):
    new, public, private = MOVED[old]
    module, deprecations = _fresh(old)
    assert [str(w.message) for w in deprecations] == [
        f"{old} is now {new}; the old path works until the next release"]
    # The warning points at the importer, not at tfdist's stub.
    assert deprecations[0].filename != str(ROOT / "tfdist" / "_moved.py")
    if public is not None:
        assert getattr(module, public) is getattr(importlib.import_module(new), public)
    if private is not None:
        where, name = private
        assert getattr(module, name) is getattr(importlib.import_module(where), name)
    with pytest.raises(AttributeError, match=f"now {new}"):
        getattr(module, "no_such_name")


def test_the_old_callbacks_path_reaches_every_callback_module():
    module, deprecations = _fresh("tfdist.callbacks")
    assert len(deprecations) == 1
    from tfdist.training.callbacks import BackupAndRestore, backup, workers
    assert module.BackupAndRestore is BackupAndRestore
    assert module._SkipSteps is backup._SkipSteps      # A private name, in a submodule.
    assert module._cluster is workers._cluster
    assert "BackupAndRestore" in dir(module)


def test_star_import_from_an_old_path_gives_the_public_names():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from tfdist.cluster import *\nexcept DeprecationWarning as w:\n"
            "    print('warned:', w)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.strip() == ("warned: tfdist.cluster is now tfdist.spec; the old "
                                     "path works until the next release"), result.stderr
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec("from tfdist.cluster import *", namespace)  # noqa: S102 - the user's spelling.
    import tfdist.spec
    assert namespace["TFConfig"] is tfdist.spec.TFConfig
    assert set(tfdist.spec.__all__) <= set(namespace)
