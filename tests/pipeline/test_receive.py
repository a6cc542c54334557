"""tfdist.pipeline.runtime.as_tensor: a received array becomes a tensor
without a copy where TensorFlow can read it in place, and a copy otherwise;
the values are the array's either way."""

from __future__ import annotations

import numpy as np
import pytest

from tfdist.transport.p2p import ALIGN_BYTES, _aligned_empty

#: Keras runs in this process: the suite's logical CPUs first (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("tf_cpus")


def _received(values: np.ndarray) -> np.ndarray:
    """``values`` in a buffer laid out as tfdist.transport.p2p receives it."""
    out = _aligned_empty(values.nbytes).view(values.dtype).reshape(values.shape)
    out[...] = values
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "int32", "int64"])
def test_an_aligned_received_array_is_shared_not_copied(dtype):
    import tensorflow as tf

    from tfdist.pipeline.runtime import as_tensor

    values = np.arange(-12, 12).reshape(4, 6).astype(dtype)
    array = _received(values)
    tensor = as_tensor(array)
    assert tensor.dtype == tf.as_dtype(dtype) and tensor.shape == (4, 6)
    np.testing.assert_array_equal(tensor.numpy(), values)
    array[0, 0] = 9  # The same memory: a copy would still hold -12.
    assert tensor.numpy()[0, 0] == 9
    # Kernels read it: a sum over the aligned buffer.
    assert float(tf.reduce_sum(tf.cast(tensor, tf.float64))) == float(values.sum()) + 21


@pytest.mark.parametrize(
    "make",
    [
        lambda v: _aligned_empty(v.nbytes + 4)[4:].view(v.dtype).reshape(v.shape),  # Misaligned.
        lambda v: np.asfortranarray(np.empty_like(v)),  # Not C-contiguous.
    ],
    ids=["misaligned", "fortran"],
)
def test_arrays_tensorflow_cannot_read_in_place_are_copied(make):
    from tfdist.pipeline.runtime import as_tensor

    values = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    array = make(values)
    array[...] = values
    assert array.ctypes.data % ALIGN_BYTES or not array.flags.c_contiguous
    tensor = as_tensor(array)
    array[0, 0] = 9
    np.testing.assert_array_equal(tensor.numpy(), values)


def test_other_dtypes_and_empty_arrays_are_copied_with_their_values():
    from tfdist.pipeline.runtime import as_tensor

    for values in (
        np.array([[True, False]]),
        np.zeros((3, 0), np.float32),
        np.array(2.5, np.float32),
        np.arange(6, dtype=np.uint16),
    ):
        array = _received(values)
        tensor = as_tensor(array)
        np.testing.assert_array_equal(tensor.numpy(), values)
        assert tensor.shape == values.shape
