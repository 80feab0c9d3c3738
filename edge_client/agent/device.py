"""Where the agent trains: `[agent] device` / `--device auto|cpu|cuda`.

`resolve` turns the choice into a torch device at the agent's start, before anything else is loaded:
`auto` is CUDA where `torch.cuda.is_available()` (a Jetson with JetPack's torch, a PC with a GPU), else
the CPU; `cuda` on a machine without CUDA is refused (AgentError, one line, exit 2) rather than silently
training on the CPU. On CUDA it applies the simulation's deterministic settings
(edge_client/determinism.py `cuda_deterministic`: no TF32, no cuDNN autotuning, deterministic kernels),
so an agent's update on a GPU is repeatable bit for bit and equals the CPU computation to float32
rounding (docs/engine.md "CUDA"; tests/test_agent_device.py).

`place` moves the model and the training shard to the device once, at start. Everything else stays on
the CPU: the global weights arrive and the update leaves as CPU float32 (edge_client/wire.py),
`local_train` copies the weights in and the delta out, batch orders and dropout masks are drawn on the
CPU generator (so they are the same on every device), and evaluation runs in onnxruntime on the CPU.

Default `cpu`: a field trial's updates then equal the simulation's bit for bit on any machine, and N
agents of one `dropfl trial` do not each take a CUDA context on a shared GPU; a GPU board opts in.
"""

from __future__ import annotations

import torch

from edge_client.agent.config import DEVICES, AgentError
from edge_client.determinism import cuda_deterministic, is_cuda


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU"


def resolve(choice: str) -> torch.device:
    """The device `choice` (one of DEVICES) means on this machine; sets deterministic CUDA if it is CUDA."""
    if choice not in DEVICES:
        raise AgentError(f"agent.device must be one of: {', '.join(DEVICES)} (got {choice!r}); "
                         f"set [agent] device or --device")
    if choice == "cuda" and not torch.cuda.is_available():
        raise AgentError(f"device cuda (--device or [agent] device): {_why_no_cuda()}; use cpu or auto, "
                         f"or install a CUDA build of torch (docs/devices.md)")
    device = torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")
    if is_cuda(device):
        cuda_deterministic()
    return device


def describe(device: torch.device) -> str:
    """For the log: `cpu`, or `cuda (NVIDIA H100 80GB HBM3, CUDA 13.0)`."""
    if not is_cuda(device):
        return "cpu"
    return f"cuda ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})"


def place(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
          device: torch.device) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model and the training shard on `device` (the same objects on the CPU: nothing copied)."""
    return model.to(device), x.to(device), y.to(device)
