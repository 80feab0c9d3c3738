"""Per-client mode's channels-last copy of a BatchNorm model, with BatchNorm computed as precisely as NCHW.

oneDNN's convolutions run faster on channels-last (NHWC) activations than on NCHW ones, which it reorders to and
from its own layout at every call: a BatchNorm ResNet's training step on one thread was 1.26× faster with the
model and its images channels-last (benchmarks/results/per_client_variants.md). What kept per-client mode NCHW
was torch's CPU BatchNorm kernel on channels-last float32 input: it sums each channel's N·H·W values one after the
other in float32, and ResNet-8's updates came out ~1,700× farther from float64 than NCHW's. Here every
`nn.BatchNorm2d` of the copy computes its batch statistics and gradients with sums in double instead
(`_BatchNormCL`), as close to float64 as torch's NCHW kernel (tests/test_channels_last.py): ResNet-8's step 1.23×
the NCHW one, the same distance from float64.

Two backends behind one autograd function, the same formulas:
- "native": `dropfl_bn_cl_fwd_f32` / `_bwd_f32` in the native kernels' library (coordinator/sim/kernels,
  conv_pool.cpp: one pass per sum, vectorised over 64 lanes), float32 on the CPU where the library builds;
- "torch": torch ops on a float64 copy of the batch (the reference the tests hold the kernels to; any float dtype;
  a layer whose tensors are not all float32).

`layout_rule(model, x)` says whether per-client mode trains a model channels-last: a model with a Conv2d and a
BatchNorm2d (the models measured faster), no GroupNorm, InstanceNorm2d or LocalResponseNorm (their channels-last
kernels' precision is not checked: such a model stays NCHW), float32 parameters and 4-D float32 inputs, the native
kernels available (the torch backend makes a float64 copy of every batch: ResNet-8's step 0.60× the NCHW one, so
without the kernels the model stays NCHW), and DROPFL_CHANNELS_LAST not "0".
A run then trains each client with `local_train` on `channels_last_copy(model)`: equal to the loop (NCHW) to
float rounding, bit for bit the same whatever the slices and workers (tests/test_channels_last.py).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

ENV = "DROPFL_CHANNELS_LAST"
_UNCHECKED_NORMS = (nn.GroupNorm, nn.InstanceNorm2d, nn.LocalResponseNorm)


def layout_rule(model: nn.Module, x: torch.Tensor) -> tuple[bool, str]:
    """(train channels-last, why): a function of the model, the input's shape and dtype, and DROPFL_CHANNELS_LAST."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "no", "false"):
        return False, f"{ENV}=0"
    if x.dim() != 4 or not x.is_floating_point():
        return False, "inputs are not 4-D float images"
    mods = list(model.modules())
    if not any(isinstance(m, nn.Conv2d) for m in mods) or not any(isinstance(m, nn.BatchNorm2d) for m in mods):
        return False, "no Conv2d with BatchNorm2d"
    odd = sorted({type(m).__name__ for m in mods if isinstance(m, _UNCHECKED_NORMS)})
    if odd:
        return False, f"{', '.join(odd)} (their channels-last kernels are not checked)"
    if x.dtype != torch.float32 or any(p.dtype != torch.float32 for p in model.parameters()):
        return False, "not float32 (the native BatchNorm kernels' dtype)"
    if _native() is None:   # the torch backend is precise but slower than NCHW: not worth the layout
        from coordinator.sim import kernels
        return False, f"the native kernels are unavailable ({kernels.error() or 'not built'})"
    return True, "Conv2d with BatchNorm2d"


def _native():
    """The kernels' library (None where it does not build or DROPFL_KERNEL=off: the torch backend)."""
    from coordinator.sim import kernels
    return kernels.load()


def backend() -> str:
    """The BatchNorm backend a channels-last copy made now uses: "native (<variant>)" or "torch"."""
    from coordinator.sim import kernels
    return f"native ({kernels.chosen()})" if _native() is not None else "torch"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _BatchNormCL(torch.autograd.Function):
    """Training-mode batch normalisation of a channels-last [N, C, H, W] batch, sums in double (module docstring).
    `running`: (running mean, running var, factor) to update as torch's kernel does, or None. `lib`: the native
    library, or None for the torch backend."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, running, lib):
        n, c, h, w = x.shape
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)   # a view: x is channels-last
        m = rows.shape[0]
        rm, rv, factor = running if running is not None else (None, None, 0.0)
        if lib is not None:
            y = torch.empty_like(x)   # channels-last, as x
            stats = torch.empty(3, c, dtype=torch.float64)   # mean, var, invstd
            lib.dropfl_bn_cl_fwd_f32(rows.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr(), stats.data_ptr(),
                                     _ptr(rm), _ptr(rv), m, c, eps, factor)
        else:
            r64 = rows.double()
            var, mean = torch.var_mean(r64, 0, correction=0)
            invstd = torch.rsqrt(var + eps)
            stats = torch.stack([mean, var, invstd])
            scale = invstd if weight is None else invstd * weight.double()
            yr = (r64 - mean) * scale + (0.0 if bias is None else bias.double())
            y = yr.to(x.dtype).reshape(n, h, w, c).permute(0, 3, 1, 2)
            if rm is not None:
                rm.copy_((factor * mean + (1 - factor) * rm.double()).to(rm.dtype))
                rv.copy_((factor * var * (m / (m - 1)) + (1 - factor) * rv.double()).to(rv.dtype))
        ctx.save_for_backward(x, weight, stats)
        ctx.lib = lib
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, stats = ctx.saved_tensors
        n, c, h, w = x.shape
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        g = gy.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, c)
        m = rows.shape[0]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.lib is not None:
            dx = torch.empty_like(x) if need_x else None
            dw = torch.empty_like(weight) if need_w else None
            db = torch.empty_like(weight) if need_b else None
            ctx.lib.dropfl_bn_cl_bwd_f32(g.data_ptr(), rows.data_ptr(), _ptr(weight), stats.data_ptr(), _ptr(dx),
                                         _ptr(dw), _ptr(db), m, c)
            return dx, dw, db, None, None, None
        mean, invstd = stats[0], stats[2]
        g64, xc = g.double(), rows.double() - mean
        sg, sgx = g64.sum(0), (g64 * xc).sum(0)
        dx = dw = db = None
        if need_x:
            a = invstd if weight is None else invstd * weight.double()
            d = a * (g64 - sg / m - xc * (invstd * invstd * sgx / m))
            dx = d.to(x.dtype).reshape(n, h, w, c).permute(0, 3, 1, 2)
        if need_w:
            dw = (sgx * invstd).to(weight.dtype)
        if need_b:
            db = sg.to(weight.dtype)
        return dx, dw, db, None, None, None


class _PreciseBatchNorm:
    """Mixed into a channels-last copy's BatchNorm2d classes (`channels_last_copy`). Where the layer normalises
    with the batch's statistics (training, or no running statistics), a float CPU batch of more than one value
    per channel: `_BatchNormCL`, the running statistics updated as `_BatchNorm.forward` and torch's kernel update
    them (momentum, or the cumulative average where it is None; the unbiased variance). Otherwise the class's own
    forward on the input made NCHW (eval mode; a batch of one value per channel, for which torch raises)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_stats = self.training or self.running_mean is None
        if not (batch_stats and x.dim() == 4 and x.is_floating_point() and x.device.type == "cpu"
                and x.numel() > x.shape[1]):
            return super().forward(x.contiguous())
        running = None
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            if self.running_mean is not None:
                running = (self.running_mean, self.running_var, factor)
        x = x.contiguous(memory_format=torch.channels_last)
        native = all(t is None or t.dtype == torch.float32 for t in (x, self.weight, self.bias, self.running_mean,
                                                                     self.running_var))
        return _BatchNormCL.apply(x, self.weight, self.bias, self.eps, running, _native() if native else None)


class _NCHWInput:
    """Mixed into a BatchNorm's class (`nchw_input`; in a channels-last copy, the classes that override `forward`):
    its own forward, on the input made NCHW (torch's precise kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.contiguous())


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed(cls: type, mixin: type) -> type:
    """`cls` with `mixin` in front, one class per pair (`isinstance`, state-dict keys and deepcopy unchanged)."""
    if (cls, mixin) not in _CLASSES:
        _CLASSES[cls, mixin] = type(cls.__name__, (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls, mixin]


def _precise_class(cls: type) -> type:
    """`cls` with `_PreciseBatchNorm` (its forward is `_BatchNorm`'s) or `_NCHWInput` (it has its own) in front."""
    return _mixed(cls, _PreciseBatchNorm if cls.forward is nn.modules.batchnorm._BatchNorm.forward else _NCHWInput)


def nchw_input(layer: nn.Module) -> None:
    """`layer`, a BatchNorm, computes its forward on its input made contiguous (NCHW) from now on: its class is
    swapped for one with `_NCHWInput` in front (rather than its `forward` patched with a closure, which a deepcopy
    of the model would share, computing on the original layer's buffers). Costs one copy per call."""
    layer.__class__ = _mixed(type(layer), _NCHWInput)


def channels_last_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with its parameters channels-last and each `nn.BatchNorm2d` computed by
    `_PreciseBatchNorm` (a class that overrides `forward`: `_NCHWInput`). Its parameters, buffers and state-dict
    keys are the model's (`get_flat` reads the parameters in their logical order)."""
    m = copy.deepcopy(model).to(memory_format=torch.channels_last)
    for layer in m.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.__class__ = _precise_class(type(layer))
    return m
