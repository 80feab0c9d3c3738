"""Round time and memory of one run with its clients trained on a local Ray cluster (issue 17 item 5).

For each (N, K): `dropfl sim` with FedAvg selecting K of N clients a round (IID FMNIST, MimiC CNN, 5
local steps of batch 16, the same `--slices`), once on the local batched engine (2 worker processes) and once
with `--engine ray` on a local Ray cluster of 1 and of 2 nodes (`ray.cluster_utils.Cluster`, loopback,
1 CPU each: 1 and 2 actors). Side by side in one run: round time = the mean `seconds` of the rounds
between the first (which starts the local worker processes) and the last (which evaluates); peak RSS of
the `dropfl sim` process (ru_maxrss) and of the Ray actors (sampled every 0.2 s with psutil, the largest
one). Every Ray run's model.pt is checked bitwise against the local engine's.

This machine has 2 cores shared by everything on it: the "nodes" are processes on those 2 cores, so the
2-node column measures overhead and correctness, not speed-up (docs/scale-out.md projects 100 nodes).

    .venv/bin/python benchmarks/ray_scale.py [--clients 1000,10000] [--k 20,100] [--rounds 3]

Writes benchmarks/results/ray_scale.json and ray_scale.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"


class ActorRss:
    """The largest RSS of any `ray::Trainer` process while running (Ray titles actor processes so)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.wait(0.2):
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::Trainer") and p.info["memory_info"]:
                    self.peak = max(self.peak, p.info["memory_info"].rss)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def sim(out: Path, n: int, k: int, rounds: int, slices: int, engine: str, address: str | None) -> dict:
    cmd = [sys.executable, "-c", "import resource, sys; from coordinator.cli import main; rc = main(sys.argv[1:]); "
           "print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)",
           "sim", "--algo", "fedavg", "--fedavg-k", str(k), "--clients", str(n), "--partition", "iid",
           "--model", "mimic-cnn", "--steps", "5", "--batch-size", "16", "--rounds", str(rounds),
           "--eval-every", str(rounds), "--slices", str(slices), "--engine", engine, "--out", str(out),
           "--no-progress", "--log-level", "warning"]
    if address:
        cmd += ["--ray-address", address]
    with ActorRss() as actors:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    rss = next(int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("maxrss_kib"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    secs = [r["seconds"] for r in rows[1:-1]]   # not the first (start-up) nor the last (evaluation)
    return {"round_s": round(sum(secs) / len(secs), 3), "first_round_s": round(rows[0]["seconds"], 3),
            "driver_rss_mib": round(rss / 1024, 1), "actor_rss_mib": round(actors.peak / 2 ** 20, 1) or None,
            "engine": rows[-1]["engine"], "model": (out / "model.pt").read_bytes()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000", help="N values (comma-separated)")
    ap.add_argument("--k", default="20,100", help="K values, clients selected a round (comma-separated)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (≥ 3: the first and last are not timed)")
    ap.add_argument("--slices", type=int, default=4)
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3")
    ns, ks = [int(x) for x in args.clients.split(",")], [int(x) for x in args.k.split(",")]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # loopback only, in this process and the children
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 400 * 2 ** 20}
    rows: list[dict] = []
    started = time.time()
    cluster = Cluster(initialize_head=True, head_node_args=node | {"include_dashboard": False})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = {}
            for n in ns:
                for k in ks:
                    r = sim(Path(tmp) / f"local-{n}-{k}", n, k, args.rounds, args.slices, "batched", None)
                    local[n, k] = r.pop("model")
                    rows.append({"N": n, "K": k, "where": "local batched engine, 2 processes", "nodes": 0} | r)
                    print(rows[-1], flush=True)
            for nodes in (1, 2):
                if nodes == 2:
                    cluster.add_node(**node)
                    cluster.wait_for_nodes()
                for n in ns:
                    for k in ks:
                        r = sim(Path(tmp) / f"ray{nodes}-{n}-{k}", n, k, args.rounds, args.slices, "ray",
                                cluster.address)
                        same = r.pop("model") == local[n, k]
                        rows.append({"N": n, "K": k, "where": f"Ray, {nodes} node(s) × 1 CPU", "nodes": nodes}
                                    | r | {"bitwise_equal_to_local": same})
                        print(rows[-1], flush=True)
                        if not same:
                            raise SystemExit(f"N={n} K={k} on {nodes} Ray node(s): model differs from the local engine")
    finally:
        cluster.shutdown()
    command = ".venv/bin/python benchmarks/ray_scale.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": f"{os.cpu_count()} cores shared with other work; the Ray nodes are local processes",
              "setup": {"algo": "fedavg", "model": "mimic-cnn", "dataset": "fmnist (iid)", "steps": 5, "batch": 16,
                        "rounds": args.rounds, "slices": args.slices},
              "wall_s": round(time.time() - started, 1), "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ray_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# One run on a local Ray cluster: round time and memory", "", f"Command: `{result['command']}`  ",
             f"Date: {result['date']}; {result['machine']}. FedAvg selecting K of N clients, MimiC CNN, IID "
             f"FMNIST, 5 local steps of batch 16, {args.slices} slices; round time = mean `seconds` of rounds "
             f"2..{args.rounds - 1} (round 1 starts the local worker processes, the last one evaluates). Every Ray "
             "run's model.pt is bitwise the local engine's.", "",
             "| N | K | where | s/round | first round s | driver peak RSS MiB | largest actor RSS MiB "
             "| bitwise = local |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']} | {r['K']} | {r['where']} | {r['round_s']} | {r['first_round_s']} | "
                     f"{r['driver_rss_mib']} | {r['actor_rss_mib'] or '–'} | "
                     f"{'yes' if r.get('bitwise_equal_to_local') else '(reference)' if r['nodes'] == 0 else 'NO'} |")
    (OUT / "ray_scale.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
