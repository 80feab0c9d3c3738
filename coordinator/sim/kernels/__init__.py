"""Native kernels of the batched engine, compiled on first use (g++) and loaded with ctypes.

`conv_pool.cpp` holds the LeNets' first two layers, each relu(max_pool2d(conv2d(·), 2)) fused, for K
clients at once: `conv_pool_relu` (the first, on the images, weight/bias gradients) and
`conv2_pool_relu` (the second, on activations, all gradients). They are optional: without a C++
compiler, or with DROPFL_NATIVE=0, `available()` is False and the engine runs the same layers with
torch ops.

The shared library is built with `g++ -O3 -march=native` into a cache directory keyed by the source,
the compiler and this CPU (`$XDG_CACHE_HOME/dropfl/kernels`, else `~/.cache/dropfl/kernels`), so
it is compiled once per machine (~8 s here) and never run on a CPU it was not built for. Written with
ctypes rather than a torch C++ extension: it needs no torch headers and no ninja, and the kernels only ever
see raw pointers to contiguous tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("conv_pool.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cpu_id() -> str:
    """What -march=native depends on: the architecture and (on Linux) the CPU's model and flags."""
    ident = platform.machine()
    with contextlib.suppress(OSError):  # no /proc/cpuinfo (not Linux): the architecture alone
        with open("/proc/cpuinfo") as f:
            ident += "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags", "Features"))}))
    return ident


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropfl" / "kernels"


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode() + _cpu_id().encode())
    target = cache_dir() / f"conv_pool-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)   # concurrent builders: last rename wins
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None (with one warning) if it cannot be built."""
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        if os.environ.get("DROPFL_NATIVE", "1") == "0":
            _error = "disabled by DROPFL_NATIVE=0"
            return None
        cxx = compiler()
        try:
            if cxx is None:
                raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++ or c++'}) on PATH")
            lib = ctypes.CDLL(str(_build(cxx)))
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            for name, pointers in (("conv_pool_fwd", 6), ("conv_pool_bwd", 6), ("conv2_pool_fwd", 5),
                                   ("conv2_pool_bwd", 7)):
                for suffix in ("f32", "f64"):
                    fn = getattr(lib, f"dropfl_{name}_{suffix}")
                    fn.argtypes = [ptr] * pointers + [i64] * 8
                    fn.restype = ctypes.c_int if name.startswith("conv2") else None
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            warnings.warn(f"dropfl: native kernels unavailable ({_error}); the batched engine uses torch ops "
                          "for the LeNets' first two layers (same results, slower)", stacklevel=2)
        return _lib


def available() -> bool:
    return load() is not None


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX if set, else g++, else c++ (None: not on PATH)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def error() -> str | None:
    """Why the kernels are not available (after `load()`): no compiler, the build's error, or
    DROPFL_NATIVE=0; None if they are, or if `load()` has not been called."""
    return _error


def _ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu", "native kernels take contiguous CPU tensors"
    return t.data_ptr()


def _ok(status: int) -> None:
    """The second-layer entry points return -1 (and do nothing) for a shape they were not built for."""
    if status != 0:
        raise RuntimeError("conv2_pool_relu: the kernel refused the shape (inner_fits and the kernel disagree)")


def _check_dtypes(name: str, *ts: torch.Tensor) -> None:
    if len({t.dtype for t in ts}) != 1 or ts[0].dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: dtypes {[str(t.dtype) for t in ts]}: need one dtype, float32 or float64")


class ConvPoolRelu(torch.autograd.Function):
    """relu(max_pool2d(conv2d(x_k, w_k, b_k), 2)) for K clients, fused (coordinator/sim/kernels/conv_pool.cpp).

    x_all [N, Cin, H, W] (all preloaded images), rows [K, B] (client k's b-th sample is x_all[rows[k, b]]),
    w [K·O, Cin, R, S], bias [K·O] → [B, K·O, Hp, Wp] in channels-last memory, as the grouped
    convolution, max-pool and relu of the torch path would give it. Gradients for w and bias only.
    """

    @staticmethod
    def forward(ctx, x_all: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        lib = load()
        assert lib is not None
        _check_dtypes("conv_pool_relu", x_all, w, bias)
        k, b = rows.shape
        _, cin, h, wd = x_all.shape
        # the kernel reads x_all[rows[k, b]] unchecked: indices must be int64 and in range
        if rows.dtype != torch.int64 or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(x_all))):
            raise IndexError(f"conv_pool_relu: rows must be int64 indices into the {len(x_all)} images")
        o, r, s = w.shape[0] // k, w.shape[2], w.shape[3]
        hp, wp = (h - r + 1) // 2, (wd - s + 1) // 2
        x_all, rows, w, bias = x_all.contiguous(), rows.contiguous(), w.contiguous(), bias.contiguous()
        y = torch.empty((b, hp, wp, k * o), dtype=w.dtype)
        arg = torch.empty((k, b, o, hp, wp), dtype=torch.uint8)
        fwd = lib.dropfl_conv_pool_fwd_f64 if w.dtype == torch.float64 else lib.dropfl_conv_pool_fwd_f32
        fwd(_ptr(x_all), _ptr(rows), _ptr(w), _ptr(bias), _ptr(y), _ptr(arg), b, h, wd, k, cin, o, r, s)
        ctx.save_for_backward(x_all, rows, arg)
        ctx.dims = (b, h, wd, k, cin, o, r, s)
        ctx.w_shape = w.shape
        return y.permute(0, 3, 1, 2)  # [B, K·O, Hp, Wp], channels-last in memory

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        lib = load()
        assert lib is not None
        x_all, rows, arg = ctx.saved_tensors
        gy = gy.permute(0, 2, 3, 1).contiguous()   # [B, Hp, Wp, K·O] (a view when already channels-last)
        gw = torch.empty(ctx.w_shape, dtype=gy.dtype)
        gb = torch.empty(ctx.w_shape[0], dtype=gy.dtype)
        bwd = lib.dropfl_conv_pool_bwd_f64 if gy.dtype == torch.float64 else lib.dropfl_conv_pool_bwd_f32
        bwd(_ptr(x_all), _ptr(rows), _ptr(gy), _ptr(arg), _ptr(gw), _ptr(gb), *ctx.dims)
        return None, None, gw, gb


def conv_pool_relu(x_all: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return ConvPoolRelu.apply(x_all, rows, w, bias)


def inner_fits(in_channels: int, out_channels: int, kernel: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `conv2_pool_relu` takes this layer: the LeNets' second layer (6 input channels per client,
    5×5, at most 2 vectors of output channels: 32 float32, 16 float64). Others run as torch ops."""
    lanes = {torch.float32: 16, torch.float64: 8}.get(dtype, 0)
    return in_channels == 6 and tuple(kernel) == (5, 5) and 0 < out_channels <= 2 * lanes


class Conv2PoolRelu(torch.autograd.Function):
    """relu(max_pool2d(conv2d(h, w, b, groups=K), 2)) on activations, fused (the LeNets' second layer).

    h [B, K·Cin, H, W] in channels-last memory (the first layer's output), w [K·O, Cin, R, S], bias [K·O]
    → [K, B, O·Hp·Wp]: each client's `flatten(1)` of its pooled map, the row layout of the
    fully connected layers. Gradients for h, w and bias; the backward only visits routed outputs.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
        lib = load()
        assert lib is not None
        _check_dtypes("conv2_pool_relu", h, w, bias)
        b, kc, hh, wd = h.shape
        cin, o, r, s = kc // k, w.shape[0] // k, w.shape[2], w.shape[3]
        if not inner_fits(cin, o, (r, s), w.dtype):
            raise ValueError(f"conv2_pool_relu: no kernel for {cin}→{o} channels, {r}×{s}, {w.dtype} (see inner_fits)")
        hp, wp = (hh - r + 1) // 2, (wd - s + 1) // 2
        hl, w, bias = h.permute(0, 2, 3, 1).contiguous(), w.contiguous(), bias.contiguous()  # [B, H, W, K·Cin]
        y = torch.empty((k, b, o * hp * wp), dtype=w.dtype)
        arg = torch.empty((k, b, o, hp, wp), dtype=torch.uint8)
        fwd = lib.dropfl_conv2_pool_fwd_f64 if w.dtype == torch.float64 else lib.dropfl_conv2_pool_fwd_f32
        _ok(fwd(_ptr(hl), _ptr(w), _ptr(bias), _ptr(y), _ptr(arg), b, hh, wd, k, cin, o, r, s))
        ctx.save_for_backward(hl, w, arg)
        ctx.dims = (b, hh, wd, k, cin, o, r, s)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        lib = load()
        assert lib is not None
        hl, w, arg = ctx.saved_tensors
        gy = gy.contiguous()
        gh = torch.empty_like(hl)
        gw, gb = torch.empty_like(w), torch.empty(w.shape[0], dtype=w.dtype)
        bwd = lib.dropfl_conv2_pool_bwd_f64 if w.dtype == torch.float64 else lib.dropfl_conv2_pool_bwd_f32
        _ok(bwd(_ptr(hl), _ptr(w), _ptr(gy), _ptr(arg), _ptr(gh), _ptr(gw), _ptr(gb), *ctx.dims))
        return gh.permute(0, 3, 1, 2), gw, gb, None


def conv2_pool_relu(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    return Conv2PoolRelu.apply(h, w, bias, k)
