"""CIFAR-10: loading (torchvision's python batches or a numpy archive), augmentation, loaders.

Sources, tried in this order for ``task.data.root``:

1. a ``.npz`` file with arrays ``x_train`` (N, 32, 32, 3) or (N, 3, 32, 32) uint8 (CIFAR-10's
   size; images of another square size are read as they are: the miniature's 8×8 digits,
   :mod:`.digits`), ``y_train``
   (N,) integer labels in 0..9, ``x_test``, ``y_test`` — the form many groups keep CIFAR in;
2. a folder with torchvision's layout, ``<root>/cifar-10-batches-py/`` (``data_batch_1`` …
   ``data_batch_5``, ``test_batch``, ``batches.meta``, md5-checked by torchvision);
3. a folder holding ``cifar10.npz`` (as 1);
4. with ``task.data.download=true``, torchvision downloads the python version into ``root``
   (or extracts ``cifar-10-python.tar.gz`` already copied there, after checking its md5).

Nothing is ever substituted: when none is found the error says where to put which file.

Augmentation (training only): random 32×32 crop of the image zero-padded by 4 pixels and a
horizontal flip with probability 1/2, then per-channel normalization. The crop offsets and the
flip of a sample are a hash of ``(seed, epoch, sample index)``, so they do not depend on the
batch layout, the number of processes or loader workers, and a resumed run augments exactly as
an uninterrupted one. torchvision's transforms draw one crop for a whole batch tensor, and torch
has no counter-based per-element random generator, hence the small hand-written hash and the
batched gather below. ``augment_on_device`` moves the augmentation after the host-to-device copy
(uint8 images are copied, 4× fewer bytes than floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from muoneq.suite.errors import DataError, UserError
from muoneq.suite.runtime import TaskDataModule
from muoneq_tasks.vision.config import Cifar10DataConfig

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass
class Cifar10Arrays:
    """uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def missing_data_message(root: Path, reason: str = "") -> str:
    """One line: where CIFAR-10 was looked for, then the three ways to provide it."""
    return (
        f"CIFAR-10 not found at task.data.root={root}{f' ({reason})' if reason else ''}; "
        f"download it with task.data.download=true on a machine with network access "
        f"(torchvision fetches {CIFAR10_URL}), or offline copy cifar-10-python.tar.gz into "
        f"{root}/ (keep task.data.download=true: it is md5-checked and extracted) or extract it "
        f"so that {root}/cifar-10-batches-py/ holds data_batch_1 … data_batch_5, test_batch and "
        "batches.meta, or point task.data.root at an .npz with arrays x_train (N,32,32,3) "
        "uint8, y_train, x_test, y_test"
    )


class Cifar10FormatError(UserError, ValueError):
    """An archive whose arrays are not CIFAR-10's (the message names the array)."""


def _bad(path: Path, text: str) -> Cifar10FormatError:
    return Cifar10FormatError(f"{path}: {text}; save the archive with x_train, x_test as uint8 "
                              "(N,32,32,3) or (N,3,32,32) and y_train, y_test as labels 0..9")


def _images(array: np.ndarray, key: str, path: Path) -> torch.Tensor:
    if array.dtype != np.uint8 or array.ndim != 4:
        raise _bad(path, f"{key} must be uint8 images, got {array.dtype} {array.shape}")
    if array.shape[3] == 3 and array.shape[1] == array.shape[2]:
        array = array.transpose(0, 3, 1, 2)
    elif not (array.shape[1] == 3 and array.shape[2] == array.shape[3]):
        raise _bad(path, f"{key} must be (N,32,32,3) or (N,3,32,32) (CIFAR-10's; another square "
                         f"size is read too), got {array.shape}")
    return torch.from_numpy(np.ascontiguousarray(array))


def _labels(array: np.ndarray, key: str, path: Path, count: int) -> torch.Tensor:
    if array.ndim != 1 or len(array) != count or not np.issubdtype(array.dtype, np.integer):
        raise _bad(path, f"{key} must be {count} integer labels, got {array.dtype} "
                         f"{array.shape}")
    if len(array) and (array.min() < 0 or array.max() > 9):
        raise _bad(path, f"{key} must hold labels 0..9, got {array.min()}..{array.max()}")
    return torch.from_numpy(array.astype(np.int64))


def load_npz(path: Path) -> Cifar10Arrays:
    with np.load(path, allow_pickle=False) as archive:
        missing = [k for k in NPZ_KEYS if k not in archive.files]
        if missing:
            raise _bad(path, f"missing array(s) {missing} (found {archive.files})")
        x_train = _images(archive["x_train"], "x_train", path)
        x_test = _images(archive["x_test"], "x_test", path)
        y_train = _labels(archive["y_train"], "y_train", path, len(x_train))
        y_test = _labels(archive["y_test"], "y_test", path, len(x_test))
    return Cifar10Arrays(x_train, y_train, x_test, y_test)


#: CIFAR-10's training and test images.
TRAIN_IMAGES, TEST_IMAGES = 50_000, 10_000


def write_synthetic(cfg, folder: str | Path) -> list[str]:
    """Random uint8 images and labels with CIFAR-10's shapes, as ``<folder>/cifar10.npz``:
    CIFAR-10's 50,000 training and 10,000 test images, or ``task.data.train_subset`` training
    images and a fifth as many test images (CIFAR-10's ratio); the overrides that point the
    run ``cfg`` at them."""
    subset = cfg.task.data.train_subset
    sizes = {"train": subset or TRAIN_IMAGES,
             "test": max(1, subset // 5) if subset else TEST_IMAGES}
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in sizes.items():
        arrays[f"x_{split}"] = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        arrays[f"y_{split}"] = rng.integers(0, 10, n, dtype=np.int64)
    path = Path(folder) / "cifar10.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return [f"task.data.root={path}"]


def load_torchvision(root: Path, download: bool) -> Cifar10Arrays:
    from torchvision.datasets import CIFAR10

    parts = []
    for train in (True, False):
        try:
            dataset = CIFAR10(str(root), train=train, download=download)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            raise DataError(missing_data_message(root, str(err))) from None
        except OSError as err:  # no network, DNS failure, ...
            raise DataError(missing_data_message(root, f"download failed: {err}")) from None
        parts.append(_images(dataset.data, "data", root))
        parts.append(torch.tensor(dataset.targets, dtype=torch.int64))
    return Cifar10Arrays(*parts)


def load_cifar10(root: str | Path, *, download: bool = False) -> Cifar10Arrays:
    """Load CIFAR-10 from ``root`` (see the module docstring), downloading if allowed."""
    root = Path(root).expanduser()
    if root.suffix == ".npz":
        if not root.is_file():
            raise DataError(missing_data_message(root, "no such file"))
        return load_npz(root)
    if (root / "cifar-10-batches-py").is_dir():
        return load_torchvision(root, download=False)
    if (root / "cifar10.npz").is_file():
        return load_npz(root / "cifar10.npz")
    if download:
        return load_torchvision(root, download=True)
    raise DataError(missing_data_message(root))


def check_data(config: Cifar10DataConfig) -> None:
    """What a run of ``config`` would say about its data before its first step, from the
    files' names and an archive's array names (nothing is loaded or downloaded): a
    :class:`DataError` when no source of the module docstring holds CIFAR-10 (with
    ``task.data.download=true`` the run would download it, so the message says that this needs
    the network), a :class:`Cifar10FormatError` for an archive without CIFAR-10's arrays."""
    root = Path(config.root).expanduser()
    archive = root if root.suffix == ".npz" else root / "cifar10.npz"
    if archive.is_file() and not (root / "cifar-10-batches-py").is_dir():
        with np.load(archive, allow_pickle=False) as found:
            missing = [k for k in NPZ_KEYS if k not in found.files]
        if missing:
            raise _bad(archive, f"missing array(s) {missing} (found {found.files})")
        return
    if not needs_download(root) and root.suffix != ".npz":
        return
    reason = ("no such file" if root.suffix == ".npz" else
              "a run with task.data.download=true downloads it first, which needs the network"
              if config.download else "")
    raise DataError(missing_data_message(root, reason))


def needs_download(root: str | Path) -> bool:
    root = Path(root).expanduser()
    return root.suffix != ".npz" and not (root / "cifar-10-batches-py").is_dir() and not (
        root / "cifar10.npz"
    ).is_file()


# --------------------------------------------------------------------------- augmentation
def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele et al., 2014) on uint64 arrays (wrapping)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def augmentation_params(indices: torch.Tensor, *, seed: int, epoch: int, pad: int = 4):
    """Per-sample ``(dx, dy, flip)`` for dataset ``indices``: a hash of (seed, epoch, index)."""
    key = _splitmix64(np.array([seed * 1_000_003 + epoch], dtype=np.uint64))
    z = _splitmix64(indices.numpy().astype(np.uint64) ^ key)
    span = np.uint64(2 * pad + 1)
    dx, dy, flip = z % span, (z // span) % span, (z // (span * span)) % np.uint64(2)
    as_tensor = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return as_tensor(dx), as_tensor(dy), as_tensor(flip).bool()


def crop_flip(x: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, flip: torch.Tensor,
              pad: int = 4) -> torch.Tensor:
    """Crop every image of ``x`` (B, C, H, W), zero-padded by ``pad``, at its own offset
    ``(dy, dx)`` and mirror those with ``flip``: one gather for the whole batch."""
    b, c, h, w = x.shape
    device = x.device
    dx, dy, flip = dx.to(device), dy.to(device), flip.to(device)
    padded = F.pad(x, (pad, pad, pad, pad))
    cols = torch.arange(w, device=device)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + dx[:, None]
    rows = torch.arange(h, device=device) + dy[:, None]
    return padded[
        torch.arange(b, device=device).view(b, 1, 1, 1),
        torch.arange(c, device=device).view(1, c, 1, 1),
        rows.view(b, 1, h, 1),
        cols.view(b, 1, 1, w),
    ]


def normalize(x: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    return (x.float() / 255.0 - mean) / std


# --------------------------------------------------------------------------- loaders
class IndexedImages(Dataset):
    """In-memory images and labels; batches come as ``(images uint8, labels, indices)``.

    ``__getitems__`` fetches a whole batch with one indexing operation (PyTorch's batched
    fetch), instead of collating single images."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index], index

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.int64)
        return self.images[idx], self.labels[idx], idx


def _as_batch(batch):
    return batch


class Cifar10DataModule(TaskDataModule):
    """CIFAR-10 loaders: the training set shuffled by
    :class:`~muoneq.suite.runtime.ResumableSampler`
    and sharded over processes; the full test set (and optional validation split) sharded
    without padding so that accuracy is exact over all 10,000 images."""

    def __init__(self, config: Cifar10DataConfig, *, seed: int):
        super().__init__()
        self.config, self.seed = config, seed
        self.data: Cifar10Arrays | None = None

    def prepare_data(self) -> None:
        """Download once per node (Lightning calls this on local rank 0 only)."""
        if self.config.download and needs_download(self.config.root):
            load_torchvision(Path(self.config.root).expanduser(), download=True)

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        arrays = load_cifar10(self.config.root, download=False)
        cfg = self.config
        x, y = arrays.x_train, arrays.y_train
        if cfg.train_subset is not None:
            x, y = x[: cfg.train_subset], y[: cfg.train_subset]
        if cfg.val_size:
            if cfg.val_size >= len(y):
                raise ValueError(
                    f"task.data.val_size={cfg.val_size} leaves no training images (of {len(y)})"
                )
            self.val = IndexedImages(x[-cfg.val_size :], y[-cfg.val_size :])
            x, y = x[: -cfg.val_size], y[: -cfg.val_size]
        self.train = IndexedImages(x, y)
        self.test = IndexedImages(arrays.x_test, arrays.y_test)
        if not cfg.val_size:
            self.val = self.test
        self.data = arrays

    def _loader(self, dataset: IndexedImages, *, batch_size: int, sampler, drop_last: bool):
        pin = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
            num_workers=self.config.num_workers, persistent_workers=self.config.num_workers > 0,
            collate_fn=_as_batch, pin_memory=pin, worker_init_fn=self.worker_init_fn(),
        )

    def train_dataloader(self) -> DataLoader:
        batch = self.per_rank(self.config.batch_size)
        sampler = self.train_sampler(len(self.train), batch_size=batch, seed=self.seed)
        return self._loader(self.train, batch_size=batch, sampler=sampler,
                            drop_last=self.config.drop_last)

    def _eval_loader(self, dataset: IndexedImages) -> DataLoader:
        batch = max(1, self.config.eval_batch_size // self.world_size)
        indices = list(self.eval_indices(len(dataset)))
        return self._loader(dataset, batch_size=batch, sampler=indices, drop_last=False)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test)

    # ------------------------------------------------------------------ augmentation hooks
    def _augment(self, images: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        dx, dy, flip = augmentation_params(
            indices.cpu(), seed=self.seed, epoch=self.trainer.current_epoch
        )
        return crop_flip(images, dx, dy, flip)

    def _training(self) -> bool:
        return self.trainer is not None and self.trainer.training and self.config.augment

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        images, labels, indices = batch
        if self._training() and not self.config.augment_on_device:
            images = self._augment(images, indices)
        return images, labels, indices

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels, indices = batch
        if self._training() and self.config.augment_on_device:
            images = self._augment(images, indices)
        return normalize(images), labels
