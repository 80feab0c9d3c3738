"""Sweep throughput: the serial and the lockstep executor (coordinator/sim/sweep.py) side by side in one run,
on a reduced MimiC Table 3 grid (issue 16 item 3).

Workload: the real Table 3 setup (`coordinator.report.reproduce.sim_config`: mimic-cnn on FMNIST, 30 clients
of 2000 samples, batch 16, 5 epochs = 625 steps per client and round, bounded availability) for the 5
methods at one τmax and one trial, `--rounds` rounds each (SCAFFOLD half, as in the paper). The same jobs
run with `executor="serial"` (one run after the other, each with its own batched engine) and then
`executor="lockstep"` (the 5 runs advance together; each round's clients of all runs train in one engine).

Measured: wall time of each executor, client-steps (Σ selected clients × 625) per second, their ratio, and
whether every run's model.pt and metrics (without the timing fields) are bitwise equal between the two.
Projected: the full Table 3 (5 methods × 3 τmax × 3 trials = 45 runs, 200 rounds, SCAFFOLD 100) at each
executor's measured client-steps/s, with the clients each round would train taken from the availability
model itself (every method trains every available client: checked on the measured rounds).

    .venv/bin/python benchmarks/sweep_throughput.py [--rounds 3] [--tau 20] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.report.reproduce import METHODS, PAPER_TABLE3, Setup, sim_config  # noqa: E402
from coordinator.runsetup import build_availability  # noqa: E402
from coordinator.sim.sweep import Job, run_sweep  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMING = ("seconds", "elapsed")


def steps_per_client(setup: Setup) -> int:
    per_client = 60000 // setup.clients                       # shards: FMNIST's 60,000 images, equal shares
    return setup.epochs * -(-per_client // 16)                # 5 epochs of ceil(2000 / 16) batches = 625


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def full_table_client_steps(setup: Setup, steps: int) -> tuple[int, int]:
    """Client-steps and run-rounds of the full Table 3 (3 trials), from the availability model alone."""
    total, run_rounds = 0, 0
    for tau in (int(t) for t in PAPER_TABLE3["FedAvg"]):
        for trial in range(3):
            for method in METHODS:
                s = Setup(rounds=200)
                cfg = sim_config(s, method, tau, trial, Path("unused"))
                avail = build_availability(cfg)
                for t in range(s.rounds_for(method)):
                    total += int(avail.round(t).available.sum()) * steps
                    run_rounds += 1
    return total, run_rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tau", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    setup = Setup(rounds=args.rounds)
    steps = steps_per_client(setup)
    work = Path(tempfile.mkdtemp(prefix="sweep-bench-"))
    result: dict = {"command": " ".join(["python benchmarks/sweep_throughput.py", *sys.argv[1:]]),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "python": platform.python_version()},
                    "workload": {"methods": list(METHODS), "tau": args.tau, "trial": 0, "rounds": args.rounds,
                                 "clients": setup.clients, "steps_per_client_round": steps,
                                 "model": setup.model, "dataset": setup.dataset},
                    "executors": {}}
    try:
        for ex in ("serial", "lockstep"):
            jobs = [Job(sim_config(setup, m, args.tau, 0, work / ex / m), work / ex / m, label=m) for m in METHODS]
            before = load()
            t0 = time.perf_counter()
            run_sweep(jobs, executor=ex, progress=False, log=lambda line: print(f"  {line}", flush=True))
            wall = time.perf_counter() - t0
            metrics = {j.label: rows(j.out) for j in jobs}
            cs = sum(r["selected"] for rs in metrics.values() for r in rs) * steps
            result["executors"][ex] = {
                "wall_s": round(wall, 1), "client_steps": cs, "client_steps_per_s": round(cs / wall, 1),
                "loadavg_before": before, "loadavg_after": load(),
                "peak_rss_main_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "engine": sorted({r["engine"] for rs in metrics.values() for r in rs})}
            print(f"{ex}: {wall:.1f} s, {cs / wall:.0f} client-steps/s", flush=True)
        same, all_selected = {}, True
        for m in METHODS:
            a, b = work / "serial" / m, work / "lockstep" / m
            ra = [{k: v for k, v in r.items() if k not in TIMING} for r in rows(a)]
            rb = [{k: v for k, v in r.items() if k not in TIMING} for r in rows(b)]
            same[m] = (a / "model.pt").read_bytes() == (b / "model.pt").read_bytes() and ra == rb
            all_selected &= all(r["selected"] == r["available"] for r in ra)
        s, lk = result["executors"]["serial"], result["executors"]["lockstep"]
        ratio = s["wall_s"] / lk["wall_s"]
        total, run_rounds = full_table_client_steps(setup, steps)
        result["bitwise_equal"] = same
        result["speedup_lockstep_over_serial"] = round(ratio, 2)
        result["projection_full_table3"] = {
            "runs": 45, "run_rounds": run_rounds, "client_steps": total,
            "every_method_trains_every_available_client": all_selected,
            "serial_h": round(total / s["client_steps_per_s"] / 3600, 2),
            "lockstep_h": round(total / lk["client_steps_per_s"] / 3600, 2),
            "how": "client-steps of the full grid (availability model, 625 steps per available client and round) "
                   "divided by each executor's measured client-steps/s on the reduced grid"}
        print(f"lockstep / serial speed: {ratio:.2f}x; bitwise equal: {same}")
        print(f"full Table 3 projected: serial {result['projection_full_table3']['serial_h']} h, "
              f"lockstep {result['projection_full_table3']['lockstep_h']} h")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_throughput.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "sweep_throughput.md").write_text(markdown(result))


def markdown(r: dict) -> str:
    p = r["projection_full_table3"]
    w = r["workload"]
    lines = [
        "# Sweep throughput: serial vs lockstep executor", "",
        f"Command: `{r['command']}` ({r['date']}, {r['machine']['cpus']} CPUs, {r['machine']['platform']}).", "",
        f"Workload: the MimiC Table 3 setup ({w['model']} on {w['dataset']}, {w['clients']} clients, "
        f"{w['steps_per_client_round']} steps per client and round), {len(w['methods'])} methods × τmax = {w['tau']} "
        f"× 1 trial, {w['rounds']} rounds (SCAFFOLD half). Both executors ran the same jobs one after the other "
        "in one process, **on a shared machine beside other load** (load averages below): the ratio is the "
        "measurement, the absolute times are pessimistic.", "",
        "| executor | wall s | client-steps/s | load avg before → after | engine |",
        "|---|---|---|---|---|"]
    for name, e in r["executors"].items():
        lines.append(f"| {name} | {e['wall_s']} | {e['client_steps_per_s']} | {e['loadavg_before']} → "
                     f"{e['loadavg_after']} | {', '.join(e['engine'])} |")
    lines += ["", f"Lockstep is **{r['speedup_lockstep_over_serial']}×** the serial executor's speed. "
              f"Every run's model.pt and metrics (without `seconds`, `elapsed`) are bitwise equal between the two: "
              f"{all(r['bitwise_equal'].values())} ({', '.join(f'{k}: {v}' for k, v in r['bitwise_equal'].items())}).",
              "", f"Projected full Table 3 ({p['runs']} runs, {p['run_rounds']} run-rounds, {p['client_steps']:,} "
              f"client-steps): serial **{p['serial_h']} h**, lockstep **{p['lockstep_h']} h** ({p['how']}; every "
              f"method trains every available client in the measured rounds: "
              f"{p['every_method_trains_every_available_client']}). The projection holds for the load the "
              "measurement ran under; on an idle machine both executors are faster (compare the engine's "
              "client-steps/s in sim_throughput.md).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
