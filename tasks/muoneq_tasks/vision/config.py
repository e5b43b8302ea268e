"""The typed config of the ``cifar10`` task (``task.*``), apart from the task's modules so that
composing a config (``muoneq train --print-config``, a sweep's checks) never imports Lightning."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Cifar10DataConfig:
    #: A folder (torchvision layout, or holding cifar10.npz) or a .npz file.
    root: str = "data/cifar10"
    #: Let torchvision download the python version into ``root`` when it is missing.
    download: bool = True
    #: Global batch size (split evenly across processes).
    batch_size: int = 128
    eval_batch_size: int = 1000
    num_workers: int = 0
    augment: bool = True
    augment_on_device: bool = False
    #: Train on the first N training images only (None: all).
    train_subset: int | None = None
    #: Hold out the last N training images to validate (and choose ``best.ckpt``); 0: no
    #: validation (the test set is never used to select anything).
    val_size: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        for key in ("batch_size", "eval_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.data.{key}: must be ≥ 1, got {getattr(self, key)}")
        if self.num_workers < 0 or self.val_size < 0:
            raise ValueError("task.data.num_workers / task.data.val_size: must be ≥ 0")
        if self.train_subset is not None and self.train_subset < 1:
            raise ValueError(
                f"task.data.train_subset: must be ≥ 1 or null, got {self.train_subset}"
            )


@dataclass
class ResNetConfig:
    #: BasicBlocks per stage: (2, 2, 2, 2) is ResNet-18.
    blocks: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    #: Channels of the first stage (doubled at every stage); 64 is ResNet-18.
    width: int = 64

    def __post_init__(self) -> None:
        if not self.blocks or min(self.blocks) < 1:
            raise ValueError(f"task.model.blocks: expected counts ≥ 1, got {self.blocks}")
        if self.width < 1:
            raise ValueError(f"task.model.width: must be ≥ 1, got {self.width}")


@dataclass
class Cifar10TaskConfig:
    name: str = "cifar10"
    data: Cifar10DataConfig = field(default_factory=Cifar10DataConfig)
    model: ResNetConfig = field(default_factory=ResNetConfig)
