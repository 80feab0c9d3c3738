"""coordinator/sim/channels_last.py: per-client mode's channels-last copy of a Conv2d-BatchNorm model.

Its BatchNorm (both backends: the native kernels of every variant this CPU runs, and torch ops) is as close to
float64 as torch's NCHW kernel: outputs, gradients and running statistics, for channel counts that divide 64 and
others, batches whose rows do not fill the last chunk, affine=False, momentum=None, no running statistics, eval
mode. The copy is the model (state-dict keys, flat weights); the rule says which models train channels-last; and
the engine trains a BatchNorm ResNet to the loop's (NCHW) result within float rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from test_functional_engine import TinyResNet, make_data, mixed_tasks
from torch import nn

from coordinator.sim import channels_last as cl
from coordinator.sim import kernels
from coordinator.sim.functional import GenericEngine
from edge_client.models import get_flat
from edge_client.trainer import TrainTask, local_train

# native: every variant this CPU runs whose library builds here; torch: the reference backend
BACKENDS = [v for v in kernels.cpu_variants() if kernels.available(v)] + ["torch"]
# why the tests of the native backend skip, where they do (no C++ compiler, a failed build): the build's error
NO_NATIVE = None if len(BACKENDS) > 1 else \
    f"the native kernels do not build here ({kernels.error(kernels.cpu_variants()[-1]) or 'unknown'})"


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def batchnorm_run(x: torch.Tensor, g: torch.Tensor, bn: nn.BatchNorm2d, how: str):
    """(y, dx, dw, db, running mean, running var) of one training step of a copy of `bn` on `x` with output gradient
    `g`: "float64" (torch's NCHW kernel in double: the reference), "nchw" (torch's, float32), or a backend of
    `_BatchNormCL` on the channels-last batch."""
    layer = copy.deepcopy(bn)
    if how == "float64":
        layer, x, g = layer.double(), x.double(), g.double()
    fmt = torch.contiguous_format if how in ("float64", "nchw") else torch.channels_last
    x = x.detach().clone(memory_format=fmt).requires_grad_()   # a leaf of its own: the caller's x untouched
    if how in ("float64", "nchw"):
        y = layer(x)
    else:
        layer.__class__ = cl._precise_class(type(bn))
        lib = None if how == "torch" else kernels.load(how)
        running = None
        if layer.track_running_stats:
            layer.num_batches_tracked.add_(1)
            factor = 1.0 / float(layer.num_batches_tracked) if layer.momentum is None else layer.momentum
            running = (layer.running_mean, layer.running_var, factor)
        y = cl._BatchNormCL.apply(x, layer.weight, layer.bias, layer.eps, running, lib)
        assert y.is_contiguous(memory_format=torch.channels_last)
    y.backward(g.contiguous(memory_format=fmt))
    grads = [None if p is None else p.grad for p in (layer.weight, layer.bias)]
    return [y.detach(), x.grad, *grads, layer.running_mean, layer.running_var]


CASES = [   # (N, C, H, W), BatchNorm2d keywords
    ((16, 16, 32, 32), {}),                                  # ResNet-8's first stage: 16,384 rows
    ((16, 64, 8, 8), {"momentum": None}),                    # the cumulative average
    ((3, 16, 5, 7), {}),                                     # 105 rows: the last chunk of 4 rows holds 1
    ((4, 24, 6, 6), {"affine": False}),                      # 24 channels do not divide 64: row by row
    ((2, 128, 3, 3), {"track_running_stats": False}),        # more lanes than 64; batch statistics only
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,kw", CASES, ids=[f"{s[1]}ch-{s[0] * s[2] * s[3]}rows" for s, _ in CASES])
def test_the_channels_last_batchnorm_is_as_close_to_float64_as_torch_s_nchw_kernel(backend, shape, kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 2 + 3   # an offset mean: a naive sum of squares would cancel
    grad = torch.randn(shape, generator=g)
    bn = nn.BatchNorm2d(shape[1], **kw)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5, generator=g)
            bn.bias.normal_(generator=g)
    if bn.running_mean is not None:
        bn.running_mean.normal_(generator=g)
        bn.running_var.uniform_(0.5, 2.0, generator=g)
    ref = batchnorm_run(x, grad, bn, "float64")
    nchw = batchnorm_run(x, grad, bn, "nchw")
    got = batchnorm_run(x, grad, bn, backend)
    names = ["y", "dx", "dweight", "dbias", "running_mean", "running_var"]
    for name, r, n, v in zip(names, ref, nchw, got):
        if r is None:
            assert v is None, name
            continue
        assert v.dtype == torch.float32 and v.shape == r.shape, name
        # within float32 rounding of float64: a few ulp, and never much farther than torch's NCHW kernel
        assert rel(v, r) <= max(4 * rel(n, r), 2e-7), (name, rel(v, r), rel(n, r))


@pytest.mark.skipif(NO_NATIVE is not None, reason=str(NO_NATIVE))
def test_the_native_and_torch_backends_train_a_resnet_to_the_same_result_within_rounding(monkeypatch):
    torch.manual_seed(0)
    model = TinyResNet(width=16)
    w = get_flat(model)
    (x, y), = make_data([24], (3, 32, 32), torch.float32, seed=2)
    task = TrainTask(client=0, round=1, lr=0.05, batch_size=8, steps=3, seed=1)
    xc = x.contiguous(memory_format=torch.channels_last)
    native = local_train(cl.channels_last_copy(model), w, xc, y, task)
    monkeypatch.setattr(cl, "_native", lambda: None)
    ops = local_train(cl.channels_last_copy(model), w, xc, y, task)
    assert rel(native.delta, ops.delta.double()) < 1e-5 and abs(native.loss - ops.loss) < 1e-5
    for n in ops.buffers:
        if ops.buffers[n].is_floating_point():
            torch.testing.assert_close(native.buffers[n], ops.buffers[n], rtol=1e-5, atol=1e-6)


def test_eval_mode_and_a_batch_of_one_value_per_channel_are_torch_s_own():
    bn = nn.BatchNorm2d(8)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
    layer = cl.channels_last_copy(nn.Sequential(bn))[0]
    x = torch.randn(4, 8, 5, 5)
    layer.eval()
    assert torch.equal(layer(x.contiguous(memory_format=torch.channels_last)), bn.eval()(x))
    layer.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 8, 1, 1))


class _MyBatchNorm(nn.BatchNorm2d):
    """A user's BatchNorm2d with its own forward: the copy gives it its input NCHW."""
    seen: list[bool] = []

    def forward(self, x):
        _MyBatchNorm.seen.append(x.is_contiguous())
        return super().forward(x)


class _Net(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv, self.norm, self.bn, self.fc = nn.Conv2d(3, 8, 3), norm, nn.BatchNorm2d(8), nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.bn(self.norm(self.conv(x))).mean((2, 3)))


def test_the_copy_is_the_model_channels_last():
    torch.manual_seed(0)
    model = _Net(_MyBatchNorm(8))
    copy_ = cl.channels_last_copy(model)
    assert list(copy_.state_dict()) == list(model.state_dict())
    assert torch.equal(get_flat(copy_), get_flat(model))
    assert copy_.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert isinstance(copy_.norm, _MyBatchNorm) and isinstance(copy_.bn, nn.BatchNorm2d)
    assert type(model.bn) is nn.BatchNorm2d   # the model itself is untouched
    _MyBatchNorm.seen.clear()
    copy_(torch.randn(4, 3, 10, 10).contiguous(memory_format=torch.channels_last)).sum().backward()
    assert _MyBatchNorm.seen == [True]


@pytest.mark.skipif(NO_NATIVE is not None, reason=str(NO_NATIVE))
def test_which_models_train_channels_last(monkeypatch):
    x = torch.zeros(2, 3, 8, 8)
    assert cl.layout_rule(TinyResNet(4), x) == (True, "Conv2d with BatchNorm2d")
    assert cl.layout_rule(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), x)[0] is False        # no BatchNorm
    assert cl.layout_rule(_Net(nn.GroupNorm(2, 8)), x) == \
        (False, "GroupNorm (their channels-last kernels are not checked)")
    assert cl.layout_rule(TinyResNet(4), torch.zeros(2, 3 * 64))[0] is False                   # not images
    assert cl.layout_rule(TinyResNet(4).double(), x.double()) == \
        (False, "not float32 (the native BatchNorm kernels' dtype)")
    monkeypatch.setattr(cl, "_native", lambda: None)   # no compiler, or DROPFL_KERNEL=off
    assert cl.layout_rule(TinyResNet(4), x)[1].startswith("the native kernels are unavailable")
    monkeypatch.setenv("DROPFL_CHANNELS_LAST", "0")
    assert cl.layout_rule(TinyResNet(4), x) == (False, "DROPFL_CHANNELS_LAST=0")


@pytest.mark.skipif(NO_NATIVE is not None, reason=str(NO_NATIVE))
def test_per_client_mode_channels_last_equals_the_loop_within_float_rounding():
    """The engine (channels-last, 2 workers) against the loop's NCHW `local_train` on one thread, one step per
    client, FedProx, SCAFFOLD and BatchNorm buffers included: the same loss, and the same update within 1e-5
    (relative) wherever neither went another way than float64 at a near-tie (both within 1e-4 of the float64
    loop: at least 3 of the 5 clients); over the clients as close to float64 as the loop (median at most 2× + 1e-7).
    With torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 machine) the loop
    itself went another way for one client after this one step, the engine did not: hence the float64 yardstick."""
    torch.manual_seed(0)
    model = TinyResNet(width=16)
    w = get_flat(model)
    data = make_data([16, 16, 16, 16, 16], (3, 32, 32), torch.float32, seed=4)
    tasks = [TrainTask(client=t.client, round=t.round, lr=t.lr, batch_size=16, steps=1, prox_mu=t.prox_mu,
                       grad_correction=t.grad_correction, seed=t.seed) for t in mixed_tasks(w, 16)]
    engine = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=2)
    try:
        assert engine.details()["layout"] == "channels-last"
        assert engine.details()["batchnorm"] == f"native ({kernels.chosen()})"
        got = engine.run(w, tasks)
    finally:
        engine.close()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    engine_err, loop_err, compared = [], [], 0
    try:
        for t, r in zip(tasks, got):
            x, y = data[t.client]
            ref = local_train(copy.deepcopy(model), w, x, y, t)
            corr = None if t.grad_correction is None else t.grad_correction.double()
            t64 = TrainTask(client=t.client, round=t.round, lr=t.lr, batch_size=16, steps=1, prox_mu=t.prox_mu,
                            grad_correction=corr, seed=t.seed)
            f64 = local_train(copy.deepcopy(model).double(), w.double(), x.double(), y, t64).delta
            engine_err.append(rel(r.delta, f64))
            loop_err.append(rel(ref.delta, f64))
            assert abs(r.loss - ref.loss) < 1e-5 and r.steps == ref.steps
            if max(engine_err[-1], loop_err[-1]) < 1e-4:
                compared += 1
                assert rel(r.delta, ref.delta.double()) < 1e-5, (t.client, rel(r.delta, ref.delta.double()))
                for n in ref.buffers:
                    torch.testing.assert_close(r.buffers[n], ref.buffers[n], rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(saved)
    assert compared >= 3, (engine_err, loop_err)
    median = lambda v: sorted(v)[len(v) // 2]   # noqa: E731
    assert median(engine_err) <= 2 * median(loop_err) + 1e-7, (engine_err, loop_err)


def test_without_the_native_kernels_per_client_mode_stays_nchw(monkeypatch):
    """With DROPFL_KERNEL=off (as without a compiler) a BatchNorm ResNet trains NCHW, `local_train`'s bits: the torch
    backend's float64 copy of every batch would make the channels-last step slower than the NCHW one."""
    monkeypatch.setenv("DROPFL_KERNEL", "off")
    monkeypatch.setattr(kernels, "_chosen", None)
    torch.manual_seed(0)
    model = TinyResNet(width=16)
    engine = GenericEngine(copy.deepcopy(model), make_data([8, 8], (3, 32, 32), torch.float32, seed=4), device="cpu",
                           workers=0)
    try:
        d = engine.details()
        assert engine.describe() == "batched (per client)" and d["layout"] == "NCHW" and d["batchnorm"] is None
        assert d["layout_reason"].startswith("the native kernels are unavailable (turned off")
    finally:
        engine.close()
