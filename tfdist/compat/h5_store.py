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

Writing is the mirror image: :func:`new_dataset` creates the dataset of a
key, empty, in the entry group Keras's ``__setitem__`` would create
(``store._create_h5_group(store._h5_entry_path)`` on the entry's first key,
as Keras 3.10 to 3.15 do), so a split weight is written block by block.
tests/distribution/test_checkpoints.py reads such a file back with Keras
alone, and fails if a block is missing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lazy_dataset", "new_dataset"]


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


def new_dataset(store: Any, key: str, shape: tuple, dtype: Any) -> Any:
    """An empty h5py dataset of ``shape`` and ``dtype`` under ``key`` in the
    store's current entry, created as Keras would create it, or None (another
    store, a store not writing, bfloat16, which Keras marks itself). The
    caller fills it by slices."""
    try:
        import h5py
        import numpy as np
    except ImportError:  # pragma: no cover - Keras requires h5py.
        return None
    if getattr(store, "mode", None) not in ("w", "a") or np.dtype(dtype).name == "bfloat16":
        return None
    if not hasattr(store, "_h5_entry_initialized") or not hasattr(store, "_h5_entry_path"):
        return None
    if not store._h5_entry_initialized:  # Keras creates an entry's group on its first key.
        store._create_h5_group(store._h5_entry_path)
    group = getattr(store, "_h5_entry_group", None)
    if not isinstance(group, h5py.Group):
        return None
    return group.create_dataset(key, shape=tuple(shape), dtype=np.dtype(dtype))
