"""The channels-last BatchNorm's native kernels (`dropfl_bn_cl_fwd_f32`, `_bwd_f32`) against another checkout's.

Per-client mode trains a Conv2d-BatchNorm model on a channels-last copy whose BatchNorm sums in double with these
kernels (coordinator/sim/channels_last.py, docs/engine.md). This times them on ResNet-8's three BatchNorm shapes at
batch 16 (16 × 32×32 rows of 16 channels, 16 × 16×16 of 32, 16 × 8×8 of 64) for this checkout and, with
`--before DIR`, for the conv_pool.cpp of the checkout in DIR (`git worktree add DIR <commit>`), compiled with the
same variant's flags: both libraries in this process, the calls interleaved, `--sets` medians of `--calls` calls
each; and says whether the two give the same bits (outputs, statistics, running statistics, gradients).

    .venv/bin/python benchmarks/bn_kernels.py [--before DIR] [--variant avx512]   # results/bn_kernels.{md,json}
"""

from __future__ import annotations

import argparse
import ctypes
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from machine import cpu_model, git_commit  # noqa: E402

from coordinator.sim import kernels  # noqa: E402

SHAPES = ((16 * 32 * 32, 16), (16 * 16 * 16, 32), (16 * 8 * 8, 64))   # ResNet-8's BatchNorms at batch 16: [M, C]


def build_before(before: Path, variant: str, into: str) -> ctypes.CDLL:
    """DIR's conv_pool.cpp built with `variant`'s flags, its BatchNorm entry points typed as this checkout's."""
    source = before / "coordinator" / "sim" / "kernels" / "conv_pool.cpp"
    if not source.is_file():
        raise SystemExit(f"bn_kernels: error: --before {before}: no coordinator/sim/kernels/conv_pool.cpp there; "
                         "make a checkout with `git worktree add DIR <commit>`")
    target = os.path.join(into, "before.so")
    cxx = os.environ.get("CXX", "g++")
    proc = subprocess.run([cxx, *kernels.flags(variant), "-o", target, str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bn_kernels: error: {cxx} could not build {source}: {proc.stderr.strip()[-500:]}")
    lib = ctypes.CDLL(target)
    mine = kernels.load(variant)
    for name in ("dropfl_bn_cl_fwd_f32", "dropfl_bn_cl_bwd_f32"):
        fn, ref = getattr(lib, name), getattr(mine, name)
        fn.argtypes, fn.restype = ref.argtypes, ref.restype
    return lib


def calls(lib: ctypes.CDLL, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict:
    """One forward and one backward; their outputs, and the two calls for timing."""
    m, c = x.shape
    out = {"y": torch.empty_like(x), "stats": torch.empty(3, c, dtype=torch.float64), "rm": torch.zeros(c),
           "rv": torch.ones(c), "dx": torch.empty_like(x), "dw": torch.empty(c), "db": torch.empty(c)}
    p = {k: v.data_ptr() for k, v in out.items()}

    def fwd() -> None:
        lib.dropfl_bn_cl_fwd_f32(x.data_ptr(), w.data_ptr(), b.data_ptr(), p["y"], p["stats"], p["rm"], p["rv"],
                                 m, c, 1e-5, 0.1)

    def bwd() -> None:
        lib.dropfl_bn_cl_bwd_f32(g.data_ptr(), x.data_ptr(), w.data_ptr(), p["stats"], p["dx"], p["dw"], p["db"],
                                 m, c)
    fwd()
    bwd()
    return {"out": out, "fwd": fwd, "bwd": bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", metavar="DIR", help="also time the kernels of the dropfl checkout in DIR")
    ap.add_argument("--variant", default=None, help="the kernels' variant (default: this CPU's best)")
    ap.add_argument("--sets", type=int, default=30)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "results" / "bn_kernels"))
    args = ap.parse_args()
    variant = kernels.check(args.variant) if args.variant else kernels.cpu_variants()[0]
    if not kernels.available(variant):
        raise SystemExit(f"bn_kernels: error: the {variant} kernels do not build here ({kernels.error(variant)})")
    torch.set_num_threads(1)
    libs = {"this": kernels.load(variant)}
    tmp = tempfile.TemporaryDirectory()
    if args.before:
        libs["before"] = build_before(Path(args.before).resolve(), variant, tmp.name)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for m, c in SHAPES:
        x, g = torch.randn(m, c, generator=gen), torch.randn(m, c, generator=gen)
        w, b = torch.rand(c, generator=gen), torch.rand(c, generator=gen)
        runs = {k: calls(lib, x, g, w, b) for k, lib in libs.items()}
        times: dict[str, list[float]] = {f"{k} {d}": [] for k in libs for d in ("fwd", "bwd")}
        for s in range(args.sets):
            for k in (list(libs) if s % 2 == 0 else list(libs)[::-1]):
                for d in ("fwd", "bwd"):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        runs[k][d]()
                    times[f"{k} {d}"].append((time.perf_counter() - start) / args.calls * 1e6)
        row = {"M": m, "C": c, "us": {k: statistics.median(v) for k, v in times.items()}}
        if "before" in runs:
            row["same_bits"] = all(torch.equal(runs["this"]["out"][k], runs["before"]["out"][k])
                                   for k in runs["this"]["out"])
            for d in ("fwd", "bwd"):
                row[f"{d}_speedup"] = row["us"][f"before {d}"] / row["us"][f"this {d}"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"cpu": f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})", "variant": variant,
            "torch": torch.__version__, "python": platform.python_version(), "commit": git_commit(HERE.parent),
            "before": None if not args.before else git_commit(Path(args.before)),
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["benchmarks/bn_kernels.py", *sys.argv[1:]]), "sets": args.sets,
            "calls": args.calls, "load_avg_1min": os.getloadavg()[0]}
    Path(args.out + ".json").write_text(json.dumps(meta | {"shapes": rows}, indent=1) + "\n")
    before = "before" in libs
    md = ["# The channels-last BatchNorm's native kernels (benchmarks/bn_kernels.py)", "",
          f"`.venv/bin/python {meta['command']}`", "",
          f"CPU: {meta['cpu']}, the `{variant}` kernels, 1 thread; torch {meta['torch']}, Python {meta['python']}; "
          f"commit {meta['commit']}" + (f", before: {meta['before']}" if before else "") + f"; measured "
          f"{meta['measured']}, 1-min load {meta['load_avg_1min']:.2f}.", "",
          f"µs per call, the median of {args.sets} interleaved sets of {args.calls} calls; [M, C] = rows × channels "
          "of a channels-last batch (ResNet-8's BatchNorms at batch 16).", "",
          "| M × C | forward | backward |" + (" forward before | backward before | forward × | backward × | same bits |"
                                              if before else ""),
          "|---|---:|---:|" + ("---:|---:|---:|---:|---|" if before else "")]
    for r in rows:
        u = r["us"]
        line = f"| {r['M']} × {r['C']} | {u['this fwd']:.1f} | {u['this bwd']:.1f} |"
        if before:
            line += (f" {u['before fwd']:.1f} | {u['before bwd']:.1f} | {r['fwd_speedup']:.2f} | "
                     f"{r['bwd_speedup']:.2f} | {'yes' if r['same_bits'] else '**no**'} |")
        md.append(line)
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
