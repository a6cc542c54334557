"""``TPUStrategy``, and a check that a TPU is reachable before TensorFlow waits for one."""

from __future__ import annotations

import socket
from typing import Any

import tensorflow as tf

from tfdist import spec as spec_lib
from tfdist.errors import ConfigError
from tfdist.spec.detect import Choice
from tfdist.strategies.base import TfdistStrategy, TPUNotFoundError


class TPUStrategy(TfdistStrategy, tf.distribute.TPUStrategy):
    """``TPUStrategy`` with a description. Use :func:`strategy_from_config`
    to get one: it checks for a TPU before TensorFlow can hang looking."""

    kind = "tpu"

    def __init__(
        self, tpu_cluster_resolver, *, compression: Any = None, choice: Choice | None = None
    ):
        super().__init__(tpu_cluster_resolver)
        self._set_up(compression, choice)


def _no_tpu(tpu: str, why: str) -> TPUNotFoundError:
    return TPUNotFoundError(
        f"No TPU found for tpu={tpu!r}: {why}. To train without a TPU, pass "
        "strategy='auto' (or 'mirrored', 'one_device', ...) and unset "
        "TPU_NAME."
    )


def _on_google_cloud() -> bool:
    """Whether this is a Google Cloud VM, read locally (no network call)."""
    try:
        with open("/sys/class/dmi/id/product_name", encoding="ascii") as f:
            return "Google" in f.read()
    except OSError:
        return False


def check_tpu(tpu: str, connect_timeout: float = 3.0) -> None:
    """Fails fast, before TensorFlow is asked, when no TPU can be reached.

    TensorFlow fails late or hangs: ``tpu="local"`` without a TPU gives an
    IndexError; an unknown name makes a call to the cloud metadata server,
    which hangs where that address does not answer; a ``grpc://`` address on
    a closed port hangs in ``experimental_connect_to_cluster``.

    Raises:
        TPUNotFoundError: No TPU at ``tpu``; the message says what to do.
    """
    if tpu == "local":
        if not tf.config.list_physical_devices("TPU"):
            raise _no_tpu(tpu, "this machine has no local TPU device")
        return
    if tpu.startswith("grpc://"):
        try:
            host, port = spec_lib.parse_address(tpu[len("grpc://") :])
        except ConfigError as error:
            raise ConfigError(
                "tpu", tpu, "'grpc://host:port'", source="strategy_from_config"
            ) from error
        try:
            socket.create_connection((host, port), timeout=connect_timeout).close()
        except OSError as error:
            raise _no_tpu(tpu, f"nothing answers at {host}:{port} ({error})") from None
        return
    if not _on_google_cloud():
        raise _no_tpu(
            tpu,
            "a TPU name is resolved through the Google Cloud "
            "metadata server, and this machine is not a Google Cloud "
            "VM",
        )
