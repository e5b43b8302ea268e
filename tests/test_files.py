"""muoneq.suite.files: file names from free text and writes that a failure leaves whole."""

from __future__ import annotations

import pytest

from muoneq.suite.files import atomic_open, atomic_write, slug


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "metrics.json"
    atomic_write(path, "old")
    with pytest.raises(RuntimeError, match="cut short"):
        with atomic_open(path, "wb", fsync=True) as f:
            f.write(b"half of the new")
            assert path.read_text() == "old"  # nothing replaced while writing
            raise RuntimeError("cut short")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    with atomic_open(path, newline="") as f:
        f.write("a,b\r\n")
    assert path.read_bytes() == b"a,b\r\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_slug_keeps_the_allowed_characters_and_trims_the_separator():
    assert slug("val/loss (mean)") == "val_loss_mean"
    assert slug("lr=0.01 | K=5") == "lr=0.01_K=5"
    assert slug("///", empty="all") == "all"
    assert slug("nvidia h100 (80gb)", keep="a-z0-9", sep="-") == "nvidia-h100-80gb"
