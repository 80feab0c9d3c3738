"""Solve time of the FedDD allocation LP (cvx/allocation.py) for N = 10 .. 10000 clients.

For each N: build the DPP problem once, time the first solve (canonicalisation + solve), then
`--resolves` re-solves with fresh parameter values (Table 4-like random data, δ = 1e3). Reports the
wall time of `solve` and the solver's own time, side by side, and saves
benchmarks/results/cvx_solve_time.{json,md}.

    .venv/bin/python benchmarks/cvx_solve_time.py [--sizes 10 100 1000 10000] [--resolves 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import cvxpy as cp
import numpy as np

from cvx.allocation import AllocationInputs, DropoutAllocator

RESULTS = Path(__file__).parent / "results"


def random_inputs(rng: np.random.Generator, n: int) -> AllocationInputs:
    """Table 4 ranges converted to bytes: r^u 1-5 kbit/s, r^d 40-200 kbit/s; CNN2 fp32 (2.35 MB)."""
    return AllocationInputs(compute_s=rng.uniform(1, 150, n), up_rate=rng.uniform(125, 625, n),
                            down_rate=rng.uniform(5e3, 2.5e4, n), model_bytes=np.full(n, 2_348_776.0),
                            global_bytes=2_348_776.0, num_samples=rng.integers(100, 1000, n).astype(float),
                            label_score=rng.uniform(1, 10, n), loss=rng.uniform(0.5, 2.3, n),
                            delta=1e3, d_max=0.8, a_server=0.6)


def bench(n: int, resolves: int, solver: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    alloc = DropoutAllocator(n, solver=solver)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    first = alloc.solve(random_inputs(rng, n))
    first_s = time.perf_counter() - t
    first_solver_s = alloc.problem.solver_stats.solve_time
    wall, inner, statuses = [], [], [first.status]
    for _ in range(resolves):
        inp = random_inputs(rng, n)
        t = time.perf_counter()
        res = alloc.solve(inp)
        wall.append(time.perf_counter() - t)
        inner.append(alloc.problem.solver_stats.solve_time)
        statuses.append(res.status)
    return {"n": n, "solver": solver, "build_s": build_s, "first_solve_s": first_s,
            "first_solver_internal_s": first_solver_s, "resolve_median_s": statistics.median(wall),
            "resolve_min_s": min(wall), "resolve_max_s": max(wall),
            "resolve_solver_internal_median_s": statistics.median(inner),
            "first_over_resolve": first_s / statistics.median(wall), "statuses": sorted(set(statuses))}


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# FedDD allocation LP: solve time ({meta['solver']}, cvxpy {meta['cvxpy']})", "",
             f"Host: {meta['host']}; {meta['resolves']} re-solves per N; δ = 1e3, D_max = 0.8, A_server = 0.6; "
             "Table 4-like random inputs. Times in milliseconds (wall time of `DropoutAllocator.solve`, "
             "which includes cvxpy's parameter update; 'solver' = the solver's own time).", "",
             "| N | build | first solve | first: solver | re-solve median | re-solve min–max "
             "| re-solve: solver | first / re-solve | status |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {1e3 * r['build_s']:.1f} | {1e3 * r['first_solve_s']:.1f} "
                     f"| {1e3 * r['first_solver_internal_s']:.1f} | {1e3 * r['resolve_median_s']:.1f} "
                     f"| {1e3 * r['resolve_min_s']:.1f}–{1e3 * r['resolve_max_s']:.1f} "
                     f"| {1e3 * r['resolve_solver_internal_median_s']:.1f} | {r['first_over_resolve']:.1f}× "
                     f"| {', '.join(r['statuses'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    p.add_argument("--resolves", type=int, default=5)
    p.add_argument("--solver", default="CLARABEL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "cvx_solve_time"))
    args = p.parse_args()
    rows = []
    for n in args.sizes:
        rows.append(bench(n, args.resolves, args.solver, args.seed))
        r = rows[-1]
        print(f"N={n:>6}: first {1e3 * r['first_solve_s']:.1f} ms, re-solve median "
              f"{1e3 * r['resolve_median_s']:.1f} ms ({r['first_over_resolve']:.1f}x)", flush=True)
    meta = {"solver": args.solver, "cvxpy": cp.__version__, "resolves": args.resolves, "seed": args.seed,
            "host": f"{platform.machine()}, Python {platform.python_version()}"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(rows, meta))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
