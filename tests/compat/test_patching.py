"""tfdist.compat's patches: checked before they apply, composed in the
registry's order whatever the install order, removable, and never silent
when a target changed.

The engine is tested on a module of this test's own (a class with a method
and a registry of test patches), then on the real registry: every target
checks out on the installed Keras/TF, a changed signature fails or switches
the feature off, and a fresh process changes no Keras/TF attribute that the
registry does not account for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from tfdist import compat
from tfdist.compat import patching, registry
from tfdist.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TARGETS = "tfdist_test_targets"
WRAPPERS = "tfdist_test_wrappers"


@pytest.fixture
def fake(monkeypatch):
    """A target module (class ``Model`` with ``step(self, batch)``), wrappers
    that record their order, and a registry of patches of them."""
    calls: list[str] = []

    targets = types.ModuleType(TARGETS)

    class Model:
        def step(self, batch):
            calls.append("keras")
            return batch

        def save(self, path):
            return path

    targets.Model = Model
    wrappers = types.ModuleType(WRAPPERS)

    def make(label):
        def wrap(original):
            def step(self, batch):
                calls.append(label)
                return original(self, batch)

            return step

        return wrap

    wrappers.inner = make("inner")
    wrappers.outer = make("outer")
    wrappers.save = lambda original: lambda self, path: original(self, "saved:" + path)
    monkeypatch.setitem(sys.modules, TARGETS, targets)
    monkeypatch.setitem(sys.modules, WRAPPERS, wrappers)
    patches = (
        patching.Patch(
            "a.inner",
            f"{TARGETS}:Model.step",
            f"{WRAPPERS}:inner",
            "a",
            "test",
            params=("self", "batch"),
        ),
        patching.Patch(
            "a.save",
            f"{TARGETS}:Model.save",
            f"{WRAPPERS}:save",
            "a",
            "test",
            params=("self", "path"),
        ),
        patching.Patch(
            "b.outer",
            f"{TARGETS}:Model.step",
            f"{WRAPPERS}:outer",
            "b",
            "test",
            params=("self", "batch"),
        ),
        patching.Patch(
            "old.only",
            f"{TARGETS}:Model.step",
            f"{WRAPPERS}:outer",
            "old",
            "test",
            needed="keras<3.0",
        ),
    )
    features = {
        "a": {"description": "feature a", "required": True},
        "b": {"description": "feature b", "required": False},
        "old": {"description": "for Keras 2", "required": True},
    }
    monkeypatch.setattr(registry, "PATCHES", patches)
    monkeypatch.setattr(registry, "FEATURES", features)
    yield types.SimpleNamespace(
        Model=Model, calls=calls, original=Model.step, original_save=Model.save
    )
    patching.uninstall("a")
    patching.uninstall("b")
    patching.uninstall("old")


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_patches_compose_in_the_registrys_order_whatever_the_install_order(fake, order):
    for feature in order:
        assert compat.install(feature)
    fake.calls.clear()
    assert fake.Model().step(7) == 7
    # First listed is closest to the original: b's wrapper runs first.
    assert fake.calls == ["outer", "inner", "keras"]
    assert fake.Model.step.__tfdist_patches__ == ("a.inner", "b.outer")
    assert [p.name for p, _ in compat.active() if p.feature in ("a", "b")] == [
        "a.inner",
        "a.save",
        "b.outer",
    ]


def test_install_is_idempotent_and_uninstall_restores_the_original(fake):
    compat.install("a")
    compat.install("b")
    installed = fake.Model.step
    compat.install("a")
    assert fake.Model.step is installed
    compat.uninstall("b")  # The other feature's patch is rebuilt alone.
    fake.calls.clear()
    fake.Model().step(1)
    assert fake.calls == ["inner", "keras"]
    assert fake.Model().save("x") == "saved:x"
    compat.uninstall("a")
    assert fake.Model.step is fake.original and fake.Model.save is fake.original_save
    assert [p for p, _ in compat.active() if p.feature in ("a", "b")] == []
    assert compat.install("a")  # And again after removal.
    assert fake.Model.step.__tfdist_patches__ == ("a.inner",)


def test_a_patch_for_other_versions_is_not_installed(fake):
    assert compat.install("old")
    assert fake.Model.step is fake.original
    assert compat.check("old") == {"old.only": "not needed on this version"}


def test_a_changed_signature_of_a_required_feature_raises_and_changes_nothing(fake, monkeypatch):
    def step(self, inputs, training):  # Keras renamed the argument.
        return inputs

    monkeypatch.setattr(fake.Model, "step", step)
    with pytest.raises(compat.PatchError) as error:
        compat.install("a")
    message = str(error.value)
    assert "feature a" in message and "a.inner" in message
    # It names the target by where it lives, what it takes and what was expected.
    assert "Model.step takes (self, inputs, training)" in message
    assert "expects (self, batch, ...)" in message
    assert "keras" in message and "tensorflow" in message  # The installed versions.
    # All or nothing: the feature's other, fitting target is untouched too.
    assert fake.Model.step is step and fake.Model.save is fake.original_save
    assert not compat.is_installed("a")


def test_a_changed_target_of_an_optional_feature_switches_it_off_with_a_warning(fake, monkeypatch):
    monkeypatch.delattr(fake.Model, "step")
    with pytest.warns(compat.FeatureDisabledWarning, match="Model.step does not exist"):
        assert compat.install("b") is False
    assert compat.disabled()["b"].startswith("tfdist cannot install feature b")
    with pytest.raises(ConfigError, match="feature b to be available.*switched off"):
        compat.require("b", "the setting that needs b")
    # Asking again does not retry or warn twice.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.install("b") is False


def test_an_unknown_feature_is_refused(fake):
    with pytest.raises(ValueError, match="feature: expected one of.*Received: 'c'"):
        compat.install("c")


def test_a_value_replaced_outside_tfdist_is_wrapped_not_lost(fake, caplog):
    compat.install("a")

    def theirs(self, batch):
        fake.calls.append("theirs")
        return batch

    fake.Model.step = theirs  # Another library patches after tfdist.
    compat.install("b")
    fake.calls.clear()
    fake.Model().step(2)
    assert fake.calls == ["outer", "inner", "theirs"]
    assert "replaced outside tfdist" in caplog.text


# --- the real registry ---------------------------------------------------------


def test_every_target_of_the_registry_fits_the_installed_versions():
    report = compat.check()
    assert set(report) == {p.name for p in registry.PATCHES}
    assert {
        name: problem
        for name, problem in report.items()
        if problem not in (None, "not needed on this version")
    } == {}


def test_the_registry_is_consistent():
    names = [p.name for p in registry.PATCHES]
    assert len(names) == len(set(names))
    for patch in registry.PATCHES:
        assert patch.feature in registry.FEATURES, patch.name
        assert patch.name.startswith(patch.feature + "."), patch.name
        assert patch.why, patch.name
        assert patch.kind in ("function", "property", "module", "value", "new"), patch.name
        module, _, function = patch.wrapper.partition(":")
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), patch.wrapper
        assert f"def {function}(" in (REPO / (module.replace(".", "/") + ".py")).read_text(), (
            patch.wrapper
        )


def test_each_canary_the_registry_names_exists():
    """A canary is a test that stock Keras/TF still has the bug; the registry
    names it, so that a fixed upstream bug points at the patch to remove.
    Every feature names one, or says why there is none."""
    for feature in registry.FEATURES:
        canaries = [p.canary for p in registry.PATCHES if p.feature == feature and p.canary]
        assert canaries, f"feature {feature}: no canary, and no reason why not"
        assert all(c.startswith(("tests/", "no upstream bug:", "none")) for c in canaries), canaries
    for patch in registry.PATCHES:
        if not patch.canary.startswith("tests/"):
            continue
        path, _, test = patch.canary.partition("::")
        assert (REPO / path).is_file(), patch.canary
        if test:
            assert f"def {test}(" in (REPO / path).read_text(), patch.canary


def test_a_changed_keras_signature_fails_the_required_feature(monkeypatch):
    """A real target, monkeypatched as a Keras release might change it."""
    from tfdist.compat.keras_src import TensorFlowTrainer

    keras_own = compat.pristine(TensorFlowTrainer, "_make_function")
    compat.uninstall("inline_steps")

    def renamed(self, fn):  # Keras renamed the argument tfdist passes.
        return keras_own(self, fn)

    try:
        monkeypatch.setattr(TensorFlowTrainer, "_make_function", renamed)
        with pytest.raises(
            compat.PatchError,
            match=r"Trainer\._make_function takes "
            r"\(self, fn\); tfdist's wrapper expects \(self, step_function",
        ):
            compat.install("inline_steps")
        assert TensorFlowTrainer._make_function is renamed
    finally:
        monkeypatch.undo()
        assert compat.install("inline_steps")
    assert "inline_steps.make_function" in TensorFlowTrainer._make_function.__tfdist_patches__
    assert compat.pristine(TensorFlowTrainer, "_make_function") is keras_own


def test_a_changed_target_switches_tensor_parallelism_off_and_model_parallel_says_so(
    tf_cpus, monkeypatch
):
    """Checked at strategy creation: ConfigError naming the setting, not a
    TypeError inside Keras."""
    import tfdist
    from tfdist.compat.keras_src import LossScaleOptimizer

    compat.uninstall("tensor_parallel")
    monkeypatch.setattr(LossScaleOptimizer, "check_finite", property(lambda self: True))
    try:
        with (
            pytest.warns(compat.FeatureDisabledWarning, match="check_finite is a property"),
            pytest.raises(ConfigError) as error,
        ):
            tfdist.strategy_from_config(cpu_replicas=2, model_parallel=2)
        assert "field 'model_parallel'" in str(error.value)
        assert "tensor parallelism (tfdist.parallel) to be available" in str(error.value)
        # The feature's other targets were left as they were.
        assert not hasattr(
            compat.pristine(LossScaleOptimizer, "check_finite"), "__tfdist_patches__"
        )
    finally:
        monkeypatch.undo()
        compat.uninstall("tensor_parallel")
    assert compat.install("tensor_parallel")


_SNAPSHOT = r"""
import inspect, json, sys
import tensorflow as tf, keras

def owners():
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith(("keras", "tensorflow.python.eager.backprop",
                "tensorflow.python.checkpoint.checkpoint_management",
                "tensorflow.python.distribute.failure_handling")):
            continue
        yield name, module
        for value in list(vars(module).values()):
            if inspect.isclass(value) and value.__module__ == name:
                yield f"{name}.{value.__qualname__}", value

def behaviour(value):
    # What a patch replaces; Keras's own run-time state (counters, caches)
    # is not behaviour.
    return (callable(value) or inspect.ismodule(value)
            or isinstance(value, (property, classmethod, staticmethod)))

def snapshot():
    return {f"{where}.{attr}": id(value) for where, owner in owners()
            for attr, value in list(vars(owner).items()) if behaviour(value)}

before = snapshot()
import tfdist
from tfdist import compat
tfdist.strategy_from_config(cpu_replicas=2, compression="powersgd:2")
tfdist.strategy_from_config(cpu_replicas=2, model_parallel=2)
for feature in ("parameter_server", "profiling", "timeline", "horovod", "horovod_spellings",
                "distribution_guard"):
    assert compat.install(feature), feature
from tfdist.horovod import compat as hvd_compat
hvd_compat.install()
after = snapshot()
changed = sorted(k for k in after if before.get(k) != after[k] and k in before)
added = sorted(k for k in after if k not in before)
active = [[p.name, where] for p, where in compat.active()]
compat.uninstall()
restored = snapshot()
print(json.dumps({"changed": changed, "added": added, "active": active,
                  "still": sorted(k for k in changed if restored.get(k) != before[k])}))
"""


def test_a_process_changes_only_what_the_registry_declares_and_uninstall_restores_it():
    """Every Keras/TF attribute that differs after tfdist installed all its
    features is a registered patch; uninstall puts every original back."""
    result = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    declared = {where for _, where in report["active"]}
    assert len(report["changed"]) >= 40, report["changed"]  # The snapshot sees the patches.
    assert sorted(set(report["changed"] + report["added"]) - declared) == []
    assert report["still"] == []
