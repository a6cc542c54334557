"""Error feedback (memory): resend what compression dropped, later."""

from __future__ import annotations

import tensorflow as tf

from tfdist.compression.base import Compressor, Context
from tfdist.errors import ConfigError


class ErrorFeedback:
    """Adds error feedback to a lossy compressor, with explicit state.

    The residual (what was not sent yet) is passed in and returned rather
    than stored here, so that the caller can keep it in a ``tf.Variable``
    per gradient and per replica. Per step::

        corrected = grad + residual
        payload = compress(corrected)
        residual = corrected - decompress(payload)

    If ``corrected`` (or the new residual) is not all finite, e.g. after a
    NaN or inf gradient, the new residual is all zeros: the memory is reset
    rather than poisoned for every later step. The non-finite values are
    still compressed and sent, so the usual NaN handling (such as a loss
    scaler skipping the step) still sees them.

    Args:
        compressor: A lossy, contractive compressor (``compressor.lossy``
            and ``compressor.contractive`` are True).

    Raises:
        ConfigError: The compressor is lossless, so there is nothing to feed
            back, or it is not contractive (random-k scaled to be unbiased),
            so the residual would grow without bound (field ``'compressor'``).
    """

    def __init__(self, compressor: Compressor) -> None:
        if not getattr(compressor, "lossy", False):
            raise ConfigError(
                "compressor",
                compressor,
                "a lossy compressor",
                hint="Error feedback only helps a compressor that loses information.",
            )
        if not getattr(compressor, "contractive", True):
            raise ConfigError(
                "compressor",
                compressor,
                "a contractive compressor",
                hint="This compressor scales what it keeps up to be unbiased, so an "
                "error-feedback residual would grow every step. Use it without error "
                "feedback, or RandomKCompressor(ratio, unbiased=False) with it.",
            )
        self.compressor = compressor

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"

    @property
    def name(self) -> str:
        """The wrapped compressor's name, so the object is a compression setting."""
        return self.compressor.name

    def compensate(self, grad: tf.Tensor, residual: tf.Tensor | None) -> tf.Tensor:
        """Returns ``grad + residual`` (a None residual counts as zeros)."""
        grad = tf.convert_to_tensor(grad)
        return grad if residual is None else grad + tf.cast(residual, grad.dtype)

    def update(
        self, corrected: tf.Tensor, payload: tuple[tf.Tensor, ...], ctx: Context
    ) -> tf.Tensor:
        """Returns the new residual ``corrected - decompress(payload)``.

        Zeros instead when the result or ``corrected`` is not all finite.
        """
        residual = corrected - self.compressor.decompress(payload, ctx)
        finite = tf.logical_and(
            tf.reduce_all(tf.math.is_finite(corrected)), tf.reduce_all(tf.math.is_finite(residual))
        )
        return tf.where(finite, residual, tf.zeros_like(residual))

    def compress(
        self,
        grad: tf.Tensor,
        residual: tf.Tensor | None,
        step: tf.Tensor | int = 0,
        key: int = 0,
    ) -> tuple[tuple[tf.Tensor, ...], Context, tf.Tensor]:
        """Compensates, compresses and updates in one call.

        Returns:
            ``(payload, ctx, new_residual)``.
        """
        corrected = self.compensate(grad, residual)
        payload, ctx = self.compressor.compress(corrected, step=step, key=key)
        return payload, ctx, self.update(corrected, payload, ctx)

    def decompress(self, payload: tuple[tf.Tensor, ...], ctx: Context) -> tf.Tensor:
        """The wrapped compressor's decompress."""
        return self.compressor.decompress(payload, ctx)
