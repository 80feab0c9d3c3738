"""A/B of the batched engine's training step by CPU time: this checkout against another code tree (issue 16).

The throughput benchmark (`sim_throughput.py --before DIR`) measures wall time with two worker processes,
which on this shared 2-core machine swings by far more than a kernel change (docs/engine.md: an A/A control
gave 1.03x, two A/B runs of one change 1.59x and 0.84x). This one measures what a change does to the
step itself: one slice of clients (`Group.train`, 1 thread) in child processes that import either tree,
alternating A, B, B, A, ... and timed by the process's CPU time (`time.process_time`), which other jobs on
the machine do not add to. Each child trains once to warm up (kernel load, allocator), then `--calls`
times; the child's number is its fastest call. It also hashes the deltas, so the report says whether the
two trees computed the same bits (a change that claims to be exact must print `same bits: yes`).

Workload: mimic-cnn on FMNIST (the Table 3 model), `--clients` clients × 2000 samples, batch 16 (`--mix`: every
third client with FedProx's term, the fused update of a sweep of several methods),
`--steps` SGD steps each.

    git worktree add /tmp/before HEAD          # the code before the change
    .venv/bin/python benchmarks/step_ab.py --before /tmp/before [--repeats 6] [--steps 60] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from coordinator.sim import batched
from coordinator.sim.batched import Group
if hasattr(batched, "_keep_freed_memory"):
    batched._keep_freed_memory()   # as the engine's worker processes do
from edge_client.datasets import load_fmnist
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask
clients, steps, calls, native = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mix = sys.argv[6] == "1"
ds = load_fmnist()
n = 2000
x, y = ds.train.x[: clients * n].contiguous(), ds.train.y[: clients * n].contiguous()
model = build_model("mimic-cnn", tuple(x.shape[1:]))
t0 = time.process_time()
group = Group(model, x, y, [i * n for i in range(clients)], [n] * clients, threads=1,
              native=False if native == "off" else True)
setup = time.process_time() - t0
w = get_flat(model)
tasks = [TrainTask(client=i, round=1, lr=0.01, batch_size=16, steps=steps, seed=3,
                   prox_mu=0.001 if mix and i % 3 == 1 else 0.0) for i in range(clients)]
group.train(w, tasks)   # warm-up
best, digest = float("inf"), None
for _ in range(calls):
    t0 = time.process_time()
    out = group.train(w, tasks)
    best = min(best, time.process_time() - t0)
    d = hashlib.sha256(b"".join(r.delta.numpy().tobytes() for r in out)).hexdigest()[:16]
    assert digest in (None, d), "one tree gave two results for the same task"
    digest = d
print(json.dumps({"seconds": best, "digest": digest, "setup": setup, "kernel": group.native}))
"""


def child(tree: Path, args: argparse.Namespace) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(args.clients), str(args.steps),
                           str(args.calls), args.native, str(int(args.mix))], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"step_ab: the child for {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="code tree to compare with (e.g. a git worktree)")
    ap.add_argument("--repeats", type=int, default=6, help="child processes per tree (alternating)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per child (its fastest counts)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--clients", type=int, default=15)
    ap.add_argument("--native", choices=["auto", "off"], default="auto", help="off: torch ops for the conv layers")
    ap.add_argument("--mix", action="store_true", help="every third client with FedProx's term (μ 0.001): the "
                    "fused update's path, as in a lockstep sweep of several methods")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    if not (args.before / "coordinator" / "sim" / "batched.py").exists():
        sys.exit(f"step_ab: error: {args.before} holds no dropfl code tree (coordinator/sim/batched.py); "
                 "make one with `git worktree add DIR REV`")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.repeats):
        order = [("before", args.before), ("after", ROOT)]
        for name, tree in order if i % 2 == 0 else order[::-1]:
            r = child(tree, args)
            runs[name].append(r)
            print(f"  {i + 1}/{args.repeats} {name:6s} {1000 * r['seconds'] / args.steps:7.2f} ms/step "
                  f"(kernel {r['kernel']}, setup {r['setup']:.2f} s, deltas {r['digest']})", flush=True)
    per_step = {n: [1000 * r["seconds"] / args.steps for r in rs] for n, rs in runs.items()}
    same = {r["digest"] for rs in runs.values() for r in rs}
    result = {
        "workload": f"mimic-cnn FMNIST, {args.clients} clients x {args.steps} steps, batch 16, 1 thread"
                    + (", every third client FedProx (fused update)" if args.mix else ""),
        "native": args.native, "kernel": runs["after"][0]["kernel"], "repeats": args.repeats,
        "ms_per_step": {n: {"min": min(v), "median": statistics.median(v), "all": v} for n, v in per_step.items()},
        "speedup_min": min(per_step["before"]) / min(per_step["after"]),
        "speedup_median": statistics.median(per_step["before"]) / statistics.median(per_step["after"]),
        "setup_s": {n: statistics.median(r["setup"] for r in rs) for n, rs in runs.items()},
        "same_bits": len(same) == 1, "load": os.getloadavg(),
    }
    print(f"before {result['ms_per_step']['before']['min']:.2f} / after {result['ms_per_step']['after']['min']:.2f} "
          f"ms/step (min); speedup {result['speedup_min']:.3f}x (min), {result['speedup_median']:.3f}x (median); "
          f"same bits: {'yes' if result['same_bits'] else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
