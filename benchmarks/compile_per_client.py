"""`torch.compile` in per-client mode: the model compiled, one client's SGD steps through `local_train`.

The generic engine trains a big convolutional model client by client with `local_train` on one thread (per-client
mode, eager torch ops: the reference loop's bits). This measures the same training with the model wrapped in
`torch.compile` (TorchInductor, its default mode; forward and backward compiled, the SGD step and the loss as
`local_train` has them), against eager, on one thread:

- compile time: the first client's first call, with an empty inductor cache (a temporary `TORCHINDUCTOR_CACHE_DIR`);
- speed: client-steps/s, median of interleaved repeats (each repeat runs both, in alternating order);
- precision: after `--steps` steps, each one's float32 update against the float64 eager update,
  ‖Δ32 − Δ64‖ / ‖Δ64‖, the median over `--clients` clients, and how many clients were farther than FAR (a near-tie
  gone another way than float64's: 1e-3 to 1e-2 after 3 steps on ResNet-8, compiled or not).

    .venv/bin/python benchmarks/compile_per_client.py   # writes benchmarks/results/compile_per_client.{md,json}
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
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import workloads  # noqa: E402
from machine import cpu_model  # noqa: E402
from test_functional_engine import TinyResNet  # noqa: E402

from edge_client.models import SeededDropout, get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402

FAR = 1e-4
MODELS = {   # name: (builder, input shape, batch, lr)
    "resnet8-cifar (ResNet-8, BatchNorm)": (lambda: workloads.build("resnet8-cifar"), (3, 32, 32), 16, 0.05),
    "tests' TinyResNet width 8, 3×32×32 (BatchNorm)": (lambda: TinyResNet(8), (3, 32, 32), 16, 0.05),
    "pfl-cifar10 (pfl's CNN, SeededDropout)":
        (lambda: workloads.build("pfl-cifar10", dropout=SeededDropout), (3, 32, 32), 10, 0.1),
}


def measure(label: str, clients: int, samples: int, steps: int, speed_steps: int, repeats: int) -> dict:
    build, shape, batch, lr = MODELS[label]
    torch.manual_seed(0)
    model = build()
    w = get_flat(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(samples, *shape, generator=g), torch.randint(0, 10, (samples,), generator=g))
            for _ in range(clients)]

    def task(c: int, n: int) -> TrainTask:
        return TrainTask(client=c, round=1, lr=lr, batch_size=batch, steps=n, seed=3)

    eager, compiled = copy.deepcopy(model), torch.compile(copy.deepcopy(model))
    t0 = time.perf_counter()
    local_train(compiled, w, *data[0], task(0, 1))
    compile_s = time.perf_counter() - t0
    m64 = copy.deepcopy(model).double()
    dist = {"eager": [], "compiled": []}
    for c, (x, y) in enumerate(data):
        ref = local_train(m64, w.double(), x.double(), y, task(c, steps)).delta
        for name, m in (("eager", eager), ("compiled", compiled)):
            delta = local_train(m, w, x, y, task(c, steps)).delta.double()
            dist[name].append(float((delta - ref).norm() / ref.norm()))
    local_train(eager, w, *data[0], task(0, 2))   # warm up
    seconds = {"eager": [], "compiled": []}
    for r in range(repeats):
        order = (("eager", eager), ("compiled", compiled))
        for name, m in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            local_train(m, w, *data[r % clients], task(r, speed_steps))
            seconds[name].append(time.perf_counter() - t0)
    rate = {k: speed_steps / sorted(v)[len(v) // 2] for k, v in seconds.items()}
    return {"model": label, "batch": batch, "lr": lr, "steps": steps, "clients": clients, "compile_s": compile_s,
            "client_steps_per_s": rate,
            "distance_from_float64": {k: {"median": sorted(v)[len(v) // 2], "far": sum(d > FAR for d in v)}
                                      for k, v in dist.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8, help="clients of the precision check (median)")
    ap.add_argument("--steps", type=int, default=3, help="SGD steps of the precision check")
    ap.add_argument("--speed-steps", type=int, default=20, help="SGD steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=8, help="timed repeats of each (median)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_per_client")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for label in MODELS:
        print(f"{label} ...", flush=True)
        rows.append(measure(label, args.clients, 64, args.steps, args.speed_steps, args.repeats))
    load1 = os.getloadavg()[0]
    meta = {"cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})", "torch": torch.__version__,
            "threads": 1, "measured": when, "load_before": load0, "load_after": load1,
            "command": " ".join(["python benchmarks/compile_per_client.py", *sys.argv[1:]])}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# `torch.compile` in per-client mode (benchmarks/compile_per_client.py)", "",
             f"CPU: {meta['cpu']}, 1 torch thread; torch {meta['torch']}. 1-min load {load0:.2f} before, "
             f"{load1:.2f} after. Measured {when}.", "",
             f"`.venv/bin/python {meta['command'].removeprefix('python ')}`", "",
             "One client's SGD steps through `local_train` on one thread (what per-client mode runs), the model "
             "eager and wrapped in `torch.compile` (inductor, default mode); compile: the first call, empty inductor "
             f"cache; speed: median of {args.repeats} interleaved repeats of {args.speed_steps} steps; precision: "
             f"the float32 update after {args.steps} steps against the float64 eager update, median of "
             f"{args.clients} clients, and how many were farther than {FAR:g} (near-ties gone another way).", "",
             "| model | compile s | eager client-steps/s | compiled client-steps/s | compiled × eager | "
             "eager from float64 (far) | compiled from float64 (far) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        rate, dist = row["client_steps_per_s"], row["distance_from_float64"]
        lines.append(f"| {row['model']} (batch {row['batch']}) | {row['compile_s']:.1f} | {rate['eager']:,.1f} | "
                     f"{rate['compiled']:,.1f} | {rate['compiled'] / rate['eager']:.2f} | "
                     f"{dist['eager']['median']:.1e} ({dist['eager']['far']} of {row['clients']}) | "
                     f"{dist['compiled']['median']:.1e} ({dist['compiled']['far']} of {row['clients']}) |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
