"""The supported TensorFlow/Keras ranges: one declaration, checked at import,
equal to what pyproject.toml promises, what CI tests and what the README says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tfdist.compat import versions
from tfdist.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2.21.0", (2, 21, 0)),
        ("3.16.0.dev2026102704", (3, 16, 0)),
        ("3.10", (3, 10, 0)),
        ("2.19.1rc0", (2, 19, 1)),
        ("v3.4.1", (3, 4, 1)),
    ],
)
def test_parse_keeps_the_release(text, expected):
    assert tuple(versions.parse(text)) == expected


def test_parse_refuses_what_is_not_a_version():
    with pytest.raises(ValueError, match="Expected a version like '2.19.1'. Received: 'nightly'"):
        versions.parse("nightly")


@pytest.mark.parametrize(
    "version,clauses,expected",
    [
        ("3.15.1", ">=3.3,<3.17", True),
        ("3.17.0", ">=3.3,<3.17", False),
        ("3.2.1", ">=3.3", False),
        ("3.16.0.dev2026102704", "<3.17", True),
        ("2.19.1", "==2.19.1", True),
        ("2.19.1", "!=2.19.1", False),
        ("2.19.1", "", True),
    ],
)
def test_satisfies(version, clauses, expected):
    assert versions.satisfies(version, clauses) is expected


def test_satisfies_refuses_a_bad_clause():
    with pytest.raises(ValueError, match="Received: '~=3.3'"):
        versions.satisfies("3.3.0", "~=3.3")


def test_the_installed_versions_are_supported():
    found = versions.installed()
    assert found["tensorflow"] and found["keras"]
    versions.check_supported(found)  # Raises otherwise; this suite runs on a tested pair.
    import keras
    import tensorflow as tf

    assert found == {"tensorflow": tf.__version__, "keras": keras.__version__}


@pytest.mark.parametrize(
    "package,version",
    [("tensorflow", "2.15.1"), ("keras", "2.15.0"), ("keras", "3.2.1"), ("tensorflow", "2.30.0")],
)
def test_an_unsupported_version_gets_a_clear_error(package, version, monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    found = {"tensorflow": "2.21.0", "keras": "3.15.1", package: version}
    low, high = versions.SUPPORTED[package]
    with pytest.raises(versions.UnsupportedVersionError) as error:
        versions.check_supported(found)
    message = str(error.value)
    assert f"{package} {version} (supported: >={low},<{high})" in message
    for tf_version, keras_version in versions.TESTED_PAIRS:
        assert f"TF {tf_version} + Keras {keras_version}" in message
    assert isinstance(error.value, ImportError)


def test_the_skip_variable_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv(versions.SKIP_ENV, "1")
    with pytest.warns(RuntimeWarning, match="does not support the installed keras 3.2.1"):
        versions.check_supported({"tensorflow": "2.21.0", "keras": "3.2.1"})


def test_packages_that_are_not_installed_pass():
    versions.check_supported({"tensorflow": None, "keras": None})


def test_import_tfdist_names_an_unsupported_keras(tmp_path):
    """A fresh interpreter that finds a Keras 2 first: ``import tfdist`` fails
    at once, naming it, without importing TensorFlow."""
    fake = tmp_path / "keras"
    (fake / "src").mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('tfdist imported keras')\n")
    (fake / "src" / "version.py").write_text('__version__ = "2.15.0"\n')
    env = {k: v for k, v in os.environ.items() if k != versions.SKIP_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    result = subprocess.run(
        [sys.executable, "-c", "import tfdist"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tfdist.compat.versions.UnsupportedVersionError: tfdist ")
    assert "keras 2.15.0 (supported: >=" in last and "tfdist imported keras" not in result.stderr


def test_a_feature_minimum_is_a_config_error(monkeypatch):
    monkeypatch.setitem(versions.FEATURE_MINIMUMS, "model_parallel", {"keras": "3.10"})
    with pytest.raises(ConfigError) as error:
        versions.require("model_parallel", {"keras": "3.8.0", "tensorflow": "2.18.1"})
    assert "field 'model_parallel': expected keras>=3.10. Received: keras 3.8.0" in str(error.value)
    versions.require("model_parallel", {"keras": "3.10.0", "tensorflow": "2.19.1"})


def _pyproject_range(package: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'^\s*"{package}([^"]*)"', text, re.M)
    assert match, f"pyproject.toml has no dependency on {package}"
    return match[1]


def test_pyproject_declares_the_supported_ranges():
    for package, (low, high) in versions.SUPPORTED.items():
        assert _pyproject_range(package) == f">={low},<{high}"


def test_the_tested_pairs_span_the_range_and_the_readme_lists_them():
    oldest, newest = versions.TESTED_PAIRS[0], versions.TESTED_PAIRS[-1]
    for index, package in enumerate(("tensorflow", "keras")):
        low, high = versions.SUPPORTED[package]
        assert versions.parse(oldest[index])[:2] == versions.parse(low)[:2]
        assert versions.satisfies(newest[index], f">={low},<{high}")
    readme = (REPO / "README.md").read_text()
    for tf_version, keras_version in versions.TESTED_PAIRS:
        assert re.search(
            rf"\|\s*{re.escape(tf_version)}\s*\|\s*{re.escape(keras_version)}\s*\|", readme
        ), (tf_version, keras_version)


def test_ci_tests_every_pair():
    """.ci/run hands the older pairs to .ci/matrix from TESTED_PAIRS itself;
    the newest is what pip resolves within pyproject's ranges."""
    run = (REPO / ".ci" / "run").read_text()
    snippet = re.search(
        r"mapfile -t older < <\(TFDIST_SKIP_VERSION_CHECK=1 python3 -c '(.*?)'\)", run, re.S
    )
    # The oldest pair whole, the others from the third value on.
    assert snippet and 'nice -n 19 .ci/matrix "${older[@]:0:2}"' in run
    assert 'TFDIST_MATRIX_SUBSET=tests/compat nice -n 19 .ci/matrix "${older[@]:2}"' in run
    result = subprocess.run(
        [sys.executable, "-c", snippet[1]], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.stdout.split() == [v for pair in versions.TESTED_PAIRS[:-1] for v in pair]
    assert (REPO / ".ci" / "matrix").stat().st_mode & 0o111


def test_the_matrix_lists_tests_that_exist():
    """.ci/matrix-tests names files and test functions of the suite: a renamed
    test would otherwise leave the older pairs running nothing in its place."""
    lines = (REPO / ".ci" / "matrix-tests").read_text().splitlines()
    listed = [line for line in lines if line.strip() and not line.startswith("#")]
    assert len(listed) >= 10, listed
    for node in listed:
        path, _, function = node.partition("::")
        source = (REPO / path).read_text()
        if function:
            name = function.split("[")[0]
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), node


@pytest.mark.parametrize(
    "feature,options",
    [
        ("model_parallel", {"cpu_replicas": 2, "model_parallel": 2}),
        ("compression", {"cpu_replicas": 2, "compression": "powersgd:2"}),
        ("mirrored", {"cpu_replicas": 2}),
    ],
)
def test_strategy_creation_checks_the_minimum_of_each_setting(
    tf_cpus, monkeypatch, feature, options
):
    """Checked before anything is built, not as a TypeError inside Keras."""
    import keras

    import tfdist

    monkeypatch.setitem(versions.FEATURE_MINIMUMS, feature, {"keras": "9.0"})
    with pytest.raises(ConfigError) as error:
        tfdist.strategy_from_config(**options)
    assert f"field '{feature}': expected keras>=9.0. Received: keras {keras.__version__}" in str(
        error.value
    )
