"""Where a step of the batched engine goes, part by part, against the machine's FLOP rate (issue 16, item 1).

`sim_throughput.py` says how far the engine is from the FLOP bound; this says where the rest goes. One slice
of `--clients` clients (`Group.train`, 1 thread, mimic-cnn on FMNIST, batch 16, FedAvg: the throughput
benchmark's workload, one worker's half) trains `--steps` steps `--calls` times while every part of the
LeNet step by hand is timed where it runs. Where the whole step is one native call, client by client
(`kernels.LeNetStep`: plain SGD in float32 with the native fully connected layers and loss, the default here),
the kernel times its parts itself (`LeNetStep.time_parts`); else (`batched._lenet_step`, layer after layer):

  conv1 fwd / conv2 fwd / conv2 bwd / conv1 bwd   the four fused kernels (`kernels.LeNetLayers.fwd1` ...)
  fc matmuls        the fully connected layers: where exact, `kernels.FcLayers` (every layer's forward, and with
                    plain SGD its backward and steps, in native kernels with MKL's and ATen's bits); else their
                    batched matmuls (`torch.baddbmm`, `Tensor.bmm`: MKL), and with plain
                    SGD fc1's and fc2's weight gradient and step in one pass (`kernels.fc_sgd`, which replaces two
                    of the matmuls and those weights' `add_`)
  loss and small ops  the rest of `_lenet_step`: log-softmax, NLL, relu's and the sums' ops, the wrappers
  SGD update        each parameter's `add_` (inside the step by hand, once its gradient is final; the fully
                    connected layers' steps are in `kernels.FcLayers`, under fc matmuls, where it runs)
  step loop         the rest of `Group.train`: batch rows, labels, Python, the start and the deltas

In the native call the parts are the same, with "loss and small ops" the native loss and "SGD update" the conv
layers' steps (the fully connected layers' are under fc matmuls), and no part timed alone: every part runs on a
client's operands in cache.

Each part's FLOPs are torch's FlopCounterMode count of the reference model's step (the same count the FLOP
bound of `sim_throughput.py` divides by), so its GFLOP/s compare with the 1-thread peak: the faster of a 2048² fp32
matmul and a big 3×3 convolution measured in the same process (`sim_throughput.peak_flops`, best of 10 each).
The four kernels and fc1's forward matmul are then timed again alone, on the last step's very operands (min
of 50 calls): the difference to their time in the step is what the step's cache traffic costs them. Timing
wrappers cost ~0.3 µs a call (~17 calls a step).
Like the engine's worker processes, the process keeps freed memory (`batched._keep_freed_memory`).

    .venv/bin/python benchmarks/step_profile.py [--clients 15] [--steps 100] [--calls 5]

Writes benchmarks/results/step_profile.{json,md}. Run it on a quiet machine: it is one process on one core.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.sim import batched, kernels  # noqa: E402
from edge_client.datasets import load_fmnist  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import TrainTask  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_throughput import peak_flops  # noqa: E402  (the bound's peak rate, here on 1 thread)

HERE = Path(__file__).resolve().parent
SAMPLES, BATCH = 2000, 16
KERNELS = {"conv1 fwd": "fwd1", "conv2 fwd": "fwd2", "conv2 bwd": "bwd2", "conv1 bwd": "bwd1"}   # LeNetLayers
PARTS = [*KERNELS, "fc matmuls", "loss and small ops", "SGD update", "step loop"]
FC1_IN = 256   # mimic-cnn's fc1 inputs: the baddbmm kept for timing alone is fc1's forward


def part_flops(clients: int) -> dict[str, float]:
    """FLOPs of one step of `clients` clients, per part: torch's FlopCounterMode on the reference model."""
    from torch.utils.flop_counter import FlopCounterMode
    model = build_model("mimic-cnn", (1, 28, 28), 10)
    x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    c = {m: {str(op): n for op, n in ops.items()} for m, ops in counter.get_flop_counts().items()}
    fc = sum(n for m in ("fc1", "fc2", "fc3") for n in c[f"MimicCNN.{m}"].values())
    out = {"conv1 fwd": c["MimicCNN.conv1"]["aten.convolution"],
           "conv1 bwd": c["MimicCNN.conv1"]["aten.convolution_backward"],
           "conv2 fwd": c["MimicCNN.conv2"]["aten.convolution"],
           "conv2 bwd": c["MimicCNN.conv2"]["aten.convolution_backward"], "fc matmuls": fc}
    assert sum(out.values()) == counter.get_total_flops(), "a layer's FLOPs are not in a part"
    return {k: clients * v for k, v in out.items()}


class Timers:
    """Wraps the step's parts in place (module attributes), accumulating ns per part; keeps each part's last
    call's arguments, for timing it alone afterwards."""

    def __init__(self) -> None:
        self.ns = dict.fromkeys([*KERNELS, "fc matmuls", "lenet step", "SGD update", "update after", "native step"],
                                0)
        self.laps: list[torch.Tensor] = []   # the native step's part timers (`LeNetStep.time_parts`)
        self.last: dict[str, tuple] = {}
        self.undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attr: str, part: str, keep: str | None = None) -> None:
        fn = getattr(owner, attr)
        ns, last = self.ns, self.last

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            out = fn(*args, **kwargs)
            ns[part] += time.perf_counter_ns() - t0
            if keep and (keep not in last or keep != "fc1 fwd (baddbmm)" or args[1].shape[-1] >= FC1_IN):
                last[keep] = (fn, args, kwargs)
            return out
        self.undo.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def __enter__(self) -> Timers:
        for part, name in KERNELS.items():
            self.wrap(kernels.LeNetLayers, name, part, keep=part)
        self.wrap(torch, "baddbmm", "fc matmuls", keep="fc1 fwd (baddbmm)")
        self.wrap(torch.Tensor, "bmm", "fc matmuls")
        self.wrap(kernels, "fc_sgd", "fc matmuls")            # a weight's gradient and step in one pass
        self.wrap(kernels.FcLayers, "forward", "fc matmuls", keep="fc forward (FcLayers)")   # the layers natively
        self.wrap(kernels.FcLayers, "backward", "fc matmuls")
        self.wrap(batched, "_lenet_step", "lenet step")
        self.wrap(torch.Tensor, "add_", "SGD update")         # the step by hand's updates, inside it
        self.wrap(torch, "_foreach_add_", "update after")     # an update after the step (none expected here)
        self.wrap(kernels.LeNetStep, "steps", "native step")   # a round's steps in one native call
        init, laps = kernels.LeNetStep.__init__, self.laps

        def timed_init(step: kernels.LeNetStep, *args, **kwargs) -> None:   # its parts timed inside the kernel
            init(step, *args, **kwargs)
            laps.append(step.time_parts())
        self.undo.append((kernels.LeNetStep, "__init__", init))
        kernels.LeNetStep.__init__ = timed_init
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)

    def reset(self) -> None:
        for k in self.ns:
            self.ns[k] = 0
        self.laps.clear()

    def native_parts(self) -> dict[str, float]:
        """Seconds per `LeNetStep.PARTS` part, over the native calls since `reset`."""
        total = sum(self.laps, torch.zeros(len(kernels.LeNetStep.PARTS), dtype=torch.float64))
        return dict(zip(kernels.LeNetStep.PARTS, total.tolist()))


def alone(call: tuple, reps: int = 50) -> float:
    """Seconds of the fastest of `reps` calls of a kept call (its operands as in the step's last call)."""
    fn, args, kwargs = call
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter_ns() - t0)
    return best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=15, help="clients in the slice (15: one of 2 workers' half)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--calls", type=int, default=5, help="timed Group.train calls; the fastest counts")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batched._keep_freed_memory()   # as the engine's worker processes do (no page faults on each step's buffers)
    ds = load_fmnist()
    x = ds.train.x[: args.clients * SAMPLES].contiguous()
    y = ds.train.y[: args.clients * SAMPLES].contiguous()
    model = build_model("mimic-cnn", tuple(x.shape[1:]))
    group = batched.Group(model, x, y, [i * SAMPLES for i in range(args.clients)], [SAMPLES] * args.clients,
                          threads=1)
    if not group.by_hand:
        sys.exit("step_profile: error: the LeNet step by hand is off here (no native kernels: "
                 f"kernel {group.native!r}); nothing to profile part by part")
    w = get_flat(model)
    tasks = [TrainTask(client=i, round=1, lr=0.01, batch_size=BATCH, steps=args.steps, seed=3)
             for i in range(args.clients)]
    flops = part_flops(args.clients)
    with Timers() as timers:
        group.train(w, tasks)   # warm-up
        best = None
        for _ in range(args.calls):
            timers.reset()
            t0 = time.perf_counter_ns()
            group.train(w, tasks)
            total = time.perf_counter_ns() - t0
            if best is None or total < best[0]:
                best = (total, dict(timers.ns), timers.native_parts())
        kept = dict(timers.last)
    total, ns, native = best
    if ns["update after"]:
        sys.exit("step_profile: error: the SGD update ran after the step (_foreach_add_), not inside the step by "
                 "hand: this profile's parts assume the latter")
    one_call = ns["native step"] > 0
    if one_call:   # the whole step in one native call: its parts as the kernel timed them
        ms = {p: native[p] * 1e3 / args.steps for p in KERNELS}   # the kernel's parts of the same names
        ms["loss and small ops"] = native["loss"] * 1e3 / args.steps
        ms["SGD update"] = native["conv steps"] * 1e3 / args.steps
        ms["fc matmuls"] = (native["fc fwd"] + native["fc bwd"]) * 1e3 / args.steps
        ms["step loop"] = (total / 1e9 - sum(native.values())) * 1e3 / args.steps
        alone_ms: dict[str, float] = {}
        fc_alone = None
    else:
        ms = {p: ns[p] / 1e6 / args.steps for p in [*KERNELS, "fc matmuls", "SGD update"]}
        ms["loss and small ops"] = (ns["lenet step"] - sum(ns[p] for p in KERNELS) - ns["fc matmuls"]
                                    - ns["SGD update"]) / 1e6 / args.steps
        ms["step loop"] = (total - ns["lenet step"]) / 1e6 / args.steps
        alone_ms = {p: 1e3 * alone(kept[p]) for p in KERNELS}
        fc_alone = "fc forward (FcLayers)" if "fc forward (FcLayers)" in kept else "fc1 fwd (baddbmm)"
        alone_ms[fc_alone] = 1e3 * alone(kept[fc_alone])
    step_ms = total / 1e6 / args.steps
    peak = peak_flops()   # torch runs 1 thread here: the 1-thread peak
    step_flops = sum(flops.values())
    rows = []
    for p in PARTS:
        f = flops.get(p)
        rows.append({"part": p, "ms": ms[p], "share": ms[p] / step_ms, "mflop": f / 1e6 if f else None,
                     "gflops": f / ms[p] / 1e6 if f else None, "of_peak": f / ms[p] * 1e3 / peak if f else None,
                     "alone_ms": alone_ms.get(p)})
    result = {
        "workload": f"mimic-cnn FMNIST, {args.clients} clients x {args.steps} steps, batch {BATCH}, FedAvg, "
                    f"1 thread, Group.train (the LeNet step by hand"
                    f"{', one native call per round, client by client' if one_call else ', layer after layer'}), "
                    f"kernel {group.native}",
        "one_native_call": one_call,
        "command": "benchmarks/step_profile.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load": os.getloadavg(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "step_ms": step_ms, "step_mflop": step_flops / 1e6, "peak_gflops_1thread": peak / 1e9,
        "of_peak": step_flops / (step_ms / 1e3) / peak,
        "step_ms_at_65_percent": step_flops / (0.65 * peak) * 1e3,
        "parts": rows, "alone_ms": alone_ms,
        "notes": ("ms per step, fastest of the timed calls, each part timed inside the native call "
                  "(kernels.LeNetStep.time_parts): loss and small ops is the native loss, SGD update the conv "
                  "layers' steps, fc matmuls the fully connected layers' forward, backward and steps, step loop "
                  "everything outside the native call (Group.train's set-up, the losses, the deltas)."
                  if one_call else
                  "ms per step, fastest of the timed calls; 'alone': the part's last call in the step repeated on "
                  "the same operands (min of 50): hot caches. fc forward (FcLayers) alone is the three layers' "
                  "forward where the step runs them natively (else fc1 fwd (baddbmm): fc1's forward matmul, the "
                  "largest). fc matmuls includes kernels.fc_sgd (fc1's and fc2's weight gradient and SGD step "
                  "in one pass)."),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    md = ["# Where a step goes (benchmarks/step_profile.py)\n",
          f"`{result['command']}`, {result['date']}, 1-min load {result['load'][0]:.2f}\n",
          f"{result['workload']}. One step: **{step_ms:.2f} ms** for {step_flops / 1e6:.0f} MFLOP = "
          f"**{result['of_peak']:.1%} of the 1-thread peak** ({peak / 1e9:.0f} GFLOP/s, the faster of a 2048² fp32 "
          f"matmul and a 3×3 convolution in the same process); 65 % of that peak would be "
          f"{result['step_ms_at_65_percent']:.2f} ms.\n",
          "| part | ms/step | share | MFLOP | GFLOP/s | of peak | alone, ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    def fmt(v: float | None, f: str) -> str:
        return "" if v is None else format(v, f)

    for r in rows:
        md.append(f"| {r['part']} | {r['ms']:.3f} | {r['share']:.1%} | {fmt(r['mflop'], '.1f')} | "
                  f"{fmt(r['gflops'], '.0f')} | {fmt(r['of_peak'], '.0%')} | {fmt(r['alone_ms'], '.3f')} |")
    md.append(f"\n{f'{fc_alone} alone: {alone_ms[fc_alone]:.3f} ms. ' if fc_alone else ''}{result['notes']}\n")
    (args.out / "step_profile.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
