"""Where vmap pays: the generic engine's two ways to compute a slice, side by side, one thread each.

For models of several sizes, one slice of clients (batch 16 unless said, a few steps each) trained
- `vmap`: `FunctionalEngine` (torch.func: one computation of the slice's clients per step), and
- `per-client`: `local_train` client after client (what `PerClientEngine` runs, without its channels-last
  copies of big max pools),
interleaved over 3 repeats (median), with each model's training FLOPs per sample (FlopCounterMode). The lines
of `choose_mode` (coordinator/sim/functional.py: PER_CLIENT_FLOPS_PER_SAMPLE, PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE)
are drawn from this table.

    .venv/bin/python benchmarks/generic_mode.py     # writes benchmarks/results/generic_mode.md
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import workloads  # noqa: E402
from test_functional_engine import TinyCNN, TinyMLP, TinyResNet  # noqa: E402

from coordinator.sim import functional  # noqa: E402
from coordinator.sim.functional import FunctionalEngine, choose_mode, training_flops  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402


def measure(model, shape, clients=15, samples=64, batch=16, steps=8, repeats=3):
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(samples, *shape, generator=g), torch.randint(0, 10, (samples,), generator=g))
            for _ in range(clients)]
    tasks = [TrainTask(client=c, round=1, lr=0.05, batch_size=batch, steps=steps, seed=9) for c in range(clients)]
    w = get_flat(model)
    engine = FunctionalEngine(model, data, device="cpu", threads=1)
    plain = copy.deepcopy(model)
    vm, tp, pc = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.run(w, tasks)
        vm.append(time.perf_counter() - t0)
        with torchs_pool_rule():
            t0 = time.perf_counter()
            engine.run(w, tasks)
            tp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tasks:
            local_train(plain, w, *data[t.client], t)
        pc.append(time.perf_counter() - t0)
    steps_all = clients * steps
    return (training_flops(model, data[0][0][:2]), steps_all / sorted(vm)[repeats // 2],
            steps_all / sorted(tp)[repeats // 2], steps_all / sorted(pc)[repeats // 2])


@contextlib.contextmanager
def torchs_pool_rule():
    """The vmap engine without its pooling rule (`functional._ClientPooling`): torch's own batching rule."""
    saved = functional._ClientPooling
    functional._ClientPooling = contextlib.nullcontext
    try:
        yield
    finally:
        functional._ClientPooling = saved


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = [
        ("tests' TinyMLP (64-32-10)", TinyMLP(), (1, 8, 8), {}),
        ("tests' TinyCNN (4/8 channels, 14×14)", TinyCNN(), (1, 14, 14), {}),
        ("tests' TinyResNet (width 4, 3×8×8, BatchNorm)", TinyResNet(), (3, 8, 8), {}),
        ("dropfl `logreg` (FMNIST 1×28×28)", build_model("logreg", (1, 28, 28)), (1, 28, 28), {}),
        ("dropfl `mlp` (FMNIST 1×28×28)", build_model("mlp", (1, 28, 28)), (1, 28, 28), {}),
        ("mimic-cnn's LeNet (FMNIST 1×28×28)", workloads.build("mimic-fmnist"), (1, 28, 28), {}),
        ("dropfl `fdms-cnn` (MNIST 1×28×28)", build_model("fdms-cnn", (1, 28, 28)), (1, 28, 28), {}),
        ("dropfl `cifar-lenet` (3×32×32)", build_model("cifar-lenet", (3, 32, 32)), (3, 32, 32), {}),
        ("tests' TinyResNet width 8, 3×16×16", TinyResNet(8), (3, 16, 16), {}),
        ("tests' TinyResNet width 16, 3×16×16", TinyResNet(16), (3, 16, 16), {"clients": 10, "steps": 4}),
        ("tests' TinyResNet width 8, 3×32×32", TinyResNet(8), (3, 32, 32), {"clients": 10, "steps": 4}),
        ("ResNet-8 (examples, 3×32×32, BatchNorm)", workloads.build("resnet8-cifar"), (3, 32, 32),
         {"clients": 10, "steps": 3}),
        ("pfl's simple_cnn (3×32×32), batch 10", workloads.PflCNN(), (3, 32, 32),
         {"clients": 10, "samples": 50, "batch": 10, "steps": 3}),
    ]
    rows = []
    load = os.getloadavg()[0]
    for name, model, shape, kw in cases:
        (f, conv), vm, tp, pc = measure(model, shape, **kw)
        pick = choose_mode(model, torch.rand(2, *shape), torch.device("cpu"))[0]
        rows.append((name, f, f"{100 * conv / f:.0f}%", vm, tp, pc, pick))
        print(f"{name}: {f / 1e6:.2f} MFLOP/sample, vmap {vm:.1f} (torch's pool rule {tp:.1f}), per-client {pc:.1f} "
              f"client-steps/s; the rule picks {pick}", flush=True)
    from sim_throughput import cpu_model
    lines = ["# The generic engine's two modes, side by side (benchmarks/generic_mode.py)", "",
             f"CPU: {cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), 1 torch thread; torch "
             f"{torch.__version__}. 1-min load {load:.2f} before, {os.getloadavg()[0]:.2f} after. Measured "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}.", "",
             "One slice of clients (15, batch 16, 8 steps, unless said) trained by `FunctionalEngine` (vmap, one "
             "computation per step; also with torch's own batching rule for max pooling instead of the engine's "
             "`_ClientsMaxPool`) and by `local_train` client after client; median of 3 interleaved repeats. "
             "The rule (`choose_mode`): per-client from "
             f"{functional.PER_CLIENT_FLOPS_PER_SAMPLE / 1e6:g} MFLOP per sample (training FLOPs, FlopCounterMode), "
             f"and from {functional.PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE / 1e6:g} for a model with at most half of "
             "them in convolutions; else vmap.", "",
             "| model | MFLOP / sample | in convolutions | vmap client-steps/s | vmap, torch's pool rule "
             "| per-client client-steps/s | vmap ÷ per-client | rule picks |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, f, conv, vm, tp, pc, pick in rows:
        lines.append(f"| {name} | {f / 1e6:.2f} | {conv} | {vm:,.1f} | {tp:,.1f} | {pc:,.1f} | {vm / pc:.2f} "
                     f"| {pick} |")
    out = ROOT / "benchmarks" / "results" / "generic_mode.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
