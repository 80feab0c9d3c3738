"""FedDD vs FedAvg vs FedCS on the virtual clock (FedDD eq. 12), with the paper's simulation settings.

The virtual-clock half of issue 6's time-to-accuracy benchmark (the emulated-link trial is separate).
Settings (FedDD Table 4 and §8.5 of ../shared/papers/feddd.md): MNIST IID, 100 clients, 1 local epoch,
D_max = 0.8, A_server = 0.6 (FedCS: the same 60 % upload budget), h = 5, per-client rates drawn once
from Table 4 (`coordinator.sim.clock.table4_profile`). Not in the paper, declared here: dropfl's MLP
784-200-200-10 (the paper's is 784-100-64-10), SGD lr 0.1, batch 32, δ = 0, seed 0.

Each method runs the same `dropfl sim` code path; the script reads the run directories' metrics and
reports, per method, the virtual time and uploaded bytes until the first evaluation at or above the
target accuracy, side by side, as ratios to FedAvg. Saves benchmarks/results/feddd_virtual_clock.{json,md}.

    nice .venv/bin/python benchmarks/feddd_virtual_clock.py [--rounds 40] [--target 0.88]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from coordinator.config import SimConfig
from coordinator.rundir import read_metrics
from coordinator.sim.clock import table4_profile
from coordinator.sim.run import run_sim

RESULTS = Path(__file__).parent / "results"
METHODS = ("fedavg", "fedcs", "feddd")


def config(algo: str, args, profile_path: str) -> SimConfig:
    cfg = SimConfig()
    cfg.data.dataset, cfg.data.partition, cfg.data.clients = "mnist", args.partition, args.clients
    cfg.model.model = "mlp"
    cfg.train.lr, cfg.train.batch_size, cfg.train.epochs = args.lr, 32, 1
    cfg.strategy.algo = algo
    cfg.strategy.feddd_d_max, cfg.strategy.feddd_a_server = 0.8, 0.6
    cfg.strategy.feddd_delta, cfg.strategy.feddd_full_every = 0.0, 5
    cfg.clock.profile = profile_path
    cfg.run.rounds, cfg.run.seed, cfg.run.threads, cfg.run.checkpoint_every = args.rounds, 0, 1, args.rounds
    return cfg


def summarise(rows: list[dict], target: float) -> dict:
    hit = next((r for r in rows if (r.get("accuracy") or 0.0) >= target), None)
    last = rows[-1]
    return {"rounds_run": len(rows), "final_accuracy": last["accuracy"],
            "best_accuracy": max(r["accuracy"] for r in rows),
            "virtual_s_total": last["virtual_s_total"], "upload_bytes_total": last["upload_bytes_total"],
            "target_round": None if hit is None else hit["round"],
            "virtual_s_to_target": None if hit is None else hit["virtual_s_total"],
            "upload_bytes_to_target": None if hit is None else hit["upload_bytes_total"],
            "mean_round_virtual_s_after_0": sum(r["virtual_s"] for r in rows[1:]) / max(len(rows) - 1, 1)}


def to_markdown(res: dict) -> str:
    s, m = res["settings"], res["methods"]
    base = m["fedavg"]
    lines = [f"# FedDD on the virtual clock: time to {100 * s['target_accuracy']:.0f}% accuracy", "",
             f"MNIST, partition {s['partition']}, {s['clients']} clients, MLP 784-200-200-10, 1 local epoch, "
             f"batch 32, lr {s['lr']}, "
             f"h = 5, D_max = 0.8, A_server = 0.6, δ = 0; Table 4 rates (profile seed 0); up to {s['rounds']} rounds. "
             "Virtual time = Σ_rounds max_n(t^d + t^cmp + t^u) (eq. 12) with the bytes actually sent.", "",
             "| method | round reaching target | virtual time to target (s) | vs FedAvg | uploaded to target (MB) "
             "| vs FedAvg | mean round after round 0 (s) | final accuracy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in m.items():
        t, b = r["virtual_s_to_target"], r["upload_bytes_to_target"]
        rt = "—" if t is None or base["virtual_s_to_target"] is None else f"{t / base['virtual_s_to_target']:.3f}"
        rb = "—" if b is None or base["upload_bytes_to_target"] is None else f"{b / base['upload_bytes_to_target']:.3f}"
        lines.append(f"| {name} | {r['target_round'] if r['target_round'] is not None else 'not reached'} "
                     f"| {'—' if t is None else f'{t:,.0f}'} | {rt} | {'—' if b is None else f'{b / 1e6:.1f}'} | {rb} "
                     f"| {r['mean_round_virtual_s_after_0']:,.0f} | {100 * r['final_accuracy']:.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--partition", default="iid", help="iid (paper) or a dropfl non-IID partitioner, e.g. shards")
    p.add_argument("--workdir", default="runs/bench-feddd-virtual-clock")
    p.add_argument("--out", default=str(RESULTS / "feddd_virtual_clock"))
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    prof = table4_profile(args.clients, seed=0, batch_size=32)
    profile_path = work / "profile.json"
    profile_path.write_text(json.dumps(prof.to_json()) + "\n")
    methods = {}
    for algo in METHODS:
        start = time.perf_counter()
        run_sim(config(algo, args, str(profile_path)), str(work / algo), progress=False)
        methods[algo] = summarise(read_metrics(work / algo / "metrics.jsonl"), args.target)
        methods[algo]["wall_s"] = time.perf_counter() - start
        print(algo, json.dumps(methods[algo]), flush=True)
    fa, fd = methods["fedavg"]["virtual_s_to_target"], methods["feddd"]["virtual_s_to_target"]
    res = {"settings": {"dataset": "mnist", "partition": args.partition, "clients": args.clients, "model": "mlp",
                        "rounds": args.rounds, "lr": args.lr, "batch_size": 32, "epochs": 1, "d_max": 0.8,
                        "a_server": 0.6, "full_every": 5, "delta": 0.0, "target_accuracy": args.target,
                        "profile": "table4, seed 0", "uplink_Bps_range": [float(prof.up_Bps.min()),
                                                                         float(prof.up_Bps.max())]},
           "methods": methods,
           "feddd_speedup_vs_fedavg": None if not (fa and fd) else fa / fd}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(res))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
