"""The workloads of `sim_throughput.py --workload` and the models they train, importable with torch alone: dropfl's
venv, benchmarks/.venv-flower (flower_sim.py) and benchmarks/.venv-pfl (pfl_sim.py) build the same layers from here.

- `mimic-fmnist`: MimiC's FMNIST LeNet (6/16/120/84/10; dropfl trains its registered `mimic-cnn`, whose
  hand-written batched forward and native kernels exist), real FMNIST, 30 clients, batch 16.
- `resnet8-cifar`: the ResNet-8 with BatchNorm of the examples plugin package
  (examples/dropfl-examples/src/dropfl_examples/resnet.py, He et al. 2016, width 16, 78,042 parameters),
  CIFAR-shaped synthetic data [3, 32, 32], 10 classes, 20 clients, batch 16.
- `pfl-cifar10`: pfl-research's CIFAR-10 benchmark setup (apple/pfl-research,
  benchmarks/image_classification/configs/baseline.yaml: dataset cifar10_iid, 50 data points per user, so
  50,000 / 50 = 1,000 users; cohort_size 50; local_batch_size 10; local_num_epochs 1, so 5 local steps;
  local_learning_rate 0.1; model simple_cnn), CIFAR-shaped synthetic data [3, 32, 32], 10 classes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "dropfl-examples" / "src"


@dataclass(frozen=True)
class Workload:
    clients: int           # the population
    per_round: int         # clients trained per round (sampled from the population)
    samples: int           # samples per client
    batch: int
    steps: int             # local steps per client per measured round
    lr: float
    shape: tuple[int, int, int]
    synthetic: bool        # CIFAR-shaped random data (True) or real FMNIST (False)


WORKLOADS = {
    "mimic-fmnist": Workload(30, 30, 2000, 16, 50, 0.01, (1, 28, 28), False),
    "resnet8-cifar": Workload(20, 20, 160, 16, 5, 0.05, (3, 32, 32), True),
    "pfl-cifar10": Workload(1000, 50, 50, 10, 5, 0.1, (3, 32, 32), True),
}


class LeNet(nn.Module):
    """The layers of edge_client.models.MimicCNN (dropfl's `mimic-cnn`), for the other frameworks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(256, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


class PflCNN(nn.Module):
    """pfl-research's `simple_cnn` (benchmarks/model/pytorch/cnn.py in apple/pfl-research), the model of its
    CIFAR-10 benchmark: conv 3→32 3×3, ReLU, conv 32→64 3×3, ReLU, max-pool 2, dropout 0.25, flatten,
    Linear(14·14·64 = 12,544 → 128), ReLU, dropout 0.5, Linear(128 → 10); Glorot-uniform weights; 1,626,442
    parameters at 3×32×32. pfl's version starts with a `Transpose2D` (its images are [H, W, C]); these take
    [C, H, W]. `dropout`: the dropout layer's class (dropfl's `SeededDropout`, whose masks the engines replay;
    `nn.Dropout` for the other frameworks)."""

    def __init__(self, in_channels: int = 3, side: int = 32, num_classes: int = 10,
                 dropout: type[nn.Module] = nn.Dropout) -> None:
        super().__init__()
        flat = ((side - 4) // 2) ** 2 * 64
        self.conv1, self.conv2 = nn.Conv2d(in_channels, 32, 3), nn.Conv2d(32, 64, 3)
        self.drop1, self.drop2 = dropout(0.25), dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(flat, 128), nn.Linear(128, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        x = self.drop1(x).flatten(1)
        return self.fc2(self.drop2(torch.relu(self.fc1(x))))


def resnet8(in_channels: int = 3, num_classes: int = 10) -> nn.Module:
    """The examples plugin package's ResNet-8 (imported from its source tree where it is not installed)."""
    try:
        from dropfl_examples.resnet import ResNet8
    except ImportError:
        sys.path.insert(0, str(_EXAMPLES))
        from dropfl_examples.resnet import ResNet8
    return ResNet8(in_channels, num_classes)


def build(name: str, dropout: type[nn.Module] = nn.Dropout, seed: int = 0) -> nn.Module:
    """The workload's model as the other frameworks train it (dropfl builds mimic-cnn through its registry)."""
    torch.manual_seed(seed)
    if name == "mimic-fmnist":
        return LeNet()
    if name == "resnet8-cifar":
        return resnet8(3, 10)
    if name == "pfl-cifar10":
        return PflCNN(dropout=dropout)
    raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
