"""The fused layer kernels (coordinator/sim/kernels/conv_pool.cpp) against the torch ops they replace.

relu(max_pool2d(conv2d(x, w, b, groups=K), 2)) for K clients, as the LeNets' first layer (on the
images, by index) and second layer (on activations, output in row layout): values and gradients in
float64 to 1e-12 (the kernels sum each output's products in another order than mkldnn, nothing
else differs), exact gradient routing at exact ties (blank regions, where every conv output of a
window equals the bias), NaN propagation, shapes with an odd conv output and more columns than one
vector, and the engine with and without the kernels. Every test that runs a kernel runs once per
variant this CPU runs (`kernels.cpu_variants()`: avx512, avx2, generic on this x86 machine); a
last test cross-compiles the source for aarch64. Skipped, with the reason, only where no C++
compiler exists (or DROPFL_NATIVE=0 / DROPFL_KERNEL=off turns the kernels off); with a compiler, a
failed build of any variant fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coordinator.sim import kernels
from coordinator.sim.batched import BatchedEngine
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask

CXX = os.environ.get("CXX", "g++")
pytestmark = [
    pytest.mark.skipif(kernels.compiler() is None,   # $CXX, else g++ (or c++), on PATH
                       reason=f"no C++ compiler ({CXX} not on PATH): the engine uses torch ops"),
    pytest.mark.skipif(os.environ.get("DROPFL_NATIVE", "1") == "0", reason="DROPFL_NATIVE=0 turns the kernels off"),
    pytest.mark.skipif(os.environ.get("DROPFL_KERNEL", "").lower() == "off", reason="DROPFL_KERNEL=off"),
]
VARIANTS = kernels.cpu_variants()   # what this CPU runs, best first; ends with "generic"


@pytest.fixture(params=VARIANTS)
def variant(request) -> str:
    return request.param


def test_the_kernels_build(variant: str) -> None:
    """A compiler is there, so every variant this CPU runs must build and load: a failed build is a
    failure here, not a skip (the engine would silently fall back to the slower torch ops)."""
    assert kernels.available(variant), \
        f"{kernels.compiler()} is on PATH but the {variant} kernels did not build: {kernels.error(variant)}"


def test_the_variant_follows_the_cpu_or_the_environment(monkeypatch) -> None:
    """By default the widest variant the CPU runs; DROPFL_KERNEL forces one; unknown names and variants
    this CPU cannot run are user errors (running them would kill the process with SIGILL)."""
    from coordinator.errors import UserError
    monkeypatch.delenv("DROPFL_KERNEL", raising=False)
    monkeypatch.delenv("DROPFL_NATIVE", raising=False)
    assert kernels.requested() == VARIANTS[0] and VARIANTS[-1] == "generic"
    for name in (*VARIANTS, "off"):
        monkeypatch.setenv("DROPFL_KERNEL", name)
        assert kernels.requested() == name
    monkeypatch.setenv("DROPFL_KERNEL", "avx3")
    with pytest.raises(UserError, match="unknown kernel variant 'avx3'"):
        kernels.requested()
    for name in set(kernels.VARIANTS) - set(VARIANTS):   # e.g. avx512 on an AVX2-only CPU
        monkeypatch.setenv("DROPFL_KERNEL", name)
        with pytest.raises(UserError, match="cannot run"):
            kernels.requested()


def test_a_bad_variant_stops_the_run_before_anything_is_written(tmp_path, monkeypatch, capsys) -> None:
    """`dropfl sim` checks $DROPFL_KERNEL with the other inputs: one error line, exit 2, no run directory."""
    from coordinator.cli import main
    monkeypatch.setenv("DROPFL_KERNEL", "avx3")
    out = tmp_path / "run"
    assert main(["sim", "--dataset", "fmnist", "--clients", "4", "--model", "mimic-cnn", "--steps", "1",
                 "--rounds", "1", "--no-progress", "--out", str(out)]) == 2
    assert "DROPFL_KERNEL=avx3: unknown kernel variant" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_the_source_cross_compiles_for_aarch64(tmp_path) -> None:
    """The source builds for a Pi or Jetson (aarch64, NEON) with Debian's cross compiler: no x86-only
    code. Object file only (nothing to run it on here)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (aarch64-linux-gnu-g++; Debian: g++-aarch64-linux-gnu)")
    obj = tmp_path / "conv_pool.o"
    proc = subprocess.run([cxx, *kernels.COMMON_FLAGS, "-Werror", "-c", "-o", str(obj), str(kernels.SOURCE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nm = shutil.which("aarch64-linux-gnu-nm") or shutil.which("nm")
    symbols = subprocess.run([nm, "--defined-only", str(obj)], capture_output=True, text=True).stdout
    for name in ("conv_pool_fwd", "conv_pool_fwd_lanes", "conv_pool_bwd", "conv2_pool_fwd", "conv2_pool_bwd", "fc_sgd",
                 "sgd_update"):
        for suffix in ("f32", "f64"):
            assert f"dropfl_{name}_{suffix}" in symbols


def _raw_inputs() -> list[torch.Tensor]:
    """The inputs of tests/data/kernel_driver.cpp, in its file's order: both layers, float32."""
    g = torch.Generator().manual_seed(5)
    n, b, h, w, k, cin, o, h2, w2, o2 = 10, 5, 28, 28, 3, 1, 6, 12, 12, 16
    hp, wp, hp2, wp2 = (h - 4) // 2, (w - 4) // 2, (h2 - 4) // 2, (w2 - 4) // 2

    def f(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale
    return [torch.tensor([n, b, h, w, k, cin, o]), f(n, cin, h, w), torch.randint(0, n, (k, b), generator=g),
            f(k * o, cin, 5, 5, scale=0.2), f(k * o, scale=0.2), f(b, hp, wp, k * o), torch.tensor([h2, w2, o2]),
            f(b, h2, w2, k * 6), f(k * o2, 6, 5, 5, scale=0.1), f(k * o2, scale=0.1), f(k, b, o2 * hp2 * wp2)]


def _raw_outputs(variant: str, ins: list[torch.Tensor]) -> bytes:
    """What the driver writes, computed by this machine's `variant` library through ctypes: both layers in the
    engine's layouts, then in the client-major ones (layout = 1, the same buffers read as [K, B, ...] tensors), then
    the first layer's forward with the samples in the lanes (client-major)."""
    lib = kernels.load(variant)
    dims, x, rows, w, bias, gy, dims2, h, w2, b2, gy2 = ins
    n, b, hh, ww, k, cin, o = dims.tolist()
    h2, ww2, o2 = dims2.tolist()
    xs = kernels.split_images(x, 5, variant)   # the images as the first layer reads them
    gyp = torch.cat([gy.reshape(-1), torch.zeros(16)])   # 64 bytes of slack: the client-major backward reads them
    out = []
    for layout in (0, 1):
        y = torch.empty(b * ((hh - 4) // 2) * ((ww - 4) // 2) * k * o)
        arg = torch.empty(y.numel() + 64, dtype=torch.uint8)
        gw, gb = torch.empty_like(w), torch.empty_like(bias)
        p = [t.data_ptr() for t in (xs, rows, w, bias, y, arg)]
        lib.dropfl_conv_pool_fwd_f32(*p, b, hh, ww, k, cin, o, 5, 5, layout)
        lib.dropfl_conv_pool_bwd_f32(xs.data_ptr(), rows.data_ptr(), gyp.data_ptr(), arg.data_ptr(), gw.data_ptr(),
                                     gb.data_ptr(), b, hh, ww, k, cin, o, 5, 5, layout)
        y2 = torch.empty(gy2.numel())
        arg2 = torch.empty(y2.numel(), dtype=torch.uint8)
        gh, gw2, gb2 = torch.empty(h.numel() + 16), torch.empty_like(w2), torch.empty_like(b2)
        assert lib.dropfl_conv2_pool_fwd_f32(h.data_ptr(), w2.data_ptr(), b2.data_ptr(), y2.data_ptr(),
                                             arg2.data_ptr(), b, h2, ww2, k, 6, o2, 5, 5, layout) == 0
        assert lib.dropfl_conv2_pool_bwd_f32(h.data_ptr(), w2.data_ptr(), gy2.data_ptr(), arg2.data_ptr(),
                                             gh.data_ptr(), gw2.data_ptr(), gb2.data_ptr(), b, h2, ww2, k, 6, o2, 5, 5,
                                             layout) == 0
        out += [y, arg[:-64], gw, gb, y2, arg2, gh[:h.numel()], gw2, gb2]
    y = torch.empty(b * ((hh - 4) // 2) * ((ww - 4) // 2) * k * o)
    arg = torch.empty(y.numel(), dtype=torch.uint8)
    lib.dropfl_conv_pool_fwd_lanes_f32(*[t.data_ptr() for t in (xs, rows, w, bias, y, arg)], b, hh, ww, k, cin, o, 5,
                                       5)
    out += [y, arg]
    return b"".join(t.numpy().tobytes() for t in out)


@pytest.mark.slow
def test_the_aarch64_build_gives_the_x86_fma_builds_bits(tmp_path) -> None:
    """The source built for aarch64 (NEON, the cross compiler's baseline) and run under qemu-user
    (tests/data/kernel_driver.cpp: both layers forward and backward, float32) gives bitwise the
    outputs of the x86 variants with FMA: what a Pi or Jetson agent would compute, checked here."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static")
    if cxx is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64-static (Debian: g++-aarch64-linux-gnu, "
                    "qemu-user-static)")
    fma = [v for v in VARIANTS if v != "generic"]
    if not fma:
        pytest.skip(f"no x86 variant with FMA on this machine ({VARIANTS}) to compare with")
    exe, inp, out = tmp_path / "driver", tmp_path / "in.bin", tmp_path / "out.bin"
    driver = Path(__file__).with_name("data") / "kernel_driver.cpp"
    build = subprocess.run([cxx, "-O3", "-std=c++17", "-static", "-o", str(exe), str(driver), str(kernels.SOURCE)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    ins = _raw_inputs()
    inp.write_bytes(b"".join(t.numpy().tobytes() for t in ins))
    run = subprocess.run([qemu, str(exe), str(inp), str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    arm = out.read_bytes()
    for v in fma:
        assert arm == _raw_outputs(v, ins), v


def torch_layer(x_all, rows, w, b):
    k, batch = rows.shape
    x = x_all[rows.t().reshape(-1)].reshape(batch, k * x_all.shape[1], *x_all.shape[2:])
    return torch.relu(F.max_pool2d(F.conv2d(x, w, b, groups=k), 2))


def both(x_all, rows, w, b, grad_out, variant):
    """(y, dw, db) from the kernel and from torch ops."""
    out = []
    for fn in (lambda *a: kernels.conv_pool_relu(*a, variant), torch_layer):
        wv, bv = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = fn(x_all, rows, wv, bv)
        dw, db = torch.autograd.grad((y * grad_out).sum(), [wv, bv])
        out.append((y.detach(), dw, db))
    return out


@pytest.mark.parametrize("cin,side,o", [(1, 28, 6), (3, 32, 6), (1, 28, 10), (2, 27, 4), (1, 41, 3)])
def test_matches_torch_ops_in_float64(cin: int, side: int, o: int, variant: str) -> None:
    """mimic-cnn, cifar-lenet, fdms-cnn shapes; an odd conv output (27 → 23, pooled 11); 18 pooled
    columns (more than one vector of 16 floats or 8 doubles)."""
    g = torch.Generator().manual_seed(0)
    k, batch, n = 4, 5, 30
    x_all = torch.randn(n, cin, side, side, generator=g, dtype=torch.float64)
    rows = torch.randint(0, n, (k, batch), generator=g)
    w = torch.randn(k * o, cin, 5, 5, generator=g, dtype=torch.float64) * 0.2
    b = torch.randn(k * o, generator=g, dtype=torch.float64) * 0.2
    hp = (side - 4) // 2
    grad_out = torch.randn(batch, k * o, hp, hp, generator=g, dtype=torch.float64)
    (y, dw, db), (y_ref, dw_ref, db_ref) = both(x_all, rows, w, b, grad_out, variant)
    assert y.shape == y_ref.shape == (batch, k * o, hp, hp)
    assert y.is_contiguous(memory_format=torch.channels_last)   # what the next grouped conv reads fastest
    assert (y > 0).float().mean() > 0.2                         # relu leaves a real share of positions
    assert torch.allclose(y, y_ref, rtol=0, atol=1e-12)
    assert torch.allclose(dw, dw_ref, rtol=0, atol=1e-12)
    assert torch.allclose(db, db_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_route_to_the_first_maximum_exactly(dtype: torch.dtype, variant: str) -> None:
    """Blank images: every conv output of a window is exactly the bias, a 4-way tie. The gradient must
    go to the window's first position where bias > 0 and nowhere where bias <= 0, as in torch.
    Inputs, weights and output gradients are small integers or quarters, so every sum is exact in any
    order and the kernel must agree with torch bit for bit: any misrouted gradient shows."""
    k, batch, o = 3, 2, 6
    x_all = torch.zeros(4, 1, 28, 28, dtype=dtype)
    x_all[1, 0, 10:20, 5:9] = 1.0     # one image with a patch: some windows are not ties
    rows = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.full((k * o, 1, 5, 5), 0.25, dtype=dtype)
    b = torch.tensor([0.5, -0.5, 0.0, 1.0, -1.0, 2.0] * k, dtype=dtype)
    grad_out = (torch.arange(batch * k * o * 144) % 7 + 1).to(dtype).reshape(batch, k * o, 12, 12)
    (y, dw, db), (y_ref, dw_ref, db_ref) = both(x_all, rows, w, b, grad_out, variant)
    assert torch.equal(y, y_ref)
    assert torch.equal(db, db_ref)
    assert torch.equal(dw, dw_ref)
    # client 2 sees only blank images: where its bias is -0.5 or 0.0, relu passes nothing
    assert db[13] == 0 and db[14] == 0 and db[12] > 0 and dw[13].abs().sum() == 0


def torch_layer2(h, w, b, k):
    y = torch.relu(F.max_pool2d(F.conv2d(h, w, b, groups=k), 2))
    return y.reshape(y.shape[0], k, -1).transpose(0, 1)          # the engine's row layout [K, B, O·Hp·Wp]


def both2(h, w, b, k, grad_out, variant):
    out = []
    for fn in (lambda *a: kernels.conv2_pool_relu(*a, variant), torch_layer2):
        hv, wv, bv = h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        y = fn(hv, wv, bv, k)
        out.append((y.detach(), *torch.autograd.grad((y * grad_out).sum(), [hv, wv, bv])))
    return out


@pytest.mark.parametrize("dtype,side,o", [(torch.float64, 12, 16), (torch.float64, 14, 16), (torch.float64, 11, 5),
                                          (torch.float32, 13, 32), (torch.float32, 12, 16)])
def test_second_layer_matches_torch_ops(dtype: torch.dtype, side: int, o: int, variant: str) -> None:
    """mimic-cnn (12 → 4×4) and cifar-lenet (14 → 5×5, two column blocks) second layers, an odd conv
    output, and 32 channels (two vectors of float32); float32 at float32 rounding."""
    g = torch.Generator().manual_seed(1)
    k, batch = 4, 5
    h = torch.randn(batch, k * 6, side, side, generator=g, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(k * o, 6, 5, 5, generator=g, dtype=dtype) * 0.1
    b = torch.randn(k * o, generator=g, dtype=dtype) * 0.1
    hp = (side - 4) // 2
    grad_out = torch.randn(k, batch, o * hp * hp, generator=g, dtype=dtype)
    (y, dh, dw, db), (y_ref, dh_ref, dw_ref, db_ref) = both2(h, w, b, k, grad_out, variant)
    assert y.shape == y_ref.shape == (k, batch, o * hp * hp)
    assert dh.is_contiguous(memory_format=torch.channels_last)   # what the first layer's backward reads
    assert (y > 0).float().mean() > 0.2
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for got, want in ((y, y_ref), (dh, dh_ref), (dw, dw_ref), (db, db_ref)):
        assert torch.allclose(got, want, rtol=0, atol=tol)


def test_second_layer_ties_and_unsupported_shapes(variant: str) -> None:
    """Blank input: 4-way ties everywhere, integer gradients: bit-equal to torch. Shapes without a
    kernel are refused (the engine then uses torch ops; kernels.inner_fits)."""
    k, batch, o = 2, 3, 16
    h = torch.zeros(batch, k * 6, 12, 12, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    h[1, 3, 2:6, 4:7] = 1.0
    w = torch.full((k * o, 6, 5, 5), 0.5, dtype=torch.float64)
    b = torch.tensor([1.0, -1.0, 0.0, 2.0] * (k * o // 4), dtype=torch.float64)
    grad_out = (torch.arange(k * batch * o * 16) % 5 + 1).to(torch.float64).reshape(k, batch, -1)
    (y, dh, dw, db), (y_ref, dh_ref, dw_ref, db_ref) = both2(h, w, b, k, grad_out, variant)
    for got, want in ((y, y_ref), (dh, dh_ref), (dw, dw_ref), (db, db_ref)):
        assert torch.equal(got, want)
    assert not kernels.inner_fits(10, 20, (5, 5), torch.float32)          # fdms-cnn's conv2
    assert not kernels.inner_fits(6, 17, (5, 5), torch.float64)           # more than 2 vectors
    with pytest.raises(ValueError, match="no kernel"):
        kernels.conv2_pool_relu(torch.rand(2, 20, 12, 12), torch.rand(40, 10, 5, 5), torch.rand(40), 2, variant)


def test_nan_propagates_as_in_torch(variant: str) -> None:
    x_all = torch.rand(2, 1, 28, 28)
    x_all[0, 0, 3, 3] = float("nan")
    rows = torch.tensor([[0, 1]])
    w, b = torch.rand(6, 1, 5, 5), torch.rand(6)
    y = kernels.conv_pool_relu(x_all, rows, w, b, variant)
    y_ref = torch_layer(x_all, rows, w, b)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.isnan(y).any()
    ok = ~torch.isnan(y_ref)
    assert torch.allclose(y[ok], y_ref[ok], atol=1e-5)


@pytest.mark.parametrize("name", ["mimic-cnn", "fdms-cnn", "cifar-lenet"])
def test_engine_with_and_without_kernel(name: str, variant: str) -> None:
    """The batched engine's rounds with the kernel = the same engine with torch ops (float64, 1e-10):
    clients of different sizes, steps and learning rates (the prefix of active clients shrinks)."""
    shape = (3, 32, 32) if name == "cifar-lenet" else (1, 28, 28)
    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
            for n in (21, 16, 9)]
    model = build_model(name, shape, 10, seed=3).double()
    w = get_flat(model)
    tasks = [TrainTask(client=0, round=1, lr=0.05, batch_size=4, epochs=1, seed=2),
             TrainTask(client=1, round=1, lr=0.1, batch_size=4, steps=2, seed=2),
             TrainTask(client=2, round=1, lr=0.05, batch_size=4, steps=6, seed=2)]
    fast = BatchedEngine(model, data, workers=0, device="cpu", native=variant)   # the kernels are CPU code
    plain = BatchedEngine(model, data, workers=0, device="cpu", native=False)
    assert fast.local.native == variant and not plain.local.native
    assert fast.describe() == f"batched+native({variant})" and plain.describe() == "batched"
    for a, b in zip(fast.run(w, tasks), plain.run(w, tasks)):
        assert a.steps == b.steps
        assert (a.delta - b.delta).abs().max() < 1e-10
        assert a.delta.abs().max() > 1e-4


def test_the_fma_variants_compute_the_same_bits() -> None:
    """The variants differ in vector width and register blocking only, never in the order of any sum
    (conv_pool.cpp, "Portability"): where both contract a*b+c into FMAs (avx512, avx2) a float32
    mimic-cnn round gives the same bits. (x86's generic build has no FMA: ulp-level differences.)"""
    fma = [v for v in VARIANTS if v != "generic"]
    if len(fma) < 2:
        pytest.skip(f"this CPU runs only {VARIANTS}: fewer than two FMA variants to compare")
    g = torch.Generator().manual_seed(4)
    data = [(torch.rand(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)) for _ in range(3)]
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    tasks = [TrainTask(client=i, round=1, lr=0.05, batch_size=16, steps=6, seed=1) for i in range(3)]
    runs = [torch.stack([r.delta for r in BatchedEngine(model, data, workers=0, device="cpu", native=v).run(w, tasks)])
            for v in fma]
    assert runs[0].abs().max() > 1e-4
    for other in runs[1:]:
        assert torch.equal(runs[0], other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_images_split_once_give_the_bits_of_the_step_split(variant: str, dtype: torch.dtype) -> None:
    """The engine splits its images once (`split_images`, shared by its workers); a caller without the
    split gets the step's images split per call: the layer's output, routing and gradients are the same
    bits either way (only where the kernel reads its inputs from differs). A split of the wrong shape or
    dtype is refused, since the kernel reads it unchecked."""
    g = torch.Generator().manual_seed(7)
    for cin, side in ((1, 28), (3, 32), (2, 27)):
        x_all = torch.randn(12, cin, side, side, generator=g).to(dtype)
        rows = torch.randint(0, 12, (3, 5), generator=g)
        w, b = (torch.randn(18, cin, 5, 5, generator=g) * 0.2).to(dtype), (torch.randn(18, generator=g) * 0.2).to(dtype)
        outs = []
        for x_split in (None, kernels.split_images(x_all, 5, variant)):
            wv, bv = w.clone().requires_grad_(), b.clone().requires_grad_()
            y = kernels.conv_pool_relu(x_all, rows, wv, bv, variant, x_split)
            grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum(), [wv, bv])
            outs.append((y.detach(), *grads))
        assert all(torch.equal(a, c) for a, c in zip(*outs)) and outs[0][1].abs().max() > 0
    x_all = torch.rand(4, 1, 28, 28)
    good = kernels.split_images(x_all, 5, variant)
    for bad in (good[:3], good.double(), good[:, :-1], kernels.split_images(x_all, 3, variant)):
        with pytest.raises(ValueError, match="is not split_images"):
            kernels.conv_pool_relu(x_all, torch.tensor([[0, 1]]), torch.rand(6, 1, 5, 5), torch.rand(6), variant, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_update_gives_the_torch_ops_bits(variant: str, dtype: torch.dtype) -> None:
    """`sgd_update` (FedProx's term, SCAFFOLD's correction and the step, one pass) element for element as the
    engine's torch ops: every length up to three AVX-512 vectors and beyond (each vector tail), an anchor shared
    by the clients or one per client, μ = 0 for a client (its term adds 0); and the engine uses it where it is
    exact and the fma is an instruction."""
    gen = torch.Generator().manual_seed(7)
    as_int = torch.int32 if dtype == torch.float32 else torch.int64
    for n in [*range(1, 50), 255, 30720]:
        k = 1 + n % 4
        p0, g = torch.randn(k, n, generator=gen, dtype=dtype), torch.randn(k, n, generator=gen, dtype=dtype)
        shared, own = torch.randn(n, generator=gen, dtype=dtype), torch.randn(k, n, generator=gen, dtype=dtype)
        mu = torch.rand(k, generator=gen, dtype=dtype)
        mu[-1] = 0.0
        c = 0.1 * torch.randn(k, n, generator=gen, dtype=dtype)
        for anchor, m, cc in ((shared, mu, None), (own, mu, None), (None, None, c), (own, mu, c), (None, None, None)):
            want, got = p0.clone(), p0.clone()
            kernels._torch_update(want, g, anchor, m, cc, -0.07)
            kernels.sgd_update(got, g, anchor, m, cc, -0.07, variant)
            assert torch.equal(want.view(as_int), got.view(as_int)), (n, anchor is shared, m is None, cc is None)
        # per-client terms (a lockstep computation of plain, FedProx and SCAFFOLD clients): each row as its own
        terms = torch.tensor([(n + i) % 4 for i in range(k)], dtype=torch.uint8)
        got = p0.clone()
        kernels.sgd_update(got, g, own, mu, c, -0.07, variant, terms=terms)
        for i in range(k):
            want = p0[i:i + 1].clone()
            kernels._torch_update(want, g[i:i + 1], own[i:i + 1], mu[i:i + 1] if terms[i] & 1 else None,
                                  c[i:i + 1] if terms[i] & 2 else None, -0.07)
            assert torch.equal(want.view(as_int), got[i:i + 1].view(as_int)), (n, i, int(terms[i]))
    assert kernels.sgd_update_exact(variant, dtype)
    assert kernels.fused_update(variant, dtype) == (variant != "generic" or not sys.platform.startswith("linux")
                                                    or os.uname().machine in ("aarch64", "arm64"))
    with pytest.raises(ValueError):
        kernels.sgd_update(p0, g[:, :-1].contiguous(), None, None, None, -0.1, variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_linear_weights_gradient_and_step_in_one_pass_give_the_torch_ops_bits(variant: str,
                                                                              dtype: torch.dtype) -> None:
    """`fc_sgd` (plain SGD of a fully connected weight in the LeNet step by hand: its gradient xᵀ·g and the step in
    one pass): where it runs, the bits of `w.add_(xᵀ.bmm(g), alpha=-lr)`; where it does not (a shape whose bits it
    would not give, a layer narrower than a vector) it leaves w as it was and says so: it runs exactly where its
    runtime check (`fc_sgd_exact`) passes, which depends on the CPU and the BLAS build. Wherever the check refuses
    it, the kernel is still run directly and must give the same step to float rounding."""
    gen = torch.Generator().manual_seed(11)
    as_int = torch.int32 if dtype == torch.float32 else torch.int64
    lanes = kernels.VECTOR_BYTES[variant] // torch.empty(0, dtype=dtype).element_size()
    for b, fin, fout in [(16, 256, 120), (8, 120, 84), (1, 256, 120), (2, 120, 84), (7, 400, 120), (16, 84, 10),
                         (17, 30, 33), (33, 17, 64), (5, 9, 3)]:
        x = torch.relu(torch.randn(4, b, fin, generator=gen, dtype=dtype))
        g = 0.1 * torch.randn(4, b, fout, generator=gen, dtype=dtype)
        w = torch.randn(4, fin, fout, generator=gen, dtype=dtype)
        want, got = w.clone(), w.clone()
        kernels._torch_fc_sgd(x, g, want, -0.05)
        ran = kernels.fc_sgd(x, g, got, -0.05, variant)
        assert ran == kernels.fc_sgd_exact(variant, dtype, b, fin, fout)
        assert torch.equal(got.view(as_int), (want if ran else w).view(as_int)), (b, fin, fout, ran)
        assert not ran or fout >= lanes
        # the kernel itself, whatever its runtime check says here: the same step to float rounding (its bits are
        # the torch ops' only where it sums in this BLAS's order, which is what the check finds out)
        raw = w.clone()
        if kernels._fc_call(x, g, raw, -0.05, variant, (4, b, fin, fout)):
            assert torch.allclose(raw, want, **TOL[dtype]), (b, fin, fout)
        else:
            assert fout < lanes and not ran, (b, fin, fout)
    with pytest.raises(ValueError, match="fc_sgd"):
        kernels.fc_sgd(x, g[:, :-1].contiguous(), w, -0.05, variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_native_fully_connected_layers_give_the_torch_ops_bits(variant: str, dtype: torch.dtype) -> None:
    """`FcLayers` (the LeNet step by hand's fully connected layers with plain SGD: `fc_fwd`, `fc_bwd_sgd`): where
    `make` returns it, its logits, its input gradient and every weight and bias after the steps are the bits of the
    torch ops it replaces, layer by layer (baddbmm, relu; bmm, threshold_backward, sum, add_), step after step on
    the first k clients. `make` returns it exactly where `fc_layer_exact` passes (CPU and BLAS dependent); where it
    does not, the same kernels are made regardless and must give the torch ops' results to float rounding."""
    gen = torch.Generator().manual_seed(12)
    as_int = torch.int32 if dtype == torch.float32 else torch.int64
    for b, dims in [(16, (256, 120, 84, 10)), (10, (256, 120, 84, 10)), (32, (400, 120, 84, 10)),
                    (5, (40, 33, 17, 3))]:
        k_all = 4
        ws = [0.1 * torch.randn(k_all, fin, fout, generator=gen, dtype=dtype) for fin, fout in zip(dims, dims[1:])]
        bs = [0.1 * torch.randn(k_all, fout, generator=gen, dtype=dtype) for fout in dims[1:]]
        want_ws, want_bs = [w.clone() for w in ws], [b_.clone() for b_ in bs]
        fc = kernels.FcLayers.make(variant, ws, bs, b, -0.05)
        exact = all(kernels.fc_layer_exact(variant, dtype, b, fin, fout) for fin, fout in zip(dims, dims[1:]))
        assert (fc is not None) == exact
        if fc is None:   # not this BLAS's order here: the same kernels, made regardless, to float rounding
            fc = _fc_layers_regardless(variant, ws, bs, b, -0.05)
            if fc is None:
                continue

        def same(got: torch.Tensor, want: torch.Tensor, exact: bool = exact) -> bool:
            return torch.equal(got.view(as_int), want.view(as_int)) if exact else \
                torch.allclose(got, want, **TOL[dtype])
        for k in (4, 4, 2):
            x = torch.relu(torch.randn(k, b, dims[0], generator=gen, dtype=dtype))
            g = 0.1 * torch.randn(k, b, dims[-1], generator=gen, dtype=dtype)
            ins = [x]   # the torch ops, layer by layer, on the first k clients
            for i, (w, b_) in enumerate(zip(want_ws, want_bs)):
                ins.append(kernels._torch_fc_fwd(ins[-1], w[:k], b_[:k], i < len(want_ws) - 1))
            want_g = g
            for i in range(len(want_ws) - 1, -1, -1):
                wk, bk = want_ws[i][:k], want_bs[i][:k]
                want_g = kernels._torch_fc_bwd_sgd(ins[i], want_g, wk, bk, ins[i] if i else None, -0.05)
            logits = fc.forward(x, k)
            assert same(logits, ins[-1])
            # the loss down to the logits' gradient (natively where `loss_exact`), as the torch ops (on the same
            # logits: the loss's own bits do not depend on the layers' order)
            t = torch.randint(0, dims[-1], (k * b,), generator=gen)
            d = torch.rand(k * b, generator=gen, dtype=dtype) / b
            ce, g_logits = fc.loss(logits, t, d, k)
            want_ce, want_gl = kernels._torch_loss(logits.reshape(k * b, -1), t, d)
            assert torch.equal(ce.view(as_int), want_ce.view(as_int))
            assert torch.equal(g_logits.reshape(k * b, -1).view(as_int), want_gl.view(as_int))
            gin = fc.backward(g, k)
            assert same(gin, want_g)
            for got, want in zip([*ws, *bs], [*want_ws, *want_bs]):
                assert same(got, want)
            if not exact:   # each step from the same weights again, so that rounding does not add up over steps
                for got, want in zip([*ws, *bs], [*want_ws, *want_bs]):
                    want.copy_(got)
    with pytest.raises(ValueError, match="FcLayers"):
        kernels.FcLayers(variant, ws, bs[:1] + bs[1:2] * 2, b, -0.05, [1, 1, 1])
    if fc is not None and fc.loss_fn is not None:   # a label outside the classes: refused, not read out of range
        with pytest.raises(ValueError, match="target outside"):
            fc.loss(logits, torch.full((k * b,), dims[-1]), d, k)


TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


def _fc_layers_regardless(variant: str, ws: list[torch.Tensor], bs: list[torch.Tensor], b: int,
                          neg_lr: float) -> kernels.FcLayers | None:
    """`FcLayers` made whatever `fc_layer_exact` finds on this machine (`make` returns None where the kernels' sums
    are not in this BLAS's order): the native loss where its own check passes, the bias sums in blocks of 4 vectors
    of the variant's ISA. The same arithmetic in another order: results equal the torch ops' to float rounding.
    None for a batch of more than 8 vectors of lanes, which the backward kernel refuses (conv_pool.cpp)."""
    item = ws[0].element_size()
    lanes = kernels.VECTOR_BYTES[variant] // item
    if (b + lanes - 1) // lanes > 8:
        return None
    native_loss = ws[0].dtype == torch.float32 and kernels.loss_exact(variant, ws[-1].shape[2])
    return kernels.FcLayers(variant, ws, bs, b, neg_lr, [lanes * 4] * len(ws), native_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_updater_gives_sgd_updates_bits_step_after_step(variant: str, dtype: torch.dtype) -> None:
    """`sgd_updater` (the engine's update of one parameter stack, its operands checked once): step after step, on
    the first k clients (clients that finished drop off the end), with and without FedProx's term, with per-client
    terms, the same bits as `sgd_update` on the same slices."""
    gen = torch.Generator().manual_seed(11)
    as_int = torch.int32 if dtype == torch.float32 else torch.int64
    k_all, shape = 5, (7, 13)
    own = torch.randn(k_all, *shape, generator=gen, dtype=dtype)
    mu = torch.rand(k_all, generator=gen, dtype=dtype)
    c = 0.1 * torch.randn(k_all, *shape, generator=gen, dtype=dtype)
    terms = torch.tensor([0, 1, 2, 3, 1], dtype=torch.uint8)
    for anchor, m, cc, tt in ((own[0], mu, None, None), (own, mu, c, terms), (None, None, c, None)):
        p0 = torch.randn(k_all, *shape, generator=gen, dtype=dtype)
        want, got = p0.clone(), p0.clone()
        update = kernels.sgd_updater(got, anchor, m, cc, variant, tt)
        for step, (k, prox) in enumerate([(5, True), (5, False), (4, True), (2, True)]):
            g = torch.randn(k, *shape, generator=gen, dtype=dtype)
            a = anchor if anchor is None or anchor.dim() == len(shape) else anchor[:k]
            kernels.sgd_update(want[:k], g, a, m[:k] if m is not None and prox else None,
                               None if cc is None else cc[:k], -0.05 * (step + 1), variant,
                               None if tt is None else tt[:k])
            update(g, k, -0.05 * (step + 1), prox)
            assert torch.equal(want.view(as_int), got.view(as_int)), (step, k, prox)
        with pytest.raises(ValueError, match="g must be"):
            update(torch.randn(2, 7, 12, dtype=dtype), 2, -0.1)
    with pytest.raises(ValueError, match="mu must be"):
        kernels.sgd_updater(own.clone(), None, mu, None, variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cin,side,o", [(1, 28, 6), (3, 32, 6), (1, 41, 3)])
def test_client_major_layouts_give_the_same_bits(cin: int, side: int, o: int, dtype: torch.dtype,
                                                 variant: str) -> None:
    """The step by hand chains the two layers in client-major layouts (`client_major=True`): only where each value
    lives changes, so every output and gradient equals the engine layouts' bit for bit (rows wider than a vector,
    a last vector with masked lanes, more than one vector of columns, the LeNets' second layer where it fits)."""
    g = torch.Generator().manual_seed(11)
    k, b, n = 3, 5, 12
    x_all = torch.randn(n, cin, side, side, generator=g, dtype=dtype)
    x_all[0, :, :8] = 0.0   # a blank region: windows of ties, rows where relu passes nothing
    rows = torch.randint(0, n, (k, b), generator=g)
    w = torch.randn(k * o, cin, 5, 5, generator=g, dtype=dtype) * 0.3
    bias = torch.randn(k * o, generator=g, dtype=dtype) * 0.1
    xs = kernels.split_images(x_all, 5, variant)
    y, s = kernels.conv_pool_fwd(x_all, rows, w, bias, variant, xs)
    y_cm, s_cm = kernels.conv_pool_fwd(x_all, rows, w, bias, variant, xs, client_major=True)
    hp = y.shape[2]
    assert torch.equal(y_cm, y.reshape(b, k, o, hp, hp).permute(1, 0, 3, 4, 2))   # [K, B, Hp, Wp, O]
    gy = torch.randn(k, b, o, hp, hp, generator=g, dtype=dtype)
    gw, gb = kernels.conv_pool_bwd(s, gy.permute(1, 0, 2, 3, 4).reshape(b, k * o, hp, hp))
    gw_cm, gb_cm = kernels.conv_pool_bwd(s_cm, gy)
    assert torch.equal(gw, gw_cm) and torch.equal(gb, gb_cm)
    if not kernels.inner_fits(o, 16, (5, 5), dtype):
        return
    w2 = torch.randn(k * 16, o, 5, 5, generator=g, dtype=dtype) * 0.2
    b2 = torch.randn(k * 16, generator=g, dtype=dtype) * 0.1
    y2, s2 = kernels.conv2_pool_fwd(y, w2, b2, k, variant)
    y2_cm, s2_cm = kernels.conv2_pool_fwd(y_cm, w2, b2, k, variant, client_major=True)
    assert torch.equal(y2, y2_cm)
    gy2 = torch.randn(y2.shape, generator=g, dtype=dtype)
    gh, gw2, gb2 = kernels.conv2_pool_bwd(s2, gy2)
    gh_cm, gw2_cm, gb2_cm = kernels.conv2_pool_bwd(s2_cm, gy2)
    assert torch.equal(gw2, gw2_cm) and torch.equal(gb2, gb2_cm)
    assert torch.equal(gh_cm, gh.reshape(b, k, o, hp, hp).permute(1, 0, 2, 3, 4))   # [K, B, Cin, H, W]
    assert torch.equal(kernels.conv_pool_bwd(s_cm, gh_cm)[0], kernels.conv_pool_bwd(s, gh)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cin,side,b", [(1, 28, 5), (3, 32, 5), (1, 28, 37)])
def test_prepared_layers_give_the_functions_bits(cin: int, side: int, b: int, dtype: torch.dtype,
                                                 variant: str) -> None:
    """`LeNetLayers` (the step by hand's calls, prepared once) computes what `conv_pool_fwd`, `conv2_pool_fwd`,
    `conv2_pool_bwd` and `conv_pool_bwd` compute in client-major layouts, bit for bit, step after step in its reused
    buffers, with all clients and with a prefix of them (clients that have finished); it refuses rows out of range
    and shapes it was not made for. Its first layer's forward is another kernel where a batch fills the vector lanes
    (`forward_lanes`: a client's samples in the lanes): its outputs and window indices are compared directly, with
    batches of fewer samples than lanes (5) and of several lane groups and a partial one (37)."""
    g = torch.Generator().manual_seed(5)
    k, n, o = 4, 30, 6
    x_all = torch.randn(n, cin, side, side, generator=g, dtype=dtype)
    xs = kernels.split_images(x_all, 5, variant)
    w1 = torch.randn(k, o, cin, 5, 5, generator=g, dtype=dtype) * 0.3
    b1 = torch.randn(k, o, generator=g, dtype=dtype) * 0.1
    w2 = torch.randn(k, 16, o, 5, 5, generator=g, dtype=dtype) * 0.2
    b2 = torch.randn(k, 16, generator=g, dtype=dtype) * 0.1
    layers = kernels.LeNetLayers(variant, x_all, xs, w1, b1, w2, b2, b)
    table = torch.randint(0, n, (3, k, b), generator=g)   # every step's rows, as Group._steps makes them
    for step, kk in enumerate((k, k, 2)):
        rows = table[step, :kk]
        args1 = (x_all, rows, w1[:kk].flatten(0, 1), b1[:kk].reshape(-1), variant, xs)
        y1, s1 = kernels.conv_pool_fwd(*args1, client_major=True)
        y2, s2 = kernels.conv2_pool_fwd(y1, w2[:kk].flatten(0, 1), b2[:kk].reshape(-1), kk, variant, client_major=True)
        gy = torch.randn(y2.shape, generator=g, dtype=dtype)
        gh, gw2, gb2 = kernels.conv2_pool_bwd(s2, gy)
        gw1, gb1 = kernels.conv_pool_bwd(s1, gh)
        assert torch.equal(layers.fwd1(rows, kk), y1)
        assert torch.equal(layers.arg1[:kk], s1[0][2])   # the window indices the backward reads
        assert torch.equal(layers.fwd2(kk), y2)
        got_gh, got_gw2, got_gb2 = layers.bwd2(gy, kk)
        assert torch.equal(got_gh, gh) and torch.equal(got_gw2, gw2.view(kk, 16, o, 5, 5))
        assert torch.equal(got_gb2, gb2.view(kk, 16))
        got_gw1, got_gb1 = layers.bwd1(kk)
        assert torch.equal(got_gw1, gw1.view(kk, o, cin, 5, 5)) and torch.equal(got_gb1, gb1.view(kk, o))
        w1.add_(0.01)   # the engine updates the parameters in place between steps
        w2.sub_(0.01)
    with pytest.raises(IndexError, match="indices into the 30 images"):
        layers.fwd1(torch.full((3, k, b), n)[0], k)
    with pytest.raises(ValueError, match="need contiguous"):
        layers.fwd1(table[0, :, :2], k)
    with pytest.raises(ValueError, match="at most 4 clients"):
        layers.fwd1(torch.zeros(5, b, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="need"):
        layers.bwd2(torch.zeros(k, b, 7, dtype=dtype), k)
    with pytest.raises(ValueError, match="not the LeNet layers"):
        kernels.LeNetLayers(variant, x_all, xs, w1, b1, w2[:, :, :3].contiguous(), b2, b)


def _lenet_operands(gen: torch.Generator, k: int, b: int, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """mimic-cnn's shapes in the engine's layouts: images [n, 1, 28, 28] and the parameter stacks of k clients (conv
    weights, conv biases, fully connected weights [k, in, out] and biases)."""
    x_all = torch.randn(n, 1, 28, 28, generator=gen)
    shapes = [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (16,), (256, 120), (120,), (120, 84), (84,), (84, 10), (10,)]
    return x_all, [0.2 * torch.randn(k, *s, generator=gen) for s in shapes]


def _lenet_reference(variant: str, x_all: torch.Tensor, ps: list[torch.Tensor], b: int, neg_lr: float):
    """The step by hand layer after layer (`LeNetLayers`, `FcLayers`' forward, loss, backward, torch's add_ for the
    conv layers' steps), as `batched._lenet_step` runs it without `LeNetStep`: step(rows, target, dloss, k) → ce."""
    xs = kernels.split_images(x_all, 5, variant)
    layers = kernels.LeNetLayers(variant, x_all, xs, *ps[:4], b)
    fc = _fc_layers_regardless(variant, ps[4::2], ps[5::2], b, neg_lr)

    def step(rows: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor, k: int) -> torch.Tensor:
        layers.fwd1(rows, k)
        logits = fc.forward(layers.fwd2(k), k)
        ce, g = fc.loss(logits, target, dloss, k)
        _, gw2, gb2 = layers.bwd2(fc.backward(g, k), k)
        gw1, gb1 = layers.bwd1(k)
        for p, g_ in zip(ps[:4], (gw1, gb1, gw2, gb2)):
            p[:k].add_(g_, alpha=neg_lr)
        return ce.clone()
    return layers, fc, step


def test_the_whole_step_gives_the_layer_by_layer_bits(variant: str) -> None:
    """`LeNetStep` (the step by hand in one native call, client by client) computes what `LeNetLayers` and `FcLayers`
    compute layer after layer for all clients, bit for bit: every loss and every parameter after the steps, step
    after step on all clients and on a prefix (clients that have finished), with the conv layers' steps left to the
    caller (torch's add_) and, where the fused update has torch's bits, in the kernel (`conv_steps`, and `steps`: a
    round's steps in one call). It refuses a label outside the classes before writing anything."""
    gen = torch.Generator().manual_seed(31)
    neg_lr = -0.05
    for b in (16, 5, 37):
        k, n = 4, 60
        x_all, ps = _lenet_operands(gen, k, b, n)
        table = torch.randint(0, n, (3, k, b), generator=gen)
        target = torch.randint(0, 10, (3, k, b), generator=gen)
        dloss = torch.rand(3, k, b, generator=gen) / b
        ks = [k, k, 2]
        ref_ps = [p.clone() for p in ps]
        _, fc_ref, ref_step = _lenet_reference(variant, x_all, ref_ps, b, neg_lr)
        if not fc_ref.fused:
            pytest.skip(f"the whole step needs the native loss, whose bits are ATen's only where a row of 10 "
                        f"logits fits its vectors and SLEEF is found (kernels.loss_exact): not {variant} here")
        want_ce = [ref_step(table[j, :kk], target[j, :kk].reshape(-1), dloss[j, :kk].reshape(-1), kk)
                   for j, kk in enumerate(ks)]
        xs = kernels.split_images(x_all, 5, variant)
        for conv_steps in (False, True):
            if conv_steps and not kernels.fused_update(variant, torch.float32):
                continue
            got_ps = [p.clone() for p in ps]
            layers = kernels.LeNetLayers(variant, x_all, xs, *got_ps[:4], b)
            fc = _fc_layers_regardless(variant, got_ps[4::2], got_ps[5::2], b, neg_lr)
            whole = kernels.LeNetStep(layers, fc, conv_steps)
            for j, kk in enumerate(ks):
                ce = whole(table[j, :kk], target[j, :kk].reshape(-1), dloss[j, :kk].reshape(-1), kk)
                assert torch.equal(ce, want_ce[j]), (b, conv_steps, j)
                if not conv_steps:
                    _, _, _, gw1, gb1, gw2, gb2 = layers.views(kk)
                    for p, g_ in zip(got_ps[:4], (gw1, gb1, gw2, gb2)):
                        p[:kk].add_(g_, alpha=neg_lr)
            for got, want in zip(got_ps, ref_ps):
                assert torch.equal(got, want), (b, conv_steps)
            if conv_steps:   # the same round in one call
                got_ps = [p.clone() for p in ps]
                layers = kernels.LeNetLayers(variant, x_all, xs, *got_ps[:4], b)
                whole = kernels.LeNetStep(layers, _fc_layers_regardless(variant, got_ps[4::2], got_ps[5::2], b,
                                                                        neg_lr), True)
                ce_all = whole.steps(table, target, dloss, ks)
                for j, kk in enumerate(ks):
                    assert torch.equal(ce_all[j, :kk].reshape(-1), want_ce[j])
                    assert not ce_all[j, kk:].any()
                for got, want in zip(got_ps, ref_ps):
                    assert torch.equal(got, want), b
                before = [p.clone() for p in got_ps]
                bad = target.clone()
                bad[2, 1, 0] = 10   # step 2's clients are 0 and 1: checked before step 0 writes anything
                with pytest.raises(ValueError, match="target outside"):
                    whole.steps(table, bad, dloss, ks)
                assert all(torch.equal(p, q) for p, q in zip(got_ps, before))
                with pytest.raises(RuntimeError, match="conv_steps"):
                    kernels.LeNetStep(layers, whole.fc, False).steps(table, target, dloss, ks)
        before = [p.clone() for p in got_ps]
        with pytest.raises(ValueError, match="target outside"):
            whole(table[0], torch.full((k * b,), 10), dloss[0].reshape(-1), k)
        assert all(torch.equal(p, q) for p, q in zip(got_ps, before))
        with pytest.raises(ValueError, match="need contiguous"):
            whole(table[0, :, :2], target[0].reshape(-1), dloss[0].reshape(-1), k)


def test_the_fully_connected_head_gives_the_layer_by_layer_bits(variant: str) -> None:
    """`FcLayers.head` (forward, loss, backward and steps client by client in one call) gives `forward`, `loss` and
    `backward`'s bits: the losses, the first layer's input gradient and every weight and bias."""
    gen = torch.Generator().manual_seed(32)
    for b in (16, 3):
        k = 3
        _, ps = _lenet_operands(gen, k, b, 1)
        fc_ps = ps[4:]
        ref = [p.clone() for p in fc_ps]
        fc_ref = _fc_layers_regardless(variant, ref[0::2], ref[1::2], b, -0.05)
        fc = _fc_layers_regardless(variant, fc_ps[0::2], fc_ps[1::2], b, -0.05)
        if not fc.fused:
            pytest.skip(f"the head needs the native loss, whose bits are ATen's only where a row of 10 logits fits "
                        f"its vectors and SLEEF is found (kernels.loss_exact): not {variant} here")
        for kk in (3, 2):
            x = torch.relu(torch.randn(kk, b, 256, generator=gen))
            t = torch.randint(0, 10, (kk * b,), generator=gen)
            d = torch.rand(kk * b, generator=gen) / b
            want_ce, g = fc_ref.loss(fc_ref.forward(x, kk), t, d, kk)
            want_ce = want_ce.clone()
            want_gin = fc_ref.backward(g, kk)
            ce, gin = fc.head(x, t, d, kk)
            assert torch.equal(ce, want_ce) and torch.equal(gin, want_gin)
            assert all(torch.equal(p, q) for p, q in zip(fc_ps, ref))
        with pytest.raises(ValueError, match="target outside"):
            fc.head(x, torch.full((kk * b,), -1), d, kk)
        assert all(torch.equal(p, q) for p, q in zip(fc_ps, ref))


def test_mixed_dtypes_and_bad_indices_are_refused() -> None:
    with pytest.raises(TypeError, match="one dtype"):
        kernels.conv_pool_relu(torch.rand(2, 1, 28, 28), torch.tensor([[0, 1]]), torch.rand(6, 1, 5, 5).double(),
                               torch.rand(6).double())
    for rows in (torch.tensor([[0, 2]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]], dtype=torch.int32)):
        with pytest.raises(IndexError, match="int64 indices"):
            kernels.conv_pool_relu(torch.rand(2, 1, 28, 28), rows, torch.rand(6, 1, 5, 5), torch.rand(6))


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from coordinator.sim import kernels\nprint(kernels.available())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_disabled_or_unbuildable_kernel_falls_back_with_a_warning(tmp_path) -> None:
    off = _probe({"DROPFL_NATIVE": "0", "DROPFL_KERNEL": ""})   # DROPFL_KERNEL, where the suite runs with one, wins
    assert off.stdout.strip() == "False"
    assert _probe({"DROPFL_KERNEL": "off"}).stdout.strip() == "False"
    broken = _probe({"CXX": "false", "XDG_CACHE_HOME": str(tmp_path)})   # a compiler that always fails
    assert broken.stdout.strip() == "False" and "native kernels unavailable" in broken.stderr
    assert list((tmp_path / "dropfl" / "kernels").glob("*")) == []      # no half-written library left
