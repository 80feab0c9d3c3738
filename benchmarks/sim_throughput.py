"""Simulation throughput on the MimiC FMNIST workload, side by side in one run (issues 4 and 16).

Workload: 30 clients × 2000 FMNIST samples, mimic-cnn (LeNet 6/16/120/84/10), batch 16, FedAvg,
full participation; a measured round is 625 steps per client, as in the paper (`--steps` to
shorten it; per-round costs then weigh more). Measured, interleaved over `--repeats`:

  loop    dropfl's reference engine: one client after another (SimTransport engine="loop")
  dropfl  dropfl's batched engine (SimTransport engine="batched": 2 worker processes), with the
          kernel variant this CPU gets by default (coordinator/sim/kernels: the widest it runs)
  dropfl_<variant>  the same engine forced to each other kernel variant this CPU runs (avx2,
          generic): what an AVX2-only or a baseline CPU's build does, on this machine
  dropfl_torch_ops  the same engine with the LeNet's first two layers in torch ops instead of the
          fused native kernels: what the kernels are worth, side by side
  agent   one edge agent's local training (edge_client.trainer.local_train, the agent's default 1
          torch thread), the same task on one client: the field agent's client-steps/s
  flower  Flower's simulation engine (Ray, 2 actors × 1 CPU), from benchmarks/.venv-flower
          (created by benchmarks/setup_flower.sh; flwr is never a dropfl dependency). Without that
          venv (or with --flower-runs 0) Flower is not measured, and the previous result file's
          Flower number is carried over as `flower_earlier`, marked as from an earlier run
  bound   FLOP bound: FLOPs of one training step counted with torch's FlopCounterMode,
          divided into the peak fp32 rate of a large matmul on the same threads (measured in
          every repeat, interleaved with the engines: the median)

Prints client-steps/s and ratios; writes benchmarks/results/sim_throughput.json and .md.

    .venv/bin/python benchmarks/sim_throughput.py [--steps 625] [--repeats 3] [--flower-runs 2]
"""

from __future__ import annotations

import argparse
import contextlib
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

# `--serve DIR` (the child process of `--before DIR`): import dropfl from DIR instead of this checkout
_SERVE = sys.argv[sys.argv.index("--serve") + 1] if "--serve" in sys.argv[:-1] else None
sys.path.insert(0, _SERVE or str(Path(__file__).resolve().parents[1]))

from coordinator.sim import kernels  # noqa: E402
from coordinator.sim.batched import BatchedEngine  # noqa: E402
from coordinator.sim.transport import SimTransport  # noqa: E402
from edge_client.datasets import load_fmnist  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402

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


def agent_rate(model: torch.nn.Module, w: torch.Tensor, data: list, steps: int, threads: int = 1) -> float:
    """One agent's round: `local_train` of client 0's task, on the agent's default torch threads (1)."""
    task = TrainTask(client=0, round=0, lr=0.01, batch_size=BATCH, steps=steps)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        result = local_train(model, w, *data[0], task)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(saved)
    assert result.steps == steps
    return steps / seconds


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


def serve(steps_in=sys.stdin, out=sys.stdout) -> None:
    """`--serve DIR`: the batched engine of the dropfl checkout in DIR (imported instead of this one) on the
    same workload; answers each line "<steps>" on stdin with "rate <client-steps/s>" (`--before`)."""
    data = federation()
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    transport = SimTransport(model, data, "batched")
    round_rate(transport, w, 2)  # start the worker processes
    import coordinator  # DIR's (sys.path above): the record says which code ran
    print(f"ready {transport.describe()} ({Path(coordinator.__file__).parent})", file=out, flush=True)
    for line in steps_in:
        print(f"rate {round_rate(transport, w, int(line))}", file=out, flush=True)
    transport.batched.close()


class Before:
    """The engine of another checkout (`--before DIR`), measured in a child process (`--serve DIR`): the
    code before a change, side by side with this checkout's in the same run."""

    def __init__(self, code: str, threads: int):
        if not (Path(code) / "coordinator" / "sim" / "batched.py").is_file():
            raise SystemExit(f"sim_throughput: error: --before {code}: no dropfl checkout there "
                             "(coordinator/sim/batched.py missing); use e.g. `git worktree add DIR <commit>`")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", code,
                                      "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.describe = self._reply("ready")

    def _reply(self, tag: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1:].strip()
        raise RuntimeError(f"--before: the child process ended (exit {self.proc.wait()}) before answering")

    def rate(self, steps: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self._reply("rate"))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


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
    ap.add_argument("--setup-flower", action="store_true",
                    help="create benchmarks/.venv-flower (setup_flower.sh) if it is missing; without it, a "
                         "missing venv means Flower is not measured")
    ap.add_argument("--before", metavar="DIR",
                    help="also measure the batched engine of the dropfl checkout in DIR (e.g. `git worktree add "
                         "DIR HEAD`, or a copy of coordinator/ and edge_client/ taken before a change), side by "
                         "side in this run, as dropfl_before (in a child process that imports DIR's code)")
    ap.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)   # the child process of --before
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        serve()
        return
    if args.flower_runs and not FLOWER_PY.exists() and args.setup_flower:
        subprocess.run(["sh", str(HERE / "setup_flower.sh")], check=True)
    flower_status = "measured" if args.flower_runs else "not measured: --flower-runs 0"
    if not FLOWER_PY.exists():
        flower_status = f"not measured: Flower is not installed ({FLOWER_PY.relative_to(HERE.parent)} missing)"
        print(f"{flower_status}; --setup-flower creates it. The previous result's Flower number is carried over, "
              "marked as from an earlier run", flush=True)
        args.flower_runs = 0

    data = federation()
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    loop = SimTransport(model, data, "loop")
    batched = SimTransport(model, data, "batched")       # the default: the CPU's best kernel variant
    transports = {"loop": loop, "dropfl": batched}
    default = batched.batched.native
    for v in [*kernels.cpu_variants(), False]:           # the other variants, and no kernels at all
        if v == default:
            continue
        t = SimTransport(model, data, "loop")
        t.batched = BatchedEngine(model, data, native=v)
        transports[f"dropfl_{v}" if v else "dropfl_torch_ops"] = t
    for name, t in transports.items():
        if name != "loop":
            round_rate(t, w, 2)  # start the worker processes
    engines = {name: t.describe() for name, t in transports.items()} | {"agent": "local_train, 1 thread"}
    before = Before(args.before, args.threads) if args.before else None
    if before:
        engines["dropfl_before"] = before.describe
    tmp = tempfile.TemporaryDirectory(prefix="dropfl-flower-")
    for i, (x, y) in enumerate(data):
        torch.save({"x": x, "y": y}, os.path.join(tmp.name, f"client_{i}.pt"))

    flop = flops_per_step()
    names = [*transports, *(["dropfl_before"] if before else []), "agent", "bound", "flower"]
    # (the bound too: the machine's load changes over the run)
    samples: dict[str, list[float]] = {name: [] for name in names}
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
            elif name == "agent":
                rate = agent_rate(model, w, data, args.steps)
            elif name == "bound":
                rate = peak_flops() / flop
            elif name == "dropfl_before":
                assert before is not None
                rate = before.rate(args.steps)
            else:
                rate = round_rate(transports[name], w, args.steps)
            samples[name].append(rate)
            print(f"repeat {r}: {name:16s} {rate:8.0f} client-steps/s   (load {loads[-1][1]:.2f})", flush=True)
    for t in transports.values():
        if t.batched is not None:
            t.batched.close()
    if before:
        before.close()

    result: dict = {name: statistics.median(v) if v else None for name, v in samples.items()}
    peak = result["bound"] * flop
    result["ratio_vs_flower"] = result["dropfl"] / result["flower"] if result["flower"] else None
    result["ratio_vs_bound"] = result["dropfl"] / result["bound"]
    result["ratio_vs_loop"] = result["dropfl"] / result["loop"]
    result["native_kernel_speedup"] = result["dropfl"] / result["dropfl_torch_ops"]
    result["ratio_agent_vs_loop"] = result["agent"] / result["loop"]
    if before:
        result["speedup_vs_before"] = result["dropfl"] / result["dropfl_before"]
        result["before_ratio_vs_bound"] = result["dropfl_before"] / result["bound"]
    if result["flower"] is None:   # not measured in this run: the previous result's number, marked as such
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            old = json.loads((Path(args.out) / "sim_throughput.json").read_text())
            earlier = old.get("flower_earlier") or {"client_steps_per_s": old["flower"], "date": old["setup"]["date"],
                                                    "bound": old["bound"], "loop": old["loop"]}
            if earlier["client_steps_per_s"]:
                result["flower_earlier"] = {**earlier, "note": "not measured in this run: Flower's number from "
                                            "an earlier run of this benchmark (other machine load), with that "
                                            "run's FLOP bound and loop"}
                # each normalised by its own run's FLOP bound: machine load differs between the runs
                result["ratio_vs_flower_earlier_bound_normalised"] = (
                    (result["dropfl"] / result["bound"]) / (earlier["client_steps_per_s"] / earlier["bound"]))
    result["samples"] = samples
    result["setup"] = {
        "workload": f"MimiC FMNIST: {CLIENTS} clients x {SAMPLES} samples, mimic-cnn, batch {BATCH}, FedAvg, "
                    f"full participation; {args.steps} steps per client per measured round "
                    f"(paper: {PAPER_STEPS})",
        "statistic": "median over repeats; every engine and the agent interleaved (rotating order), with the "
                     "Flower runs where measured",
        "engines": engines, "command": " ".join(["benchmarks/sim_throughput.py", *sys.argv[1:]]),
        "threads": args.threads, "dropfl_workers": batched.batched.workers, "flower_actors": 2,
        "flower_worker_niceness": 0, "flower_status": flower_status,
        "flops_per_step": flop, "peak_flops": peak,
        "peak_method": "2048x2048 fp32 matmul, best of 10, measured once per repeat (median)",
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

    def row(name: str, what: str, v: float | None = None, loop: float | None = None, bound: float | None = None) -> str:
        v = r[name] if v is None else v
        if v is None:
            return f"| {name} | {what} | not measured | | |\n"
        return f"| {name} | {what} | {v:,.0f} | {v / (loop or r['loop']):.2f} | {v / (bound or r['bound']):.1%} |\n"

    variants = [n for n in s["engines"] if n.startswith("dropfl_") and n not in ("dropfl_torch_ops", "dropfl_before")]
    earlier = r.get("flower_earlier")
    if r["flower"]:
        flower_row = row("flower", "Flower simulation (Ray, 2 actors × 1 CPU)")
        flower_ratio = f"dropfl / Flower: **{r['ratio_vs_flower']:.2f}×**"
    elif earlier:
        flower_row = row("flower", f"Flower simulation — {s.get('flower_status', 'not measured')}. **Its number "
                         f"from an earlier run**, {earlier['date']} (× loop and of FLOP bound: that run's)",
                         earlier["client_steps_per_s"], earlier["loop"], earlier["bound"])
        flower_ratio = (f"dropfl / Flower: {r['ratio_vs_flower_earlier_bound_normalised']:.2f}× (**not side by "
                        "side**: each as a fraction of its own run's FLOP bound)")
    else:
        flower_row, flower_ratio = row("flower", "Flower simulation"), "dropfl / Flower: n/a"
    return (
        "# Simulation throughput (benchmarks/sim_throughput.py)\n\n"
        f"`{s.get('command', 'benchmarks/sim_throughput.py')}`\n\n"
        f"{s['workload']}. {s['cpus']} CPUs, torch {s['torch']}, {s['threads']} threads; {s['statistic']}.\n"
        f"Measured {s['date']}; 1-min load average during the measurements: "
        f"{min(v for _, v in s['load_avg_1min_at_each_measurement']):.2f}–"
        f"{max(v for _, v in s['load_avg_1min_at_each_measurement']):.2f} (other work on the machine).\n\n"
        "| engine | what | client-steps/s | × loop | of FLOP bound |\n|---|---|---:|---:|---:|\n"
        + row("loop", "dropfl reference: per-client loop")
        + row("dropfl", f"dropfl batched engine, {s['dropfl_workers']} workers: `{s['engines']['dropfl']}` "
                        "(this CPU's default)")
        + "".join(row(n, f"the same, kernel variant forced: `{s['engines'][n]}`") for n in variants)
        + (row("dropfl_torch_ops", "the same, conv layers in torch ops (no native kernels)")
           if r.get("dropfl_torch_ops") else "")
        + (row("dropfl_before", f"the batched engine before the change: `{s['engines']['dropfl_before']}`")
           if r.get("dropfl_before") else "")
        + row("agent", "one edge agent: `local_train`, 1 thread (edge_client; one client's round)")
        + flower_row
        + row("bound", f"{s['peak_flops'] / 1e9:.0f} GFLOP/s ÷ {s['flops_per_step'] / 1e6:.1f} MFLOP/step")
        + f"\n{flower_ratio}; dropfl / FLOP bound: **{r['ratio_vs_bound']:.1%}**; "
        f"native kernels: **{r['native_kernel_speedup']:.2f}×** the same engine in torch ops"
        + (f"; dropfl / dropfl_before: **{r['speedup_vs_before']:.3f}×** (the same run, interleaved)"
           if r.get("speedup_vs_before") else "") + ".\n"
    )


if __name__ == "__main__":
    main()
