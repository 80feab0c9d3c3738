"""Per-client strategy state, in bytes per client, and the peak memory of a MIFA simulation with
N = 10 000 FMNIST clients (issue 4, item 3).

1. For every strategy in coordinator.strategies, `init_state(N, w0)` for mimic-cnn (M = 44,426
   parameters) at two client counts; bytes per client = (bytes(N2) − bytes(N1)) / (N2 − N1) at the
   larger N (tables that grow as N² — FL-FDMS's similarity table — are reported at N = 10 000 too).
2. `dropfl sim --algo mifa --clients 10000 --model mimic-cnn --steps 1` with a low-participation
   static availability, run in a child process; its peak RSS (ru_maxrss) is recorded.

Writes benchmarks/results/memory.json and memory.md.

    .venv/bin/python benchmarks/memory.py [--rounds 3] [--engine batched]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.config import StrategyConfig  # noqa: E402
from coordinator.strategies import STRATEGIES  # noqa: E402
from edge_client.models import build_model, get_flat  # noqa: E402

N_SIM = 10_000


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def strategy_table(w0: torch.Tensor) -> list[dict]:
    rows = []
    for name, cls in STRATEGIES.items():
        s = cls.from_config(StrategyConfig()) if hasattr(cls, "from_config") else cls()
        small, large = 100, 1000
        b_small, b_large = state_bytes(s.init_state(small, w0)), state_bytes(s.init_state(large, w0))
        per_client = (b_large - b_small) / (large - small)
        # extrapolate to N_SIM exactly: b(N) = a + b·N + c·N² fitted on three points
        b_mid = state_bytes(s.init_state(550, w0))
        n = torch.tensor([small, 550, large], dtype=torch.float64)
        a = torch.stack([torch.ones(3, dtype=torch.float64), n, n * n], 1)
        coef = torch.linalg.solve(a, torch.tensor([b_small, b_mid, b_large], dtype=torch.float64))
        at_n = float(coef[0] + coef[1] * N_SIM + coef[2] * N_SIM ** 2)
        rows.append({"strategy": name, "bytes_per_client_at_1000": per_client,
                     "bytes_per_client_at_10000": at_n / N_SIM, "total_bytes_at_10000": at_n,
                     "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in s.init_state(small, w0).items()
                                 if isinstance(v, torch.Tensor)}})
    return rows


def mifa_run(rounds: int, engine: str, p: float) -> dict:
    out = tempfile.mkdtemp(prefix="dropfl-mifa10k-")
    cmd = [sys.executable, "-m", "coordinator.cli", "sim", "--algo", "mifa", "--clients", str(N_SIM),
           "--model", "mimic-cnn", "--dataset", "fmnist", "--partition", "iid", "--steps", "1",
           "--rounds", str(rounds), "--availability", "static", "--p", str(p), "--engine", engine,
           "--eval-every", str(rounds), "--checkpoint-every", str(rounds), "--out", out, "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB, largest child
    if proc.returncode != 0:
        raise RuntimeError(f"MIFA N={N_SIM} run failed:\n{proc.stderr[-3000:]}")
    ck = Path(out) / "checkpoint.pt"
    return {"command": " ".join(cmd[1:]), "seconds": seconds, "peak_rss_bytes": peak_kib * 1024,
            "checkpoint_bytes": ck.stat().st_size if ck.exists() else None, "stdout_tail": proc.stdout[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.01, help="static availability: active probability")
    ap.add_argument("--engine", default="batched", choices=["loop", "batched"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    w0 = get_flat(build_model("mimic-cnn", (1, 28, 28), 10))
    table = strategy_table(w0)
    run = mifa_run(args.rounds, args.engine, args.p)
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    result = {"model": "mimic-cnn", "params": w0.numel(), "n_clients": N_SIM, "strategies": table,
              "mifa_10000": run, "machine_memory_bytes": mem_total,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "memory.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    lines = ["# Strategy state memory (benchmarks/memory.py)", "",
             f"mimic-cnn, M = {r['params']:,} float32 parameters ({4 * r['params']:,} bytes per model copy).", "",
             "| strategy | bytes per client | at N = 10 000 | state tensors |", "|---|---:|---:|---|"]
    for s in r["strategies"]:
        tensors = ", ".join(f"{k} {'×'.join(map(str, shape))} {dt.replace('torch.', '')}"
                            for k, (shape, dt) in s["tensors"].items()) or "none"
        lines.append(f"| {s['strategy']} | {s['bytes_per_client_at_10000']:,.0f} | "
                     f"{s['total_bytes_at_10000'] / 2**20:,.1f} MiB | {tensors} (at N = 100) |")
    m = r["mifa_10000"]
    lines += ["", f"MIFA simulation, N = {r['n_clients']:,} clients: `{m['command']}`", "",
              f"- peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GiB of {r['machine_memory_bytes'] / 2**30:.1f} GiB; "
              f"wall {m['seconds']:.0f} s; checkpoint {(m['checkpoint_bytes'] or 0) / 2**30:.2f} GiB", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
