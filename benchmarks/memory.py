"""Per-client strategy state, in bytes per client, and the peak memory of large simulations (issue 4 item 3,
issue 17 items 3-5).

1. For every strategy in coordinator.strategies, `init_state(N, w0)` for mimic-cnn (M = 44,426
   parameters) at three client counts, extrapolated to N = 10 000 (tables that grow as N² — FL-FDMS's
   similarity table — included).
2. `dropfl sim --algo mifa --clients 10000 --model mimic-cnn --steps 1` with a low-participation static
   availability, once with --state-store memory and once with --state-store disk, side by side; and on
   the disk store once more with MIFA not absorbing its updates as they arrive (`mifa_10000_disk_no_absorb`:
   round 0's 10,000 deltas all held until aggregate, as before Strategy.absorb), side by side.
3. A large run: N = 100 000 clients, K = 1 000 a round (FedLaAvg, β = K/N, always available), the MLP,
   the state store and participation format left to auto (disk, npz), on FMNIST's training set doubled
   (120,000 samples, 1-2 per client).
Each run is a child process that reports its own peak RSS (ru_maxrss). Writes benchmarks/results/memory.json
and memory.md.

    .venv/bin/python benchmarks/memory.py [--rounds 3] [--engine batched] [--skip-memory-store]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def child(argv: list[str], double_fmnist: bool, no_absorb: bool = False) -> None:
    """Runs `dropfl <argv>` in this (child) process and prints its own peak RSS as the last line, as JSON.
    --double-fmnist: FMNIST's 60,000 training images twice (120,000 samples), so that 100,000 clients of
    the iid partition hold 1 or 2 samples each (a benchmark setting, not a dropfl dataset).
    --no-absorb: MIFA without Strategy.absorb (every delta of a round held until aggregate, as before), for
    the side-by-side measurement; the results are the same bits (tests/test_absorb_exact.py)."""
    from coordinator.strategies.mifa import MIFA
    from edge_client import datasets

    if no_absorb:
        MIFA.absorbs = False

    if double_fmnist:
        plain = datasets.DATASETS["fmnist"]

        def doubled(data_dir=None):
            ds = plain(data_dir)
            train = type(ds.train)(torch.cat([ds.train.x, ds.train.x]), torch.cat([ds.train.y, ds.train.y]))
            return dataclasses.replace(ds, train=train)
        datasets.DATASETS["fmnist"] = doubled
    from coordinator.cli import main as dropfl

    start = time.perf_counter()
    rc = dropfl(argv)
    seconds = time.perf_counter() - start
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"rc": rc, "seconds": seconds, "peak_rss_bytes": me.ru_maxrss * 1024,
                      "workers_peak_rss_bytes": kids.ru_maxrss * 1024}))


def disk(d: Path) -> int:
    """Bytes a directory's files occupy on disk (sparse files: their data only)."""
    return sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file()) if d.exists() else 0


def run(name: str, argv: list[str], double_fmnist: bool = False, no_absorb: bool = False) -> dict:
    """One `dropfl` run in a child process (benchmarks/memory.py --child), its peak RSS and its run directory."""
    out = tempfile.mkdtemp(prefix=f"dropfl-{name}-")
    argv = [*argv, "--out", out, "--no-progress"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(argv)]
    cmd += ["--double-fmnist"] if double_fmnist else []
    cmd += ["--no-absorb"] if no_absorb else []
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ck, live = Path(out) / "checkpoint.pt", Path(out) / "state"
    snaps = Path(out) / "checkpoint.state"
    metrics = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"command": "dropfl " + " ".join(argv) + (" (FMNIST train set doubled: --double-fmnist)"
                                                      if double_fmnist else "") + (
                           " (MIFA without absorb: --no-absorb)" if no_absorb else ""),
            "wall_seconds": wall, **got, "checkpoint_bytes": ck.stat().st_size if ck.exists() else None,
            "state_dir_bytes_on_disk": disk(live), "snapshot_bytes_on_disk": disk(snaps),
            "participation_bytes": disk(Path(out) / "participation") + (
                (Path(out) / "participation.csv").stat().st_size if (Path(out) / "participation.csv").exists()
                else 0),
            "rounds": len(metrics), "participants": [m["participants"] for m in metrics],
            "round_seconds": [round(m["seconds"], 2) for m in metrics],
            "final_accuracy": metrics[-1].get("accuracy") if metrics else None,
            "stderr_tail": proc.stderr[-600:]}


def participation_formats(n: int, rounds: int = 3, k: int = 1_000) -> dict:
    """Bytes and seconds per round of the two participation-log formats at N = n, everyone available, K
    participants (participation.csv's writer against the columnar one, side by side)."""
    import numpy as np

    from coordinator.availability.columnar import ColumnarLog
    from coordinator.availability.models import RoundAvailability
    from coordinator.availability.participation import ParticipationLog

    d = Path(tempfile.mkdtemp(prefix="dropfl-plog-"))
    avail, sel = RoundAvailability(np.ones(n, bool)), list(range(0, n, n // k))
    out = {}
    for name, log, files in (("csv", ParticipationLog(d / "participation.csv"), [d / "participation.csv"]),
                             ("npz", ColumnarLog(d / "participation"), None)):
        start = time.perf_counter()
        for t in range(rounds):
            log.write_round(t, n, avail, sel, set(sel), {})
        seconds = (time.perf_counter() - start) / rounds
        size = sum(f.stat().st_size for f in (files or (d / "participation").iterdir()))
        out[name] = {"bytes_per_round": size / rounds, "seconds_per_round": seconds}
    return {"n_clients": n, "participants": len(sel), "rounds": rounds, **out}


def mifa_argv(rounds: int, engine: str, p: float, store: str) -> list[str]:
    return ["sim", "--algo", "mifa", "--clients", str(N_SIM), "--model", "mimic-cnn", "--dataset", "fmnist",
            "--partition", "iid", "--steps", "1", "--rounds", str(rounds), "--availability", "static", "--p", str(p),
            "--engine", engine, "--eval-every", str(rounds), "--checkpoint-every", str(rounds),
            "--state-store", store]


def large_argv(rounds: int, n: int, k: int) -> list[str]:
    """N clients, exactly K a round: FedLaAvg (β = K/N, the K oldest of everyone available), the MLP."""
    return ["sim", "--algo", "fedlaavg", "--beta", str(k / n), "--clients", str(n), "--model", "mlp",
            "--dataset", "fmnist", "--partition", "iid", "--steps", "1", "--rounds", str(rounds),
            "--availability", "always", "--eval-every", str(rounds), "--checkpoint-every", str(rounds),
            "--state-store", "auto", "--participation-format", "auto"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p", type=float, default=0.01, help="static availability: active probability")
    ap.add_argument("--engine", default="batched", choices=["loop", "batched"])
    ap.add_argument("--large-clients", type=int, default=100_000)
    ap.add_argument("--large-k", type=int, default=1_000)
    ap.add_argument("--skip-memory-store", action="store_true", help="skip the MIFA run with --state-store memory")
    ap.add_argument("--only", nargs="+", help="run only these (names as in memory.json, or participation_log); "
                                             "the others are kept from the existing memory.json with their dates")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--double-fmnist", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-absorb", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child), args.double_fmnist, args.no_absorb)
        return
    w0 = get_flat(build_model("mimic-cnn", (1, 28, 28), 10))
    table = strategy_table(w0)
    plan = {  # name: (run directory prefix, argv, doubled FMNIST[, MIFA without absorb])
        "mifa_10000_memory": ("mifa10k-memory", mifa_argv(args.rounds, args.engine, args.p, "memory"), False),
        "mifa_10000_disk": ("mifa10k-disk", mifa_argv(args.rounds, args.engine, args.p, "disk"), False),
        # as before Strategy.absorb: round 0's 10,000 updates all held until aggregate
        "mifa_10000_disk_no_absorb": (
            "mifa10k-disk-noabs", mifa_argv(args.rounds, args.engine, args.p, "disk"), False, True),
        # round 0 without everyone: ~pN clients every round, so the round's updates (O(K)) stay small
        "mifa_10000_disk_no_first_round_all": (
            "mifa10k-disk-k", mifa_argv(args.rounds, args.engine, args.p, "disk") + ["--no-first-round-all"], False),
        "large": ("large", large_argv(args.rounds, args.large_clients, args.large_k), True)}
    if args.skip_memory_store:
        del plan["mifa_10000_memory"]
    out = Path(args.out)
    previous = json.loads((out / "memory.json").read_text()) if args.only and (out / "memory.json").exists() else {}
    runs = dict(previous.get("runs", {}))  # --only: the other runs as they were measured (each has its date)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")  # one date: runs side by side
    for name, (prefix, argv, double, *no_absorb) in plan.items():
        if not args.only or name in args.only:
            runs[name] = run(prefix, argv, double, *no_absorb) | {"date": started}
    plog = previous.get("participation_log")
    if not args.only or "participation_log" in args.only:
        plog = participation_formats(args.large_clients, k=args.large_k)
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    command = "benchmarks/memory.py " + " ".join(sys.argv[1:])
    result = {"model": "mimic-cnn", "params": w0.numel(), "n_clients": N_SIM, "strategies": table, "runs": runs,
              "large_clients": args.large_clients, "large_k": args.large_k, "machine_memory_bytes": mem_total,
              "cpus": os.cpu_count(), "commands": previous.get("commands", []) + [command], "participation_log": plog,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "memory.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    gib = 2 ** 30
    lines = ["# Strategy state memory (benchmarks/memory.py)", "",
             "Commands: " + "; then ".join(f"`.venv/bin/python {c}`" for c in r["commands"]) +
             f" on {r['cpus']} CPUs, {r['machine_memory_bytes'] / gib:.1f} GiB (shared with other work).", "",
             f"mimic-cnn, M = {r['params']:,} float32 parameters ({4 * r['params']:,} bytes per model copy).", "",
             "| strategy | bytes per client | at N = 10 000 | state tensors |", "|---|---:|---:|---|"]
    for s in r["strategies"]:
        tensors = ", ".join(f"{k} {'×'.join(map(str, shape))} {dt.replace('torch.', '')}"
                            for k, (shape, dt) in s["tensors"].items()) or "none"
        lines.append(f"| {s['strategy']} | {s['bytes_per_client_at_10000']:,.0f} | "
                     f"{s['total_bytes_at_10000'] / 2**20:,.1f} MiB | {tensors} (at N = 100) |")
    lines += ["", "Runs, each in a child process; peak RSS = the coordinator process's own ru_maxrss (batched-engine "
              "worker processes, if any, separately).", "",
              "| run | peak RSS | workers' peak RSS | wall | per round (s) | participants | checkpoint.pt | "
              "state/ on disk | snapshots on disk | participation log |",
              "|---|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    mib = 2 ** 20
    for name, m in r["runs"].items():
        lines.append(" | ".join([
            f"| {name}", f"{m['peak_rss_bytes'] / gib:.2f} GiB", f"{m['workers_peak_rss_bytes'] / gib:.2f} GiB",
            f"{m['wall_seconds']:.0f} s", ", ".join(map(str, m["round_seconds"])),
            ", ".join(map(str, m["participants"])),
            f"{(m['checkpoint_bytes'] or 0) / mib:,.1f} MiB", f"{m['state_dir_bytes_on_disk'] / mib:,.1f} MiB",
            f"{m['snapshot_bytes_on_disk'] / mib:,.1f} MiB", f"{m['participation_bytes'] / mib:,.2f} MiB |"]))
    lines += ["", "Commands (run directories in /tmp):", ""] + [
        f"- {name} ({m.get('date', r['date'])}): `{m['command']}`" for name, m in r["runs"].items()]
    if r.get("participation_log"):
        p = r["participation_log"]
        lines += ["", f"Participation log at N = {p['n_clients']:,}, {p['participants']:,} participants, everyone "
                      f"available (the two writers side by side, {p['rounds']} rounds): participation.csv "
                      f"{p['csv']['bytes_per_round'] / 1e6:.2f} MB and {1e3 * p['csv']['seconds_per_round']:.0f} ms "
                      f"per round; columnar npz {p['npz']['bytes_per_round'] / 1e3:.1f} kB and "
                      f"{1e3 * p['npz']['seconds_per_round']:.0f} ms per round."]
    for old, new, what in (("mifa_10000_memory", "mifa_10000_disk", "disk store / memory store"),
                           ("mifa_10000_disk_no_absorb", "mifa_10000_disk", "absorbed / held until aggregate")):
        a, b = r["runs"].get(old), r["runs"].get(new)
        if a and b and a.get("date") == b.get("date"):  # only runs of one invocation, side by side
            lines += ["", f"MIFA at N = 10,000, measured side by side: {what} peak RSS = "
                          f"{b['peak_rss_bytes'] / a['peak_rss_bytes']:.3f}, wall = "
                          f"{b['wall_seconds'] / a['wall_seconds']:.2f}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
