"""Batched simulation engine: all clients of a round trained as ONE computation, exactly like the loop.

Longer than the ~300-line rule because it is one idea that only reads as a whole: the batched layers,
the step plan that replays each client's batches and dropout masks, and the worker pool that runs slices
of it must agree line by line with `local_train` for the results to be exact.

Every parameter gets a leading client dimension ([K, *shape]); convolutions become grouped
convolutions (groups = K) on activations laid out [B, K·C, H, W], linear layers become batched
matmuls on [K, B, F]. Each client's loss only depends on its own slice, so one backward pass of
Σ_k loss_k gives every client exactly the gradient `local_train` computes for it.

Exactness, client by client (see docs/engine.md):
- batches: `batch_plan`'s table (`batch_table`) is replayed with the client's own `client_generator`;
- dropout masks: drawn from that same generator, with the client's real batch shape, in the
  model's forward order, after the plan (as `local_train` does);
- a smaller batch (last batch of an epoch, smaller data set) is padded to the round's batch width;
  padded rows have loss weight 0 and the client's loss is the mean over its real rows;
- clients that have finished (fewer steps) are frozen: clients are sorted by step count, so the
  clients still training at step j are a prefix and only that prefix is computed;
- the tasks' local objectives (edge_client/objectives.py) as in `local_train`: FedProx's proximal term and
  SCAFFOLD's correction added to each client's gradient with stacked (and native) arithmetic of the loop's
  bits; any other objective (a plugin's) through its own hooks, client by client, on the torch-ops path; then
  w ← w − lr·g with the client's own lr.

The LeNets' first two layers, each relu(max_pool(conv)), run as native kernels (coordinator/kernels,
compiled with g++ on first use; torch ops where they cannot be built): docs/engine.md.

Workers: the tasks of a round are cut into `groups` fixed slices (independent of the worker
count); `workers` processes (1 thread each) train the slices. A slice's result does not depend on
which process or how many processes trained it, so the same seed gives the same weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.sim import kernels
from coordinator.sim.kernels import conv2_pool_relu, conv_pool_relu
from edge_client import objectives as objectives_
from edge_client.determinism import cuda_deterministic, is_cuda
from edge_client.models import MODELS, VGG11, CifarLeNet, FdmsMnistCNN, LogReg, MimicCNN, SeededDropout
from edge_client.trainer import LocalResult, TrainTask, batch_table, client_generator

log = logging.getLogger("dropfl.sim")


@dataclass
class _Step:
    """What the active clients (a prefix of length `k`) do at one step."""

    k: int
    rows: torch.Tensor     # [k, B] global sample indices (padded rows repeat a real index)
    y: torch.Tensor        # [k, B] labels
    weight: torch.Tensor   # [k, B] 1 for real rows, 0 for padding
    size: torch.Tensor     # [k] real batch size of each active client, in the weight's dtype
    sizes: list[int]       # the same, as ints
    dloss: torch.Tensor | None = None   # [k, B] d loss_k / d row loss: weight / size (the step by hand's start;
                                        # made by `Group._steps` where the step by hand runs, else None)


@dataclass
class _Tables:
    """Every step's `_Step` fields at once, [steps, K, B] ([steps, K] for size), K all the clients (`Group._tables`):
    past a client's last step its rows are index 0 and its weight and size 0 (never read: step j uses the first
    ks[j] clients)."""

    rows: torch.Tensor
    ys: torch.Tensor
    weight: torch.Tensor
    size: torch.Tensor
    sizes: list[list[int]]
    dloss: torch.Tensor | None
    ks: list[int]


class _Batch:
    """The active clients' parameters and this step's batch; batched layers for the model forwards."""

    def __init__(self, params: dict[str, torch.Tensor], step: _Step, gens: list[torch.Generator],
                 x_all: torch.Tensor, native: str | None = None, x_split: torch.Tensor | None = None,
                 training: bool = True, layers: kernels.LeNetLayers | None = None):
        # native: the kernel variant that runs the fused layers (coordinator/sim/kernels), None: torch ops;
        # x_split: x_all as that variant's first-layer kernel reads it (`kernels.split_images`);
        # training: False = the model's eval mode (dropout passes its input through), for `Evaluator`;
        # layers: the fused layers' calls prepared for the step by hand (`_lenet_step`, which needs them)
        self.p, self.s, self.gens, self.x_all, self.native = params, step, gens, x_all, native
        self.x_split, self.training, self.layers = x_split, training, layers
        self.k, self.b = step.rows.shape

    # inputs -------------------------------------------------------------------------------------
    def images(self) -> torch.Tensor:
        """Inputs in conv layout [B, K·C, H, W] (sample-major, then client), stored channels-last:
        mkldnn's grouped convolutions run ~1.4x faster on it here (measured)."""
        x = self.x_all[self.s.rows.t().reshape(-1)]
        x = x.reshape(self.b, self.k * x.shape[1], *x.shape[2:])
        return x.contiguous(memory_format=torch.channels_last)

    def flat_inputs(self) -> torch.Tensor:
        """Inputs in row layout [K, B, F]."""
        return self.x_all[self.s.rows.reshape(-1)].reshape(self.k, self.b, -1)

    # layers ---------------------------------------------------------------------------------------
    def conv(self, h: torch.Tensor, name: str, padding: int = 0) -> torch.Tensor:
        w, b = self.p[name + ".weight"], self.p[name + ".bias"]
        return F.conv2d(h, w.reshape(-1, *w.shape[2:]), b.reshape(-1), padding=padding, groups=self.k)

    def conv_pool_relu(self, name: str) -> torch.Tensor:
        """The LeNets' first layer on the images, relu(max_pool(conv(x), 2)): fused in one native kernel
        (coordinator/sim/kernels/conv_pool.cpp) when the engine has it, else the same with torch ops.
        (relu after the pool, as in `_lenet`: same values and gradient routing, 4x fewer elements.)"""
        if self.native:
            return conv_pool_relu(self.x_all, self.s.rows, self.p[name + ".weight"].flatten(0, 1),
                                  self.p[name + ".bias"].reshape(-1), self.native, self.x_split)
        return torch.relu(max_pool(self.conv(self.images(), name)))

    def conv2_pool_relu(self, h: torch.Tensor, name: str) -> torch.Tensor:
        """The LeNets' second layer, relu(max_pool(conv(h), 2)), returned in row layout [K, B, C·H·W]:
        one native kernel (coordinator/sim/kernels/conv_pool.cpp) for the shapes it covers, else torch ops."""
        w, b = self.p[name + ".weight"], self.p[name + ".bias"]   # [K, O, Cin, R, S], [K, O]
        if self.native and kernels.inner_fits(w.shape[2], w.shape[1], tuple(w.shape[3:]), w.dtype):
            return conv2_pool_relu(h, w.flatten(0, 1), b.reshape(-1), self.k, self.native)
        return self.to_rows(torch.relu(max_pool(self.conv(h, name))))

    def linear(self, h: torch.Tensor, name: str) -> torch.Tensor:
        """h [K, B, in] @ wᵀ + b; the weight is held transposed ([K, in, out], see `Group`)."""
        wt, b = self.p[name + ".weight"], self.p[name + ".bias"]
        return torch.baddbmm(b.unsqueeze(1), h, wt)

    def to_rows(self, h: torch.Tensor) -> torch.Tensor:
        """Conv layout [B, K·C, H, W] → row layout [K, B, C·H·W] (each client's `flatten(1)`)."""
        return h.reshape(self.b, self.k, -1).transpose(0, 1)

    def dropout(self, h: torch.Tensor, layer: SeededDropout, conv_layout: bool) -> torch.Tensor:
        """`SeededDropout.forward` per client: mask = rand(real batch shape, client generator) >= p."""
        if layer.p == 0.0 or not self.training:
            return h
        if conv_layout:                      # h [B, K·C, H, W] → per-client feature shape (C, H, W)
            feat = (h.shape[1] // self.k, *h.shape[2:])
        else:                                # h [K, B, F]
            feat = tuple(h.shape[2:])
        if layer.channel:
            feat = (feat[0],) + (1,) * (len(feat) - 1)
        masks = torch.ones((self.k, self.b, *feat), dtype=h.dtype)
        for i, (gen, n) in enumerate(zip(self.gens, self.s.sizes)):
            masks[i, :n] = (torch.rand((n, *feat), generator=gen) >= layer.p).to(masks.dtype)
        masks = masks.to(h.device)
        if conv_layout:
            masks = masks.transpose(0, 1).reshape(self.b, self.k * feat[0], *feat[1:])
        return h * masks / (1.0 - layer.p)


def max_pool(h: torch.Tensor, k: int = 2) -> torch.Tensor:
    """F.max_pool2d(h, k), same values and gradient routing (first maximum of each window), run in
    channels-last layout: with K·C channels the NCHW kernel is ~6x slower on CPU (measured); the
    output stays channels-last (the next grouped conv takes it as is: ~1.4x faster per step)."""
    return F.max_pool2d(h.contiguous(memory_format=torch.channels_last), k)


# Batched forwards, one per model class of edge_client/models.py (same layer order as its forward).

def _lenet(m: MimicCNN, z: _Batch) -> torch.Tensor:
    # relu(max_pool(x)) = max_pool(relu(x)) value for value (relu is monotone) and routes the same
    # gradient (the window's first maximum, zero where the maximum is <= 0): 4x fewer relu elements.
    h = z.conv2_pool_relu(z.conv_pool_relu("conv1"), "conv2")   # row layout [K, B, 16·H·W]
    h = torch.relu(z.linear(h, "fc1"))
    return z.linear(torch.relu(z.linear(h, "fc2")), "fc3")


def _lenet_step(z: _Batch, apply: Callable[[str, torch.Tensor], None] | None = None,
                sgd: Callable[[str, torch.Tensor, torch.Tensor], bool] | None = None,
                fc: kernels.FcLayers | None = None, whole: kernels.LeNetStep | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """`_lenet`'s forward, the per-client loss and the gradients of every parameter, by hand, for the LeNets with
    both fused layers: the very aten ops, on the very operands, that `torch.autograd.grad(loss.sum(), params)`
    runs on `_lenet` (torch's derivative formulas for baddbmm, relu, log_softmax, nll_loss, mul, sum and div),
    so the gradients are bitwise autograd's (tests/test_batched_fastpath.py) without building a graph each
    step. Returns (loss [K], {name: gradient}) with the parameters' shapes.
    `apply(name, gradient)`, if given, is called once per parameter as soon as its gradient is final and the step
    no longer reads the parameter (its SGD update, while the gradient is still in cache: the same update on the
    same values as after the step). `sgd(name, x, g)`, if given (with `apply`, plain SGD), makes a fully connected
    weight's gradient xᵀ·g and its SGD step in one pass (`kernels.fc_sgd`) and says whether it did; that weight's
    gradient is then None. `fc`, where given, runs the fully connected layers' forward and the loss as native kernels
    with those ops' bits (`kernels.FcLayers`), and with `fc.steps` (plain SGD at one lr, with `apply` and `sgd`) their
    gradients and steps too: those gradients are then None. `whole`, where given (with `fc.fused`), runs all of it,
    client by client, in one native call (`kernels.LeNetStep`: the same kernels, the same bits); the conv layers'
    steps are then `apply`'s, as always."""
    def done(*names: str) -> None:
        if apply is not None:
            for n in names:
                if grads[n] is not None:
                    apply(n, grads[n])

    def back(name: str, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, relu: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # baddbmm's derivatives: the input's grad·wᵀ (then relu's threshold_backward, where a relu'd `x` came in;
        # it reads the weight, so it comes first) and the weight's xᵀ·grad, or with `sgd` the weight's gradient and
        # step in one pass where that runs (the weight's gradient is then None)
        gx = g.bmm(w.transpose(1, 2))
        gx = gx if relu is None else torch.ops.aten.threshold_backward(gx, relu, 0)
        return gx, None if sgd is not None and sgd(name, x, g) else x.transpose(1, 2).bmm(g)

    p, k, b, st, layers = z.p, z.k, z.b, z.s, z.layers
    grads: dict[str, torch.Tensor | None]
    if whole is not None:   # the whole step in one native call, client by client (the same kernels, the same bits)
        ce = whole(st.rows, st.y.reshape(-1), st.dloss.reshape(-1), k)
        loss = (ce.view(k, b) * st.weight).sum(1) / st.size.to(ce.dtype)
        grads = dict.fromkeys(("fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"))
        _, _, _, grads["conv1.weight"], grads["conv1.bias"], grads["conv2.weight"], grads["conv2.bias"] = \
            layers.views(k)
        done("conv2.weight", "conv2.bias", "conv1.weight", "conv1.bias")
        return loss, grads
    # the two fused layers, prepared once per `Group.train` (`kernels.LeNetLayers`: `conv_pool_fwd` and
    # `conv2_pool_fwd` with client-major layouts between them, no autograd sits between them here: the second
    # layer copies its input row by row, the first layer's backward reads its gradient as whole vectors)
    layers.fwd1(st.rows, k)
    h2 = layers.fwd2(k)
    w1, w2, w3 = p["fc1.weight"], p["fc2.weight"], p["fc3.weight"]   # held transposed: [K, in, out]
    target = st.y.reshape(-1)
    if fc is not None:   # baddbmm and relu, layer by layer, in one native call each (the same bits)
        logits = fc.forward(h2, k)
        r1, r2 = fc.relu_out(0, k), fc.relu_out(1, k)
    else:
        r1 = torch.relu(torch.baddbmm(p["fc1.bias"].unsqueeze(1), h2, w1))
        r2 = torch.relu(torch.baddbmm(p["fc2.bias"].unsqueeze(1), r1, w2))
        logits = torch.baddbmm(p["fc3.bias"].unsqueeze(1), r2, w3)
    # F.cross_entropy(reduction="none") = nll_loss(log_softmax(x, 1)); then each client's mean over its real rows
    # backward, node by node as autograd runs it: sum → div → sum(1) → mul → nll_loss → log_softmax → fc3 ...
    # (torch.ones(k) / size).unsqueeze(1).expand(k, b) * weight, made for every step at once by `Group._steps`
    if fc is not None:   # the loss and its gradient down to the logits (`kernels.FcLayers.loss`: the same ops' bits)
        ce, g = fc.loss(logits, target, st.dloss.reshape(-1), k)
    else:
        lsm = torch.log_softmax(logits.reshape(k * b, -1), 1)
        ce, total_weight = torch.ops.aten.nll_loss_forward(lsm, target, None, 0, -100)
        g = torch.ops.aten.nll_loss_backward(st.dloss.reshape(-1), lsm, target, None, 0, -100, total_weight)
        g = torch.ops.aten._log_softmax_backward_data(g, lsm, 1, lsm.dtype).view(k, b, -1)
    loss = (ce.view(k, b) * st.weight).sum(1) / st.size.to(ce.dtype)
    if fc is not None and fc.steps:   # every fully connected layer's gradients and steps (`back`, `done`), natively
        grads = dict.fromkeys(("fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"))
        return _conv_grads(layers, fc.backward(g, k), k, grads, done, loss)
    grads = {"fc3.bias": g.sum(1)}   # baddbmm: the bias's is sum_to(grad)
    g, grads["fc3.weight"] = back("fc3.weight", r2, g, w3, r2)
    done("fc3.bias", "fc3.weight")
    grads["fc2.bias"] = g.sum(1)
    g, grads["fc2.weight"] = back("fc2.weight", r1, g, w2, r1)
    done("fc2.bias", "fc2.weight")
    grads["fc1.bias"] = g.sum(1)
    gin, grads["fc1.weight"] = back("fc1.weight", h2, g, w1, None)
    done("fc1.bias", "fc1.weight")
    return _conv_grads(layers, gin, k, grads, done, loss)


def _conv_grads(layers: kernels.LeNetLayers, gin: torch.Tensor, k: int, grads: dict[str, torch.Tensor | None],
                done: Callable[..., None], loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The end of `_lenet_step`: the two fused layers' backwards from fc1's input gradient, each parameter's update
    (`done`) once its gradient is final."""
    _, grads["conv2.weight"], grads["conv2.bias"] = layers.bwd2(gin, k)   # reads conv2's weight: its update after
    done("conv2.weight", "conv2.bias")
    grads["conv1.weight"], grads["conv1.bias"] = layers.bwd1(k)
    done("conv1.weight", "conv1.bias")
    return loss, grads


def _fdms(m: FdmsMnistCNN, z: _Batch) -> torch.Tensor:
    h = z.conv_pool_relu("conv1")
    h = torch.relu(max_pool(z.dropout(z.conv(h, "conv2"), m.drop2d, conv_layout=True)))
    h = z.dropout(torch.relu(z.linear(z.to_rows(h), "fc1")), m.drop, conv_layout=False)
    return z.linear(h, "fc2")


def _sequential(seq: nn.Sequential, prefix: str, z: _Batch, h: torch.Tensor, conv_layout: bool) -> torch.Tensor:
    for i, layer in enumerate(seq):
        if isinstance(layer, nn.Conv2d):
            h = z.conv(h, f"{prefix}.{i}", padding=layer.padding[0])
        elif isinstance(layer, nn.Linear):
            h = z.linear(h, f"{prefix}.{i}")
        elif isinstance(layer, nn.ReLU):
            h = torch.relu(h)
        elif isinstance(layer, nn.MaxPool2d):
            h = max_pool(h, layer.kernel_size)
        elif isinstance(layer, SeededDropout):
            h = z.dropout(h, layer, conv_layout)
        else:
            raise TypeError(f"batched engine: no batched version of {type(layer).__name__}")
    return h


def _vgg(m: VGG11, z: _Batch) -> torch.Tensor:
    h = _sequential(m.features, "features", z, z.images(), conv_layout=True)
    return _sequential(m.classifier, "classifier", z, z.to_rows(h), conv_layout=False)


def _mlp(m: nn.Module, z: _Batch) -> torch.Tensor:
    h = torch.relu(z.linear(z.flat_inputs(), "fc1"))
    return z.linear(torch.relu(z.linear(h, "fc2")), "fc3")


def _logreg(m: LogReg, z: _Batch) -> torch.Tensor:
    return z.linear(z.flat_inputs(), "fc")


def batched_forward(model: nn.Module) -> Callable[[nn.Module, _Batch], torch.Tensor]:
    """The batched forward of `model`'s class (subclasses first: CifarLeNet is a MimicCNN)."""
    table: list[tuple[type, Callable]] = [(CifarLeNet, _lenet), (MimicCNN, _lenet), (FdmsMnistCNN, _fdms),
                                          (VGG11, _vgg), (LogReg, _logreg)]
    for cls, fn in table:
        if isinstance(model, cls):
            return fn
    if type(model).__name__ == "MLP":
        return _mlp
    raise TypeError(f"batched engine: no batched forward for {type(model).__name__}; use --engine loop")


def native_fits(model: nn.Module, x_all: torch.Tensor, device: torch.device) -> bool:
    """Whether the fused layers can run for `model` on these inputs: a LeNet (its first layer is the
    fused kernel), on the CPU, float32/64 images; whether they are built is `kernels.available()`."""
    return (batched_forward(model) in (_lenet, _fdms) and device.type == "cpu" and x_all.dim() == 4
            and x_all.dtype in (torch.float32, torch.float64))


def split_for(model: nn.Module, x_all: torch.Tensor, variant: str | None) -> torch.Tensor | None:
    """The images as `variant`'s first-layer kernel reads them (`kernels.split_images`), made once per
    engine: None without kernels. The LeNets' first layer is `conv1` (`_lenet`, `_fdms`)."""
    if variant is None:
        return None
    return kernels.split_images(x_all, model.conv1.kernel_size[1], variant)


def kernel_variant(native: bool | str, model: nn.Module, x_all: torch.Tensor, device: torch.device) -> str | None:
    """The kernel variant that runs the fused layers, or None (torch ops). `native`: True = this process's
    choice (`kernels.requested()`: $DROPFL_KERNEL, else the best for this CPU), a variant's name = that one
    (checked: UserError if unknown or the CPU cannot run it), False = none. None also where the model or
    device has no fused layers (`native_fits`) or the variant cannot be built (a warning says why)."""
    if native is False or not native_fits(model, x_all, device):
        return None
    variant = kernels.requested() if native is True else kernels.check(native)
    return variant if kernels.available(variant) else None   # "off": never available (kernels.error says why)


def auto_device(model_name: str) -> str:
    """--sim-device auto, by --model name: "cpu" for the models registered `cpu_first` (the LeNets, whose batched
    forward runs the fused CPU kernels: edge_client/models.py; tests/test_engine_device.py checks the fact against
    the forwards), else "cuda" where `torch.cuda.is_available()`, else "cpu". `engine_device` decides the same from
    the model itself."""
    return "cuda" if not MODELS.meta(model_name, "cpu_first") and torch.cuda.is_available() else "cpu"


def engine_device(requested: str | None, model: nn.Module) -> torch.device:
    """Where `BatchedEngine` trains `model` (--sim-device): "cpu"; "cuda" (ValueError where
    `torch.cuda.is_available()` is False); "auto" or None: the CPU for the LeNets, whose first layers are the
    fused CPU kernels (at batch 16 a LeNet step on a GPU is a few hundred small kernel launches: on an H100 machine
    the CPU engine with its default 2 slices was faster, docs/engine.md), a GPU for the other models where there
    is one, else the CPU. Another name is taken as a torch device ("cuda:1")."""
    if requested in (None, "auto"):
        lenet = batched_forward(model) in (_lenet, _fdms)
        return torch.device("cuda" if not lenet and torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"BatchedEngine: device {requested!r}, but torch sees no usable GPU here "
                         f"(torch.cuda.is_available() is False): use 'auto' or 'cpu'")
    return device


AUTO_SLICES_MAX = 16   # --slices auto's most: each slice is a worker process (torch, the model, its buffers)


def cpus() -> int:
    """The CPUs this process may use: inside a Ray task or actor, the CPUs Ray assigned it (a sweep's runs on Ray
    take 1 each); else those it may run on (its affinity), else `os.cpu_count()`."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:   # the driver is not a worker: Ray asserts
            assigned = ray.get_runtime_context().get_assigned_resources().get("CPU")
        except (AssertionError, AttributeError, RuntimeError):
            assigned = None
        if assigned:
            return max(1, int(assigned))
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def batch_independent(model: nn.Module, native: str | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the engine gives each client the same bits whatever other clients share its computation: mlp and
    logreg (batched matmuls, one client's matrices at a time) and the LeNets with both fused layers (the kernels
    take one client after another), on the CPU. Not the torch grouped convolutions (fdms-cnn's second layer, vgg11,
    a LeNet without its kernels: they round differently with the number of clients), nor a GPU (not checked).
    tests/test_sweep.py checks it on the paths it admits."""
    if device.type != "cpu":
        return False
    fn = batched_forward(model)
    if fn in (_mlp, _logreg):
        return True
    if fn is _lenet and native:
        w = dict(model.named_parameters())["conv2.weight"]
        return kernels.inner_fits(w.shape[1], w.shape[0], tuple(w.shape[2:]), dtype)
    return False


def slices_for(groups: int, model: nn.Module, native: str | None, dtype: torch.dtype, device: torch.device) -> int:
    """--slices: `groups` where ≥ 1; 0 (auto): one slice (a worker process) per CPU (`cpus()`), at least 2 and at
    most `AUTO_SLICES_MAX`, where the number of slices cannot change the results (`batch_independent`), else 2, the
    fixed number it was before auto, as the slices may change a run's rounding there. So auto gives each run the
    results of --slices 2 on any machine, and uses the machine's cores where that costs nothing."""
    if groups >= 1:
        return groups
    if not batch_independent(model, native, dtype, device):
        return 2
    return max(2, min(AUTO_SLICES_MAX, cpus()))


class Group:
    """Trains a list of tasks as one batched computation. Holds the preloaded data of all clients."""

    def __init__(self, model: nn.Module, x_all: torch.Tensor, y_all: torch.Tensor, offsets: list[int],
                 sizes: list[int], device: str | torch.device = "cpu", threads: int = 1,
                 native: bool | str = True, x_split: torch.Tensor | None = None):
        self.model, self.forward, self.threads = model, batched_forward(model), threads
        self.device = torch.device(device)
        self.x_all, self.y_all = x_all.to(self.device).contiguous(), y_all.to(self.device)
        # the fused layers (coordinator/kernels) where they can run: CPU, float32/64 images; the variant's name
        self.native = kernel_variant(native, model, self.x_all, self.device)
        # the images split once for the first-layer kernel (BatchedEngine makes it once for all its workers)
        self.x_split = x_split if x_split is not None else split_for(model, self.x_all, self.native)
        self.offsets, self.sizes = offsets, sizes
        # mimic-cnn, cifar-lenet with both layers fused: each step's gradients by hand (`_lenet_step`), no autograd
        conv2 = getattr(model, "conv2", None)
        self.by_hand = (self.forward is _lenet and self.native is not None
                        and kernels.inner_fits(conv2.in_channels, conv2.out_channels, conv2.kernel_size,
                                               self.x_all.dtype))
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]

    def train(self, w_global: torch.Tensor, tasks: list[TrainTask], data: list[int] | None = None,
              start: list[int] | None = None, terms: list[int] | None = None) -> list[LocalResult]:
        """Train `tasks` from `w_global` with `threads` intra-op threads (fixed, so that a slice's
        float rounding, hence its result, is the same in any process).
        A lockstep sweep (coordinator/sim/lockstep.py) trains clients of several runs at once: `data`
        gives each task's client in this group's data (default: `task.client`), and with `start`,
        `w_global` is [R, P] and task i starts from row `start[i]`. `terms` (lockstep, with the fused update
        only): per task, which of FedProx's term (1) and SCAFFOLD's correction (2) its own run's computation
        adds, so that plain, FedProx and SCAFFOLD clients of one lr train as one computation; without it the
        computation decides for all its tasks (any μ: the term for all; any correction: a correction for all)."""
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._train(w_global, tasks, data, start, terms)
        finally:
            torch.set_num_threads(saved)

    def _train(self, w_global: torch.Tensor, tasks: list[TrainTask], data: list[int] | None = None,
               start: list[int] | None = None, terms: list[int] | None = None) -> list[LocalResult]:
        t_start = time.perf_counter()
        data = [t.client for t in tasks] if data is None else list(data)
        gens = [client_generator(t.seed, t.round, t.client) for t in tasks]
        plans = [batch_table(self.sizes[d], t, g) for t, d, g in zip(tasks, data, gens)]   # (rows, sizes)
        # most steps first: the clients still training at any step are then a prefix
        order = sorted(range(len(tasks)), key=lambda i: -len(plans[i][1]))
        tasks, gens, plans = [tasks[i] for i in order], [gens[i] for i in order], [plans[i] for i in order]
        data = [data[i] for i in order]
        terms = None if terms is None else [terms[i] for i in order]
        k_all, dev = len(tasks), self.device
        w0 = w_global.to(dev)
        # per-parameter stacks [K, *shape], all clients starting from w_global
        # Linear weights (the 2-D parameters) are held transposed, [K, in, out]: their gradient then
        # comes out of the batched matmul contiguous, and the update is ~4x cheaper (measured).
        if start is None:
            chunks = torch.split(w0, [s.numel() for s in self.shapes])
            anchors = {n: _held(c.view(s)).contiguous() for n, s, c in zip(self.names, self.shapes, chunks)}
            params = {n: a.expand(k_all, *a.shape).clone(memory_format=torch.contiguous_format)
                      for n, a in anchors.items()}
        else:  # one start per task, [K, P]; anchors are then per task too (same values, same arithmetic)
            w0 = w0[torch.tensor([start[i] for i in order], dtype=torch.long, device=dev)]
            chunks = torch.split(w0, [s.numel() for s in self.shapes], 1)
            anchors = {n: _held(c.reshape(k_all, *s), stacked=True).contiguous()
                       for n, s, c in zip(self.names, self.shapes, chunks)}
            params = {n: a.clone() for n, a in anchors.items()}

        def col(vals: list[float], shape: torch.Size) -> torch.Tensor:  # per-client scalars, broadcastable
            return torch.tensor(vals, dtype=w0.dtype, device=dev).view(-1, *([1] * len(shape)))

        # the local objectives: FedProx's μ and SCAFFOLD's c − c_i by the stacked arithmetic below; where a task has
        # any other (a plugin's, or these in another order), every task's through its hooks (`hooked`)
        hooked = None if all(objectives_.builtin_only(t.objectives) for t in tasks) else \
            [tuple(o.to(dev) for o in t.objectives) for t in tasks]
        mu = [0.0 if hooked else objectives_.proximal_mu(t.objectives) for t in tasks]
        cs = [None if hooked else objectives_.correction_of(t.objectives) for t in tasks]
        neg_lr = [-t.lr for t in tasks]
        same_lr = len(set(neg_lr)) == 1  # the usual case; a broadcast addcmul_ is ~3x slower than add_
        corr = None
        if any(c is not None for c in cs):
            zero = torch.zeros(w_global.shape[-1], dtype=w_global.dtype)   # w_global: [P], or [R, P] with `start`
            c = torch.stack([c if c is not None else zero for c in cs]).to(dev)
            corr = dict(zip(self.names, [_held(cc.reshape(k_all, *s), stacked=True).contiguous() for cc, s in
                                         zip(torch.split(c, [s.numel() for s in self.shapes], 1), self.shapes)]))
        # the usual case: one lr, no FedProx term, no SCAFFOLD correction. On the CPU the update is then one
        # _foreach_add_ over all parameters, which runs the same add_ per tensor (same bits, fewer calls;
        # tests/test_batched_fastpath.py). Not on CUDA, where foreach ops have their own fused kernels.
        plain_sgd = (same_lr and dev.type == "cpu" and hooked is None
                     and (not any(terms) if terms is not None else not any(mu) and corr is None))
        # FedProx's term and SCAFFOLD's correction with one lr: one fused pass per parameter, the same bits as the
        # torch ops below (`kernels.sgd_update`, checked against them once per process: `fused_update`)
        fused = (not plain_sgd and same_lr and dev.type == "cpu" and hooked is None
                 and kernels.fused_update(self.native, w0.dtype))
        if terms is not None and not (plain_sgd or fused):
            raise RuntimeError("Group.train: per-task terms need one lr and the fused update (kernels.fused_update)")
        mu_t = torch.tensor(mu, dtype=w0.dtype) if fused and any(mu) else None
        terms_t = torch.tensor(terms, dtype=torch.uint8) if fused and terms is not None else None
        loss_sum = torch.zeros(k_all, dtype=torch.float64, device=dev)
        if fused:   # one updater per parameter stack: its operands checked once, not every step
            updaters = [kernels.sgd_updater(p, anchors[n], mu_t, corr[n] if corr is not None else None, self.native,
                                            terms_t) for n, p in params.items()]
        # the LeNet step by hand updates each parameter inside the step, as soon as its gradient is final (while it
        # is still in cache): the plain step as `p.add_(g, alpha=-lr)`, what _foreach_add_ runs per tensor, the fused
        # one with its updater; `live`, `k` and `prox` are this step's (looked up when called)
        updater_of = dict(zip(params, updaters)) if fused else {}

        def apply(n: str, g: torch.Tensor) -> None:
            if plain_sgd:
                live[n].add_(g, alpha=neg_lr[0])
            else:
                updater_of[n](g.contiguous(), k, neg_lr[0], prox)

        def sgd(n: str, x: torch.Tensor, g: torch.Tensor) -> bool:   # plain SGD: a linear weight's gradient and
            return kernels.fc_sgd(x, g, live[n], neg_lr[0], self.native)   # step in one pass, where exact

        live_k, layers, fc, whole = None, None, None, None
        by_hand = self.by_hand and hooked is None   # the LeNet step by hand has no autograd for a plugin's loss term
        in_step = by_hand and (plain_sgd or fused)   # the step by hand updates as it goes (`apply`)
        tables = self._tables(tasks, plans, data)
        if by_hand and tables is not None:   # the fused layers' calls, prepared once (all clients' stacks)
            width = tables.rows.shape[2]
            layers = kernels.LeNetLayers(self.native, self.x_all, self.x_split, params["conv1.weight"],
                                         params["conv1.bias"], params["conv2.weight"], params["conv2.bias"], width)
            # the fully connected layers' forward and the loss natively too, where their bits are the torch ops',
            # and with plain SGD in the step their backward and steps
            fc = kernels.FcLayers.make(self.native, [params[f"fc{i}.weight"] for i in (1, 2, 3)],
                                       [params[f"fc{i}.bias"] for i in (1, 2, 3)], width,
                                       neg_lr[0] if in_step and plain_sgd else None)
            # and where all of that is native, the whole step in one call, client by client, with the conv layers'
            # steps too where the fused update has torch's bits
            if fc is not None and fc.fused:
                whole = kernels.LeNetStep(layers, fc, conv_steps=kernels.fused_update(self.native, w0.dtype))
        one_call = whole is not None and whole.conv_steps and tables is not None and tables.dloss is not None
        if one_call:   # the round's steps in one native call
            ce = whole.steps(tables.rows, tables.ys, tables.dloss.contiguous(), tables.ks)
            loss_all = ((ce * tables.weight).sum(2) / tables.size).double()   # each step's, as below (same ops)
            for j, k in enumerate(tables.ks):
                loss_sum[:k] += loss_all[j, :k]
            tables = None   # no step left to run below
        for step in self._steps(tables):
            k = step.k
            prox = fused and mu_t is not None and any(mu[:k])   # this step's FedProx term in the fused update
            if by_hand:   # the LeNets with both fused layers: the same gradients, no autograd graph
                if k != live_k:   # the active clients' views, made again only when a client has finished
                    live, live_k = {n: p[:k] for n, p in params.items()}, k
                z = _Batch(live, step, gens[:k], self.x_all, self.native, self.x_split, layers=layers)
                loss, by_name = _lenet_step(z, apply if in_step else None, sgd if in_step and plain_sgd else None,
                                            fc, whole)
                grads = tuple(by_name[n] for n in live)   # (not read where the step updated in_step)
            else:
                live = {n: p[:k].detach().requires_grad_() for n, p in params.items()}
                z = _Batch(live, step, gens[:k], self.x_all, self.native, self.x_split)
                logits = self.forward(self.model, z)
                ce = F.cross_entropy(logits.reshape(k * z.b, -1), step.y.reshape(-1), reduction="none").view(k, z.b)
                loss = (ce * step.weight).sum(1) / step.size.to(ce.dtype)   # each client's mean over its real rows
                total = loss.sum()
                if hooked is not None:   # the objectives' loss terms, each client's on its own slice
                    term = objectives_.loss_stacked(hooked[:k], list(live.values()), list(anchors.values()),
                                                    stacked_anchor=start is not None, layout=_held)
                    total = total if term is None else total + term
                grads = torch.autograd.grad(total, list(live.values()))
            with torch.no_grad():
                loss_sum[:k] += loss.detach().double()
                if hooked is not None:   # the objectives' gradient hooks, client by client
                    grads = objectives_.apply_stacked(hooked[:k], grads, [p[:k] for p in params.values()],
                                                      list(anchors.values()), stacked_anchor=start is not None,
                                                      layout=_held)
                if in_step:   # every parameter already updated inside the step
                    continue
                if plain_sgd:   # w ← w − lr·g for every parameter in one call: the same add_ per tensor
                    torch._foreach_add_(list(live.values()), grads, alpha=neg_lr[0])
                    continue
                if fused:   # the loop below, one pass per parameter (`kernels.sgd_update` on the first k clients)
                    for update, g in zip(updaters, grads):
                        update(g.contiguous(), k, neg_lr[0], prox)
                    continue
                for (n, p), g in zip(params.items(), grads):
                    s = p.shape[1:]
                    if any(mu[:k]):                            # FedProx: g + μ (w − w_global)
                        g = g + col(mu[:k], s) * (p[:k] - (anchors[n] if start is None else anchors[n][:k]))
                    if corr is not None:                       # SCAFFOLD: g + (c − c_i)
                        g = g + corr[n][:k]
                    if same_lr:                                # w ← w − lr·g, as p.add_(g, alpha=−lr)
                        p[:k].add_(g, alpha=neg_lr[0])
                    else:
                        p[:k].addcmul_(g, col(neg_lr[:k], s))
        flat = torch.cat([_held(p, stacked=True).reshape(k_all, -1) for p in params.values()], 1)
        deltas = ((w0.unsqueeze(0) if start is None else w0) - flat).cpu()
        seconds = time.perf_counter() - t_start
        path, fallback = self._path(fused, layers, fc, whole, one_call)
        out: list[LocalResult | None] = [None] * k_all
        for j, i in enumerate(order):
            steps = len(plans[j][1])
            out[i] = LocalResult(deltas[j].clone(), self.sizes[data[j]], steps,
                                 float(loss_sum[j]) / max(steps, 1), seconds, path, fallback)
        return out  # type: ignore[return-value]

    def _path(self, fused: bool, layers, fc, whole, one_call: bool) -> tuple[str | None, str | None]:
        """The native parts that trained this call (`LocalResult.path`: "conv" the fused conv layers, "fc" the fully
        connected layers, "loss" the loss, "step" each whole step in one native call, "round" a round's steps in one
        native call, "update" the fused FedProx / SCAFFOLD update), and why a part the step by hand could have used
        did not run (each part runs only where its runtime check finds the torch ops' bits)."""
        if self.native is None:
            return None, None
        parts = ["conv"]
        if fc is not None:
            parts.append("fc")
            if fc.loss_fn is not None:
                parts.append("loss")
        if whole is not None:
            parts.append("round" if one_call else "step")
        if fused:
            parts.append("update")
        fallback = None
        if self.by_hand and layers is not None and fc is None:
            fallback = ("the native fully connected layers do not give the torch ops' bits for these shapes on this "
                        "CPU and BLAS (kernels.fc_layer_exact): torch ops run them")
        elif fc is not None and fc.loss_fn is None and self.x_all.dtype == torch.float32:
            fallback = ("the native loss does not give ATen's bits here (kernels.loss_exact: a row of the logits "
                        f"must fit one {self.native} vector and SLEEF be found): torch ops run it")
        return "+".join(parts), fallback

    def _tables(self, tasks: list[TrainTask], plans: list[tuple[torch.Tensor, torch.Tensor]], data: list[int]
                ) -> _Tables | None:
        """Every step's padded index rows, labels, weights, sizes at once (None: no steps).
        `plans`: each task's `batch_table` (rows [steps, batch_size], -1 past a batch's end; sizes)."""
        width = max([t.batch_size for t, (_, n) in zip(tasks, plans) if len(n)], default=1)
        padded = []
        for d, (rows, sizes) in zip(data, plans):
            if not len(sizes):
                padded.append((torch.zeros(0, width, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
                continue
            rows = rows[:, :int(sizes.max())]   # as wide as its widest batch (a client with < batch_size samples)
            if rows.shape[1] < width:
                rows = F.pad(rows, (0, width - rows.shape[1]), value=-1)
            pad = rows < 0
            rows = torch.where(pad, rows[:, :1], rows) + self.offsets[d]   # pad with a real row
            padded.append((rows, sizes))
        n_steps = [len(n) for _, n in plans]
        total = max(n_steps, default=0)
        if total == 0:
            return None
        # every step's rows and weights at once, [steps, K, B], then one slice per step (fewer small ops per
        # step); past a client's last step its rows are index 0, never read: step j uses the clients still
        # training. (`padded` is dropped: the tables take its place in memory, plus the weights.)
        rows = torch.stack([F.pad(r, (0, 0, 0, total - len(r))) for r, _ in padded]).transpose(0, 1).contiguous()
        sizes = torch.stack([F.pad(n, (0, total - len(n))) for _, n in padded]).t()     # [steps, K]
        del padded
        weight = (torch.arange(width).view(1, 1, -1) < sizes.unsqueeze(2)).to(self.x_all.dtype).to(self.device)
        rows, size, sizes_list = rows.to(self.device), sizes.to(self.x_all.dtype).to(self.device), sizes.tolist()
        ys = self.y_all[rows]   # every step's labels at once
        # the loss's gradient per row, 1/size on real rows (the step by hand's backward starts there): the same
        # elementwise division and product per element as one step's, for all steps (inf/NaN past a client's
        # last step, where no step reads it)
        dloss = (torch.ones_like(size) / size).unsqueeze(2) * weight if self.by_hand else None
        ks = [sum(1 for n in n_steps if n > j) for j in range(total)]   # the clients still training at step j
        return _Tables(rows, ys, weight, size, sizes_list, dloss, ks)

    @staticmethod
    def _steps(t: _Tables | None):
        """Yield one `_Step` per step of `_tables`: the active prefix's padded index rows, labels, weights, sizes."""
        for j, k in enumerate(t.ks if t is not None else []):
            yield _Step(k, t.rows[j, :k], t.ys[j, :k], t.weight[j, :k], t.size[j, :k], t.sizes[j][:k],
                        None if t.dloss is None else t.dloss[j, :k])


_SPLITS: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}   # `_shared_split`: key → (images, split)
_SPLITS_KEPT = 2


def _shared_split(model: nn.Module, x: torch.Tensor, variant: str | None) -> torch.Tensor | None:
    """`split_for`, made once per test set and kernel layout in a process: the runs of a sweep share their
    test set (`runsetup.load_dataset`), and each run's `Evaluator` split its own copy (43 MB for FMNIST).
    The key holds the images tensor itself (so its id cannot be reused while it is cached); the last
    _SPLITS_KEPT are kept."""
    if variant is None:
        return None
    key = (id(x), variant, model.conv1.kernel_size[1])
    hit = _SPLITS.get(key)
    if hit is None or hit[0] is not x:
        hit = (x, split_for(model, x, variant))
        _SPLITS[key] = hit
        while len(_SPLITS) > _SPLITS_KEPT:
            del _SPLITS[next(iter(_SPLITS))]
    return hit[1]


class Evaluator:
    """The coordinator's evaluation (`edge_client.trainer.evaluate`: accuracy and mean cross-entropy on the
    test set, in batches of `batch`) through the batched engine's forward with its fused LeNet kernels:
    one "client" (K = 1), the model's eval mode (no dropout). For the LeNets on the CPU that is 4.9-6.6x less
    CPU time than the model's own torch forward (mkldnn's NCHW convolutions and max-pool on 2,000 images;
    docs/engine.md, "Evaluation"), which made evaluation a large share of a sweep's rounds.

    Not bitwise the reference: the kernels sum each output's products in another order than mkldnn, so the
    loss differs at the float rounding level (and an argmax at an exact near-tie could flip), as the
    batched engine's training does. The test set is always cut into the same batches of `batch` samples and each
    is computed alone (K = 1), so a run's metrics are the same bits whatever else shares the process: resume, the
    lockstep and serial sweep executors and Ray agree. (A sample's logits may depend on the batch it is in: the
    fully connected layers are BLAS GEMMs, and MKL picks its kernel by shape and CPU.)
    `available()` is False (use the reference) where the model has no fused layers or no kernels build."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, native: bool | str = True,
                 batch: int = 2000):
        self.model, self.batch = model, batch
        try:
            self.forward = batched_forward(model)
        except TypeError:   # a model without a hand-written forward (the generic engine's): the reference evaluates
            self.forward, native = None, False
        self.x, self.y = x.contiguous(), y
        self.native = kernel_variant(native, model, self.x, torch.device("cpu"))   # None: no fused layers
        self.x_split = _shared_split(model, self.x, self.native)
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]

    def available(self) -> bool:
        return self.native is not None

    def params(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat weights `w` as one client's parameter stacks ([1, *shape], linear weights transposed)."""
        chunks = torch.split(w.to(self.x.dtype), [s.numel() for s in self.shapes])
        return {n: _held(c.view(s)).unsqueeze(0).contiguous() for n, s, c in zip(self.names, self.shapes, chunks)}

    @torch.no_grad()
    def logits(self, params: dict[str, torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """The logits of test samples lo..hi-1, [hi - lo, classes]."""
        rows = torch.arange(lo, hi).view(1, -1)
        step = _Step(1, rows, self.y[lo:hi].view(1, -1), torch.ones(0), torch.ones(0), [hi - lo])
        return self.forward(self.model, _Batch(params, step, [], self.x, self.native, self.x_split,
                                               training=False))[0]

    @torch.no_grad()
    def __call__(self, w: torch.Tensor) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) of weights `w`, as `edge_client.trainer.evaluate` computes them."""
        params, correct, loss, n = self.params(w), 0, 0.0, len(self.y)
        for i in range(0, n, self.batch):
            out, y = self.logits(params, i, min(i + self.batch, n)), self.y[i:i + self.batch]
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
        n = max(n, 1)
        return correct / n, loss / n


def _held(t: torch.Tensor, stacked: bool = False) -> torch.Tensor:
    """Model layout ↔ engine layout (its own inverse): a linear weight, [out, in] ([K, out, in] if
    `stacked` over clients), is held transposed; every other parameter as it is."""
    return t.transpose(-1, -2) if t.dim() - stacked == 2 else t


# ---- worker processes ------------------------------------------------------------------------------

_WORKER: Group | None = None


def _die_with_parent() -> None:
    """End this worker when the process that started it dies. Without it, a killed simulation (Ctrl-C twice,
    SIGKILL) left its workers training a slice for many minutes.

    Linux: PR_SET_PDEATHSIG, delivered by the kernel even while the worker is inside a long call that holds the
    GIL. Caveat: it fires when the parent *thread* that started the worker ends, not the process, so an engine's
    pool must be started and used from a thread that outlives it (the main thread, or the lockstep group's own
    engine thread, coordinator/sim/lockstep.py: a run's thread ending first once killed the workers under the
    other runs). Elsewhere a daemon thread polls the parent's pid (it needs the GIL: a long GIL-holding call
    delays it; measured in CI, one worker alive 20 s after its parent's SIGKILL)."""
    parent = os.getppid()
    if parent == 1:   # the parent died before we got here
        os._exit(1)
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        return
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _keep_freed_memory() -> bool:
    """In a training worker: glibc serves every allocation below 1 GiB from the heap and keeps up to 1 GiB of freed
    memory (`coordinator.alloc.keep_freed_memory`). A training step allocates and frees activations of a few MB; by
    default glibc maps them fresh each time and the first touch of every page faults (~400 page faults and ~0.7 ms
    of kernel time per 15-client MimiC-CNN step, ~8 % of the step; measured, see docs/engine.md). The worker's RSS
    then stays at its peak, which is what a long-lived training worker needs anyway. DROPFL_MALLOC=default keeps
    glibc's own settings here too."""
    from coordinator import alloc
    return alloc.keep_freed_memory(mmap_below=1 << 30, keep=1 << 30)


def _init_worker(model: nn.Module, x_all: torch.Tensor, y_all: torch.Tensor, offsets: list[int], sizes: list[int],
                 device: str, threads: int, native: bool | str, x_split: torch.Tensor | None) -> None:
    """A worker's `Group`, from the arguments the engine's own would take (`BatchedEngine._group`)."""
    global _WORKER
    _die_with_parent()
    _keep_freed_memory()
    torch.set_num_threads(threads)
    _WORKER = Group(model, x_all, y_all, offsets, sizes, device, threads, native, x_split)


def _train_in_worker(w_global: torch.Tensor, tasks: list[TrainTask], data: list[int] | None = None,
                     start: list[int] | None = None,
                     terms: list[int] | None = None) -> tuple[torch.Tensor | None, list[LocalResult]]:
    """`Group.train` in a worker, its deltas packed into one [K, P] tensor for the trip back (`_unpack`).
    Why packed: torch hands each tensor of a result to the parent as its own shared-memory file, one
    socket connection with an authentication handshake per tensor; for a slice of 50 logreg clients
    that handover cost more than training them (measured with py-spy on fedlaavg-fig8: the handover
    was ~40 % of the parent's samples). One tensor per slice is one handover."""
    assert _WORKER is not None, "worker not initialised"
    return _pack(_WORKER.train(w_global, tasks, data, start, terms))


def _pack(results: list[LocalResult]) -> tuple[torch.Tensor | None, list[LocalResult]]:
    """A worker's results for the trip back: their deltas stacked into one tensor (`_train_in_worker`), `_unpack`'s
    inverse."""
    if not results:
        return None, results
    packed = torch.stack([r.delta for r in results])
    for r in results:
        r.delta = None  # type: ignore[assignment]  # travels in `packed`
    return packed, results


def _unpack(packed: tuple[torch.Tensor | None, list[LocalResult]]) -> list[LocalResult]:
    """A worker's results with their deltas again, each its own tensor (a copy of its row: a delta a
    strategy keeps must not hold the slice's whole block, nor save it with itself in a checkpoint)."""
    deltas, results = packed
    for i, r in enumerate(results):
        r.delta = deltas[i].clone()   # type: ignore[index]
    return results


def shm_error(e: BaseException) -> bool:
    """Whether `e` is torch failing to allocate shared memory (a full or small /dev/shm: a container's default is
    64 MB; torch allocates the whole file when it creates it, so this is raised there, not met later)."""
    return isinstance(e, RuntimeError) and ("shared memory" in str(e) or "No space left on device" in str(e))


def shm_room(nbytes: int, what: str, e: BaseException) -> str:
    """Why `nbytes` of `what` did not go into shared memory, and what to do, in one line."""
    try:
        usage = shutil.disk_usage("/dev/shm")
        have = f"/dev/shm: {usage.free / 1e6:,.0f} MB free of {usage.total / 1e6:,.0f} MB"
    except OSError:
        have = "no /dev/shm"
    return (f"shared memory cannot hold the {nbytes / 1e6:,.0f} MB of {what} ({have}; torch: {e}); give /dev/shm "
            "more room (in a container: `docker run --shm-size=4g`) to train on every core")


class PoolOwner:
    """What both batched engines share: `self.pool`, the worker processes (None: the slices run in this process),
    started by `start_pool` and stopped by `close` (or when the engine is collected), and `in_process_reason`, why
    an engine that could have had workers runs its slices in this process (None: it does not). Class attributes
    first: `close` works on an engine whose __init__ raised before its pool started."""

    pool: ProcessPoolExecutor | None = None
    in_process_reason: str | None = None
    no_room: dict[str, str] | None = None   # why work first found no room in shared memory, by where (`_no_room`)

    def share_data(self, tensors: list[torch.Tensor | None], engine: str, slices: int) -> bool:
        """Put `tensors` (the data the workers read) in shared memory; False where it cannot hold them: then
        `in_process_reason` says why and what to do (`shm_room`, warned once), and the engine runs its `slices`
        in this process instead, with the same bits."""
        try:
            for t in tensors:
                if t is not None:
                    t.share_memory_()
        except RuntimeError as e:
            if not shm_error(e):
                raise
            self.in_process_reason = shm_room(sum(t.nbytes for t in tensors if t is not None), "training data", e)
            log.warning("the %s runs its %d slices in this process, one after the other (the same results): %s",
                        engine, slices, self.in_process_reason)
            return False
        return True

    def start_pool(self, workers: int, initializer, initargs: tuple) -> None:
        """`workers` spawned processes (spawn: torch's threads and a CUDA context do not survive a fork), each
        prepared once by `initializer(*initargs)` (the model, and the data in shared memory)."""
        import torch.multiprocessing as tmp
        self.pool = ProcessPoolExecutor(workers, mp_context=tmp.get_context("spawn"), initializer=initializer,
                                        initargs=initargs)

    def _no_room(self, doing: str, where: str, need: int, what: str, e: BaseException) -> None:
        """Work that found no room in shared memory on its way to or from the workers trains in this process, with
        the same bits (the workers wait for work that fits): said once for each `where` (`no_room`: why, by where,
        `shm_room`'s line), as "<doing> where <where> (the same results): <why>"."""
        if self.no_room is None:
            self.no_room = {}
        if where not in self.no_room:
            self.no_room[where] = shm_room(need, what, e)
            log.warning("%s where %s (the same results): %s", doing, where, self.no_room[where])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def __del__(self) -> None:
        self.close()


class BatchedEngine(PoolOwner):
    """Runs a round's tasks as `groups` batched slices on `workers` processes (0 = in this process).

    Data is concatenated once ([Σ n_i, ...]) and handed to the workers once (shared memory); a round
    only ships the global weights and the tasks. `device` (--sim-device): "auto" (the CPU for the LeNets, a GPU
    for the other models where there is one: `engine_device`), "cpu" or "cuda". On CUDA, everything runs in this
    process, with deterministic arithmetic (edge_client/determinism.py: no TF32, no cuDNN autotuning).
    `native=False` runs the LeNets' first two layers with torch ops instead of the fused kernels
    (coordinator/kernels; for A/B measurements and tests: the results agree to rounding); a variant's
    name ("avx512", "avx2", "generic") runs that variant's kernels (default: `kernels.requested()`).
    """

    def __init__(self, model: nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]],
                 workers: int | None = None, groups: int = 2, device: str | None = "auto",
                 native: bool | str = True):
        batched_forward(model)  # a model without one is refused here, before any worker starts
        def refuse_workers(dev: str | None) -> None:   # its worker processes would train on the CPU
            if workers and dev not in (None, "auto") and torch.device(dev).type != "cpu":
                raise ValueError(f"BatchedEngine: worker processes train on the CPU; on {dev} the engine runs in "
                                 "this process: pass workers=0 (or None), or device='cpu'")
        refuse_workers(device)   # as asked: before any CUDA check
        device = str(engine_device(device, model))   # auto: the CPU for the LeNets, else a GPU if there is one
        refuse_workers(device)   # as resolved
        if is_cuda(device):
            cuda_deterministic()  # before anything reaches the GPU
        sizes = [len(y) for _, y in client_data]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        x_all = torch.cat([x for x, _ in client_data])
        y_all = torch.cat([y for _, y in client_data])
        model = _strip_generators(model)
        self.device = torch.device(device)
        threads = 1 if device == "cpu" else torch.get_num_threads()   # per slice, in any process
        # the fused layers' kernel variant (its name, or None), decided and built here, once, for every
        # slice and worker: the workers are told the variant, they do not choose again
        self.fits = native_fits(model, x_all, self.device)
        self.requested = None if native is False else kernels.requested() if native is True else kernels.check(native)
        self.native = kernel_variant(native, model, x_all, self.device)
        variant = self.native or False
        groups = slices_for(groups, model, self.native, x_all.dtype, self.device)   # 0: auto
        if workers is None:
            workers = 0 if device != "cpu" else min(groups, cpus())
        x_split = split_for(model, x_all, self.native) if workers > 0 else None   # the first layer's split images
        # the data (and the split images), shared once with every worker
        if workers > 0 and not self.share_data([x_all, y_all, x_split], "batched engine", max(1, groups)):
            workers = 0
        self.groups, self.workers = max(1, groups), workers
        # a Group's arguments: this process's (without workers), each worker's, and, with workers, what a slice that
        # finds no room in shared memory trains on here (`_result`, made then)
        self._group = (model, x_all, y_all, offsets, sizes, device, threads, variant, x_split)
        self.local = Group(*self._group) if workers == 0 else None
        self._here_group = None
        if workers > 0:
            self.start_pool(workers, _init_worker, self._group)

    def describe(self) -> str:
        """What trains the tasks, as recorded in metrics.jsonl's `engine`: "batched+native(<variant>)"
        (the LeNets' fused layers, built for the variant: avx512, avx2, generic), "batched" (torch ops
        only: a model without fused layers, or no kernels), and " (cuda)" on a GPU."""
        return (f"batched+native({self.native})" if self.native else "batched") + (
            "" if self.device.type == "cpu" else f" ({self.device.type})")

    def details(self) -> dict:
        """The engine's settings, for the log line at the start of a run."""
        out = {"device": str(self.device), "workers": self.workers, "slices": self.groups,
               "native": self.native is not None, "kernel": self.native}
        if self.fits and not self.native:   # a LeNet on the CPU without its fused layers: why
            out["native_off"] = "native=False" if self.requested is None else kernels.error(self.requested) or "?"
        if self.in_process_reason:
            out["in_process"] = self.in_process_reason
        return out

    def slices(self, tasks: list[TrainTask]) -> list[list[TrainTask]]:
        """`groups` contiguous slices of the task list, fixed by the tasks alone (not by `workers`)."""
        return contiguous_slices(tasks, self.groups)

    def run(self, w_global: torch.Tensor, tasks: list[TrainTask]) -> list[LocalResult]:
        results = self.run_parts([(w_global, p, None, None) for p in self.slices(tasks)])
        return [r for part in results for r in part]

    def run_iter(self, w_global: torch.Tensor, tasks: list[TrainTask]) -> Iterator[list[LocalResult]]:
        """`run`, one slice's results at a time, in order, as each is trained (the same slices, so the
        same bits): a caller that absorbs a slice and drops it keeps a round's deltas out of memory."""
        parts = [(w_global, p, None, None) for p in self.slices(tasks)]
        if self.pool is None:
            assert self.local is not None
            for p in parts:
                yield self.local.train(*p)
            return
        futures = [self.pool.submit(_train_in_worker, *p) for p in parts]
        while futures:  # popped: a handed-over slice is not kept by its future
            yield self._result(futures.pop(0), parts.pop(0))

    def run_parts(self, parts: list[tuple]) -> list[list[LocalResult]]:
        """Train each part, (w_global, tasks, data, start[, terms]) as `Group.train` takes them, as one
        computation (in a worker where there are workers); the results of each part, in order."""
        if self.pool is None:
            assert self.local is not None
            return [self.local.train(*p) for p in parts]
        futures = [self.pool.submit(_train_in_worker, *p) for p in parts]
        return [self._result(f, p) for f, p in zip(futures, parts)]

    def _result(self, future, part: tuple) -> list[LocalResult]:
        """A worker's results for `part`; where its weights or its results found no room in shared memory on the
        way (torch pickles them through /dev/shm), the part trained in this process instead: the same `Group.train`
        on the same slice with the same threads, so the same bits; said once (`_no_room`)."""
        e = future.exception()
        if e is None or not shm_error(e):
            return _unpack(future.result())
        w_global, tasks = part[0], part[1]
        need = w_global.nbytes + len(tasks) * w_global.shape[-1] * w_global.element_size()
        self._no_room("the batched engine trains a slice in this process",
                      "it does not fit in shared memory on its way to or from its worker", need,
                      "a slice's weights and deltas", e)
        if self._here_group is None:
            self._here_group = Group(*self._group)
        return self._here_group.train(*part)


def contiguous_slices(tasks: list, groups: int) -> list[list]:
    """`groups` contiguous, near-equal slices of `tasks` (fewer where there are fewer tasks), in order: the rule by
    which the batched engines cut a round, so that a client's computation depends on the tasks, not the workers."""
    g = min(groups, max(len(tasks), 1))
    bounds = [len(tasks) * i // g for i in range(g + 1)]
    return [tasks[bounds[i]:bounds[i + 1]] for i in range(g) if bounds[i + 1] > bounds[i]]


def _strip_generators(model: nn.Module) -> nn.Module:
    """A copy of `model` without the torch.Generator that `local_train` leaves on its dropout layers
    (generators do not pickle; the engine passes generators explicitly)."""
    import copy
    saved = [(m, m.generator) for m in model.modules() if isinstance(m, SeededDropout)]
    for m, _ in saved:
        m.generator = None
    try:
        return copy.deepcopy(model)
    finally:
        for m, g in saved:
            m.generator = g
