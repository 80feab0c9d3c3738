"""The engine on a GPU: the benchmark of record's three workloads (sim_throughput.py --workload) on CUDA, side by
side in one run with the same machine's CPU and Flower's simulation on the same GPU; and what `--sim-device auto`
picks against what was measured faster (issue 38).

Engines, each workload, interleaved over `--repeats` (client-steps/s of a round, after a warm-up round):

  loop      dropfl's per-client loop on the CPU (SimTransport engine="loop", torch's default threads: every core)
  cpu       the engine `--sim-device cpu` trains: mimic-fmnist the hand-written batched engine (native kernels,
            one slice per core), the others the generic engine (2 slices, 2 worker processes; `choose_mode`)
  cuda      the engine `--sim-device cuda` trains: mimic-fmnist the hand-written batched forward on the GPU
            (BatchedEngine), the others the generic engine (vmap over the round's clients, one computation)
  generic_cuda  mimic-fmnist only: the generic engine on the GPU, what a user's LeNet without a hand-written forward
            gets
  flower    Flower 1.41's simulation (flower_sim.py --device cuda: `--flower-actors` Ray actors share the GPU,
            num_gpus 1/actors each), with `--flower-python` (a Python that imports flwr and ray)

and for every registered model (`--models`, a short task: 30 clients x 200 samples, batch 16, 10 steps, vgg11 2)
its `cpu` and `cuda` engines, to check `--sim-device auto`'s choice for each. Data are random everywhere
(FMNIST-shaped for mimic-fmnist and the FMNIST models: a step's time does not depend on the pixels). Also: the
GPU's fp32 matmul rate (TF32 off, as the engine runs it), each workload's FLOP bound on it, and a torch.profiler
profile of one GPU round (kernel launches per client-step, the GPU's busy time against the round's wall time).

Writes gpu_throughput.json and .md to `--out` (default benchmarks/results). Needs a GPU that torch sees.

    python benchmarks/gpu_throughput.py [--repeats 3] [--flower-python PY] [--flower-actors 4] [--budget 600]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_throughput as st  # noqa: E402  (puts the repository on sys.path)
from machine import cpu_model  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402

from coordinator.sim.batched import BatchedEngine  # noqa: E402
from coordinator.sim.functional import GenericEngine  # noqa: E402
from coordinator.sim.transport import SimTransport  # noqa: E402
from edge_client.models import MODELS, build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask  # noqa: E402

MODEL_SHAPES = {"cifar-lenet": (3, 32, 32), "vgg11": (3, 32, 32)}   # the others: FMNIST's (1, 28, 28)
MODEL_STEPS = {"vgg11": 2}   # the auto check's local steps (default 10): vgg11's round on the CPU takes seconds


def sim(model: torch.nn.Module, data: list, device: str) -> SimTransport:
    """The transport `dropfl sim --sim-device DEVICE` trains with (coordinator/sim/run.py: --slices auto)."""
    return SimTransport(model, data, "batched", make_engine=functools.partial(BatchedEngine, groups=0, device=device),
                        device=device)


def engines(name: str, model: torch.nn.Module, data: list) -> dict[str, SimTransport]:
    ts = {"loop": SimTransport(model, data, "loop"), "cpu": sim(model, data, "cpu"), "cuda": sim(model, data, "cuda")}
    if name == "mimic-fmnist":
        ts["generic_cuda"] = SimTransport(model, data, "batched",
                                          make_engine=lambda m, d: GenericEngine(m, d, "cuda"))
    return ts


def gpu_peak(n: int = 8192, reps: int = 10) -> float:
    """fp32 FLOP/s of an n x n matmul on the GPU with TF32 off (the engine's setting), the best of `reps`."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a, b = torch.rand(n, n, device="cuda"), torch.rand(n, n, device="cuda")
        a @ b
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return 2 * n ** 3 / best
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def profile_gpu_round(t: SimTransport, w: torch.Tensor, wl: Workload, steps: int) -> dict:
    """One round on the GPU under torch.profiler: kernel launches per client-step and the GPU's busy time (the sum
    of its kernels' times) against the round's wall time: where a round is launch-bound, busy << wall."""
    from torch.profiler import ProfilerActivity, profile
    clients = st.cohort(wl, 2000)
    tasks = [TrainTask(client=c, round=2000, lr=wl.lr, batch_size=wl.batch, steps=steps) for c in clients]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        t.run_round(2000, w, tasks)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in kernels) / 1e6
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name] = top.get(e.name, 0.0) + e.device_time_total / 1e6
    return {"wall_s": wall, "gpu_busy_s": busy, "kernels": len(kernels),
            "kernels_per_step": len(kernels) / steps, "client_steps": len(tasks) * steps,
            "top_kernels": [{"kernel": k[:90], "gpu_s": v} for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]]}


def flower(py: str, name: str, wl: Workload, data: list, rounds: int, actors: int, timeout: float) -> dict:
    """Flower's simulation of the workload with its actors sharing the GPU (sim_throughput.flower_rate)."""
    with tempfile.TemporaryDirectory() as folder:
        st.write_clients(folder, data)
        return st.flower_rate(folder, wl.steps, rounds, name, wl.batch, wl.lr,
                              wl.per_round if wl.per_round < wl.clients else 0, timeout, python=py, device="cuda",
                              actors=actors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", help="names from benchmarks/workloads.py, comma-separated, or all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flower-python", default=None, help="a Python that imports flwr and ray (default: none)")
    ap.add_argument("--flower-actors", type=int, default=4)
    ap.add_argument("--flower-rounds", type=int, default=3)
    ap.add_argument("--flower-workloads", default="all", help="the workloads Flower runs (comma-separated, or all)")
    ap.add_argument("--models", default="all", help="registered models for the auto check (comma-separated, all, "
                                                    "or none)")
    ap.add_argument("--budget", type=float, default=1200,
                    help="seconds: what is not started by then is recorded as not measured")
    ap.add_argument("--out", default=str(st.HERE / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: error: torch sees no GPU here; run it on a machine with one")
    t0 = time.perf_counter()

    def left() -> float:
        return args.budget - (time.perf_counter() - t0)

    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    peak = gpu_peak()
    print(f"GPU {torch.cuda.get_device_name()}: fp32 matmul (TF32 off) {peak / 1e12:.1f} TFLOP/s; host CPU "
          f"{cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    result: dict = {"setup": {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "gpu_fp32_flops": peak, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(), "repeats": args.repeats, "flower_actors": args.flower_actors,
        "data": "random (FMNIST- or CIFAR-shaped)"}, "workloads": {}, "models": {}}

    for name in names:
        wl = WORKLOADS[name]
        model = st.workload_model(name, wl)
        data = st.synthetic_data(wl.clients, wl.samples, wl.shape)
        w = get_flat(model)
        ts = engines(name, model, data)
        auto = sim(model, data, "auto")   # where --sim-device auto trains it here
        rec: dict = {"engines": {e: {"describe": t.describe(), "rates": []} for e, t in ts.items()},
                     "auto": auto.describe(), "steps": wl.steps,
                     "client_steps_per_round": min(wl.per_round, wl.clients) * wl.steps}
        auto.close()
        for t in ts.values():   # warm-up: worker start-up, CUDA context, kernel builds
            st.train_rate(t, w, wl, st.cohort(wl, 0), 0, 1)
        for r in range(args.repeats):
            if left() < 0:
                rec["cut_short"] = f"budget reached after {r} repeats"
                break
            order = list(ts)[r % len(ts):] + list(ts)[:r % len(ts)]
            for e in order:
                rate = st.train_rate(ts[e], w, wl, st.cohort(wl, r + 1), r + 1, wl.steps)
                rec["engines"][e]["rates"].append(rate)
        for v in rec["engines"].values():
            v["client_steps_per_s"] = statistics.median(v["rates"]) if v["rates"] else None
        flops = st.flops_per_step(model, wl.shape, wl.batch)
        rec["flops_per_step"] = flops
        best = rec["engines"]["cuda"]["client_steps_per_s"]
        rec["cuda_of_gpu_bound"] = best * flops / peak if best else None
        try:
            rec["profile"] = profile_gpu_round(ts["cuda"], w, wl, wl.steps)
        except Exception as ex:   # noqa: BLE001 - a profiler failure is recorded, the rates stand
            rec["profile"] = {"error": f"{type(ex).__name__}: {ex}"}
        for t in ts.values():
            t.close()
        if args.flower_python and args.flower_workloads not in ("all", "") and \
                name not in args.flower_workloads.split(","):
            rec["flower"] = {"client_steps_per_s": None, "error": "not measured: not in --flower-workloads"}
        elif args.flower_python and left() > 60:
            try:
                run = flower(args.flower_python, name, wl, data, args.flower_rounds, args.flower_actors,
                             timeout=max(left(), 60))
                rec["flower"] = {"client_steps_per_s": run["client_steps_per_s"], "rounds": run["rounds"],
                                 "total_seconds": run["total_seconds"], "actors": args.flower_actors}
            except Exception as ex:   # noqa: BLE001 - recorded as not measured, with why
                rec["flower"] = {"client_steps_per_s": None, "error": f"{type(ex).__name__}: {str(ex)[-1500:]}"}
        else:
            rec["flower"] = {"client_steps_per_s": None,
                             "error": "not measured: " + ("no --flower-python" if not args.flower_python
                                                          else "time budget spent")}
        result["workloads"][name] = rec
        print(name, {e: round(v["client_steps_per_s"] or 0, 1) for e, v in rec["engines"].items()},
              "flower", rec["flower"].get("client_steps_per_s"), "auto:", rec["auto"], flush=True)

    models = [] if args.models == "none" else (list(MODELS.names()) if args.models == "all"
                                               else args.models.split(","))
    short = Workload(30, 30, 200, 16, 10, 0.01, (1, 28, 28), True)
    for m in models:
        if left() < 30:
            result["models"][m] = {"error": "not measured: time budget spent"}
            continue
        shape = MODEL_SHAPES.get(m, (1, 28, 28))
        wl = dataclasses.replace(short, steps=MODEL_STEPS.get(m, short.steps), shape=shape)
        model = build_model(m, shape, 10, seed=0)
        data = st.synthetic_data(wl.clients, wl.samples, shape)
        w = get_flat(model)
        row: dict = {"shape": list(shape), "steps": wl.steps}
        auto = sim(model, data, "auto")
        row["auto"] = auto.describe()
        auto.close()
        for dev in ("cpu", "cuda"):
            t = sim(model, data, dev)
            st.train_rate(t, w, wl, st.cohort(wl, 0), 0, 1)
            rates = [st.train_rate(t, w, wl, st.cohort(wl, r), r, wl.steps) for r in (1, 2)]
            row[dev] = {"describe": t.describe(), "client_steps_per_s": statistics.median(rates)}
            t.close()
        row["faster"] = "cuda" if row["cuda"]["client_steps_per_s"] > row["cpu"]["client_steps_per_s"] else "cpu"
        result["models"][m] = row
        print(m, row, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_throughput.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_throughput.md").write_text(markdown(result))
    print(markdown(result))


def _rate(v: float | None) -> str:
    return "-" if not v else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def markdown(r: dict) -> str:
    s = r["setup"]
    lines = [f"# The engine on a GPU ({s['date'][:10]})", "",
             f"GPU: {s['gpu']} (torch {s['torch']}, CUDA {s['cuda']}; fp32 matmul with TF32 off: "
             f"{s['gpu_fp32_flops'] / 1e12:.1f} TFLOP/s); host: {s['cpu']} ({s['isa']}), {s['cpus']} CPUs. "
             f"Client-steps/s, the median of {s['repeats']} interleaved rounds after a warm-up; data "
             f"{s['data']}. `benchmarks/gpu_throughput.py`.", "",
             "| workload | loop (CPU) | cpu engine | cuda engine | generic on cuda | Flower on the GPU "
             f"({s['flower_actors']} actors) | cuda × loop | cuda × cpu | cuda × Flower | of GPU bound | auto trains |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, w in r["workloads"].items():
        e = {k: v["client_steps_per_s"] for k, v in w["engines"].items()}
        fl = w["flower"].get("client_steps_per_s")
        bound = w.get("cuda_of_gpu_bound")
        lines.append(f"| {name} | {_rate(e['loop'])} | {_rate(e['cpu'])} | {_rate(e['cuda'])} | "
                     f"{_rate(e.get('generic_cuda'))} | {_rate(fl)} | {_ratio(e['cuda'], e['loop'])} | "
                     f"{_ratio(e['cuda'], e['cpu'])} | {_ratio(e['cuda'], fl)} | "
                     f"{'-' if bound is None else f'{100 * bound:.2f} %'} | {w['auto']} |")
    lines += ["", "Engines as they ran:", ""]
    for name, w in r["workloads"].items():
        lines.append(f"- {name}: " + "; ".join(f"{k} = `{v['describe']}`" for k, v in w["engines"].items()))
        if w["flower"].get("error"):
            lines.append(f"  Flower: {w['flower']['error'].splitlines()[0][:300]}")
    lines += ["", "One round on the GPU (`cuda` engine) under torch.profiler:", "",
              "| workload | wall (s) | GPU busy (s) | busy share | kernels per local step | top kernels |",
              "|---|---:|---:|---:|---:|---|"]
    for name, w in r["workloads"].items():
        p = w.get("profile", {})
        if "error" in p:
            lines.append(f"| {name} | - | - | - | - | {p['error'][:120]} |")
            continue
        top = ", ".join(f"{k['kernel'][:40]} {100 * k['gpu_s'] / p['gpu_busy_s']:.0f} %" for k in p["top_kernels"][:3])
        lines.append(f"| {name} | {p['wall_s']:.3f} | {p['gpu_busy_s']:.3f} | "
                     f"{100 * p['gpu_busy_s'] / p['wall_s']:.0f} % | {p['kernels_per_step']:.0f} | {top} |")
    if r["models"]:
        lines += ["", "Every registered model, a short task (30 clients × 200 samples, batch 16, 10 steps; vgg11 2): "
                  "where `--sim-device auto` trains it against what was faster:", "",
                  "| model | cpu engine | cuda engine | faster | auto trains |", "|---|---:|---:|---|---|"]
        for m, row in r["models"].items():
            if "error" in row:
                lines.append(f"| {m} | - | - | - | {row['error']} |")
                continue
            lines.append(f"| {m} | {_rate(row['cpu']['client_steps_per_s'])} | "
                         f"{_rate(row['cuda']['client_steps_per_s'])} | {row['faster']} | {row['auto']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
