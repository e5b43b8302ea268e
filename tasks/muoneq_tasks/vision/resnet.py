"""ResNet-18, CIFAR variant: a 3×3 stride-1 stem and no max-pool (He et al., 2016, §4.2).

Built from torchvision's ``BasicBlock`` with torchvision's layer names (``conv1``, ``bn1``,
``layer1``…``layer4``, ``fc``) and initialization, so with ``width=64`` it is exactly
``torchvision.models.resnet18(num_classes=10)`` with ``conv1`` replaced by a 3×3 stride-1
convolution and ``maxpool`` removed — the standard adaptation to 32×32 images (the ImageNet
stem does worse there). ``width`` and ``blocks`` are configurable only so that tests can run a
small network through the same code; torchvision's ``ResNet`` class fixes the widths, hence
this class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, conv1x1


class CifarResNet(nn.Module):
    """``blocks=(2, 2, 2, 2)``, ``width=64``: ResNet-18 for 32×32 inputs (11.2M parameters)."""

    def __init__(
        self, blocks: Sequence[int] = (2, 2, 2, 2), width: int = 64, num_classes: int = 10
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        inplanes = width
        for i, count in enumerate(blocks):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            downsample = None
            if stride != 1 or inplanes != planes:
                downsample = nn.Sequential(
                    conv1x1(inplanes, planes, stride), nn.BatchNorm2d(planes)
                )
            layer = [BasicBlock(inplanes, planes, stride, downsample)]
            layer += [BasicBlock(planes, planes) for _ in range(count - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*layer))
            inplanes = planes
        self.num_stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        for m in self.modules():  # torchvision's ResNet initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
