"""tfdist/training/atomic.py: a file is replaced whole or not at all."""

from __future__ import annotations

import os

import pytest

from tfdist.training import atomic


def test_a_block_that_ends_well_replaces_the_file(tmp_path):
    path, tmp = tmp_path / "state.json", tmp_path / ".tmp-state.json"
    path.write_text("old")
    with atomic.replacing(str(path), str(tmp), open(tmp, "w")) as f:
        f.write("new")
        assert path.read_text() == "old"  # Nothing shows before the rename.
    assert path.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


def test_a_block_that_raises_leaves_the_old_file_and_no_temporary(tmp_path):
    path, tmp = tmp_path / "state.npz", tmp_path / ".tmp-1.npz"
    path.write_bytes(b"old")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY)
    opened = os.fdopen(fd, "wb")
    with pytest.raises(OSError, match="disk full"), atomic.replacing(str(path), str(tmp), opened):
        opened.write(b"half of it")
        raise OSError("disk full")
    assert path.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["state.npz"]
    assert opened.closed


def test_fsync_flushes_a_file_or_a_directory_and_skips_what_it_cannot(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    real, flushed = os.fsync, []

    def recording(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        if len(flushed) == 2:
            raise OSError("this filesystem refuses to fsync a directory")
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    for path in (tmp_path / "f", tmp_path, tmp_path / "missing"):
        atomic.fsync(str(path))  # The refusal and the missing file raise nothing.
    assert flushed == [str(tmp_path / "f"), str(tmp_path)]
