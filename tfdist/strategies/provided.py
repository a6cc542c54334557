"""The strategy an engine built for this process, which
:func:`~tfdist.strategies.strategy_from_config` returns instead of a second one.

``tfdist.spark.run`` builds each task's MultiWorkerMirroredStrategy and calls
``train_fn`` inside its scope. A ``train_fn`` that makes its own strategy
(spark-tensorflow-distributor's convention: ``strategy_from_config()`` in a
zero-argument ``train_fn``) would get a second strategy over the same cluster,
whose scope TensorFlow refuses inside the first ("Mixing different
tf.distribute.Strategy objects"); a process configures its collectives once,
so the second could not be a different one anyway. While an engine provides
a strategy, a call that asks for that cluster gets it; a call that asks for
other settings of it (compression, options) fails, naming where to set them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

from tfdist.errors import ConfigError
from tfdist.spec.compression import parse_compression, with_error_feedback
from tfdist.spec.options import make_options


@dataclasses.dataclass(frozen=True)
class Provided:
    """A strategy built by an engine, and the arguments it was built from."""

    strategy: Any
    tf_config: dict
    compression: Any
    error_feedback: bool | None
    options: Mapping[str, Any]
    source: str


_current: Provided | None = None


@contextlib.contextmanager
def provide(
    strategy: Any,
    *,
    tf_config: dict,
    compression: Any,
    error_feedback: bool | None,
    options: Mapping[str, Any],
    source: str,
) -> Iterator[None]:
    """Makes ``strategy_from_config`` return ``strategy`` meanwhile.

    Args:
        strategy: The strategy the engine built with ``strategy_from_config``.
        tf_config: The ``TF_CONFIG`` it was built from.
        compression, error_feedback, options: The arguments it was built
            with.
        source: Who built it, for error messages (e.g. ``"tfdist.spark.run"``).
    """
    global _current
    saved = _current
    _current = Provided(
        strategy, dict(tf_config), compression, error_feedback, dict(options), source
    )
    try:
        yield
    finally:
        _current = saved


def _same_cluster(config: Any, tf_config: dict) -> bool:
    if config is None:  # TF_CONFIG from the environment: the engine set it.
        return True
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return False  # A spec file: another cluster, built as asked.
    return isinstance(config, Mapping) and dict(config) == tf_config


def lookup(
    config: Any,
    strategy: str,
    compression: Any,
    error_feedback: bool | None,
    options: Mapping[str, Any],
) -> Any:
    """The provided strategy when ``strategy_from_config``'s arguments ask for
    it, else None (build as usual).

    A call asks for it when it names no other cluster or strategy kind.
    Arguments left out (None) take the provided strategy's values; given ones
    must equal them.

    Raises:
        ConfigError: The call asks for the provided cluster with another
            compression, error feedback or option.
    """
    provided = _current
    if provided is None or strategy not in ("auto", provided.strategy.kind):
        return None
    if not _same_cluster(config, provided.tf_config):
        return None
    hint = (
        f"Here {provided.source} built this process's strategy, and "
        "strategy_from_config() returns it (one multi-worker strategy per "
        f"process): pass the setting to {provided.source} instead."
    )
    if compression is not None or error_feedback is not None:
        given = with_error_feedback(
            parse_compression(provided.compression), provided.error_feedback
        )
        asked = with_error_feedback(
            parse_compression(provided.compression if compression is None else compression),
            provided.error_feedback if error_feedback is None else error_feedback,
        )
        if str(asked) != str(given):
            field, value = (
                ("compression", compression)
                if compression is not None
                else ("error_feedback", error_feedback)
            )
            raise ConfigError(
                field,
                value,
                f"None or the setting given to {provided.source} ({given})",
                source="strategy_from_config",
                hint=hint,
            )
    asked_options = {k: v for k, v in options.items() if v is not None}
    if asked_options:
        given = make_options(**provided.options)
        merged = make_options(**{**provided.options, **asked_options})
        for field in dataclasses.fields(given):
            if getattr(merged, field.name) != getattr(given, field.name):
                raise ConfigError(
                    field.name,
                    asked_options.get(field.name),
                    f"None or the value given to {provided.source} "
                    f"({getattr(given, field.name)!r})",
                    source="strategy_from_config",
                    hint=hint,
                )
    return provided.strategy
