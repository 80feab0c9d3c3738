"""Models from the papers, as plain torch modules (no torchvision).

All models return logits; training uses cross-entropy (= the papers' log_softmax + NLL).
Dropout layers draw their masks from an explicit generator (`SeededDropout`), so a client's
training is a pure function of (weights, data, seed) and the batched engine can replay it exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from edge_client.registry import PluginError, Registry, blame


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


def _is_model_builder(obj) -> str | None:
    return None if callable(obj) else "a callable (input_shape, num_classes[, dropout=]) -> torch.nn.Module"


# The models by --model name (edge_client/registry.py). Each entry is a builder called as
# build(input_shape, num_classes), plus dropout= where --dropout is given, under torch.manual_seed(seed); a plugin
# (entry point group dropfl.models, or module:attr) is the same. Its facts, declared here with the model:
#   cpu_first          the batched engine's forward runs fused CPU kernels, so --sim-device auto trains it on the
#                      CPU (coordinator/sim/batched.py auto_device; tests/test_engine_device.py checks the forwards)
#   batch_independent  a client's result does not depend on the other clients in its batched computation (on the
#                      CPU paths; the LeNets with their native kernels), so lockstep sweeps may merge runs
#                      (coordinator/sim/lockstep.py; the engine checks the run's own model: batched.batch_independent)
MODELS = Registry("model", "dropfl.models", check=_is_model_builder,
                  meta={"cpu_first": False, "batch_independent": False})


@MODELS.register("mimic-cnn", cpu_first=True, batch_independent=True)
def mimic_cnn(input_shape, num_classes=10, dropout=None):   # no dropout layers: --dropout does not apply
    c, h, _ = input_shape
    return MimicCNN(c, num_classes, h)


@MODELS.register("fdms-cnn", cpu_first=True)
def fdms_cnn(input_shape, num_classes=10, **kw):
    return FdmsMnistCNN(input_shape[0], num_classes, **kw)


@MODELS.register("cifar-lenet", cpu_first=True, batch_independent=True)
def cifar_lenet(input_shape, num_classes=10, dropout=None):
    c, h, _ = input_shape
    return CifarLeNet(c, num_classes, h)


@MODELS.register("vgg11")
def vgg11(input_shape, num_classes=10, **kw):
    return VGG11(input_shape[0], num_classes, **kw)


@MODELS.register("mlp", batch_independent=True)
def mlp(input_shape, num_classes=10, dropout=None):
    return MLP(math.prod(input_shape), num_classes)


@MODELS.register("logreg", batch_independent=True)
def logreg(input_shape, num_classes=10, dropout=None):
    return LogReg(math.prod(input_shape), num_classes)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int = 10, seed: int = 0,
                dropout: float | None = None) -> nn.Module:
    """Build the model `name` (a registered name, an entry point of dropfl.models, or module:attr) for inputs
    of shape (C, H, W), initialised from `seed`. ValueError (one line) if the name does not resolve."""
    try:
        entry = MODELS.entry(name)
    except PluginError as e:
        raise ValueError(f"--model: {e}") from None
    torch.manual_seed(seed)
    kw = {} if dropout is None else {"dropout": dropout}
    with blame(entry, ValueError):
        model = entry.obj(tuple(input_shape), num_classes, **kw)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name}: its builder returned {type(model).__name__}, not a torch.nn.Module")
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def get_flat(model: nn.Module) -> torch.Tensor:
    """The parameters as one new flat vector (torch.cat's copy: it shares no memory with the model), each in its
    logical (NCHW) order whatever its memory format (a channels-last parameter is not a view of a flat vector)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


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


def get_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's buffers by name (BatchNorm's running_mean, running_var, num_batches_tracked): the part
    of its state that is not in `get_flat` (parameters only). {} for a model without buffers."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


@torch.no_grad()
def set_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Copy `buffers` (names as `get_buffers` gives them, all of the model's) into the model's buffers."""
    own = dict(model.named_buffers())
    if set(own) != set(buffers):
        raise ValueError(f"buffers {sorted(buffers)} do not match the model's {sorted(own)}")
    for n, b in own.items():
        b.copy_(buffers[n])
