"""What the tests share: a client update from plain numbers."""

from __future__ import annotations

import dropfl
import torch


def update(client: int, delta: list[float], num_samples: int = 1) -> dropfl.ClientUpdate:
    return dropfl.ClientUpdate(client=client, delta=torch.tensor(delta, dtype=torch.float32),
                               num_samples=num_samples, steps=1, lr=0.1)


def vec(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)
