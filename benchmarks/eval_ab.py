"""The coordinator's evaluation: the reference (`edge_client.trainer.evaluate`, the model's own torch forward)
against `coordinator.sim.batched.Evaluator` (the batched forward with the fused LeNet kernels), side by side in
one process, interleaved (issue 16: in a sweep every run evaluates the full test set every round while the
training workers wait).

For each LeNet on its dataset's test set (10,000 images, batches of 2,000): CPU time of one evaluation
(`time.process_time`, fastest of `--repeats`, 1 torch thread), the reference also at 2 threads by wall time
(how `dropfl sim` runs it on this machine), and the largest difference in accuracy and loss between the two.

    .venv/bin/python benchmarks/eval_ab.py [--repeats 5] [--json benchmarks/results/eval_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from coordinator.sim.batched import Evaluator  # noqa: E402
from edge_client.datasets import load_fmnist, load_mnist  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.trainer import evaluate  # noqa: E402


def timed(fn, threads: int, clock) -> tuple[float, tuple[float, float]]:
    torch.set_num_threads(threads)
    t0 = clock()
    out = fn()
    return clock() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cases = [("mimic-cnn", "fmnist", load_fmnist), ("fdms-cnn", "mnist", load_mnist)]
    rows = []
    for name, dsname, load in cases:
        ds = load()
        shape = tuple(ds.test.x.shape[1:])
        ref_model, fast_model = build_model(name, shape, 10, seed=0), build_model(name, shape, 10, seed=0)
        g = torch.Generator().manual_seed(0)
        w = get_flat(ref_model)
        w = w + 0.05 * torch.randn(w.shape, generator=g)     # not the initialisation
        ev = Evaluator(fast_model, ds.test.x, ds.test.y)

        def reference(model=ref_model, w=w, ds=ds):
            return evaluate(model, w, ds.test.x, ds.test.y)

        def fast(ev=ev, w=w):
            return ev(w)

        ref1, fast1, ref2 = [], [], []
        for _ in range(args.repeats + 1):                    # the first of each is a warm-up
            t, r = timed(reference, 1, time.process_time)
            ref1.append(t)
            t, f = timed(fast, 1, time.process_time)
            fast1.append(t)
            t, _ = timed(reference, 2, time.perf_counter)
            ref2.append(t)
        row = {"model": name, "dataset": dsname, "images": len(ds.test.y), "kernel": ev.native,
               "reference_cpu_s": round(min(ref1[1:]), 4), "evaluator_cpu_s": round(min(fast1[1:]), 4),
               "reference_2threads_wall_s": round(min(ref2[1:]), 4),
               "cpu_ratio": round(min(ref1[1:]) / min(fast1[1:]), 2),
               "accuracy": [r[0], f[0]], "loss": [r[1], f[1]], "loss_rel_diff": abs(r[1] - f[1]) / r[1]}
        rows.append(row)
        print(f"{name} on {dsname} ({row['images']} images): reference {row['reference_cpu_s']:.3f} s CPU "
              f"(2 threads: {row['reference_2threads_wall_s']:.3f} s wall), Evaluator[{ev.native}] "
              f"{row['evaluator_cpu_s']:.3f} s CPU: {row['cpu_ratio']:.2f}x; accuracy {r[0]:.4f} vs {f[0]:.4f}, "
              f"loss {r[1]:.7f} vs {f[1]:.7f} (rel {row['loss_rel_diff']:.1e})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "repeats": args.repeats, "cpus": os.cpu_count(),
                                         "machine": platform.machine(), "load": os.getloadavg(),
                                         "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2)
                             + "\n")


if __name__ == "__main__":
    main()
