"""`dropfl flower run --num-cpus 1` against 2 on the quickstart app (examples/flower_quickstart, 4 clients, 2 rounds,
MimiC's bounded availability): wall time of `dropfl.flower.simulation.run_app` (Ray's start, the actors' start,
discovery, training, central evaluation, Ray's shutdown), the two settings in alternation, with the load average
(1 min) at each start. Results: benchmarks/results/flower_num_cpus.{json,md}.

    .venv/bin/python benchmarks/flower_num_cpus.py --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"data": {"dataset": "fmnist", "partition": "shards", "clients": 4}, "model": {"model": "logreg"},
          "train": {"lr": 0.05, "batch_size": 32, "epochs": 1}, "strategy": {"algo": "fedavg", "weighting": "samples"},
          "availability": {"kind": "bounded", "tau_max": 3}, "run": {"rounds": 2, "seed": 0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "flower_num_cpus"))
    args = ap.parse_args()
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    from dropfl.flower.simulation import run_app

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            for n in (1, 2):
                load = os.getloadavg()[0]
                t = time.perf_counter()
                run_app(ROOT / "examples" / "flower_quickstart", CONFIG, Path(tmp) / f"run-{k}-{n}", num_cpus=n)
                rows.append({"pair": k, "num_cpus": n, "seconds": round(time.perf_counter() - t, 1),
                             "load_1min": round(load, 2)})
                print(rows[-1], flush=True)
    result = {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(), "runs": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| pair | --num-cpus | seconds | load (1 min) at start |", "|---|---|---|---|"]
    lines += [f"| {r['pair']} | {r['num_cpus']} | {r['seconds']} | {r['load_1min']} |" for r in rows]
    Path(args.out + ".md").write_text(f"# dropfl flower run: --num-cpus 1 against 2 (quickstart, 4 clients, 2 rounds; "
                                      f"{os.cpu_count()} CPUs)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
