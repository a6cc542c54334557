"""The spec layer: what a cluster is, before anything runs on it.

"Spec" as in a cluster spec (``tf.train.ClusterSpec``, TF_CONFIG's
``cluster``), not a test specification: the tests are in ``tests/``.

It owns the TF_CONFIG (:class:`TFConfig`: parsed, validated, generated for each
task), the cluster specs in ``cluster_specs/``, the options of
``strategy_from_config`` (:mod:`~tfdist.spec.options`, and the ``compression=``
setting in :mod:`~tfdist.spec.compression`) and the detection of
which strategy to build (:mod:`~tfdist.spec.detect`). It is the bottom layer:
it imports nothing of tfdist but :mod:`tfdist.errors`, and never TensorFlow or
Keras, so that launchers and the CLI's spec commands stay fast and run where
TensorFlow is not installed (``tests/test_layering.py`` checks both).

Typical use::

    from tfdist import spec

    config = spec.parse()                               # reads $TF_CONFIG
    config = spec.parse("two_workers", require_task=False)   # a spec file
    env = {"TF_CONFIG": json.dumps(spec.tf_config_for_task(
        "two_workers", "worker", 1))}
"""

from __future__ import annotations

from tfdist.spec.address import parse_address, parse_task
from tfdist.spec.generate import all_task_configs, spec_from_hosts, tf_config_for_task
from tfdist.spec.names import (
    CLUSTER_JOBS,
    DEFAULT_SPEC_DIR,
    KINDS,
    RESOLVER_SOURCE,
    SPEC_DIR_ENV,
    STRATEGIES,
    TASK_TYPES,
)
from tfdist.spec.parse import is_cluster_resolver, parse
from tfdist.spec.tf_config import TFConfig, validate

__all__ = [
    "TASK_TYPES",
    "CLUSTER_JOBS",
    "KINDS",
    "STRATEGIES",
    "SPEC_DIR_ENV",
    "DEFAULT_SPEC_DIR",
    "TFConfig",
    "parse",
    "validate",
    "tf_config_for_task",
    "all_task_configs",
    "spec_from_hosts",
    "parse_task",
    "parse_address",
    "is_cluster_resolver",
    "RESOLVER_SOURCE",
]
