"""The CIFAR-10 task's data for miniatures (``muoneq sweep ablation-cifar10 --mini``): real
images available offline, never synthetic ones. CIFAR-10 itself cannot ship with the suite
(163 MB, downloaded from its authors); scikit-learn, a declared dependency of the suite, ships
the UCI handwritten digits (``sklearn.datasets.load_digits``: 1,797 images of 8×8 pixels in 17
grey levels, 10 classes, from 43 writers). They are written in the task's own format
(:func:`.cifar10_data.load_npz`) at their own size: each pixel scaled to 0–255, the grey copied
to three channels, and split 80/20 into training and test images by a fixed permutation (seed
0), so the run is the CIFAR pipeline (the network is fully convolutional up to its global
pooling) on another, much easier and 16× smaller, data set."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from muoneq.suite.runtime.tasks import MiniData

ARCHIVE = "digits.npz"
TEST_SHARE = 0.2
DESCRIPTION = ("scikit-learn's UCI handwritten digits (load_digits: 1,797 real 8×8 grey images, "
               "10 classes; 1,437 for training, 360 for the test), not CIFAR-10")


def digits_arrays() -> dict[str, np.ndarray]:
    """The digits as CIFAR-format arrays (module docstring)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = np.round(digits.images * (255 / 16)).astype(np.uint8)  # values 0..16
    images = grey[..., None].repeat(3, axis=3)  # (N, 8, 8, 3)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = round(TEST_SHARE * len(labels))
    train, test = order[:-n_test], order[-n_test:]
    return {"x_train": images[train], "y_train": labels[train],
            "x_test": images[test], "y_test": labels[test]}


def mini_data(folder: Path) -> MiniData:
    """``<folder>/digits.npz`` (written unless already there), and the overrides that read
    it."""
    path = Path(folder) / ARCHIVE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial.npz")
        np.savez(partial, **digits_arrays())
        partial.replace(path)
    return MiniData([f"task.data.root={path}", "task.data.download=false"], DESCRIPTION)
