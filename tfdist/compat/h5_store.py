"""The h5py dataset behind a key of Keras's weights store, unread.

Keras's ``H5IOStore`` (``model.weights.h5``, keras-hub's presets) reads a
whole dataset into memory when a layer's ``load_own_variables`` asks for a
key (``__getitem__`` calls ``np.array``). A weight split over a mesh needs
only its blocks: the h5py dataset reads slices from the file. Keras 3.10 to
3.15 keep the current entry's h5py group as ``store._h5_entry_group``
(tests/distribution/test_preset_loading.py counts the blocks read, and fails
without it). On a Keras without it, or for a key in another shard file of a
sharded store, :func:`lazy_dataset` returns None
and the caller reads the value whole, as Keras does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lazy_dataset"]


def lazy_dataset(store: Any, key: str) -> Any:
    """The h5py dataset under ``key`` in the store's current entry, or None
    (another store, a missing key, bfloat16 data Keras converts itself)."""
    group = getattr(store, "_h5_entry_group", None)
    try:
        import h5py
    except ImportError:  # pragma: no cover - Keras requires h5py.
        return None
    if not isinstance(group, h5py.Group) or key not in group:
        return None
    dataset = group[key]
    if not isinstance(dataset, h5py.Dataset) or dataset.attrs.get("dtype") == "bfloat16":
        return None
    return dataset
