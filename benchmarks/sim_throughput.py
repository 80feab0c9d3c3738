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

`--workload mimic-fmnist,resnet8-cifar,pfl-cifar10` (or `all`): the engine's benchmark of record instead, the
listed workloads of benchmarks/workloads.py side by side in one run, every engine of every workload interleaved
(rotating order) over `--repeats`; `--steps` there overrides each workload's local steps (the table's otherwise):

  mimic-fmnist   mimic-cnn on real FMNIST, 30 clients x 2000 samples, all per round, batch 16, 50 steps
  resnet8-cifar  the examples package's ResNet-8 with BatchNorm, CIFAR-shaped synthetic data [3, 32, 32],
                 10 classes, 20 clients x 160 samples, all per round, batch 16, 5 steps
  pfl-cifar10    pfl-research's CIFAR-10 benchmark setup: its CNN (workloads.PflCNN, with dropfl's
                 SeededDropout), synthetic CIFAR-shaped data, 1,000 clients x 50 samples, 50 sampled per
                 round, batch 10, 5 steps (one epoch)

  loop       dropfl's per-client loop (SimTransport engine="loop"), --threads torch threads
  generic    the generic engine (coordinator/sim/functional.py GenericEngine), the one SimTransport runs for a
             model without a hand-written batched forward: the round in 2 slices, in 2 worker processes of 1
             thread, each slice in the mode its rule picks for the model (`choose_mode`: vmap over the clients
             with torch.func, or per client with local_train); on mimic-fmnist forced in (make_engine)
  generic_vmap  the same engine held to vmap (mode="vmap"): what torch.func gives where the rule chose per-client
  loop_1t    the loop on 1 torch thread (where --threads is not 1): on a loaded machine an OpenMP team of 2
             threads waits for its slower thread at every op
  generic_1t the generic engine's computation (FunctionalEngine) of the whole round in this process, 1 thread
  generic_sliced  the same engine given the round's clients in run_round calls of --generic-slice (0: off)
             clients: what a smaller computation per call would give (a setting of the benchmark)
  native     mimic-fmnist only: the hand-written batched engine with its native kernels (this CPU's default)
  torch_ops  mimic-fmnist only: the hand-written batched engine in torch ops (no native kernels)
  flower     Flower 1.41's simulation (flower_sim.py in benchmarks/.venv-flower; --setup-flower creates it)
  pfl        pfl-research 0.6 (pfl_sim.py in benchmarks/.venv-pfl; --setup-pfl creates it, or records pip's
             error where pfl does not install beside torch 2.13), one process, --pfl-threads (1) threads
  bound      the FLOP bound: FlopCounterMode FLOPs of one step ÷ the peak rate on all the machine's CPUs, the
             faster of a 2048x2048 matmul (MKL) and a big 3x3 convolution (oneDNN) (each repeat)

plus a torch.profiler profile of one generic round of each workload, in the mode the engine ran (top ops by self
CPU time and their split by kind). Writes benchmarks/results/sim_throughput_workloads.json and .md (the default mode's
files are left as they are).

    .venv/bin/python benchmarks/sim_throughput.py --workload all [--repeats 2] [--flower-runs 2]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import signal
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

from machine import cpu_model  # noqa: E402
from workloads import WORKLOADS, PflCNN, Workload, resnet8  # noqa: E402

from coordinator.sim import kernels  # noqa: E402
from coordinator.sim.batched import BatchedEngine  # noqa: E402
from coordinator.sim.functional import FunctionalEngine, GenericEngine  # noqa: E402
from coordinator.sim.transport import SimTransport  # noqa: E402
from edge_client.datasets import load_fmnist  # noqa: E402
from edge_client.models import SeededDropout, build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask, local_train  # noqa: E402

HERE = Path(__file__).resolve().parent
FLOWER_PY = HERE / ".venv-flower" / "bin" / "python"
PFL_PY = HERE / ".venv-pfl" / "bin" / "python"
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


def run_framework(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run another framework's script; past `timeout` seconds its whole process group (Ray's too) is killed and a
    RuntimeError says so (a hung simulation is a fault of the run, recorded as such, never a rate)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"{Path(cmd[1]).name} did not finish within {timeout:.0f} s (its process group was "
                           f"killed):\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def flower_rate(data_dir: str, steps: int, rounds: int, workload: str = "mimic-fmnist", batch: int = BATCH,
                lr: float = 0.01, per_round: int = 0, timeout: float | None = None, python: str = str(FLOWER_PY),
                device: str = "cpu", actors: int = 2) -> dict:
    """flower_sim.py with `python` (default: benchmarks/.venv-flower's) on the clients in `data_dir`."""
    out = Path(data_dir) / "flower.json"
    cmd = [python, str(HERE / "flower_sim.py"), "--data", data_dir, "--steps", str(steps),
           "--rounds", str(rounds), "--out", str(out), "--workload", workload, "--batch", str(batch),
           "--lr", str(lr), "--per-round", str(per_round), "--device", device, "--actors", str(actors)]
    # Ray starts its workers at niceness 15 by default; with other work on the machine that would
    # slow Flower down unfairly, so its actors run at the same priority as our processes.
    env = {**os.environ, "RAY_worker_niceness": "0"}
    proc = run_framework(cmd, env, timeout)
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


def flops_per_step(model: torch.nn.Module | None = None, shape: tuple[int, ...] = (1, 28, 28),
                   batch: int = BATCH) -> int:
    """FLOPs of one SGD step (forward + backward) of `model` (default mimic-cnn) on a batch, counted by torch."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode
    model = build_model("mimic-cnn", (1, 28, 28), 10) if model is None else copy.deepcopy(model).train()
    x, y = torch.rand(batch, *shape), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return int(counter.get_total_flops())


# The peak the FLOP bound divides by: the faster of two big fp32 kernels on torch's threads. One library's kernel
# alone is not the CPU's peak everywhere: on an AMD EPYC Zen 5 (AVX-512 with full-width FMA units) MKL's sgemm ran
# its 2048² matmul at 113 GFLOP/s on one thread, the AVX2 rate, while oneDNN's 3×3 convolution below ran at 258
# (and the native LeNet kernels beat the matmul's "bound": 121 % of it in the benchmark of record there).
PEAK_METHOD = ("the faster of a 2048x2048 fp32 matmul (MKL) and a 3x3 convolution, 8x256x32x32 -> 256 channels "
               "(oneDNN), best of 10 each on torch's threads")


def peak_flops(n: int = 2048, reps: int = 10) -> float:
    """fp32 FLOP/s of the faster of two big kernels on torch's threads, best of `reps` each (`PEAK_METHOD`)."""
    a, b = torch.rand(n, n), torch.rand(n, n)
    x, w = torch.rand(8, 256, 32, 32), torch.rand(256, 256, 3, 3)
    kernels = ((lambda: a @ b, 2 * n ** 3),
               (lambda: torch.nn.functional.conv2d(x, w, padding=1), 2 * 8 * 32 * 32 * 256 * 256 * 9))
    rate = 0.0
    for run, flops in kernels:
        run()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        rate = max(rate, flops / best)
    return rate

# -- the benchmark of record: three workloads side by side (--workload) -------------------------------------------

def workload_data(name: str, wl: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The workload's clients' data: real FMNIST (mimic-fmnist, as the default mode) or CIFAR-shaped random
    images in [0, 1) with random labels of 10 classes (seeded)."""
    return federation() if not wl.synthetic else synthetic_data(wl.clients, wl.samples, wl.shape)


def synthetic_data(clients: int, samples: int, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`clients` clients of `samples` random images of `shape` in [0, 1), random labels of 10 classes (seeded)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(clients, samples, *shape, generator=g)
    y = torch.randint(0, 10, (clients, samples), generator=g)
    return [(x[i], y[i]) for i in range(clients)]


def write_clients(folder: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The clients' data as the other frameworks' scripts load it: `folder`/client_<i>.pt = {"x", "y"} (clones: a
    view would save the whole federation's storage)."""
    for i, (x, y) in enumerate(data):
        torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(folder, f"client_{i}.pt"))


def workload_model(name: str, wl: Workload) -> torch.nn.Module:
    """dropfl's model of the workload: the registered mimic-cnn; the examples package's ResNet-8; pfl's CNN with
    SeededDropout (dropfl's dropout, whose masks every engine replays)."""
    if name == "mimic-fmnist":
        return build_model("mimic-cnn", wl.shape, 10, seed=0)
    torch.manual_seed(0)
    return resnet8(3, 10) if name == "resnet8-cifar" else PflCNN(dropout=SeededDropout)


def dropfl_engines(name: str, model: torch.nn.Module, data: list, threads: int) -> dict[str, SimTransport]:
    """loop and generic for every workload; the hand-written batched engine (native kernels, torch ops) where the
    model has one (mimic-cnn). The generic engine is the one SimTransport picks for a model without a hand-written
    forward; mimic-cnn has one, so there it is handed in as the engine (make_engine). Where `threads` is not 1,
    also the loop and the generic engine on 1 thread (`loop_1t`, `generic_1t`)."""
    ts = {"loop": SimTransport(model, data, "loop")}
    if threads != 1:
        ts["loop_1t"] = SimTransport(model, data, "loop")
        ts["generic_1t"] = SimTransport(model, data, "batched",
                                        make_engine=lambda m, d: FunctionalEngine(m, d, "cpu", threads=1))
    if name == "mimic-fmnist":
        ts["generic"] = SimTransport(model, data, "batched", make_engine=lambda m, d: GenericEngine(m, d, "cpu"))
        ts["generic_vmap"] = SimTransport(model, data, "batched",
                                          make_engine=lambda m, d: GenericEngine(m, d, "cpu", mode="vmap"))
        ts["native"] = SimTransport(model, data, "batched")
        t = SimTransport(model, data, "loop")
        t.batched = BatchedEngine(model, data, native=False)
        ts["torch_ops"] = t
    else:
        ts["generic"] = SimTransport(model, data, "batched", device="cpu")
        ts["generic_vmap"] = SimTransport(model, data, "batched",
                                          make_engine=lambda m, d: GenericEngine(m, d, "cpu", mode="vmap"))
    for e in ("generic", "generic_vmap", "generic_1t"):
        if e in ts and not ts[e].describe().startswith(("batched (torch.func)", "batched (per client")):
            raise SystemExit(f"sim_throughput: error: {name}: the generic engine did not start "
                             f"(SimTransport runs {ts[e].describe()!r}); see the warning above")
    return ts


def engine_threads(e: str, t: SimTransport, threads: int) -> str:
    """How an engine's computation is spread: worker processes (1 thread each), or the threads of this process."""
    if t.batched is None:   # the loop: this process's threads when it runs
        return f", {1 if e == 'loop_1t' else threads} thread(s)"
    d = t.batched.details()
    if d.get("workers"):
        return f", {d['workers']} worker processes x 1 thread"
    return f", {d.get('threads', threads)} thread(s)"


def cohort(wl: Workload, r: int) -> list[int]:
    """Round r's clients: all of them, or `per_round` drawn without replacement (seeded by r)."""
    if wl.per_round >= wl.clients:
        return list(range(wl.clients))
    return sorted(random.Random(r).sample(range(wl.clients), wl.per_round))


def train_rate(t: SimTransport, w: torch.Tensor, wl: Workload, clients: list[int], r: int, steps: int,
               slice_: int = 0) -> float:
    """Client-steps/s of round r's clients; `slice_` > 0: the tasks in `run_round` calls of that many clients
    (the generic engine trains each call as one computation)."""
    tasks = [TrainTask(client=c, round=r, lr=wl.lr, batch_size=wl.batch, steps=steps) for c in clients]
    size = slice_ or len(tasks)
    start = time.perf_counter()
    updates = {}
    for at in range(0, len(tasks), size):
        updates |= t.run_round(r, w, tasks[at:at + size])[0]
    seconds = time.perf_counter() - start
    assert len(updates) == len(tasks) and all(u.steps == steps for u in updates.values())
    return len(tasks) * steps / seconds


def pfl_rate(data_dir: str, name: str, wl: Workload, steps: int, rounds: int, threads: int,
             timeout: float | None = None) -> dict:
    out = Path(data_dir) / "pfl.json"
    cmd = [str(PFL_PY), str(HERE / "pfl_sim.py"), "--data", data_dir, "--workload", name, "--steps", str(steps),
           "--batch", str(wl.batch), "--lr", str(wl.lr), "--per-round", str(wl.per_round), "--rounds", str(rounds),
           "--threads", str(threads), "--out", str(out)]
    proc = run_framework(cmd, None, timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"pfl simulation failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def framework_status(py: Path, setup: str, wanted: bool, runs: int, what: str) -> str:
    """'measured', or why not: no runs asked for, the venv missing, or its setup script's failure (pip's error)."""
    if not runs:
        return f"not measured: --{what}-runs 0" if what == "flower" else "not measured: --pfl-runs 0"
    if not py.exists() and wanted:
        proc = subprocess.run(["sh", str(HERE / setup)], capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                      if ln.strip() and not ln.startswith("WARNING: Location")]
            return f"not measured: benchmarks/{setup} failed (exit {proc.returncode}): " + " | ".join(errors[-12:])
    if not py.exists():
        return f"not measured: {os.path.relpath(py, HERE.parent)} missing (--setup-{what} runs benchmarks/{setup})"
    return "measured"


PHASES = [   # op kinds of the profile, by the name of the aten op (self CPU time: no op counted twice)
    ("convolution (forward, backward)", ("convolution", "mkldnn_conv", "conv2d", "conv_depthwise")),
    ("matmul (linear layers)", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul")),
    ("batch norm", ("batch_norm",)),
    ("max-pool", ("pool",)),
    ("dropout masks (rand >= p, per client)", ("aten::uniform_", "aten::rand", "aten::ge")),
    ("batch orders (randperm)", ("aten::randperm",)),
    ("copies, gathers, layout", ("aten::copy_", "aten::index", "aten::index_select", "aten::clone", "aten::cat",
                                 "aten::stack", "aten::_to_copy", "aten::contiguous", "aten::index_put_",
                                 "aten::fill_", "aten::zero_")),
]


def _op_matches(op: str, key: str) -> bool:
    """An aten op name against a PHASES key: "aten::x" keys name one op exactly, the others are parts of names."""
    return op == key if key.startswith("aten::") else key in op


def profile_generic(t: SimTransport, w: torch.Tensor, wl: Workload, steps: int) -> dict:
    """One generic round under torch.profiler: the top ops by self CPU time, their split by kind, and the round's
    wall time against the ops' total (the rest: Python and torch.func's dispatch between ops, on the calling
    thread; profiling overhead included)."""
    from torch.profiler import ProfilerActivity, profile
    clients = cohort(wl, 1000)
    tasks = [TrainTask(client=c, round=1000, lr=wl.lr, batch_size=wl.batch, steps=steps) for c in clients]
    engine = getattr(t.batched, "local", None)   # GenericEngine: its computation, in this process (1 thread)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        if engine is not None:
            engine.run(w, tasks)
        else:
            t.run_round(1000, w, tasks)
        wall = time.perf_counter() - start
    avgs = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in avgs) / 1e6
    top = sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:12]
    phases: dict[str, float] = {}
    for e in avgs:
        kind = next((k for k, keys in PHASES if any(_op_matches(e.key, key) for key in keys)),
                    "elementwise and other ops")
        phases[kind] = phases.get(kind, 0.0) + e.self_cpu_time_total / 1e6
    return {"mode": getattr(engine, "mode", None), "wall_s": wall, "ops_self_cpu_s": total,
            "outside_ops_s": max(wall - total, 0.0),
            "client_steps": len(tasks) * steps,
            "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
                         "share_of_wall": e.self_cpu_time_total / 1e6 / wall} for e in top],
            "by_kind": {k: {"self_cpu_s": v, "share_of_wall": v / wall}
                        for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}}


def run_workloads(args: argparse.Namespace) -> None:
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    for n in names:
        if n not in WORKLOADS:
            raise SystemExit(f"sim_throughput: error: --workload {n}: unknown; one of {', '.join(WORKLOADS)} "
                             "(comma-separated) or all")
    load_before = os.getloadavg()
    started = time.perf_counter()
    if args.flower_runs and args.setup_flower and not FLOWER_PY.exists():
        subprocess.run(["sh", str(HERE / "setup_flower.sh")], check=False)
    flower_status = framework_status(FLOWER_PY, "setup_flower.sh", args.setup_flower, args.flower_runs, "flower")
    pfl_status = framework_status(PFL_PY, "setup_pfl.sh", args.setup_pfl, args.pfl_runs, "pfl")
    print(f"flower: {flower_status}\npfl: {pfl_status}", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="dropfl-workloads-")
    setups: dict[str, dict] = {}
    for name in names:
        wl = WORKLOADS[name]
        steps = args.steps or wl.steps
        data = workload_data(name, wl)
        model = workload_model(name, wl)
        w = get_flat(model)
        ts = dropfl_engines(name, model, data, args.threads)
        for e, t in ts.items():   # warm-up: worker processes, allocator, oneDNN primitives
            if e != "loop":
                train_rate(t, w, wl, cohort(wl, 0), 0, 2)
        folder = os.path.join(tmp.name, name)
        os.makedirs(folder)
        write_clients(folder, data)
        flop = flops_per_step(model, wl.shape, wl.batch)
        sliced = ["generic_sliced"] if 0 < args.generic_slice < min(wl.per_round, wl.clients) else []
        engines = [*ts, *sliced, *(["flower"] if flower_status == "measured" else []),
                   *(["pfl"] if pfl_status == "measured" else []), "bound"]
        setups[name] = {"wl": wl, "steps": steps, "w": w, "ts": ts, "folder": folder, "flop": flop,
                        "params": w.numel(), "engines": engines, "samples": {e: [] for e in engines},
                        "runs": {"flower": [], "pfl": []}, "failed": {}, "loads": []}
        print(f"{name}: {w.numel():,} parameters, {flop / 1e6:.1f} MFLOP/step, engines "
              + ", ".join(f"{e}={t.describe()}" for e, t in ts.items()), flush=True)
    for r in range(args.repeats):
        for name in names:
            s = setups[name]
            wl, steps, engines = s["wl"], s["steps"], s["engines"]
            for e in engines[r % len(engines):] + engines[:r % len(engines)]:
                runs = args.flower_runs if e == "flower" else args.pfl_runs if e == "pfl" else args.repeats
                if r >= runs or e in s["failed"]:
                    continue
                s["loads"].append((e, os.getloadavg()[0]))
                try:
                    if e == "flower":
                        run = flower_rate(s["folder"], steps, args.flower_rounds, name, wl.batch, wl.lr,
                                          wl.per_round if wl.per_round < wl.clients else 0, args.framework_timeout)
                    elif e == "pfl":
                        run = pfl_rate(s["folder"], name, wl, steps, args.flower_rounds, args.pfl_threads,
                                       args.framework_timeout)
                except RuntimeError as err:   # recorded, not retried: the other engines go on
                    s["failed"][e] = str(err)
                    print(f"{name}: {e} failed: {err}", flush=True)
                    continue
                if e in ("flower", "pfl"):
                    s["runs"][e].append(run)
                    rate = run["client_steps_per_s"]
                elif e == "bound":   # the machine's: the peak kernels on all its CPUs
                    torch.set_num_threads(os.cpu_count() or 1)
                    try:
                        rate = peak_flops() / s["flop"]
                    finally:
                        torch.set_num_threads(args.threads)
                elif e == "generic_sliced":
                    rate = train_rate(s["ts"]["generic"], s["w"], wl, cohort(wl, r + 1), r + 1, steps,
                                      args.generic_slice)
                elif e == "loop_1t":   # the loop runs on the calling thread's setting
                    torch.set_num_threads(1)
                    try:
                        rate = train_rate(s["ts"][e], s["w"], wl, cohort(wl, r + 1), r + 1, steps)
                    finally:
                        torch.set_num_threads(args.threads)
                else:
                    rate = train_rate(s["ts"][e], s["w"], wl, cohort(wl, r + 1), r + 1, steps)
                s["samples"][e].append(rate)
                print(f"repeat {r}: {name:14s} {e:10s} {rate:9.1f} client-steps/s   (load {s['loads'][-1][1]:.2f})",
                      flush=True)
    profiles = {name: profile_generic(setups[name]["ts"]["generic"], setups[name]["w"], setups[name]["wl"],
                                      setups[name]["steps"])
                for name in names}
    for s in setups.values():
        for t in s["ts"].values():
            t.close()
    results = {}
    for name in names:
        s = setups[name]
        med = {e: statistics.median(v) if v else None for e, v in s["samples"].items()}
        peak = med["bound"] * s["flop"]
        rows = {}
        for e, v in med.items():
            if e == "bound":
                continue
            rows[e] = {"client_steps_per_s": v,
                       "x_loop": v / med["loop"] if v else None,
                       "x_loop_1t": v / med["loop_1t"] if v and med.get("loop_1t") else None,
                       "x_flower": v / med["flower"] if v and med.get("flower") else None,
                       "x_pfl": v / med["pfl"] if v and med.get("pfl") else None,
                       "of_flop_bound": v / med["bound"] if v else None}
        wl = s["wl"]
        results[name] = {
            "setup": {"clients": wl.clients, "clients_per_round": min(wl.per_round, wl.clients), "samples": wl.samples,
                      "batch": wl.batch, "steps": s["steps"], "lr": wl.lr, "input": list(wl.shape),
                      "data": "CIFAR-shaped synthetic (uniform [0, 1), random labels)" if wl.synthetic
                      else "FMNIST (real)", "parameters": s["params"], "flops_per_step": s["flop"],
                      "peak_flops": peak, "peak_method": PEAK_METHOD},
            "engines": {e: t.describe() + engine_threads(e, t, args.threads) for e, t in s["ts"].items()}
            | {"generic_sliced": f"{s['ts']['generic'].describe()}, the round in run_round calls of "
                                 f"{args.generic_slice} clients (the benchmark's slicing, not the engine's)",
               "flower": "Flower 1.41 simulation (Ray, 2 actors x 1 CPU)",
               "pfl": f"pfl-research 0.6 SimulatedBackend, FederatedAveraging, {args.pfl_threads} thread(s)"},
            "rates": rows, "bound": med["bound"], "samples": s["samples"], "failed": s["failed"],
            "flower_runs": s["runs"]["flower"], "pfl_runs": s["runs"]["pfl"],
            "load_avg_1min_at_each_measurement": s["loads"]}
        if name in profiles:
            results[name]["profile_generic"] = profiles[name]
    targets = []

    def target(name: str, what: str, num: str, den: str, goal: float) -> None:
        if name not in results or num not in results[name]["rates"]:
            return
        r = results[name]["rates"]
        v = r[num]["client_steps_per_s"] / r[den]["client_steps_per_s"] \
            if r.get(den, {}).get("client_steps_per_s") and r[num]["client_steps_per_s"] else None
        targets.append({"workload": name, "target": what, "goal": goal, "measured": v,
                        "met": None if v is None else v >= goal})

    for e, loop in (("generic", "loop"), ("generic_vmap", "loop"), ("generic_sliced", "loop"),
                    ("generic_1t", "loop_1t")):
        target("mimic-fmnist", f"{e} ≥ 5× {loop}", e, loop, 5.0)
        for name in ("resnet8-cifar", "pfl-cifar10"):
            target(name, f"{e} ≥ 1.5× {loop}", e, loop, 1.5)
            target(name, f"{e} ≥ 2× Flower", e, "flower", 2.0)
    out = {"workloads": results, "targets": targets, "machine": {
        "cpu": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
        "threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
        "setup": {"command": " ".join([".venv/bin/python", "benchmarks/sim_throughput.py", *sys.argv[1:]]),
                  "repeats": args.repeats, "flower_runs": args.flower_runs, "pfl_runs": args.pfl_runs,
                  "framework_rounds": args.flower_rounds, "flower_status": flower_status, "pfl_status": pfl_status,
                  "statistic": "median over repeats; in each repeat, each workload's engines in rotating order; "
                               "Flower and pfl: the median of a run's rounds after the first (start-up)",
                  "seconds": time.perf_counter() - started,
                  "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}}
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sim_throughput_workloads.json").write_text(json.dumps(out, indent=1) + "\n")
    (dest / "sim_throughput_workloads.md").write_text(workloads_markdown(out))
    print(workloads_markdown(out))


def peak_words(setup: dict) -> str:
    """How a record's peak was measured, in its table's words: records before `PEAK_METHOD` timed the matmul alone."""
    return ("fp32: the faster of a 2048² matmul and a 3×3 convolution" if setup.get("peak_method")
            else "2048² fp32 matmul")


def workloads_markdown(o: dict) -> str:
    m, s = o["machine"], o["setup"]
    f = lambda v, fmt: "" if v is None else format(v, fmt)   # noqa: E731
    lines = ["# The engine's benchmark of record: three workloads side by side (benchmarks/sim_throughput.py)", "",
             f"`{s['command']}`", "",
             f"CPU: {m['cpu']} ({m['isa']}), {m['cpus']} CPUs, {m['threads']} torch thread(s) in this process; "
             f"torch {m['torch']}, "
             f"Python {m['python']}. 1-min load average {m['load_avg_before'][0]:.2f} before, "
             f"{m['load_avg_after'][0]:.2f} after (a shared machine). Measured {s['date']}, "
             f"{s['seconds'] / 60:.1f} min in all.", "",
             f"Statistic: {s['statistic']}. {s['repeats']} repeats; Flower and pfl: {s['flower_runs']} and "
             f"{s['pfl_runs']} runs of {s['framework_rounds']} rounds each. Flower: {s['flower_status']}. "
             f"pfl: {s['pfl_status']}." + (f" Note: {s['note']}" if s.get("note") else ""), "",
             f"Cores each engine uses: the loop runs in this process on {m['threads']} torch thread(s) (loop_1t: "
             "1); the engines' `what ran` says theirs (generic and generic_sliced: the generic engine's worker "
             "processes, 1 thread each, where the run had them; generic_1t: its computation in this process on 1 "
             "thread); native and torch_ops in 2 worker processes of 1 thread; Flower in 2 Ray actors of 1 CPU; "
             "pfl in one process. So × Flower compares engines that may use different numbers of cores.", ""]
    for name, r in o["workloads"].items():
        u = r["setup"]
        loads = [v for _, v in r["load_avg_1min_at_each_measurement"]]
        one = "loop_1t" in r["rates"]   # the 1-thread loop's column, where it was measured
        lines += [f"## {name}", "",
                  f"{u['clients']:,} clients × {u['samples']} samples ({u['data']}, input {u['input']}), "
                  f"{u['clients_per_round']} per round, batch {u['batch']}, {u['steps']} local steps, lr {u['lr']}; "
                  f"{u['parameters']:,} parameters, {u['flops_per_step'] / 1e6:.1f} MFLOP per step (FlopCounterMode), "
                  f"peak {u['peak_flops'] / 1e9:.0f} GFLOP/s ({peak_words(u)}). Load "
                  f"{min(loads, default=0):.2f}–{max(loads, default=0):.2f}.", "",
                  "| engine | what ran | client-steps/s | × loop |" + (" × loop_1t |" if one else "")
                  + " × Flower | × pfl | of FLOP bound |",
                  "|---|---|---:|---:|" + ("---:|" if one else "") + "---:|---:|---:|"]
        for e, row in r["rates"].items():
            v = row["client_steps_per_s"]
            what = r["engines"].get(e, e)
            if v is None:
                err = r["failed"].get(e, "").splitlines() or ["not measured"]
                why = next((ln.strip() for ln in err if "Error:" in ln), err[0])   # the first (innermost) error
                lines.append(f"| {e} | {what} | {why} | |" + (" |" if one else "") + " | | |")
                continue
            lines.append(f"| {e} | `{what}` | {v:,.1f} | {f(row['x_loop'], '.2f')} | "
                         + (f"{f(row['x_loop_1t'], '.2f')} | " if one else "")
                         + f"{f(row['x_flower'], '.2f')} | {f(row['x_pfl'], '.2f')} | {row['of_flop_bound']:.1%} |")
        kernels = "the peak kernels" if u.get("peak_method") else "the matmul"
        lines.append(f"| bound | FLOP bound ({kernels} on {o['machine']['cpus']} threads) | "
                     f"{r['bound']:,.1f} | |"
                     + (" |" if one else "") + " | | 100% |")
        p = r.get("profile_generic")
        if p:
            lines += ["", f"Where the generic engine's time goes (torch.profiler, its computation of one round of "
                      f"{p['client_steps']} client-steps as one slice in this process, 1 thread"
                      + (f", {p['mode']} mode" if p.get("mode") else "") + ": "
                      f"{p['wall_s']:.2f} s wall under the profiler; aten ops' self CPU time on the "
                      f"calling thread {p['ops_self_cpu_s']:.2f} s; outside ops (Python, torch.func dispatch) "
                      f"{p['outside_ops_s']:.2f} s):", "",
                      "| kind | self CPU s | of wall |", "|---|---:|---:|"]
            lines += [f"| {k} | {v['self_cpu_s']:.3f} | {v['share_of_wall']:.1%} |" for k, v in p["by_kind"].items()]
            lines += ["", "| top op | calls | self CPU s | of wall |", "|---|---:|---:|---:|"]
            lines += [f"| `{t['op']}` | {t['calls']} | {t['self_cpu_s']:.3f} | {t['share_of_wall']:.1%} |"
                      for t in p["top_ops"]]
        lines.append("")
    lines += ["## Targets (issue 38, side by side in this run)", "", "| workload | target | measured | met |",
              "|---|---|---:|---|"]
    for t in o["targets"]:
        met = "not measured" if t["met"] is None else "yes" if t["met"] else "**no**"
        # a miss that two decimals would round up to the goal shows four (1.4996, not 1.50 beside "no")
        close = t["met"] is False and t["measured"] is not None and round(t["measured"], 2) >= t["goal"]
        lines.append(f"| {t['workload']} | {t['target']} | {f(t['measured'], '.4f' if close else '.2f')}× | {met} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"local steps per client per measured round (default {PAPER_STEPS}, the paper's round; "
                         "with --workload, each workload's own)")
    ap.add_argument("--workload", metavar="NAMES",
                    help=f"the benchmark of record: {', '.join(WORKLOADS)} (comma-separated) or all, side by side; "
                         "writes sim_throughput_workloads.json/.md")
    ap.add_argument("--generic-slice", type=int, default=0,
                    help="with --workload: also measure the generic engine on the round's clients in run_round "
                         "calls of this many (generic_sliced; 0: not)")
    ap.add_argument("--pfl-threads", type=int, default=1,
                    help="with --workload: torch threads of the pfl-research process (default 1: one process, as "
                         "loop_1t and generic_1t)")
    ap.add_argument("--framework-timeout", type=float, default=900,
                    help="with --workload: seconds a Flower or pfl run may take before it is killed and recorded as "
                         "failed (default 900)")
    ap.add_argument("--pfl-runs", type=int, default=2, help="with --workload: pfl-research simulations per workload")
    ap.add_argument("--setup-pfl", action="store_true",
                    help="with --workload: create benchmarks/.venv-pfl (setup_pfl.sh) if it is missing, recording "
                         "pip's error where pfl does not install")
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
    if args.workload:
        run_workloads(args)
        return
    args.steps = args.steps or PAPER_STEPS
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
    write_clients(tmp.name, data)

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
        "peak_method": PEAK_METHOD + ", measured once per repeat (median)",
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
