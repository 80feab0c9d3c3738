"""Simulation throughput on the MimiC FMNIST workload, side by side in one run (issue 4).

Workload: 30 clients × 2000 FMNIST samples, mimic-cnn (LeNet 6/16/120/84/10), batch 16, FedAvg,
full participation; a measured round is 625 steps per client, as in the paper (`--steps` to
shorten it; per-round costs then weigh more). Measured, interleaved over `--repeats`:

  loop    dropfl's reference engine: one client after another (SimTransport engine="loop")
  dropfl  dropfl's batched engine (SimTransport engine="batched": 2 worker processes)
  dropfl_torch_ops  the same engine with the LeNet's first two layers in torch ops instead of the
          fused native kernels (coordinator/kernels): what the kernels are worth, side by side
  flower  Flower's simulation engine (Ray, 2 actors × 1 CPU), from benchmarks/.venv-flower
          (created by benchmarks/setup_flower.sh; flwr is never a dropfl dependency)
  bound   FLOP bound: FLOPs of one training step counted with torch's FlopCounterMode,
          divided into the peak fp32 rate of a large matmul on the same threads

Prints client-steps/s and ratios; writes benchmarks/results/sim_throughput.json and .md.

    .venv/bin/python benchmarks/sim_throughput.py [--steps 625] [--repeats 3] [--flower-runs 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.sim.batched import BatchedEngine  # noqa: E402
from coordinator.sim.transport import SimTransport  # noqa: E402
from edge_client.datasets import load_fmnist  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask  # noqa: E402

HERE = Path(__file__).resolve().parent
FLOWER_PY = HERE / ".venv-flower" / "bin" / "python"
CLIENTS, SAMPLES, BATCH, PAPER_STEPS = 30, 2000, 16, 625


def federation() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ds = load_fmnist()
    perm = torch.randperm(len(ds.train), generator=torch.Generator().manual_seed(0))[:CLIENTS * SAMPLES]
    return [(ds.train.x[p].contiguous(), ds.train.y[p].contiguous()) for p in perm.view(CLIENTS, SAMPLES)]


def round_rate(transport: SimTransport, w: torch.Tensor, steps: int) -> float:
    tasks = [TrainTask(client=i, round=0, lr=0.01, batch_size=BATCH, steps=steps) for i in range(CLIENTS)]
    start = time.perf_counter()
    updates, _ = transport.run_round(0, w, tasks)
    seconds = time.perf_counter() - start
    assert len(updates) == CLIENTS and all(u.steps == steps for u in updates.values())
    return CLIENTS * steps / seconds


def flower_rate(data_dir: str, steps: int, rounds: int) -> dict:
    out = Path(data_dir) / "flower.json"
    cmd = [str(FLOWER_PY), str(HERE / "flower_sim.py"), "--data", data_dir, "--steps", str(steps),
           "--rounds", str(rounds), "--out", str(out)]
    # Ray starts its workers at niceness 15 by default; with other work on the machine that would
    # slow Flower down unfairly, so its actors run at the same priority as our processes.
    env = {**os.environ, "RAY_worker_niceness": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"Flower simulation failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def flops_per_step() -> int:
    """FLOPs of one SGD step (forward + backward) of mimic-cnn on a batch of 16, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode
    model = build_model("mimic-cnn", (1, 28, 28), 10)
    x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return int(counter.get_total_flops())


def peak_flops(n: int = 2048, reps: int = 10) -> float:
    """fp32 FLOP/s of an n×n matmul on torch's threads (best of `reps`)."""
    a, b = torch.rand(n, n), torch.rand(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=PAPER_STEPS,
                    help=f"local steps per client per measured round (default {PAPER_STEPS}, the paper's round)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of loop and dropfl")
    ap.add_argument("--flower-runs", type=int, default=2, help="Flower simulations (each: start-up + rounds)")
    ap.add_argument("--flower-rounds", type=int, default=3, help="rounds per Flower run (round 1 = warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.flower_runs and not FLOWER_PY.exists():
        subprocess.run(["sh", str(HERE / "setup_flower.sh")], check=True)

    data = federation()
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    loop = SimTransport(model, data, "loop")
    batched = SimTransport(model, data, "batched")
    torch_ops = SimTransport(model, data, "loop")
    torch_ops.batched = BatchedEngine(model, data, native=False)  # the batched engine without its kernels
    round_rate(batched, w, 2)  # start the worker processes
    round_rate(torch_ops, w, 2)
    tmp = tempfile.TemporaryDirectory(prefix="dropfl-flower-")
    for i, (x, y) in enumerate(data):
        torch.save({"x": x, "y": y}, os.path.join(tmp.name, f"client_{i}.pt"))

    samples: dict[str, list[float]] = {"loop": [], "dropfl": [], "dropfl_torch_ops": [], "flower": []}
    transports = {"loop": loop, "dropfl": batched, "dropfl_torch_ops": torch_ops}
    names = ["loop", "dropfl", "dropfl_torch_ops", "flower"]
    loads: list[tuple[str, float]] = []
    flower_runs: list[dict] = []
    for r in range(max(args.repeats, args.flower_runs)):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name == "flower" and (r >= args.flower_runs):
                continue
            if name != "flower" and r >= args.repeats:
                continue
            loads.append((name, os.getloadavg()[0]))
            if name == "flower":
                run = flower_rate(tmp.name, args.steps, args.flower_rounds)
                flower_runs.append(run)
                rate = run["client_steps_per_s"]
            else:
                rate = round_rate(transports[name], w, args.steps)
            samples[name].append(rate)
            print(f"repeat {r}: {name:16s} {rate:8.0f} client-steps/s   (load {loads[-1][1]:.2f})", flush=True)
    batched.batched.close()
    torch_ops.batched.close()

    flop = flops_per_step()
    peak = peak_flops()
    result: dict = {name: statistics.median(v) if v else None for name, v in samples.items()}
    result["bound"] = peak / flop
    result["ratio_vs_flower"] = result["dropfl"] / result["flower"] if result["flower"] else None
    result["ratio_vs_bound"] = result["dropfl"] / result["bound"]
    result["ratio_vs_loop"] = result["dropfl"] / result["loop"]
    result["native_kernel_speedup"] = result["dropfl"] / result["dropfl_torch_ops"]
    result["samples"] = samples
    result["setup"] = {
        "workload": f"MimiC FMNIST: {CLIENTS} clients x {SAMPLES} samples, mimic-cnn, batch {BATCH}, FedAvg, "
                    f"full participation; {args.steps} steps per client per measured round "
                    f"(paper: {PAPER_STEPS})",
        "statistic": "median over repeats; loop, dropfl and dropfl_torch_ops interleaved with the Flower runs",
        "threads": args.threads, "dropfl_workers": batched.batched.workers, "flower_actors": 2,
        "flower_worker_niceness": 0,
        "flops_per_step": flop, "peak_flops": peak, "peak_method": "2048x2048 fp32 matmul, best of 10",
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "flower": flower_runs,
        "load_avg_1min_at_each_measurement": loads, "load_avg_end": os.getloadavg(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "sim_throughput.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    s = r["setup"]

    def row(name: str, what: str) -> str:
        v = r[name]
        if v is None:
            return f"| {name} | {what} | not measured | | |\n"
        return f"| {name} | {what} | {v:,.0f} | {v / r['loop']:.2f} | {v / r['bound']:.1%} |\n"

    flower_ratio = f"{r['ratio_vs_flower']:.2f}×" if r["ratio_vs_flower"] else "n/a"
    return (
        "# Simulation throughput (benchmarks/sim_throughput.py)\n\n"
        f"{s['workload']}. {s['cpus']} CPUs, torch {s['torch']}, {s['threads']} threads; {s['statistic']}.\n"
        f"Measured {s['date']}; 1-min load average during the measurements: "
        f"{min(v for _, v in s['load_avg_1min_at_each_measurement']):.2f}–"
        f"{max(v for _, v in s['load_avg_1min_at_each_measurement']):.2f} (other work on the machine).\n\n"
        "| engine | what | client-steps/s | × loop | of FLOP bound |\n|---|---|---:|---:|---:|\n"
        + row("loop", "dropfl reference: per-client loop")
        + row("dropfl", f"dropfl batched engine, {s['dropfl_workers']} workers")
        + (row("dropfl_torch_ops", "the same, conv layers in torch ops (no native kernels)")
           if r.get("dropfl_torch_ops") else "")
        + row("flower", "Flower simulation (Ray, 2 actors × 1 CPU)")
        + row("bound", f"{s['peak_flops'] / 1e9:.0f} GFLOP/s ÷ {s['flops_per_step'] / 1e6:.1f} MFLOP/step")
        + f"\ndropfl / Flower: **{flower_ratio}**; dropfl / FLOP bound: **{r['ratio_vs_bound']:.1%}**; "
        f"native kernels: **{r['native_kernel_speedup']:.2f}×** the same engine in torch ops.\n"
    )


if __name__ == "__main__":
    main()
