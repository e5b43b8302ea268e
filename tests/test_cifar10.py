"""The CIFAR-10 workload: data loading in both on-disk formats, augmentation, the network."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from muoneq.suite.runtime.optim import build_optimizer_from_config
from muoneq_tasks.vision.cifar10_data import (
    augmentation_params,
    check_data,
    crop_flip,
    load_cifar10,
    normalize,
)
from muoneq_tasks.vision.resnet import CifarResNet
from tests.helpers.runtime import cifar_arrays, write_cifar_batches


def _chw(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images.transpose(0, 3, 1, 2).copy())


# ----------------------------------------------------------------------------- loading
@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_npz_archive_loads_exact_pixels(tmp_path, layout):
    arrays = cifar_arrays(12, 7)
    stored = dict(arrays)
    if layout == "chw":
        stored["x_train"] = arrays["x_train"].transpose(0, 3, 1, 2)
        stored["x_test"] = arrays["x_test"].transpose(0, 3, 1, 2)
    np.savez(tmp_path / "c.npz", **stored, label_names=np.array(["a"] * 10))
    data = load_cifar10(tmp_path / "c.npz")
    assert data.x_train.dtype == torch.uint8 and data.x_train.shape == (12, 3, 32, 32)
    assert torch.equal(data.x_train, _chw(arrays["x_train"]))
    assert torch.equal(data.x_test, _chw(arrays["x_test"]))
    assert data.y_train.tolist() == arrays["y_train"].tolist()
    # a folder holding cifar10.npz works too
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "cifar10.npz", **arrays)
    assert torch.equal(load_cifar10(tmp_path / "d").x_test, _chw(arrays["x_test"]))


def test_npz_errors_name_the_array(tmp_path):
    arrays = cifar_arrays(4, 4)
    np.savez(tmp_path / "a.npz", x_train=arrays["x_train"], y_train=arrays["y_train"])
    with pytest.raises(ValueError, match=r"missing array\(s\) \['x_test', 'y_test'\]"):
        load_cifar10(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", **{**arrays, "x_train": arrays["x_train"].astype(np.float32)})
    with pytest.raises(ValueError, match="x_train must be uint8"):
        load_cifar10(tmp_path / "b.npz")
    np.savez(tmp_path / "c.npz", **{**arrays, "y_test": arrays["y_test"][:2]})
    with pytest.raises(ValueError, match="y_test must be 4 integer labels"):
        load_cifar10(tmp_path / "c.npz")


def test_torchvision_batches_load_through_torchvision(tmp_path, monkeypatch):
    arrays = cifar_arrays(15, 6)
    md5 = write_cifar_batches(tmp_path, arrays)
    cls = torchvision.datasets.CIFAR10
    # torchvision md5-checks the real files; point its table at the files written here.
    monkeypatch.setattr(cls, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]]
                                            for i in range(1, 6)])
    monkeypatch.setattr(cls, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5["batches.meta"]})
    data = load_cifar10(tmp_path, download=False)
    assert torch.equal(data.x_train, _chw(arrays["x_train"]))
    assert torch.equal(data.x_test, _chw(arrays["x_test"]))
    assert data.y_train.tolist() == arrays["y_train"].tolist()


def test_corrupt_or_missing_data_says_where_to_put_files(tmp_path):
    write_cifar_batches(tmp_path, cifar_arrays(5, 5))  # md5s do not match the real files
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_cifar10(tmp_path / "empty", download=False)
    message = str(err.value)
    for needle in ("data_batch_1", "test_batch", "cifar-10-python.tar.gz", ".npz",
                   "task.data.download=true", str(tmp_path / "empty")):
        assert needle in message
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_cifar10(tmp_path / "nope.npz")


def test_the_data_check_finds_what_a_run_would_load_without_loading_it(tmp_path):
    """A sweep's preflight (and ``--dry-run``) says that CIFAR-10 is missing, before any run:
    from the files' names and an archive's array names."""
    from muoneq_tasks.vision.config import Cifar10DataConfig

    with pytest.raises(FileNotFoundError) as err:
        check_data(Cifar10DataConfig(root=str(tmp_path / "empty")))
    assert str(err.value).startswith(f"CIFAR-10 not found at task.data.root={tmp_path / 'empty'}"
                                     " (a run with task.data.download=true downloads it first, "
                                     "which needs the network)")
    arrays = cifar_arrays(5, 5)
    np.savez(tmp_path / "c.npz", **arrays)
    check_data(Cifar10DataConfig(root=str(tmp_path / "c.npz")))
    (tmp_path / "folder").mkdir()
    np.savez(tmp_path / "folder" / "cifar10.npz", **arrays)
    check_data(Cifar10DataConfig(root=str(tmp_path / "folder"), download=False))
    np.savez(tmp_path / "bad.npz", x_train=arrays["x_train"])
    with pytest.raises(ValueError, match=r"missing array\(s\) \['y_train', 'x_test', 'y_test'\]"):
        check_data(Cifar10DataConfig(root=str(tmp_path / "bad.npz")))


# ----------------------------------------------------------------------------- augmentation
def test_crop_flip_matches_per_image_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=gen)
    dx = torch.tensor([0, 8, 3, 4, 8, 0])
    dy = torch.tensor([0, 8, 5, 1, 0, 8])
    flip = torch.tensor([False, True, False, True, True, False])
    out = crop_flip(x, dx, dy, flip)
    for i in range(6):  # pad, slice, mirror: the definition of RandomCrop(32, 4) + flip
        ref = F.pad(x[i], (4, 4, 4, 4))[:, dy[i] : dy[i] + 32, dx[i] : dx[i] + 32]
        ref = ref.flip(-1) if flip[i] else ref
        assert torch.equal(out[i], ref)
    assert out.dtype == torch.uint8


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    idx = torch.arange(20000)
    a = augmentation_params(idx, seed=0, epoch=3)
    b = augmentation_params(idx.flip(0), seed=0, epoch=3)  # another batch layout
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v.flip(0))
    c = augmentation_params(idx, seed=0, epoch=4)
    d = augmentation_params(idx, seed=1, epoch=3)
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])
    dx, dy, flip = a
    # every offset 0..8 and both flips occur, about uniformly
    for offsets in (dx, dy):
        counts = torch.bincount(offsets, minlength=9).float()
        assert counts.numel() == 9 and (counts / counts.mean() - 1).abs().max() < 0.1
    assert abs(flip.float().mean().item() - 0.5) < 0.02


def test_normalize_uses_cifar_statistics():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(x)
    expected = (1 - torch.tensor([0.4914, 0.4822, 0.4465])) / torch.tensor([0.2470, 0.2435, 0.2616])
    assert torch.allclose(out[0, :, 0, 0], expected)


# ----------------------------------------------------------------------------- network
def test_resnet18_is_torchvisions_with_the_cifar_stem():
    reference = torchvision.models.resnet18(num_classes=10)
    reference.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    reference.maxpool = nn.Identity()
    ours = CifarResNet()
    assert sum(p.numel() for p in ours.parameters()) == 11_173_962
    ours.load_state_dict(reference.state_dict(), strict=True)  # same names and shapes
    ours.eval(), reference.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(ours(x), reference(x), atol=1e-5)


def test_routing_presets_on_resnet():
    model = CifarResNet(blocks=[1, 1], width=4)
    stem, head = model.conv1.weight, model.fc.weight

    def paths(routing):
        cfg = {"name": "muoneq_nes", "lr": 0.05, "routing": routing, "adamw_names": []}
        groups = build_optimizer_from_config(model, cfg).param_groups
        return {g["use_muon"]: {id(p) for p in g["params"]} for g in groups}

    paper = paths("all_matrices")  # the paper's CIFAR recipe: every >=2-D tensor on Muon
    assert {id(stem), id(head)} <= paper[True]
    assert all(p.ndim >= 2 for p in model.parameters() if id(p) in paper[True])
    assert all(p.ndim == 1 for p in model.parameters() if id(p) in paper[False])
    keller = paths("default")  # stem and classifier on AdamW
    assert {id(stem), id(head)} <= keller[False]


# ----------------------------------------------------------------------------- training
def test_device_side_augmentation_trains_identically_and_the_network_learns(tmp_path):
    """``augment_on_device`` moves the same per-sample augmentation after the copy: on the CPU
    both placements give bitwise the same run. The tiny network learns the colour-coded
    classes well above chance (10%)."""
    from muoneq.suite.runtime import compose, train
    from tests.helpers.runtime import tiny_cifar10

    torch.set_num_threads(1)
    states, metrics = [], []
    for on_device in (False, True):
        run = tmp_path / f"run{on_device}"
        cfg = compose(["experiment=cifar10_resnet18", *tiny_cifar10(tmp_path),
                       "trainer.max_epochs=4", f"task.data.augment_on_device={on_device}",
                       f"run.dir={run}"])
        metrics.append(train(cfg))
        states.append(torch.load(next((run / "checkpoints").glob("last-*.ckpt")),
                                 weights_only=False)["state_dict"])
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
    assert metrics[0]["test/acc"] == metrics[1]["test/acc"] >= 0.3
