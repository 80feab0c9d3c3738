"""Does `torch.compile` compute a model's gradients right here? The check a compiled per-client mode would need.

A compiled per-client mode (each client's `local_train` on a `torch.compile`d model, TorchInductor, dynamic shapes
so that one graph serves every batch size) would gain where compilation pays: a compiled ResNet-8 step ran 1.38x
eager's (benchmarks/results/per_client_variants.md). Before adopting it: are its gradients eager's to float rounding?
For each model and batch size this computes one forward and backward of the cross-entropy three ways from the same
weights and batch:

- eager float64: the yardstick;
- eager float32: what every engine path computes today; its distance from float64 is float32's rounding;
- compiled float32: the model compiled once (`model.compile(dynamic=True)`, TorchInductor's default mode), then run
  on every batch size (torch specialises a batch of one, so that size compiles again).

Distance: the largest over the parameters of ‖g32 − g64‖ / ‖g64‖. A compiled gradient is `wrong` where it is not
finite or farther from float64 than max(100 × eager's distance, 1e-3); a model whose compilation raised is
`compile error` with the message's first line. Inductor chooses its vector code from ATen's CPU capability, so
the whole check runs in a child process per ATEN_CPU_CAPABILITY value (the CPU's own, then the others this CPU
runs), each with its own empty inductor cache. No dropout (the models are built without it, or with it
off): inductor draws its own random numbers, which is a different question.

    .venv/bin/python benchmarks/compile_check.py   # writes benchmarks/results/compile_check.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BATCHES = (1, 2, 7, 10, 16, 32)
FAR, FLOOR = 100.0, 1e-3


def models() -> dict[str, tuple[nn.Module, tuple[int, int, int]]]:
    """The models checked and their input shapes: dropfl's registered models (no dropout) and the benchmark
    workloads' ResNet-8 (BatchNorm) and pfl's CNN."""
    import workloads

    from edge_client.models import build_model
    out = {}
    for name, shape in (("mimic-cnn", (1, 28, 28)), ("cifar-lenet", (3, 32, 32)), ("fdms-cnn", (1, 28, 28)),
                        ("mlp", (1, 28, 28)), ("logreg", (1, 28, 28))):
        out[name] = (build_model(name, shape, 10, seed=0, **({"dropout": 0.0} if name == "fdms-cnn" else {})),
                     shape)
    out["resnet8 (BatchNorm)"] = (workloads.build("resnet8-cifar"), (3, 32, 32))
    out["pfl-cnn"] = (workloads.build("pfl-cifar10", dropout=nn.Identity), (3, 32, 32))   # Identity ignores p
    return out


def grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The cross-entropy's gradient of each parameter, one forward and backward in train mode."""
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def distance(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    worst = 0.0
    for g, r in zip(got, ref):
        d = float((g.double() - r).norm() / max(float(r.norm()), 1e-30))
        worst = max(worst, d if d == d else float("inf"))
    return worst


def check() -> list[dict]:
    """Every model at every batch size (this process's ATEN_CPU_CAPABILITY)."""
    import copy
    torch.set_num_threads(1)
    rows = []
    for name, (model, shape) in models().items():
        model.train()
        m64 = copy.deepcopy(model).double()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        compiled = copy.deepcopy(model)
        compiled.compile(dynamic=True)
        for b in BATCHES:
            gen = torch.Generator().manual_seed(b)
            x, y = torch.rand(b, *shape, generator=gen), torch.randint(0, 10, (b,), generator=gen)
            for m in (model, compiled):
                m.load_state_dict(state)   # BatchNorm's running statistics as they started
            m64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
            g64 = grads(m64, x.double(), y)
            eager = distance(grads(model, x, y), g64)
            row = {"model": name, "batch": b, "eager": eager}
            start = time.perf_counter()
            try:
                got = distance(grads(compiled, x, y), g64)
            except Exception as e:   # noqa: BLE001 - whatever dynamo or inductor raises
                row |= {"compiled": None, "verdict": "compile error",
                        "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:200]}
            else:
                bad = not got < float("inf") or got > max(FAR * eager, FLOOR)
                row |= {"compiled": got, "verdict": "wrong" if bad else "ok"}
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
            print(f"  {name:22s} batch {b:3d}: eager {eager:.1e}, compiled "
                  f"{row['compiled'] if row['compiled'] is None else format(row['compiled'], '.1e')} "
                  f"{row['verdict']}", flush=True)
    return rows


def capabilities() -> list[str]:
    """ATEN_CPU_CAPABILITY values this CPU runs, its own first."""
    own = torch.backends.cpu.get_cpu_capability().lower()
    order = ["avx512", "avx2", "default"]
    return [own] + [c for c in order[order.index(own) + 1:] if c != own] if own in order else [own]


def table(rows: list[dict]) -> list[str]:
    out = ["| model | " + " | ".join(f"batch {b}" for b in BATCHES) + " |", "|---|" + "---|" * len(BATCHES)]
    for name in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for b in BATCHES:
            r = next(r for r in rows if r["model"] == name and r["batch"] == b)
            if r["verdict"] == "compile error":
                cells.append("**compile error**")
            else:
                mark = "**wrong**: " if r["verdict"] == "wrong" else ""
                cells.append(f"{mark}{r['compiled']:.1e} ({r['eager']:.1e})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile_check"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"rows": check()}))
        return
    runs = []
    for cap in capabilities():
        print(f"ATEN_CPU_CAPABILITY={cap}:", flush=True)
        env = os.environ | {"ATEN_CPU_CAPABILITY": cap, "PYTHONWARNINGS": "ignore",
                            "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="dropfl-inductor-")}
        start = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
        lines = p.stdout.strip().splitlines()
        for line in lines[:-1]:
            print(line)
        if p.returncode != 0 or not lines:
            raise SystemExit(f"compile_check: the child for {cap} failed (exit {p.returncode}): {p.stderr[-2000:]}")
        runs.append({"capability": cap, "rows": json.loads(lines[-1])["rows"],
                     "seconds": round(time.perf_counter() - start, 1)})
    import platform

    from machine import cpu_model
    meta = {"cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})", "torch": torch.__version__,
            "python": platform.python_version(),
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "batches": list(BATCHES), "far": FAR, "floor": FLOOR}
    Path(args.out + ".json").write_text(json.dumps(meta | {"runs": runs}, indent=1) + "\n")
    md = ["# torch.compile's gradients against eager's (benchmarks/compile_check.py)", "",
          "`.venv/bin/python benchmarks/compile_check.py`", "",
          f"CPU: {meta['cpu']}, torch {meta['torch']}, Python {meta['python']}, 1 thread; measured "
          f"{meta['measured']}.", "",
          "One forward and backward of the cross-entropy per model and batch size, from the same weights and batch: "
          "each cell is the compiled float32 gradient's distance from the eager float64 one (the largest over the "
          "parameters of ‖g32 − g64‖ / ‖g64‖), eager float32's in parentheses. The model is compiled once "
          "(`model.compile(dynamic=True)`, TorchInductor) and run on every batch size. **wrong**: not finite, or "
          f"farther than max({FAR:g} × eager's, {FLOOR:g}).", ""]
    for run in runs:
        wrong = [r for r in run["rows"] if r["verdict"] != "ok"]
        md += [f"## ATEN_CPU_CAPABILITY={run['capability']} ({run['seconds']} s)", "", *table(run["rows"]), "",
               f"{len(wrong)} of {len(run['rows'])} wrong or not compiled."]
        errors = sorted({r["error"] for r in run["rows"] if r.get("error")})
        md += [f"Compile error: `{e}`" for e in errors] + [""]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
