"""A small ResNet with BatchNorm, as a model plugin.

K. He, X. Zhang, S. Ren, J. Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, §4.2 (the CIFAR-10
ResNets: a 3×3 stem, three stages of basic blocks with 16, 32, 64 channels, global average pooling). With one
basic block per stage it has 1 + 3·2 + 1 = 8 weighted layers: ResNet-8.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """conv3×3-BN-ReLU-conv3×3-BN, plus the input (a 1×1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet8(nn.Module):
    """ResNet-8 (He et al. 2016, §4.2 with n = 1): stem conv3×3(C→w)-BN-ReLU; blocks w, 2w (stride 2), 4w
    (stride 2); global average pooling; Linear(4w, classes). `width` w = 16 as in the paper. Any input of shape
    (C, H, W) with H, W ≥ 4 (1×28×28 FMNIST/MNIST, 3×32×32 CIFAR-10); 77,754 parameters at C = 1 and 78,042
    at C = 3 (w = 16)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def resnet8(input_shape: tuple[int, ...], num_classes: int = 10, dropout: float | None = None) -> ResNet8:
    """The model registry's builder (`--model resnet8`): dropfl calls it under torch.manual_seed(seed).
    ResNet-8 has no dropout layers: --dropout is refused rather than ignored."""
    if dropout is not None:
        raise ValueError("resnet8 has no dropout layers: leave --dropout out")
    if len(input_shape) != 3:
        raise ValueError(f"resnet8 takes images (C, H, W), not inputs of shape {tuple(input_shape)}")
    return ResNet8(input_shape[0], num_classes)
