"""What a Keras weights file holds, for tests that compare two of them."""

from __future__ import annotations

from typing import Any


def h5_contents(path: Any) -> dict:
    """Every group's attributes (``"/"`` for the file's) and every dataset's
    ``(shape, dtype, attributes, value)``, by path in the file."""
    import h5py

    items: dict = {}
    with h5py.File(path, "r") as f:
        items["/"] = dict(f.attrs)

        def note(name: str, item: Any) -> None:
            if isinstance(item, h5py.Dataset):
                items[name] = (item.shape, item.dtype.str, dict(item.attrs), item[()])
            else:
                items[name] = dict(item.attrs)

        f.visititems(note)
    return items
