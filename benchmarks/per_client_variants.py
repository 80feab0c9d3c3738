"""Per-client mode's step computed other ways: channels-last and `torch.compile`, their speed and their precision.

The generic engine trains a big convolutional model client by client with `local_train` on one thread (per-client
mode: eager torch ops on NCHW tensors, the reference loop's bits). This measures one client's SGD steps through
`local_train` on one thread, computed seven ways:

- `eager, NCHW`: the model and images as they are (the loop's computation; per-client mode's for a model
  without BatchNorm);
- `channels-last`: the model's parameters and the images channels-last (`.to(memory_format=...)`), so every
  convolution, BatchNorm, ReLU and pool runs on NHWC tensors (oneDNN's NHWC convolutions);
- `channels-last, BatchNorm input NCHW`: as above, each BatchNorm given its input made contiguous (the generic
  engine's `channels_last.nchw_input`, its fix for the same precision loss under vmap);
- `channels-last, BatchNorm in torch ops`: as `channels-last`, each BatchNorm computed by torch ops (`var_mean`
  over (N, H, W), normalise, scale; autograd differentiates them) instead of torch's BatchNorm kernel;
- `channels-last, BatchNorm summed in double`: what per-client mode runs for a Conv2d-BatchNorm model
  (`coordinator/sim/channels_last.channels_last_copy`: the parameters channels-last, each BatchNorm2d summing its
  statistics and gradients in double, the native kernels where they build; the images as they are);
- `channels-last, BatchNorm summed in double (torch backend)`: the same with the reference backend (torch ops on a
  float64 copy of each batch), what runs where the kernels do not build;
- `torch.compile`: the NCHW model wrapped in `torch.compile` (TorchInductor, default mode: forward and backward
  compiled; the loss and the SGD step as `local_train` has them), its first call timed apart with an empty inductor
  cache (a temporary `TORCHINDUCTOR_CACHE_DIR`).

The process keeps freed memory, as the engine's worker processes do (`batched._keep_freed_memory`). Speed:
client-steps/s, median of interleaved repeats (each repeat runs every variant once, in rotating order).
Precision: after `--steps` steps from the same weights and buffers, the float32 update's distance from the float64
update of the eager NCHW computation, ‖Δ32 − Δ64‖ / ‖Δ64‖, the median over `--clients` clients (each its own data
and batch order), and how many clients were farther than FAR: at a near-tie float32 rounding can send a client's
training another way than float64's, in any variant (1e-3 to 1e-2 after 3 steps on ResNet-8 here).

    .venv/bin/python benchmarks/per_client_variants.py   # writes benchmarks/results/per_client_variants.{md,json}
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dropfl-inductor-"))

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import unittest.mock  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import workloads  # noqa: E402
from machine import cpu_model  # noqa: E402
from test_functional_engine import TinyResNet  # noqa: E402

from coordinator.sim import channels_last  # noqa: E402
from coordinator.sim.batched import _keep_freed_memory  # noqa: E402
from edge_client.models import SeededDropout, get_buffers, get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402

FAR = 1e-4   # a client's update this far from float64 went another way at a near-tie (a ReLU's, a pool's)
VARIANTS = ("eager, NCHW", "channels-last", "channels-last, BatchNorm input NCHW",
            "channels-last, BatchNorm in torch ops", "channels-last, BatchNorm summed in double",
            "channels-last, BatchNorm summed in double (torch backend)", "torch.compile")
MODELS = {   # name: (builder, input shape, batch, lr)
    "resnet8-cifar (ResNet-8, BatchNorm)": (lambda: workloads.build("resnet8-cifar"), (3, 32, 32), 16, 0.05),
    "tests' TinyResNet width 8, 3×32×32 (BatchNorm)": (lambda: TinyResNet(8), (3, 32, 32), 16, 0.05),
    "pfl-cifar10 (pfl's CNN, no BatchNorm)":
        (lambda: workloads.build("pfl-cifar10", dropout=SeededDropout), (3, 32, 32), 10, 0.1),
}


def _ops_batchnorm(bn: nn.BatchNorm2d) -> Callable[[torch.Tensor], torch.Tensor]:
    """`bn`'s training forward in torch ops: batch statistics by `var_mean`, running statistics as torch's."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0, keepdim=True)
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            bn.running_mean.mul_(1 - bn.momentum).add_(mean.reshape(-1), alpha=bn.momentum)
            bn.running_var.mul_(1 - bn.momentum).add_(var.reshape(-1) * (n / max(n - 1, 1)), alpha=bn.momentum)
            bn.num_batches_tracked.add_(1)
        shape = (1, -1, 1, 1)
        return (x - mean) * torch.rsqrt(var + bn.eps) * bn.weight.reshape(shape) + bn.bias.reshape(shape)
    return forward


def variant(model: nn.Module, name: str) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """A copy of `model` as variant `name` computes it, and how that variant holds the images."""
    m = copy.deepcopy(model)
    if name == "eager, NCHW":
        return m, lambda x: x
    if name == "torch.compile":
        m.compile()   # in place: its parameters' and buffers' names stay the model's
        return m, lambda x: x
    if "summed in double" in name:
        m = channels_last.channels_last_copy(model)
        if name.endswith("(torch backend)"):   # the reference backend: each forward told there is no library
            forward = m.forward

            def torch_backend(x: torch.Tensor) -> torch.Tensor:
                with unittest.mock.patch.object(channels_last, "_native", lambda: None):
                    return forward(x)   # (the backward uses what each forward chose)
            m.forward = torch_backend
        return m, lambda x: x   # the images as they are, as the engine trains
    m = m.to(memory_format=torch.channels_last)
    for layer in m.modules():
        if isinstance(layer, nn.BatchNorm2d) and name.endswith("input NCHW"):
            channels_last.nchw_input(layer)
        elif isinstance(layer, nn.BatchNorm2d) and name.endswith("torch ops"):
            layer.forward = _ops_batchnorm(layer)
    return m, lambda x: x.contiguous(memory_format=torch.channels_last)


def measure(label: str, clients: int, samples: int, steps: int, speed_steps: int, repeats: int) -> dict:
    build, shape, batch, lr = MODELS[label]
    torch.manual_seed(0)
    model = build()
    w, b0 = get_flat(model), get_buffers(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(samples, *shape, generator=g), torch.randint(0, 10, (samples,), generator=g))
            for _ in range(clients)]

    def task(c: int, n: int) -> TrainTask:
        return TrainTask(client=c, round=1, lr=lr, batch_size=batch, steps=n, seed=3)

    models = {name: variant(model, name) for name in VARIANTS}
    first_call = {}
    for name, (m, layout) in models.items():   # the first call: compilation, oneDNN's primitives, the allocator
        t0 = time.perf_counter()
        local_train(m, w, layout(data[0][0]), data[0][1], task(0, 1), buffers=b0)
        first_call[name] = time.perf_counter() - t0
    # precision: each variant's float32 update against the float64 eager NCHW update, client by client, each from
    # the same weights and buffers
    m64 = copy.deepcopy(model).double()
    b64 = {k: v.double() if v.is_floating_point() else v for k, v in b0.items()}
    ref = [local_train(m64, w.double(), x.double(), y, task(c, steps), buffers=b64).delta
           for c, (x, y) in enumerate(data)]
    distance = {}
    for name, (m, layout) in models.items():
        d = [float((local_train(m, w, layout(x), y, task(c, steps), buffers=b0).delta.double() - ref[c]).norm()
                   / ref[c].norm()) for c, (x, y) in enumerate(data)]
        distance[name] = {"median": sorted(d)[len(d) // 2], "far": sum(v > FAR for v in d)}
    # speed: interleaved repeats, every variant once per repeat in rotating order
    seconds = {name: [] for name in VARIANTS}
    for r in range(repeats):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            m, layout = models[name]
            x, y = data[r % clients]
            x = layout(x)
            t0 = time.perf_counter()
            local_train(m, w, x, y, task(r, speed_steps), buffers=b0)
            seconds[name].append(time.perf_counter() - t0)
    rate = {name: speed_steps / sorted(s)[len(s) // 2] for name, s in seconds.items()}
    return {"model": label, "batch": batch, "lr": lr, "steps": steps, "clients": clients,
            "first_call_s": first_call, "client_steps_per_s": rate, "distance_from_float64": distance}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8, help="clients of the precision check (median)")
    ap.add_argument("--steps", type=int, default=3, help="SGD steps of the precision check")
    ap.add_argument("--speed-steps", type=int, default=20, help="SGD steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=10, help="timed repeats of each variant (median)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "per_client_variants")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _keep_freed_memory()   # as the engine's workers do (no page faults on each step's buffers)
    load0 = os.getloadavg()[0]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for label in MODELS:
        print(f"{label} ...", flush=True)
        rows.append(measure(label, args.clients, 64, args.steps, args.speed_steps, args.repeats))
    load1 = os.getloadavg()[0]
    meta = {"cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})", "torch": torch.__version__,
            "threads": 1, "measured": when, "load_before": load0, "load_after": load1,
            "command": " ".join(["python benchmarks/per_client_variants.py", *sys.argv[1:]])}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Per-client mode's step computed other ways (benchmarks/per_client_variants.py)", "",
             f"CPU: {meta['cpu']}, 1 torch thread; torch {meta['torch']}. 1-min load {load0:.2f} before, "
             f"{load1:.2f} after. Measured {when}.", "",
             f"`.venv/bin/python {meta['command'].removeprefix('python ')}`", "",
             "One client's SGD steps through `local_train` on one thread (what per-client mode runs), seven ways "
             f"(the script's docstring says each); speed: median of {args.repeats} interleaved repeats of "
             f"{args.speed_steps} steps; first call: one step, `torch.compile`'s compilation with an empty cache; "
             f"precision: the float32 update after {args.steps} steps against the float64 eager NCHW update, "
             f"‖Δ32 − Δ64‖ / ‖Δ64‖, median of {args.clients} clients, and how many of them were farther than "
             f"{FAR:g} (in the precise variants a near-tie gone another way: such a client is 1e-3 to 1e-2 off "
             "whatever the computation).", "",
             f"| model | variant | first call s | client-steps/s | × eager NCHW | distance from float64 (median) | "
             f"× eager NCHW's | clients farther than {FAR:g} |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate, dist, first = row["client_steps_per_s"], row["distance_from_float64"], row["first_call_s"]
        base = VARIANTS[0]
        for name in VARIANTS:
            lines.append(f"| {row['model']} (batch {row['batch']}) | {name} | {first[name]:.2f} | "
                         f"{rate[name]:,.1f} | {rate[name] / rate[base]:.2f} | {dist[name]['median']:.1e} | "
                         f"{dist[name]['median'] / dist[base]['median']:,.1f} | {dist[name]['far']} of "
                         f"{row['clients']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
