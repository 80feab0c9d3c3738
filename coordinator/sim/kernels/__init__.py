"""Native kernels of the batched engine, compiled on first use (g++) and loaded with ctypes.

`conv_pool.cpp` holds the LeNets' first two layers, each relu(max_pool2d(conv2d(·), 2)) fused, for K
clients at once: `conv_pool_relu` (the first, on the images, weight/bias gradients) and
`conv2_pool_relu` (the second, on activations, all gradients); and per-client mode's BatchNorm on
channels-last activations (`dropfl_bn_cl_*`, coordinator/sim/channels_last.py). They are optional: without a C++
compiler, or with DROPFL_KERNEL=off (or DROPFL_NATIVE=0), `available()` is False and the engine runs the
same layers with torch ops.

Variants. One source, built with one set of compiler flags per instruction set (`VARIANTS`): `avx512`,
`avx2` (flags that forbid AVX-512) and `generic` (the compiler's baseline for the architecture: SSE2 on
x86-64, NEON on aarch64). Which one runs is decided at run time from the CPU's features
(`cpu_variants()`: /proc/cpuinfo's flags, else torch's CPU capability): the widest this CPU runs. The
environment variable DROPFL_KERNEL=avx512|avx2|generic|off forces one (tests, benchmarks); naming a
variant this CPU cannot run, or an unknown name, is a UserError. The variant that ran is part of the
engine's name (`batched+native(avx2)`, metrics.jsonl's `engine`).

Each variant's library is built with `g++ -O3 <flags>` into a cache directory keyed by the source, the
flags and the compiler (`$XDG_CACHE_HOME/dropfl/kernels`, else `~/.cache/dropfl/kernels`), so it is
compiled once per machine (~8-12 s here). Fixed flags rather than -march=native: a library is then
only ever loaded on a CPU that has the features its name says, and the same variant computes the same
bits on any such CPU. Written with ctypes rather than a torch C++ extension: it needs no torch headers
and no ninja, and the kernels only ever see raw pointers to contiguous tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from coordinator.errors import UserError

SOURCE = Path(__file__).with_name("conv_pool.cpp")
COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC"]
# Compiler flags of each variant, and the /proc/cpuinfo flags a CPU needs to run it (x86-64).
# avx512 is torch's AVX512 level (F, BW, DQ, VL), avx2 torch's AVX2 level (AVX2 + FMA).
VARIANTS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma", "-mno-avx512f"],
    "generic": [],
}
# Each variant's vector width in bytes (conv_pool.cpp's VB: 16 for generic, SSE2 or NEON).
VECTOR_BYTES: dict[str, int] = {"avx512": 64, "avx2": 32, "generic": 16}
_X86_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"}, "avx2": {"avx2", "fma"}}
ENV = "DROPFL_KERNEL"
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_errors: dict[str, str] = {}
_chosen: str | None = None   # the variant `load()` without an argument picked


@functools.cache   # read once: the kernels' entry points check their variant on every call
def _cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on ARM); None without it."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("flags", "Features")):
                    return frozenset(ln.split(":", 1)[1].split())
    return None


def cpu_variants() -> list[str]:
    """The variants this CPU runs, best first (always ends with "generic"). On x86-64 from /proc/cpuinfo's
    flags, else (not Linux) from torch's CPU capability; on any other architecture only "generic"
    (on aarch64 the compiler's baseline already has NEON)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["generic"]
    flags = _cpu_flags()
    if flags is None:
        cap = torch.backends.cpu.get_cpu_capability()   # "AVX512", "AVX2" or "DEFAULT"
        flags = _X86_NEEDS["avx512"] if cap == "AVX512" else _X86_NEEDS["avx2"] if cap == "AVX2" else set()
    return [v for v in ("avx512", "avx2") if _X86_NEEDS[v] <= flags] + ["generic"]


def requested() -> str:
    """The variant the engine uses unless told otherwise: $DROPFL_KERNEL if set (checked: UserError for an
    unknown name or one this CPU cannot run), "off" if DROPFL_NATIVE=0, else the best for this CPU."""
    name = os.environ.get(ENV, "").strip().lower()
    if not name or name == "auto":
        return "off" if os.environ.get("DROPFL_NATIVE", "1") == "0" else cpu_variants()[0]
    return check(name, where=f"{ENV}={name}")


def check(name: str, where: str = "kernel variant") -> str:
    """`name` if it is "off" or a variant this CPU runs; UserError otherwise (running the code of an
    instruction set the CPU lacks would kill the process with SIGILL)."""
    runnable = cpu_variants()
    if name == "off" or name in runnable:
        return name
    if name in VARIANTS:
        missing = ", ".join(sorted(_X86_NEEDS.get(name, set()) - (_cpu_flags() or set()))) or "x86-64"
        raise UserError(f"{where}: this CPU ({platform.machine()}) cannot run the {name} kernels (missing {missing}); "
                        f"use one of {', '.join(runnable)}, off, or leave {ENV} unset")
    raise UserError(f"{where}: unknown kernel variant {name!r}; use one of {', '.join(VARIANTS)}, off, "
                    f"or leave {ENV} unset to pick by CPU")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropfl" / "kernels"


def flags(variant: str) -> list[str]:
    """The compiler flags of `variant` (the x86 flags only on x86-64: elsewhere every variant is generic)."""
    return COMMON_FLAGS + (VARIANTS[variant] if platform.machine().lower() in ("x86_64", "amd64") else [])


def _build(cxx: str, variant: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    opts = flags(variant)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(opts).encode() + version.encode()
                         + platform.machine().encode())
    target = cache_dir() / f"conv_pool-{variant}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)   # concurrent builders: last rename wins
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *opts, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(variant: str | None = None) -> ctypes.CDLL | None:
    """The compiled library of `variant` (default: `requested()`), building it if needed; None (with one
    warning) if it cannot be built, None without a warning for "off"."""
    global _chosen
    lib = _libs.get(variant if variant is not None else _chosen)   # loaded (and so checked) before: every call
    if lib is not None:                                              # of a kernel comes here, ~10 per step
        return lib
    with _lock:
        if variant is None:
            if _chosen is None:
                _chosen = requested()
            variant = _chosen
        else:
            variant = check(variant)
        if variant == "off":
            _errors["off"] = f"turned off ({ENV}=off or DROPFL_NATIVE=0)"
            return None
        if variant in _libs or variant in _errors:
            return _libs.get(variant)
        cxx = compiler()
        try:
            if cxx is None:
                raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++ or c++'}) on PATH")
            lib = ctypes.CDLL(str(_build(cxx, variant)))
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            for name, pointers in (("conv_pool_fwd", 6), ("conv_pool_bwd", 6), ("conv2_pool_fwd", 5),
                                   ("conv2_pool_bwd", 7)):
                for suffix in ("f32", "f64"):
                    fn = getattr(lib, f"dropfl_{name}_{suffix}")
                    fn.argtypes = [ptr] * pointers + [i64] * 9   # ..., R, S, layout
                    fn.restype = ctypes.c_int if name.startswith("conv2") else None
            for suffix in ("f32", "f64"):
                fn = getattr(lib, f"dropfl_conv_pool_fwd_lanes_{suffix}")
                fn.argtypes, fn.restype = [ptr] * 6 + [i64] * 8, None   # x, rows, w, bias, y, arg, B..S
                fn = getattr(lib, f"dropfl_sgd_update_{suffix}")
                fn.argtypes, fn.restype = [ptr, ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_double, i64, i64], None
                fn = getattr(lib, f"dropfl_split_size_{suffix}")
                fn.argtypes, fn.restype = [i64] * 4, i64
                fn = getattr(lib, f"dropfl_split_images_{suffix}")
                fn.argtypes, fn.restype = [ptr, i64, i64, i64, i64, i64, ptr], None
                fn = getattr(lib, f"dropfl_fc_sgd_{suffix}")
                fn.argtypes, fn.restype = [ptr] * 3 + [i64] * 4 + [ctypes.c_double], ctypes.c_int
                fn = getattr(lib, f"dropfl_fc_fwd_{suffix}")   # x, w, bias, y, K, B, Fin, Fout, relu
                fn.argtypes, fn.restype = [ptr] * 4 + [i64] * 5, None
                fn = getattr(lib, f"dropfl_fc_bwd_sgd_{suffix}")   # x, g, w, bias, r, gx, K, B, Fin, Fout, lr, block
                fn.argtypes, fn.restype = [ptr] * 6 + [i64] * 4 + [ctypes.c_double, i64], ctypes.c_int
            fn = lib.dropfl_bn_cl_fwd_f32   # x, w, bias, y, stats, running mean, var, M, C, eps, factor
            fn.argtypes, fn.restype = [ptr] * 7 + [i64] * 2 + [ctypes.c_double] * 2, None
            fn = lib.dropfl_bn_cl_bwd_f32   # g, x, w, stats, dx, dw, db, M, C
            fn.argtypes, fn.restype = [ptr] * 7 + [i64] * 2, None
            fn = lib.dropfl_log_softmax_nll_f32   # float32 only: x, target, dloss, ce, gi, R, D, exp, log
            fn.argtypes, fn.restype = [ptr] * 5 + [i64] * 2 + [ptr] * 2, ctypes.c_int
            fn = lib.dropfl_fc_head_f32   # FcHead*, x0, target, dloss, ce, K, B
            fn.argtypes, fn.restype = [ctypes.POINTER(_FcHead)] + [ptr] * 4 + [i64] * 2, ctypes.c_int
            fn = lib.dropfl_lenet_step_f32   # LeNetStep*, rows, target, dloss, ce, K
            fn.argtypes, fn.restype = [ctypes.POINTER(_LeNetStep)] + [ptr] * 4 + [i64], ctypes.c_int
            fn = lib.dropfl_lenet_steps_f32   # LeNetStep*, rows, target, dloss, ce, ks, S, KA
            fn.argtypes, fn.restype = [ctypes.POINTER(_LeNetStep)] + [ptr] * 5 + [i64] * 2, ctypes.c_int
            _libs[variant] = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _errors[variant] = str(e)
            warnings.warn(f"dropfl: native kernels unavailable ({variant}: {e}); the engines run without them "
                          "(the LeNets' first two layers in torch ops: the same results to rounding, slower; "
                          "per-client mode keeps BatchNorm models NCHW)", stacklevel=2)
        return _libs.get(variant)


def available(variant: str | None = None) -> bool:
    return load(variant) is not None


def chosen() -> str:
    """The variant `load()` without an argument uses (`requested()`, decided once per process)."""
    load()
    assert _chosen is not None
    return _chosen


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX if set, else g++, else c++ (None: not on PATH)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def error(variant: str | None = None) -> str | None:
    """Why `variant`'s kernels (default: the chosen one) are not available, after `load()`: no compiler,
    the build's error, or turned off; None if they are, or if `load()` has not been called."""
    return _errors.get(variant or _chosen or "")


class _FcHead(ctypes.Structure):
    """conv_pool.cpp's `FcHead`: the fully connected layers' operands (at most 4 layers)."""
    _fields_ = [("nl", ctypes.c_int64), ("w", ctypes.c_void_p * 4), ("bias", ctypes.c_void_p * 4),
                ("out", ctypes.c_void_p * 4), ("gin", ctypes.c_void_p * 4), ("dims", ctypes.c_int64 * 8),
                ("blocks", ctypes.c_int64 * 4), ("glog", ctypes.c_void_p),
                ("neg_lr", ctypes.c_double), ("vexp", ctypes.c_void_p), ("vlog", ctypes.c_void_p)]


class _LeNetStep(ctypes.Structure):
    """conv_pool.cpp's `LeNetStep`: the whole step by hand's operands."""
    _fields_ = [(n, ctypes.c_void_p) for n in ("xs", "w1", "b1", "y1", "arg1", "gh", "gw1", "gb1", "w2", "b2", "y2",
                                               "arg2", "gw2", "gb2")] + \
               [(n, ctypes.c_int64) for n in ("B", "H", "W", "Cin", "O1", "R", "S", "O2", "lanes", "conv_steps")] + \
               [("prof", ctypes.c_void_p), ("fc", _FcHead)]


def _lib(variant: str | None) -> ctypes.CDLL:
    lib = load(variant)
    assert lib is not None, f"native kernels ({variant or _chosen}) not available: {error(variant)}"
    return lib


def _ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous() and t.device.type == "cpu", "native kernels take contiguous CPU tensors"
    return t.data_ptr()


def _entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    """The kernel entry point `dropfl_<name>_f64` or `_f32` for tensors of `dtype`."""
    return getattr(lib, f"dropfl_{name}_{'f64' if dtype == torch.float64 else 'f32'}")


def _ok(status: int) -> None:
    """The second-layer entry points return -1 (and do nothing) for a shape they were not built for."""
    if status != 0:
        raise RuntimeError("conv2_pool_relu: the kernel refused the shape (inner_fits and the kernel disagree)")


def _check_dtypes(name: str, *ts: torch.Tensor) -> None:
    if len({t.dtype for t in ts}) != 1 or ts[0].dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}: dtypes {[str(t.dtype) for t in ts]}: need one dtype, float32 or float64")


def _check_indices(name: str, rows: torch.Tensor, n: int) -> None:
    """The first-layer kernel reads image rows[k, b] unchecked: the indices must be int64 and in 0..n-1."""
    if rows.dtype != torch.int64 or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n)):
        raise IndexError(f"{name}: rows must be int64 indices into the {n} images")


def split_images(x: torch.Tensor, kernel_width: int, variant: str | None = None) -> torch.Tensor:
    """Images [N, Cin, H, W] as the first-layer kernel reads them: each row's even and odd columns apart,
    zero-padded to a width that depends on the variant's vector width, [N, Cin·H·2·PW] (same dtype).
    The engine splits its data once (coordinator/sim/batched.py, `Group`); `conv_pool_relu` then
    takes the split images instead of splitting the step's images in every forward and backward."""
    lib = _lib(variant)
    _check_dtypes("split_images", x)
    x = x.contiguous()
    n, cin, h, wd = x.shape
    size = _entry(lib, "split_size", x.dtype)(h, wd, cin, kernel_width)
    out = torch.empty((n, size), dtype=x.dtype)
    _entry(lib, "split_images", x.dtype)(_ptr(x), n, h, wd, cin, kernel_width, _ptr(out))
    return out


def _padded(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor with 64 bytes of slack after it: the client-major backward reads a
    row's last vector whole (lanes past the row are masked), which may run past the last row."""
    n = math.prod(shape)
    return torch.empty(n + 64 // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)[:n].view(shape)


def conv_pool_fwd(x_all: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                  variant: str | None = None, x_split: torch.Tensor | None = None,
                  client_major: bool = False) -> tuple[torch.Tensor, tuple]:
    """The first layer's forward without autograd (`ConvPoolRelu`'s arguments): the output [B, K·O, Hp, Wp]
    (channels-last memory) and what `conv_pool_bwd` needs. `client_major` (the step by hand, which has no
    autograd between the layers): the output is [K, B, Hp, Wp, O] instead, what `conv2_pool_fwd(...,
    client_major=True)` copies row by row, and `conv_pool_bwd` then takes the gradient [K, B, O, Hp, Wp] that
    `conv2_pool_bwd` gives in that mode. Only the layout differs: the same values, bit for bit."""
    lib = _lib(variant)
    _check_dtypes("conv_pool_relu", x_all, w, bias)
    k, b = rows.shape
    _, cin, h, wd = x_all.shape
    _check_indices("conv_pool_relu", rows, len(x_all))
    o, r, s = w.shape[0] // k, w.shape[2], w.shape[3]
    hp, wp = (h - r + 1) // 2, (wd - s + 1) // 2
    if x_split is None:   # split only the step's images; row i of the split is rows.flatten()[i]
        x_split = split_images(x_all[rows.reshape(-1)], s, variant)
        rows = torch.arange(k * b, dtype=torch.int64).view(k, b)
    else:
        size = _entry(lib, "split_size", w.dtype)(h, wd, cin, s)
        if x_split.shape != (len(x_all), size) or x_split.dtype != w.dtype or not x_split.is_contiguous():
            raise ValueError(f"conv_pool_relu: x_split {tuple(x_split.shape)} {x_split.dtype} is not "
                             f"split_images(x_all, {s}, {variant!r}): [{len(x_all)}, {size}] {w.dtype}")
    rows, w, bias = rows.contiguous(), w.contiguous(), bias.contiguous()
    y = torch.empty((k, b, hp, wp, o) if client_major else (b, hp, wp, k * o), dtype=w.dtype)
    arg = _padded((k, b, o, hp, wp), torch.uint8)
    _entry(lib, "conv_pool_fwd", w.dtype)(_ptr(x_split), _ptr(rows), _ptr(w), _ptr(bias), _ptr(y), _ptr(arg),
                                          b, h, wd, k, cin, o, r, s, int(client_major))
    return (y if client_major else y.permute(0, 3, 1, 2),
            ((x_split, rows, arg), ((b, h, wd, k, cin, o, r, s, int(client_major)), w.shape, lib)))


def _has_slack(t: torch.Tensor) -> bool:
    """Whether 64 bytes past `t`'s end are still its storage's (a `_padded` tensor)."""
    end = t.storage_offset() + t.numel()
    return t.untyped_storage().nbytes() >= (end * t.element_size()) + 64


def conv_pool_bwd(saved: tuple, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's weight and bias gradients from `conv_pool_fwd`'s saved state and the output's
    gradient gy [B, K·O, Hp, Wp] (a view of [B, Hp, Wp, K·O] memory, as the second layer's backward gives it);
    client-major: gy [K, B, O, Hp, Wp] as `conv2_pool_bwd` gives it in that mode (with the slack it reads)."""
    (x_split, rows, arg), (dims, w_shape, lib) = saved
    if dims[-1]:
        b, _, _, k, _, o = dims[:6]
        if gy.dim() != 5 or gy.shape[:3] != (k, b, o) or not gy.is_contiguous() or gy.dtype != x_split.dtype:
            raise ValueError(f"conv_pool_bwd: client-major gy must be contiguous [K, B, O, Hp, Wp], got "
                             f"{tuple(gy.shape)}")
        gy = _padded(tuple(gy.shape), gy.dtype).copy_(gy) if not _has_slack(gy) else gy
    else:
        gy = gy.permute(0, 2, 3, 1).contiguous()   # [B, Hp, Wp, K·O] (a view when already channels-last)
    gw = torch.empty(w_shape, dtype=gy.dtype)
    gb = torch.empty(w_shape[0], dtype=gy.dtype)
    _entry(lib, "conv_pool_bwd", gy.dtype)(_ptr(x_split), _ptr(rows), _ptr(gy), _ptr(arg), _ptr(gw), _ptr(gb), *dims)
    return gw, gb


class ConvPoolRelu(torch.autograd.Function):
    """relu(max_pool2d(conv2d(x_k, w_k, b_k), 2)) for K clients, fused (coordinator/sim/kernels/conv_pool.cpp).

    x_all [N, Cin, H, W] (all preloaded images), rows [K, B] (client k's b-th sample is x_all[rows[k, b]]),
    w [K·O, Cin, R, S], bias [K·O] → [B, K·O, Hp, Wp] in channels-last memory, as the grouped
    convolution, max-pool and relu of the torch path would give it. Gradients for w and bias only.
    `x_split`: `split_images(x_all, S, variant)` made once by the caller (without it, the step's images
    are split here, once for the forward and the backward).
    """

    @staticmethod
    def forward(ctx, x_all: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                variant: str | None = None, x_split: torch.Tensor | None = None) -> torch.Tensor:
        y, (tensors, ctx.meta) = conv_pool_fwd(x_all, rows, w, bias, variant, x_split)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        gw, gb = conv_pool_bwd((ctx.saved_tensors, ctx.meta), gy)
        return None, None, gw, gb, None, None


def conv_pool_relu(x_all: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                   variant: str | None = None, x_split: torch.Tensor | None = None) -> torch.Tensor:
    """The first layer with `variant`'s kernels (default: the chosen variant, `chosen()`); `x_split`:
    `split_images(x_all, S, variant)`, made once by a caller that trains many steps on the same images."""
    return ConvPoolRelu.apply(x_all, rows, w, bias, variant, x_split)


def inner_fits(in_channels: int, out_channels: int, kernel: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `conv2_pool_relu` takes this layer: the LeNets' second layer (6 input channels per client,
    5×5, at most 2 vectors of output channels: 32 float32, 16 float64). Others run as torch ops."""
    lanes = {torch.float32: 16, torch.float64: 8}.get(dtype, 0)
    return in_channels == 6 and tuple(kernel) == (5, 5) and 0 < out_channels <= 2 * lanes


def conv2_pool_fwd(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int,
                   variant: str | None = None, client_major: bool = False) -> tuple[torch.Tensor, tuple]:
    """The second layer's forward without autograd (`Conv2PoolRelu`'s arguments): the output [K, B, O·Hp·Wp]
    and what `conv2_pool_bwd` needs. `client_major`: h is [K, B, H, W, Cin] (`conv_pool_fwd(...,
    client_major=True)`), and `conv2_pool_bwd` gives the input's gradient as [K, B, Cin, H, W]."""
    lib = _lib(variant)
    _check_dtypes("conv2_pool_relu", h, w, bias)
    if client_major:
        if h.dim() != 5 or h.shape[0] != k or not h.is_contiguous():
            raise ValueError(f"conv2_pool_fwd: client-major h must be contiguous [K, B, H, W, Cin], "
                             f"got {tuple(h.shape)}")
        _, b, hh, wd, cin = h.shape
        kc = k * cin
    else:
        b, kc, hh, wd = h.shape
    cin, o, r, s = kc // k, w.shape[0] // k, w.shape[2], w.shape[3]
    if not inner_fits(cin, o, (r, s), w.dtype):
        raise ValueError(f"conv2_pool_relu: no kernel for {cin}→{o} channels, {r}×{s}, {w.dtype} (see inner_fits)")
    hp, wp = (hh - r + 1) // 2, (wd - s + 1) // 2
    hl = h if client_major else h.permute(0, 2, 3, 1).contiguous()  # [K, B, H, W, Cin] or [B, H, W, K·Cin]
    w, bias = w.contiguous(), bias.contiguous()
    y = torch.empty((k, b, o * hp * wp), dtype=w.dtype)
    arg = torch.empty((k, b, hp, wp, o), dtype=torch.uint8)   # a window's O indices contiguous
    _ok(_entry(lib, "conv2_pool_fwd", w.dtype)(_ptr(hl), _ptr(w), _ptr(bias), _ptr(y), _ptr(arg),
                                              b, hh, wd, k, cin, o, r, s, int(client_major)))
    return y, ((hl, w, arg), ((b, hh, wd, k, cin, o, r, s, int(client_major)), lib))


def conv2_pool_bwd(saved: tuple, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The second layer's input, weight and bias gradients from `conv2_pool_fwd`'s saved state and the
    output's gradient gy [K, B, O·Hp·Wp]; the input's is [B, K·Cin, H, W] in channels-last memory, or, client-major,
    [K, B, Cin, H, W] with the slack `conv_pool_bwd` reads."""
    (hl, w, arg), (dims, lib) = saved
    gy = gy.contiguous()
    b, hh, wd, k, cin = dims[:5]
    client_major = dims[-1]
    gh = _padded((k, b, cin, hh, wd), hl.dtype) if client_major else torch.empty_like(hl)
    gw, gb = torch.empty_like(w), torch.empty(w.shape[0], dtype=w.dtype)
    _ok(_entry(lib, "conv2_pool_bwd", w.dtype)(_ptr(hl), _ptr(w), _ptr(gy), _ptr(arg), _ptr(gh), _ptr(gw), _ptr(gb),
                                              *dims))
    return (gh if client_major else gh.permute(0, 3, 1, 2)), gw, gb


class Conv2PoolRelu(torch.autograd.Function):
    """relu(max_pool2d(conv2d(h, w, b, groups=K), 2)) on activations, fused (the LeNets' second layer).

    h [B, K·Cin, H, W] in channels-last memory (the first layer's output), w [K·O, Cin, R, S], bias [K·O]
    → [K, B, O·Hp·Wp]: each client's `flatten(1)` of its pooled map, the row layout of the
    fully connected layers. Gradients for h, w and bias; the backward only visits routed outputs.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int,
                variant: str | None = None) -> torch.Tensor:
        y, (tensors, ctx.meta) = conv2_pool_fwd(h, w, bias, k, variant)
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        gh, gw, gb = conv2_pool_bwd((ctx.saved_tensors, ctx.meta), gy)
        return gh, gw, gb, None, None


def conv2_pool_relu(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int,
                    variant: str | None = None) -> torch.Tensor:
    """The second layer with `variant`'s kernels (default: the chosen variant, `chosen()`)."""
    return Conv2PoolRelu.apply(h, w, bias, k, variant)


class LeNetLayers:
    """The LeNet step by hand's four fused-layer calls (`batched._lenet_step`), prepared once per `Group.train`:
    the same kernels on the same operands as `conv_pool_fwd(..., client_major=True)` (or, where a batch fills the
    vector lanes, `forward_lanes`: the same bits), `conv2_pool_fwd(..., client_major=True)`, `conv2_pool_bwd` and
    `conv_pool_bwd`, so the same bits, but the entry points, dims and
    checks are made here once, and the outputs go to buffers made here once and reused by every step (a step's
    outputs are read within that step only). Those functions' checks, allocations and look-ups took ~60 µs of
    Python per step, ~1.5 % of a 15-client mimic-cnn step (measured with 1-sample calls: 12-25 µs each).

    x_all [N, Cin, H, W] and x_split (`split_images(x_all, S, variant)`) as `conv_pool_fwd` takes them; w1, b1,
    w2, b2 the engine's parameter stacks [K, O, Cin, R, S] and [K, O] of all K clients. Their memory must stay where
    it is (the engine updates them in place); a step of the first k clients uses the first k rows of each (the
    engine's active clients are a prefix)."""

    def __init__(self, variant: str | None, x_all: torch.Tensor, x_split: torch.Tensor, w1: torch.Tensor,
                 b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, batch: int):
        lib = _lib(variant)
        dt = w1.dtype
        _check_dtypes("LeNetLayers", x_all, x_split, w1, b1, w2, b2)
        n_all, cin, h, wd = x_all.shape
        kk, o1, _, r, s = w1.shape
        o2 = w2.shape[1]
        if not (w1.is_contiguous() and b1.is_contiguous() and w2.is_contiguous() and b2.is_contiguous()
                and x_split.is_contiguous() and w2.shape[2] == o1
                and b1.shape == (kk, o1) and b2.shape == (kk, o2)
                and inner_fits(o1, o2, tuple(w2.shape[3:]), dt)
                and x_split.shape == (n_all, _entry(lib, "split_size", dt)(h, wd, cin, s))):
            raise ValueError(f"LeNetLayers: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, x_split "
                             f"{tuple(x_split.shape)}: not the LeNet layers' contiguous stacks and split images")
        hp, wp = (h - r + 1) // 2, (wd - s + 1) // 2
        r2, s2 = w2.shape[3:]
        hp2, wp2 = (hp - r2 + 1) // 2, (wp - s2 + 1) // 2
        self.n_all, self.b, self.k_all = n_all, batch, kk
        self.dims1 = (batch, h, wd, cin, o1, r, s)       # conv_pool_fwd's dims but K (passed per call)
        self.dims2 = (batch, hp, wp, o1, o2, r2, s2)
        # The first layer's forward: with a client's samples in the vector lanes (`forward_lanes`) where a batch fills
        # at least as many lanes as a pooled row's columns do, else the column form (conv_pool_fwd's client-major
        # forward); both read the split images, and give the same bits.
        # Measured alone (15 clients, avx512, float32, ms, columns vs lanes): batch 10 0.33 vs 0.38, 12 0.41 vs
        # 0.39, 16 0.56 vs 0.40, 20 0.67 vs 0.78, 32 1.10 vs 0.82, 50 1.68 vs 1.56.
        lanes = VECTOR_BYTES[variant or chosen()] // torch.empty(0, dtype=dt).element_size()
        fill_lanes = batch / (-(-batch // lanes) * lanes)
        fill_cols = wp / (-(-wp // lanes) * lanes)
        self.lanes = fill_lanes >= fill_cols
        self.fwd1_fn = _entry(lib, "conv_pool_fwd_lanes" if self.lanes else "conv_pool_fwd", dt)
        self.fwd1_layout = () if self.lanes else (1,)   # the column form's client-major layout argument
        self.bwd1_fn = _entry(lib, "conv_pool_bwd", dt)
        self.fwd2_fn, self.bwd2_fn = _entry(lib, "conv2_pool_fwd", dt), _entry(lib, "conv2_pool_bwd", dt)
        self.tensors = (x_split, w1, b1, w2, b2)    # kept alive: their pointers below are used every step
        self.xs, self.w1, self.b1, self.w2, self.b2 = (t.data_ptr() for t in self.tensors)
        # every output for all K clients; a step of k clients uses the first k rows of each (contiguous prefixes)
        self.y1 = torch.empty((kk, batch, hp, wp, o1), dtype=dt)
        self.arg1 = _padded((kk, batch, o1, hp, wp), torch.uint8)
        self.y2 = torch.empty((kk, batch, o2 * hp2 * wp2), dtype=dt)
        self.arg2 = torch.empty((kk, batch, hp2, wp2, o2), dtype=torch.uint8)
        self.gh = _padded((kk, batch, o1, hp, wp), dt)
        self.gw1, self.gb1 = torch.empty_like(w1), torch.empty_like(b1)
        self.gw2, self.gb2 = torch.empty_like(w2), torch.empty_like(b2)
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._checked: torch.Tensor | None = None   # the rows table checked last (`_check_rows`)

    def _check_rows(self, rows: torch.Tensor) -> None:
        """The kernels read image rows[k, b] unchecked: int64 indices in range. Checked once per table: a step's
        rows are a view of the table of all steps (`Group._steps`), which is checked whole the first time."""
        table = rows._base if rows._base is not None else rows
        if table is self._checked:
            return
        _check_indices("LeNetLayers", table, self.n_all)
        self._checked = table

    def check_step_rows(self, name: str, rows: torch.Tensor, k: int) -> None:
        """A step's rows [k, B] of the first k clients: contiguous, in range (`_check_rows`)."""
        if rows.shape != (k, self.b) or not rows.is_contiguous() or not 0 < k <= self.k_all:
            raise ValueError(f"{name}: rows {tuple(rows.shape)} for {k} clients: need contiguous [{k}, {self.b}], "
                             f"at most {self.k_all} clients")
        self._check_rows(rows)

    def views(self, k: int) -> tuple[torch.Tensor, ...]:
        """The first k clients' rows of every output buffer (made once per k)."""
        v = self._views.get(k)
        if v is None:
            v = self._views[k] = (self.y1[:k], self.y2[:k], self.gh[:k], self.gw1[:k], self.gb1[:k], self.gw2[:k],
                                  self.gb2[:k])
        return v

    def fwd1(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """The first layer of the first k clients on the step's rows [k, B] (indices into x_all): [k, B, Hp, Wp,
        O], as `conv_pool_fwd(..., client_major=True)`."""
        self.check_step_rows("LeNetLayers", rows, k)
        b, h, wd, cin, o, r, s = self.dims1
        self.fwd1_fn(self.xs, rows.data_ptr(), self.w1, self.b1, self.y1.data_ptr(), self.arg1.data_ptr(),
                     b, h, wd, k, cin, o, r, s, *self.fwd1_layout)
        self.rows = rows    # the backward reads the same rows
        return self.views(k)[0]

    def fwd2(self, k: int) -> torch.Tensor:
        """The second layer on `fwd1`'s output: [k, B, O·Hp·Wp], as `conv2_pool_fwd(..., client_major=True)`."""
        b, h, wd, cin, o, r, s = self.dims2
        _ok(self.fwd2_fn(self.y1.data_ptr(), self.w2, self.b2, self.y2.data_ptr(), self.arg2.data_ptr(),
                         b, h, wd, k, cin, o, r, s, 1))
        return self.views(k)[1]

    def bwd2(self, gy: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`conv2_pool_bwd` after `fwd2`: the gradients of its input [k, B, Cin, H, W], weight and bias (views of
        this object's buffers, with the parameters' shapes), from the output's gradient gy [k, B, O·Hp·Wp]."""
        gy = gy.contiguous()
        if gy.shape != self.y2[:k].shape or gy.dtype != self.y2.dtype:
            raise ValueError(f"LeNetLayers: gy {tuple(gy.shape)} {gy.dtype}: need {tuple(self.y2[:k].shape)}")
        _, _, gh, _, _, gw2, gb2 = self.views(k)
        b, h, wd, cin, o, r, s = self.dims2
        _ok(self.bwd2_fn(self.y1.data_ptr(), self.w2, gy.data_ptr(), self.arg2.data_ptr(), self.gh.data_ptr(),
                         self.gw2.data_ptr(), self.gb2.data_ptr(), b, h, wd, k, cin, o, r, s, 1))
        return gh, gw2, gb2

    def bwd1(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`conv_pool_bwd` after `bwd2`, on the gradient it left in this object's buffer: the first layer's weight
        and bias gradients (views of this object's buffers, with the parameters' shapes)."""
        b, h, wd, cin, o, r, s = self.dims1
        self.bwd1_fn(self.xs, self.rows.data_ptr(), self.gh.data_ptr(), self.arg1.data_ptr(), self.gw1.data_ptr(),
                     self.gb1.data_ptr(), b, h, wd, k, cin, o, r, s, 1)
        v = self.views(k)
        return v[3], v[4]


def _torch_update(p: torch.Tensor, g: torch.Tensor, anchor: torch.Tensor | None, mu: torch.Tensor | None,
                  corr: torch.Tensor | None, neg_lr: float) -> None:
    """The engine's torch ops for one parameter stack's FedProx / SCAFFOLD step (what `sgd_update` fuses)."""
    if mu is not None:
        g = g + mu.view(-1, *([1] * (p.dim() - 1))) * (p - anchor)
    if corr is not None:
        g = g + corr
    p.add_(g, alpha=neg_lr)


def sgd_update(p: torch.Tensor, g: torch.Tensor, anchor: torch.Tensor | None, mu: torch.Tensor | None,
               corr: torch.Tensor | None, neg_lr: float, variant: str | None = None,
               terms: torch.Tensor | None = None) -> None:
    """In place, p [K, ...] ← p − lr·(g + μₖ(p − anchor) + corr), element for element in the rounding of the torch
    ops it replaces (`_torch_update`; coordinator/sim/kernels/conv_pool.cpp, `sgd_update`): one pass over memory
    instead of four. `anchor`: one row broadcast to every client ([...]) or one per client ([K, ...]); `mu` [K] or
    None (no FedProx term); `corr` [K, ...] or None (no SCAFFOLD correction). All contiguous, one dtype.
    `terms` (uint8 [K], or None: every client gets the terms given): bit 1 gives client k the FedProx term, bit 2
    the correction; a client with neither is updated as `p.add_(g, alpha=-lr)` (a lockstep sweep's merged
    computation of plain, FedProx and SCAFFOLD clients). One step of `sgd_updater`: its checks, its kernel call."""
    _check_dtypes("sgd_update", p, g)
    sgd_updater(p, anchor, mu, corr, variant, terms)(g, len(p), neg_lr)


def sgd_updater(p: torch.Tensor, anchor: torch.Tensor | None, mu: torch.Tensor | None, corr: torch.Tensor | None,
                variant: str | None = None, terms: torch.Tensor | None = None) -> Callable[..., None]:
    """`sgd_update` for one parameter stack over many steps: everything but the gradient is checked here once, and
    `update(g, k, neg_lr, prox=True)` then updates the first k clients (p[:k], with mu[:k], the anchor's, corr's and
    terms' first k rows; `prox=False`: as `sgd_update` with mu None), checking only g. The same kernel on the same
    operands: the same bits. (The engine updates every parameter of every step: ~10 calls a step, whose argument
    checks cost ~1.5-3 % of a step: benchmarks/step_ab.py --mix.)"""
    ts = [t for t in (p, anchor, mu, corr) if t is not None]
    _check_dtypes("sgd_update", *ts)
    n = math.prod(p.shape[1:])
    if not all(t.is_contiguous() for t in ts) or (corr is not None and corr.shape != p.shape):
        raise ValueError("sgd_update: p, anchor, mu and corr must be contiguous, corr a stack of p's shape")
    if mu is not None and (anchor is None or mu.shape != p.shape[:1] or anchor.numel() not in (n, p.numel())):
        raise ValueError("sgd_update: mu must be [K] with an anchor of one row or one per client")
    if terms is not None and (terms.dtype != torch.uint8 or terms.shape != p.shape[:1] or not terms.is_contiguous()):
        raise ValueError("sgd_update: terms must be contiguous uint8 [K]")
    fn = _entry(_lib(variant), "sgd_update", p.dtype)
    stride = 0 if anchor is None or anchor.numel() == n else n
    ptrs = [_ptr(t) if t is not None else None for t in (p, anchor if mu is not None else None, mu, corr, terms)]
    shape, dtype = p.shape[1:], p.dtype

    def update(g: torch.Tensor, k: int, neg_lr: float, prox: bool = True) -> None:
        if g.shape[1:] != shape or g.shape[0] != k or k > len(p) or g.dtype != dtype or not g.is_contiguous():
            raise ValueError(f"sgd_update: g must be a contiguous [{k}, {', '.join(map(str, shape))}] {dtype}")
        fn(ptrs[0], g.data_ptr(), ptrs[1] if prox else None, stride, ptrs[2] if prox else None, ptrs[3], ptrs[4],
           neg_lr, k, n)

    update.keep = (p, anchor, mu, corr, terms)   # the pointers' tensors stay alive with the function
    return update


_exact: dict[tuple[str, torch.dtype], bool] = {}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float32/float64 tensors hold the same bits (NaN payloads and the sign of zero included)."""
    as_int = torch.int32 if a.dtype == torch.float32 else torch.int64
    return a.dtype == b.dtype and bool(torch.equal(a.view(as_int), b.view(as_int)))


def sgd_update_exact(variant: str, dtype: torch.dtype) -> bool:
    """Whether `sgd_update` with `variant`'s library gives the bits of the torch ops it replaces, in this process
    (torch's add with alpha is one fma in its vectorised loop and in its scalar tail on the CPUs measured; a torch
    or a CPU where it is not keeps the torch ops). Checked once per variant and dtype on random stacks whose
    lengths exercise every vector tail, with and without each term; the engine uses the kernel only where True."""
    key = (variant, dtype)
    if key not in _exact:
        gen = torch.Generator().manual_seed(20261123)
        ok = available(variant)
        for n in [*range(1, 40), 61, 64, 97, 150, 1000, 4099] if ok else []:
            k = 1 + n % 3
            p0 = torch.randn(k, n, generator=gen, dtype=dtype)
            g = torch.randn(k, n, generator=gen, dtype=dtype) * 10.0 ** (n % 5 - 2)
            a1 = torch.randn(n, generator=gen, dtype=dtype)
            ak = torch.randn(k, n, generator=gen, dtype=dtype)
            mu = torch.rand(k, generator=gen, dtype=dtype)
            mu[0] = 0.0
            c = torch.randn(k, n, generator=gen, dtype=dtype) * 0.1
            for anchor, m, cc in ((a1, mu, None), (ak, mu, None), (None, None, c), (a1, mu, c), (None, None, None)):
                want, got = p0.clone(), p0.clone()
                _torch_update(want, g, anchor, m, cc, -0.0123)
                sgd_update(got, g, anchor, m, cc, -0.0123, variant)
                ok = ok and _same_bits(want, got)
        _exact[key] = ok
    return _exact[key]


def fused_update(variant: str | None, dtype: torch.dtype) -> bool:
    """Whether the engine updates FedProx and SCAFFOLD steps with `sgd_update` (`variant`'s library): where its
    bits are torch's (`sgd_update_exact`) and the fma is an instruction (x86's avx512 and avx2 variants, every
    aarch64 build); x86's generic build would call libm's fma per element, slower than the torch ops."""
    if variant is None or variant == "off":
        return False
    hardware_fma = variant in ("avx512", "avx2") or platform.machine().lower() in ("aarch64", "arm64")
    return hardware_fma and sgd_update_exact(variant, dtype)


def _torch_fc_sgd(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, neg_lr: float) -> None:
    """The torch ops `fc_sgd` replaces: a linear weight's gradient (the engine's transposed weight [K, in, out]:
    xᵀ·g) and its plain SGD step."""
    w.add_(x.transpose(1, 2).bmm(g), alpha=neg_lr)


_fc_exact: dict[tuple, bool] = {}


def fc_sgd_exact(variant: str, dtype: torch.dtype, b: int, fin: int, fout: int) -> bool:
    """Whether `fc_sgd` with `variant`'s library gives the bits of the torch ops it replaces (`_torch_fc_sgd`) for
    batches of `b` rows and an `fin`→`fout` layer, in this process: the kernel sums each gradient element in the
    order MKL's sgemm does for these shapes on the CPUs measured, which another BLAS, CPU or shape need not. Checked
    once per shape and thread count (the engine's slices run 1 thread) on random operands (relu'd inputs: some
    zeros) of 3 clients, twice; the engine uses the kernel only where True (and the torch ops elsewhere)."""
    key = (variant, dtype, b, fin, fout, torch.get_num_threads())   # MKL may take another path with more threads
    if key not in _fc_exact:
        ok = available(variant) and dtype in (torch.float32, torch.float64)
        gen = torch.Generator().manual_seed(20261124)
        for _ in range(2 if ok else 0):
            x = torch.relu(torch.randn(3, b, fin, generator=gen, dtype=dtype))
            g = torch.randn(3, b, fout, generator=gen, dtype=dtype) * 0.1
            w = torch.randn(3, fin, fout, generator=gen, dtype=dtype)
            want, got = w.clone(), w.clone()
            _torch_fc_sgd(x, g, want, -0.0123)
            ok = ok and _fc_call(x, g, got, -0.0123, variant, (3, b, fin, fout)) and _same_bits(want, got)
        _fc_exact[key] = ok
    return _fc_exact[key]


def _fc_shapes(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int]:
    if x.dim() != 3 or g.dim() != 3 or g.shape[:2] != x.shape[:2] or w.shape != (x.shape[0], x.shape[2], g.shape[2]) \
            or not (x.dtype == g.dtype == w.dtype):
        raise ValueError(f"fc_sgd: x {tuple(x.shape)}, g {tuple(g.shape)}, w {tuple(w.shape)}: need [K, B, in], "
                         f"[K, B, out], [K, in, out] of one dtype")
    return x.shape[0], x.shape[1], x.shape[2], g.shape[2]


def _fc_call(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, neg_lr: float, variant: str | None,
             dims: tuple[int, int, int, int]) -> bool:
    """The kernel on operands whose shapes (`dims`: K, B, in, out) the caller has checked (`_fc_shapes`)."""
    return _entry(_lib(variant), "fc_sgd", x.dtype)(_ptr(x), _ptr(g), _ptr(w), *dims, neg_lr) == 0


def fc_sgd(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, neg_lr: float, variant: str | None = None) -> bool:
    """In place, w ← w − lr·(xᵀ·g) for each client: a linear weight's gradient and its plain SGD step in one pass
    (coordinator/sim/kernels/conv_pool.cpp, `fc_sgd`), x [K, B, in] (the layer's input), g [K, B, out] (its
    output's gradient), w [K, in, out] (the engine's transposed weight), all contiguous: the gradient never goes to
    memory. Where its bits would not be the torch ops' for this shape (`fc_sgd_exact`), or the layer is narrower
    than a vector, it does nothing and returns False: the caller then runs the torch ops (`_torch_fc_sgd`)."""
    variant = variant or chosen()
    dims = _fc_shapes(x, g, w)
    return fc_sgd_exact(variant, x.dtype, *dims[1:]) and _fc_call(x, g, w, neg_lr, variant, dims)


# ---- The fully connected layers of the LeNet step by hand (`fc_fwd`, `fc_bwd_sgd`) --------------------------------

def _torch_fc_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, relu: bool) -> torch.Tensor:
    """The torch ops `fc_fwd` replaces: a layer of the step by hand (`batched._lenet_step`), x [K, B, in] times the
    engine's transposed weight [K, in, out] plus the bias [K, out], then relu where `relu`."""
    y = torch.baddbmm(bias.unsqueeze(1), x, w)
    return torch.relu(y) if relu else y


def _torch_fc_bwd_sgd(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, r: torch.Tensor | None,
                      neg_lr: float) -> torch.Tensor:
    """The torch ops `fc_bwd_sgd` replaces (`batched._lenet_step`'s `back` and its plain SGD steps): the input's
    gradient g·wᵀ (relu's threshold_backward on r where given), then the bias's and the weight's steps."""
    gx = g.bmm(w.transpose(1, 2))
    if r is not None:
        gx = torch.ops.aten.threshold_backward(gx, r, 0)
    bias.add_(g.sum(1), alpha=neg_lr)
    w.add_(x.transpose(1, 2).bmm(g), alpha=neg_lr)
    return gx


_fc_layer_exact: dict[tuple, int] = {}


def fc_layer_exact(variant: str, dtype: torch.dtype, b: int, fin: int, fout: int) -> int:
    """Whether `fc_fwd` and `fc_bwd_sgd` with `variant`'s library give the bits of the torch ops they replace
    (`_torch_fc_fwd`, `_torch_fc_bwd_sgd`, with and without relu and its threshold) for batches of `b` rows and an
    `fin`→`fout` layer, in this process: the value of `fc_bwd_sgd`'s `sum_block` under which they do (the columns
    ATen's bias-gradient sum takes in whole vectorised blocks: 4 vectors of its ISA), or 0 where they do not. The
    kernels sum in the orders MKL's sgemm and ATen's reduction use for these shapes on the CPUs measured, which
    another BLAS, CPU, ISA or shape need not: checked once per shape and thread count on random operands (relu'd
    inputs, zeros in the gradient) of 3 clients, twice; the engine runs the kernels only where this is not 0."""
    key = (variant, dtype, b, fin, fout, torch.get_num_threads())
    if key in _fc_layer_exact:
        return _fc_layer_exact[key]
    found = 0
    if available(variant) and dtype in (torch.float32, torch.float64):
        lib, item = _lib(variant), torch.empty(0, dtype=dtype).element_size()
        fwd, bwd = _entry(lib, "fc_fwd", dtype), _entry(lib, "fc_bwd_sgd", dtype)
        gen = torch.Generator().manual_seed(20261125)
        cases = []
        for _ in range(2):
            x = torch.relu(torch.randn(3, b, fin, generator=gen, dtype=dtype))
            g = torch.randn(3, b, fout, generator=gen, dtype=dtype) * 0.1
            g[g.abs() < 0.02] = 0
            w = torch.randn(3, fin, fout, generator=gen, dtype=dtype) * 0.1
            bias = torch.randn(3, fout, generator=gen, dtype=dtype) * 0.1
            cases.append((x, g, w, bias))
        fwd_ok = True
        for x, _, w, bias in cases:
            for relu in (False, True):
                y = torch.empty(3, b, fout, dtype=dtype)
                fwd(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), 3, b, fin, fout, int(relu))
                fwd_ok = fwd_ok and _same_bits(y, _torch_fc_fwd(x, w, bias, relu))
        for block in ((32 // item) * 4, (64 // item) * 4) if fwd_ok else ():   # AVX2's blocks, AVX-512's
            ok = True
            for x, g, w, bias in cases:
                for r in (None, x):
                    want_w, want_b = w.clone(), bias.clone()
                    want_gx = _torch_fc_bwd_sgd(x, g, want_w, want_b, r, -0.0123)
                    got_w, got_b, got_gx = w.clone(), bias.clone(), torch.empty(3, b, fin, dtype=dtype)
                    ok = ok and bwd(x.data_ptr(), g.data_ptr(), got_w.data_ptr(), got_b.data_ptr(),
                                    0 if r is None else r.data_ptr(), got_gx.data_ptr(), 3, b, fin, fout, -0.0123,
                                    block) == 0
                    ok = ok and _same_bits(got_gx, want_gx) and _same_bits(got_w, want_w) and _same_bits(got_b, want_b)
            if ok:
                found = block
                break
    _fc_layer_exact[key] = found
    return found


def _torch_loss(logits: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops `log_softmax_nll` replaces (`batched._lenet_step`): per row, the cross-entropy nll_loss(
    log_softmax(x)) (reduction none) and the gradient of Σ dloss·ce with respect to the logits [R, D]."""
    lsm = torch.log_softmax(logits, 1)
    ce, total_weight = torch.ops.aten.nll_loss_forward(lsm, target, None, 0, -100)
    g = torch.ops.aten.nll_loss_backward(dloss, lsm, target, None, 0, -100, total_weight)
    return ce, torch.ops.aten._log_softmax_backward_data(g, lsm, 1, lsm.dtype)


@functools.cache
def _sleef(variant: str) -> tuple[int, int] | None:
    """The addresses of the SLEEF exp and log that ATen's vectorised kernels call, for `variant`'s float vector
    width (exported by libtorch_cpu), or None where they are not found."""
    if variant not in ("avx512", "avx2"):   # SLEEF's x86 exp and log of 16 and 8 floats
        return None
    width = VECTOR_BYTES[variant] // 4
    lib_path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib_path):
        return None
    try:
        tl = ctypes.CDLL(lib_path)
        return tuple(ctypes.cast(getattr(tl, f"Sleef_{f}f{width}_u10"), ctypes.c_void_p).value  # type: ignore
                     for f in ("exp", "log"))
    except (OSError, AttributeError):
        return None


_loss_exact: dict[tuple, bool] = {}


def loss_exact(variant: str, classes: int) -> bool:
    """Whether `log_softmax_nll` (float32) gives the bits of the torch ops it replaces (`_torch_loss`) for rows of
    `classes` logits, in this process: it follows ATen's vectorised kernels for a row shorter than a vector, with the
    very SLEEF exp and log they call, which another torch, CPU or ISA need not. Checked once per process on random
    logits of several scales (zeros in the incoming gradient); the step keeps the torch ops where False."""
    key = (variant, classes)
    if key not in _loss_exact:
        ok = available(variant) and _sleef(variant) is not None
        gen = torch.Generator().manual_seed(20261126)
        for scale in (1.0, 8.0, 40.0) if ok else ():
            x = torch.randn(97, classes, generator=gen) * scale
            t = torch.randint(0, classes, (97,), generator=gen)
            d = torch.rand(97, generator=gen) / 16
            d[::5] = 0
            want = _torch_loss(x, t, d)
            ce, gi = torch.empty(97), torch.empty(97, classes)
            ok = ok and _lib(variant).dropfl_log_softmax_nll_f32(x.data_ptr(), t.data_ptr(), d.data_ptr(),
                                                                 ce.data_ptr(), gi.data_ptr(), 97, classes,
                                                                 *_sleef(variant)) == 0
            ok = ok and _same_bits(ce, want[0]) and _same_bits(gi, want[1])
        _loss_exact[key] = ok
    return _loss_exact[key]


def _check_labels(name: str, target: torch.Tensor, dloss: torch.Tensor, rows: int, dtype: torch.dtype) -> None:
    """The native loss's labels and loss gradients: contiguous [rows] int64 and [rows] of `dtype`."""
    if not (target.dtype == torch.int64 and target.shape == (rows,) and dloss.shape == (rows,)
            and target.is_contiguous() and dloss.is_contiguous() and dloss.dtype == dtype):
        raise ValueError(f"{name}: target {tuple(target.shape)} {target.dtype}, dloss {tuple(dloss.shape)} "
                         f"{dloss.dtype}: need contiguous [{rows}] int64 and [{rows}] {dtype}")


def _label_status(name: str, status: int, classes: int) -> None:
    """The native loss's entry points return -2 for a label outside the classes (checked before anything is written)
    and -1 for a shape they refuse."""
    if status != 0:
        raise ValueError(f"{name}: a target outside 0..{classes - 1}" if status == -2 else
                         f"{name}: the kernel refused the shape")


class FcLayers:
    """The LeNet step by hand's fully connected layers (`batched._lenet_step`: relu between them, none after the
    last), prepared once per `Group.train`: the forward of every layer (`fc_fwd`), the loss (`loss`) and, with plain
    SGD at one lr (`neg_lr` given: `steps`), the backward of every layer with its weight's and bias's steps
    (`fc_bwd_sgd`) in place, instead of ~25 torch ops a step. The same bits as those ops (each layer's shape checked
    once: `fc_layer_exact`); `make` returns None where a layer's is not exact, and the step keeps the torch ops.

    ws [K, in, out] (the engine's transposed weights) and bs [K, out], the parameter stacks of all K clients, in
    order; their memory must stay where it is (the engine updates them in place). A step of the first k clients uses
    the first k rows of each, and the outputs go to buffers made here once (a step's outputs are read within it)."""

    @staticmethod
    def make(variant: str | None, ws: list[torch.Tensor], bs: list[torch.Tensor], batch: int,
             neg_lr: float | None) -> FcLayers | None:
        variant = variant or chosen()
        if not ws or len(ws) != len(bs) or not all(w.dim() == 3 and w.is_contiguous() for w in ws):
            return None
        blocks = [fc_layer_exact(variant, w.dtype, batch, w.shape[1], w.shape[2]) for w in ws]
        if not all(blocks):
            return None
        native_loss = ws[0].dtype == torch.float32 and loss_exact(variant, ws[-1].shape[2])
        return FcLayers(variant, ws, bs, batch, neg_lr, blocks, native_loss)

    def __init__(self, variant: str, ws: list[torch.Tensor], bs: list[torch.Tensor], batch: int,
                 neg_lr: float | None, blocks: list[int], native_loss: bool = False):
        lib, dt = _lib(variant), ws[0].dtype
        _check_dtypes("FcLayers", *ws, *bs)
        kk = ws[0].shape[0]
        for i, (w, b) in enumerate(zip(ws, bs)):
            if (w.shape[0] != kk or b.shape != (kk, w.shape[2]) or not b.is_contiguous()
                    or (i and w.shape[1] != ws[i - 1].shape[2])):
                raise ValueError(f"FcLayers: weights {[tuple(w.shape) for w in ws]}, biases "
                                 f"{[tuple(b.shape) for b in bs]}: not the contiguous stacks [K, in, out] and "
                                 "[K, out] of consecutive layers")
        self.lib = lib
        self.fwd_fn, self.bwd_fn = _entry(lib, "fc_fwd", dt), _entry(lib, "fc_bwd_sgd", dt)
        self.tensors = (*ws, *bs)   # kept alive: their pointers are used every step
        self.w = [w.data_ptr() for w in ws]
        self.b = [b.data_ptr() for b in bs]
        self.dims = [(w.shape[1], w.shape[2]) for w in ws]
        self.blocks, self.batch, self.k_all, self.neg_lr = blocks, batch, kk, neg_lr
        self.out = [torch.empty(kk, batch, fout, dtype=dt) for _, fout in self.dims]    # each layer's output
        self.gin = [torch.empty(kk, batch, fin, dtype=dt) for fin, _ in self.dims]      # each layer's input gradient
        self.x0: torch.Tensor | None = None
        # the loss (`loss`): log_softmax, nll_loss and their backward in one native call where its bits are the
        # torch ops' (`loss_exact`), else those ops
        self.loss_fn = lib.dropfl_log_softmax_nll_f32 if native_loss else None
        self.sleef = _sleef(variant) if native_loss else None
        classes = self.dims[-1][1]
        self.ce, self.g = torch.empty(kk * batch, dtype=dt), torch.empty(kk, batch, classes, dtype=dt)
        # `head` (and `LeNetStep`): forward, loss and backward client by client in one call, float32 with the
        # native loss and steps, at most 4 layers: the operands as the kernel's struct, made once
        self.head_fn, self.head_args = None, None
        if native_loss and neg_lr is not None and len(ws) <= 4:
            self.head_fn = lib.dropfl_fc_head_f32
            pad = [0] * (4 - len(ws))
            self.head_args = _FcHead(
                len(ws), (ctypes.c_void_p * 4)(*self.w, *pad), (ctypes.c_void_p * 4)(*self.b, *pad),
                (ctypes.c_void_p * 4)(*(t.data_ptr() for t in self.out), *pad),
                (ctypes.c_void_p * 4)(*(t.data_ptr() for t in self.gin), *pad),
                (ctypes.c_int64 * 8)(*(d for fin_out in self.dims for d in fin_out), *pad, *pad),
                (ctypes.c_int64 * 4)(*blocks, *pad), self.g.data_ptr(), neg_lr, *self.sleef)

    @property
    def steps(self) -> bool:
        """Whether the backward and its plain SGD steps run here (made with an lr), else the caller's torch ops."""
        return self.neg_lr is not None

    def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The layers on x [k, B, in] (contiguous): the last layer's output [k, B, out] (the logits); `relu_out`
        then gives the layers' relu'd outputs, the next layers' inputs."""
        if x.shape != (k, self.batch, self.dims[0][0]) or not x.is_contiguous() or not 0 < k <= self.k_all:
            raise ValueError(f"FcLayers: x {tuple(x.shape)} for {k} clients: need contiguous "
                             f"[{k}, {self.batch}, {self.dims[0][0]}], at most {self.k_all} clients")
        self.x0, last = x, len(self.dims) - 1
        for i, (fin, fout) in enumerate(self.dims):
            src = x if i == 0 else self.out[i - 1]
            self.fwd_fn(src.data_ptr(), self.w[i], self.b[i], self.out[i].data_ptr(), k, self.batch, fin, fout,
                        int(i < last))
        return self.out[last][:k]

    def loss(self, logits: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_torch_loss` on `forward`'s logits [k, B, D] (targets [k·B] int64, dloss [k·B]): each row's cross-entropy
        [k·B] and the logits' gradient [k, B, D], natively where exact."""
        rows, classes = k * self.batch, self.dims[-1][1]
        if self.loss_fn is None:
            ce, g = _torch_loss(logits.reshape(rows, classes), target, dloss)
            return ce, g.view(k, self.batch, classes)
        _check_labels("FcLayers.loss", target, dloss, rows, logits.dtype)
        ce, g = self.ce[:rows], self.g[:k]
        _label_status("FcLayers.loss", self.loss_fn(logits.data_ptr(), target.data_ptr(), dloss.data_ptr(),
                                                    ce.data_ptr(), g.data_ptr(), rows, classes, *self.sleef), classes)
        return ce, g

    @property
    def fused(self) -> bool:
        """Whether `head` runs (the native loss and steps): else `forward`, `loss` and `backward`, one by one."""
        return self.head_fn is not None

    def head(self, x: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, `loss` and `backward` in one native call, client by client (a client's weights stay in cache
        from its forward to its backward: the same kernels on the same operands, the same bits): from x [k, B, in],
        targets [k·B] int64 and dloss [k·B], each row's cross-entropy [k·B] and the first layer's input gradient
        [k, B, in], every weight and bias stepped in place. Only where `fused`."""
        if self.head_fn is None:
            raise RuntimeError("FcLayers.head: needs the native loss and plain SGD steps (see `fused`)")
        rows = k * self.batch
        if x.shape != (k, self.batch, self.dims[0][0]) or not x.is_contiguous() or not 0 < k <= self.k_all:
            raise ValueError(f"FcLayers: x {tuple(x.shape)} for {k} clients: need contiguous "
                             f"[{k}, {self.batch}, {self.dims[0][0]}], at most {self.k_all} clients")
        _check_labels("FcLayers.head", target, dloss, rows, x.dtype)
        _label_status("FcLayers.head", self.head_fn(ctypes.byref(self.head_args), x.data_ptr(), target.data_ptr(),
                                                    dloss.data_ptr(), self.ce.data_ptr(), k, self.batch),
                      self.dims[-1][1])
        self.x0 = x
        return self.ce[:rows], self.gin[0][:k]

    def relu_out(self, i: int, k: int) -> torch.Tensor:
        """Layer i's output [k, B, out] of the last `forward` (relu'd for every layer but the last)."""
        return self.out[i][:k]

    def backward(self, g: torch.Tensor, k: int) -> torch.Tensor:
        """After `forward` of the same k clients: from the logits' gradient g [k, B, out], every layer's weight and
        bias stepped in place (w ← w − lr·∇w, b ← b − lr·∇b, reading each weight for its input gradient first) and
        the first layer's input gradient [k, B, in] returned."""
        if not self.steps:
            raise RuntimeError("FcLayers.backward: made without an lr (the caller's update runs the torch ops)")
        g = g.contiguous()
        last = len(self.dims) - 1
        if g.shape != (k, self.batch, self.dims[last][1]) or self.x0 is None or self.x0.shape[0] != k:
            raise ValueError(f"FcLayers: g {tuple(g.shape)} for {k} clients: need [{k}, {self.batch}, "
                             f"{self.dims[last][1]}] after forward() of the same clients")
        for i in range(last, -1, -1):
            fin, fout = self.dims[i]
            x = self.x0 if i == 0 else self.out[i - 1]   # the layer's input (relu'd where i > 0: its threshold)
            if self.bwd_fn(x.data_ptr(), g.data_ptr(), self.w[i], self.b[i], x.data_ptr() if i else None,
                           self.gin[i].data_ptr(), k, self.batch, fin, fout, self.neg_lr, self.blocks[i]) != 0:
                raise RuntimeError("FcLayers: the kernel refused the shape (fc_layer_exact and the kernel disagree)")
            g = self.gin[i][:k]
        return g


class LeNetStep:
    """The LeNet step by hand as one native call, client by client (conv_pool.cpp, `lenet_run`): for each client
    the two fused layers' forwards (`LeNetLayers`'), the fully connected layers' forward, loss, backward and steps
    (`FcLayers.head`), then the two fused layers' backwards, so that a client's operands stay in cache from its
    forward to its backward (layer after layer, a 15-client mimic-cnn step's passed through L2 several times). The
    same kernels on the same operands: the same bits. With `conv_steps`, each conv parameter's plain SGD step too,
    right after its client's backward (`sgd_update`'s, made only where `fused_update`: torch's add's bits), and
    `steps` runs a round's steps in one call; else the conv layers' gradients are left in `layers`' buffers
    (`LeNetLayers.views`) for the caller's steps. Made where `fc.fused` (float32, the native loss, plain SGD)."""

    def __init__(self, layers: LeNetLayers, fc: FcLayers, conv_steps: bool):
        if not fc.fused or fc.head_args is None or layers.y2.dtype != torch.float32 or layers.b != fc.batch:
            raise ValueError("LeNetStep: needs FcLayers with `fused` (float32, the native loss and steps) for the "
                             "same batch")
        b, h, wd, cin, o1, r, s = layers.dims1
        o2 = layers.dims2[4]
        if fc.dims[0][0] != layers.y2.shape[2] or fc.k_all != layers.k_all:
            raise ValueError(f"LeNetStep: the fully connected layers take {fc.dims[0][0]} inputs of {fc.k_all} "
                             f"clients, the second layer gives {layers.y2.shape[2]} of {layers.k_all}")
        self.layers, self.fc, self.conv_steps = layers, fc, conv_steps
        self.fn, self.steps_fn = fc.lib.dropfl_lenet_step_f32, fc.lib.dropfl_lenet_steps_f32
        self.args = _LeNetStep(layers.xs, layers.w1, layers.b1, layers.y1.data_ptr(), layers.arg1.data_ptr(),
                               layers.gh.data_ptr(), layers.gw1.data_ptr(), layers.gb1.data_ptr(), layers.w2,
                               layers.b2, layers.y2.data_ptr(), layers.arg2.data_ptr(), layers.gw2.data_ptr(),
                               layers.gb2.data_ptr(), b, h, wd, cin, o1, r, s, o2, int(layers.lanes),
                               int(conv_steps), None, fc.head_args)
        self.laps: torch.Tensor | None = None

    PARTS = ("conv1 fwd", "conv2 fwd", "fc fwd", "loss", "fc bwd", "conv2 bwd", "conv1 bwd", "conv steps")

    def time_parts(self) -> torch.Tensor:
        """From now on, add each part's seconds (`PARTS`, conv_pool.cpp's `Part`) to the float64 tensor returned
        (benchmarks/step_profile.py: where the step's time goes inside the one native call)."""
        self.laps = torch.zeros(len(self.PARTS), dtype=torch.float64)
        self.args.prof = self.laps.data_ptr()
        return self.laps

    def __call__(self, rows: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor, k: int) -> torch.Tensor:
        """One step of the first k clients on rows [k, B] (indices into x_all), targets [k·B] int64 and dloss [k·B]:
        each row's cross-entropy [k·B] (a view of a buffer the next call overwrites); every fully connected
        parameter stepped in place, and the conv layers' too with `conv_steps` (else their gradients are in
        `layers`' buffers)."""
        lay, fc = self.layers, self.fc
        n = k * fc.batch
        lay.check_step_rows("LeNetStep", rows, k)
        _check_labels("LeNetStep", target, dloss, n, torch.float32)
        _label_status("LeNetStep", self.fn(ctypes.byref(self.args), rows.data_ptr(), target.data_ptr(),
                                           dloss.data_ptr(), fc.ce.data_ptr(), k), fc.dims[-1][1])
        lay.rows, fc.x0 = rows, lay.y2[:k]
        return fc.ce[:n]

    def steps(self, rows: torch.Tensor, target: torch.Tensor, dloss: torch.Tensor, ks: list[int]) -> torch.Tensor:
        """A round's steps in one native call (with `conv_steps`): rows and targets [S, K, B] int64, dloss [S, K, B]
        float32 (K: all the clients), step j training the first ks[j] clients on row j of each. Returns each step's
        rows' cross-entropy [S, K, B] (0 past a step's clients)."""
        lay = self.layers
        shape = (len(ks), lay.k_all, lay.b)
        if not self.conv_steps:
            raise RuntimeError("LeNetStep.steps: made without conv_steps (the caller steps the conv layers)")
        if not (rows.shape == target.shape == dloss.shape == shape and rows.dtype == target.dtype == torch.int64
                and dloss.dtype == torch.float32 and rows.is_contiguous() and target.is_contiguous()
                and dloss.is_contiguous() and all(0 <= k <= lay.k_all for k in ks)):
            raise ValueError(f"LeNetStep.steps: rows {tuple(rows.shape)}, targets {tuple(target.shape)}, dloss "
                             f"{tuple(dloss.shape)} {dloss.dtype}: need contiguous {shape} int64, int64, float32")
        lay._check_rows(rows)
        ce = torch.zeros(shape, dtype=torch.float32)
        ks_t = torch.tensor(ks, dtype=torch.int64)
        _label_status("LeNetStep.steps", self.steps_fn(ctypes.byref(self.args), rows.data_ptr(), target.data_ptr(),
                                                       dloss.data_ptr(), ce.data_ptr(), ks_t.data_ptr(), len(ks),
                                                       lay.k_all), self.fc.dims[-1][1])
        return ce
