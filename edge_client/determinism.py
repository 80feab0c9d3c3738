"""Deterministic GPU arithmetic: the settings a CUDA training run needs to be exact and repeatable.

On a CPU, PyTorch's kernels are deterministic and compute in full precision. On CUDA, by default:
float32 matmuls and convolutions may run in TF32 (10-bit mantissa: the batched engine would no longer
agree with the reference loop to float32 rounding), cuDNN may pick a different convolution algorithm
from one run to the next by timing them (`benchmark`), and some kernels accumulate with atomics in
an unspecified order. `cuda_deterministic()` turns all of that off, for the simulation's batched
engine (coordinator/sim/batched.py) and, later, the device agent on a GPU board (which is why it lives
on the device side: edge_client never imports coordinator).
"""

from __future__ import annotations

import contextlib
import os

import torch

# cuBLAS is only deterministic with a fixed workspace; PyTorch reads this when it creates its cuBLAS
# handle and, in deterministic mode, refuses cuBLAS calls without it.
CUBLAS_WORKSPACE = ":4096:8"


def cuda_deterministic() -> None:
    """No TF32, no cuDNN autotuning, deterministic algorithms only (an op without a deterministic CUDA
    implementation then raises instead of silently varying). Process-wide and idempotent; call it
    before the first CUDA computation (sets CUBLAS_WORKSPACE_CONFIG if unset)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def is_cuda(device: str | torch.device | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


@contextlib.contextmanager
def settings_restored():
    """Run a block, then put back the process-wide settings `cuda_deterministic` changes (TF32, cuDNN,
    deterministic algorithms): for tests and callers that must leave the process as they found it."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
         torch.backends.cudnn.deterministic) = saved[:4]
        torch.use_deterministic_algorithms(saved[4])
