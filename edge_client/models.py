"""Models from the papers, as plain torch modules (no torchvision).

All models return logits; training uses cross-entropy (= the papers' log_softmax + NLL).
Dropout layers draw their masks from an explicit generator (`SeededDropout`), so a client's
training is a pure function of (weights, data, seed) and the batched engine can replay it exactly.
"""

from __future__ import annotations

import torch
from torch import nn


class SeededDropout(nn.Module):
    """Inverted dropout whose mask comes from `self.generator` (set by the trainer).

    Element-wise (`channel=False`) or whole-channel (`channel=True`, like nn.Dropout2d).
    The mask for an input of shape [B, C, ...] is drawn as torch.rand([B, C] or full shape, generator).
    """

    def __init__(self, p: float, channel: bool = False):
        super().__init__()
        self.p, self.channel = p, channel
        self.generator: torch.Generator | None = None

    def mask_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape[:2]) + (1,) * (x.dim() - 2) if self.channel else tuple(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = torch.rand(self.mask_shape(x), generator=self.generator) >= self.p
        return x * keep.to(x.device, x.dtype) / (1.0 - self.p)  # drawn on the CPU generator on any device


class MimicCNN(nn.Module):
    """MimiC's FMNIST CNN (code `SimpleCNNMNIST`): conv 1→6 5×5, pool, conv 6→16 5×5, pool,
    FC 256→120→84→10, ReLU. 44,426 parameters."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, side: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        flat = 16 * (((side - 4) // 2 - 4) // 2) ** 2
        self.fc1, self.fc2, self.fc3 = nn.Linear(flat, 120), nn.Linear(120, 84), nn.Linear(84, num_classes)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CifarLeNet(MimicCNN):
    """FL-FDMS `CNNCifar` (LeNet-5): conv 3→6, pool, conv 6→16, pool, FC 400→120→84→10. 62,006 parameters."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, side: int = 32):
        super().__init__(in_channels, num_classes, side)


class FdmsMnistCNN(nn.Module):
    """FL-FDMS MNIST CNN (Jadhav `CNNMnist`): conv 1→10 5×5, pool, ReLU; conv 10→20 5×5, Dropout2d,
    pool, ReLU; FC 320→50, ReLU, Dropout; FC 50→10. 21,840 parameters. `dropout` defaults to the
    reference code's 0.5 (the paper text does not mention dropout; pass 0 to leave it out)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.drop2d = SeededDropout(dropout, channel=True)
        self.fc1, self.fc2 = nn.Linear(320, 50), nn.Linear(50, num_classes)
        self.drop = SeededDropout(dropout)

    def forward(self, x):
        x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
        x = torch.relu(torch.max_pool2d(self.drop2d(self.conv2(x)), 2))
        x = self.drop(torch.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


class VGG11(nn.Module):
    """MimiC's CIFAR-10 VGG-11 (config A, no BatchNorm), classifier Dropout→512→512→10.
    Conv weights ~ N(0, sqrt(2 / (k² · C_out))), conv biases 0 (as in the released code)."""

    CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

    def __init__(self, in_channels: int = 3, num_classes: int = 10, dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                conv = nn.Conv2d(c, v, 3, padding=1)
                nn.init.normal_(conv.weight, 0.0, (2.0 / (9 * v)) ** 0.5)
                nn.init.zeros_(conv.bias)
                layers += [conv, nn.ReLU()]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(SeededDropout(dropout), nn.Linear(512, 512), nn.ReLU(),
                                        SeededDropout(dropout), nn.Linear(512, 512), nn.ReLU(),
                                        nn.Linear(512, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class MLP(nn.Module):
    """MLP 784-200-200-10 with ReLU (McMahan et al. 2017's 2NN)."""

    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden: int = 200):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(in_features, hidden), nn.Linear(hidden, hidden), \
            nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


class LogReg(nn.Module):
    """Multinomial logistic regression (FedLaAvg MNIST): Linear(784, 10), 7,850 parameters."""

    def __init__(self, in_features: int = 784, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


MODELS = ("mimic-cnn", "fdms-cnn", "cifar-lenet", "vgg11", "mlp", "logreg")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int = 10, seed: int = 0,
                dropout: float | None = None) -> nn.Module:
    """Build a model for inputs of shape (C, H, W), initialised from `seed`."""
    c, h, w = input_shape
    torch.manual_seed(seed)
    kw = {} if dropout is None else {"dropout": dropout}
    if name == "mimic-cnn":
        m = MimicCNN(c, num_classes, h)
    elif name == "cifar-lenet":
        m = CifarLeNet(c, num_classes, h)
    elif name == "fdms-cnn":
        m = FdmsMnistCNN(c, num_classes, **kw)
    elif name == "vgg11":
        m = VGG11(c, num_classes, **kw)
    elif name == "mlp":
        m = MLP(c * h * w, num_classes)
    elif name == "logreg":
        m = LogReg(c * h * w, num_classes)
    else:
        raise ValueError(f"--model: unknown model {name!r} (choose from {', '.join(MODELS)})")
    return m


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_flat(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


@torch.no_grad()
def set_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (unlike torch's vector_to_parameters, which
    makes the parameters views of the vector, so training would write into the caller's tensor)."""
    i = 0
    for p in model.parameters():
        p.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    if i != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, the model {i} parameters")


def dropout_layers(model: nn.Module) -> list[SeededDropout]:
    return [m for m in model.modules() if isinstance(m, SeededDropout)]
