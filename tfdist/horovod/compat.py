"""Keras 3 spellings of Horovod-era scripts (placeholder; see branch hvdex)."""


def install() -> None:
    """Installs the Keras 3 spelling shims; idempotent."""
