"""The words of a TF_CONFIG: task types, jobs, strategy names, keys, the spec
directory, and the wording of hints ("Did you mean ...?"). No TensorFlow.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: Task types TensorFlow knows, in the order tasks are listed.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
#: Jobs allowed inside ``cluster`` (the evaluator runs outside the cluster).
CLUSTER_JOBS = ("chief", "worker", "ps")
#: Values of :attr:`TFConfig.kind`.
KINDS = ("local", "multi_worker", "parameter_server")
#: Strategy names accepted by ``strategy=`` (see :func:`validate`).
STRATEGIES = (
    "multi_worker_mirrored",
    "parameter_server",
    "mirrored",
    "one_device",
    "default",
    "tpu",
)
SINGLE_MACHINE_STRATEGIES = ("mirrored", "one_device", "default", "tpu")

TOP_LEVEL_KEYS = ("cluster", "task", "rpc_layer", "environment")
# Set by Google Cloud AI Platform / Vertex AI next to the TensorFlow keys;
# accepted and ignored so that a TF_CONFIG written by the platform parses.
IGNORED_TOP_LEVEL_KEYS = ("job",)
TASK_KEYS = ("type", "index")
IGNORED_TASK_KEYS = ("trial", "cloud")
RPC_LAYERS = ("grpc",)
#: ``TFConfig.source`` of a config read from a ``ClusterResolver``.
RESOLVER_SOURCE = "<ClusterResolver>"

#: Environment variable overriding the directory of named cluster specs.
SPEC_DIR_ENV = "TFDIST_SPEC_DIR"
#: The repository's ``cluster_specs/`` directory (next to the package).
DEFAULT_SPEC_DIR = Path(__file__).resolve().parents[2] / "cluster_specs"

TASK_EXAMPLE = '{"type": "worker", "index": 0}'


def short(text: Any, limit: int = 60) -> str:
    """Shortens a value embedded in a hint."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(names: Iterable[str]) -> str:
    """``('a', 'b')`` -> ``"'a', 'b'"``."""
    return ", ".join(f"'{name}'" for name in names)


def did_you_mean(word: Any, choices: Sequence[str]) -> str | None:
    """A "Did you mean ...?" hint for a likely typo, or None."""
    if not isinstance(word, str):
        return None
    if word.lower() == "master":  # TF1 / AI Platform name of the chief.
        return "'master' is the TF1 name of the chief; use 'chief'."
    lowered = {choice.lower(): choice for choice in choices}
    matches = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f"Did you mean '{lowered[matches[0]]}'?" if matches else None
