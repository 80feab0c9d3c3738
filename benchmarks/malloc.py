"""What keeping freed memory (coordinator/alloc.py) saves, side by side in one run: glibc's defaults
(DROPFL_MALLOC=default) against dropfl's settings, alternated A/B so that the machine's load hits both.

1. The coordinator's evaluation alone: the MimiC CNN on 10,000 FMNIST-shaped images, 6 evaluations in 3
   threads one after another (as lockstep's runs take turns); CPU user/sys seconds and page faults.
2. A real sweep: `dropfl reproduce mimic-table3` (FedAvg, MIFA, MimiC at τmax 20, 1 trial, --rounds R, the
   lockstep executor); wall seconds, CPU user/sys and page faults of the coordinator with its worker
   processes, the largest peak RSS of one of them, and whether the models and metrics are the same bytes.

    python benchmarks/malloc.py [--rounds 15] [--repeats 2]   # writes benchmarks/results/malloc.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = """
import json, resource, sys, threading, time
import coordinator.cli
import torch
from coordinator.alloc import keep_freed_memory
from edge_client.models import build_model, get_flat
from edge_client.trainer import evaluate
kept = keep_freed_memory()
torch.manual_seed(0)
x, y = torch.rand(10_000, 1, 28, 28), torch.randint(0, 10, (10_000,))
m = build_model("mimic-cnn", (1, 28, 28), 10, seed=0)
w = get_flat(m)
evaluate(m, w, x, y)
def work():
    for _ in range(2):
        evaluate(m, w, x, y)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(3):
    t = threading.Thread(target=work); t.start(); t.join()
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"kept": kept, "wall_s": time.perf_counter() - t0, "user_s": r1.ru_utime - r0.ru_utime,
                  "sys_s": r1.ru_stime - r0.ru_stime, "faults": r1.ru_minflt - r0.ru_minflt}))
"""


def env_for(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DROPFL_MALLOC"}
    return env | ({"DROPFL_MALLOC": "default"} if mode == "default" else {})


def evaluation(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", EVAL], cwd=ROOT, env=env_for(mode), capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout)


def sweep(mode: str, rounds: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "coordinator.cli", "reproduce", "mimic-table3", "--methods", "FedAvg,MIFA,MimiC",
           "--taus", "20", "--trials", "1", "--rounds", str(rounds), "--out", str(out / "runs"),
           "--results", str(out / "results"), "--quiet"]
    t0 = time.perf_counter()
    with open(out / "stderr.txt", "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env_for(mode), stdout=subprocess.DEVNULL, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)   # the coordinator and its (waited-for) worker processes
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"the sweep failed: {(out / 'stderr.txt').read_text()[-2000:]}")
    runs = sorted((out / "runs").iterdir())
    files = {r.name: ((r / "model.pt").read_bytes(),
                      [{k: v for k, v in json.loads(x).items() if k not in ("seconds", "elapsed")}
                       for x in (r / "metrics.jsonl").read_text().splitlines()]) for r in runs}
    return {"wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "faults": ru.ru_minflt,
            "maxrss_mb": ru.ru_maxrss / 1024, "files": files}


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--rounds", type=int, default=15)
    a.add_argument("--repeats", type=int, default=2)
    a.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "malloc"))
    args = a.parse_args(argv)
    load0 = os.getloadavg()
    modes = ["default", "kept"]
    evals = {m: [] for m in modes}
    sweeps = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            evals[m].append(evaluation(m))
    for _ in range(args.repeats):
        for m in modes:
            with tempfile.TemporaryDirectory(prefix="dropfl-malloc-") as tmp:
                s = sweep(m, args.rounds, Path(tmp))
                sweeps[m].append(s)
                print(m, {k: round(v, 2) for k, v in s.items() if isinstance(v, float)}, flush=True)
    same = all(s["files"] == sweeps["default"][0]["files"] for m in modes for s in sweeps[m])

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
           "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
           "command": "python benchmarks/malloc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "evaluation": {m: {k: round(med(evals[m], k), 3) for k in ("wall_s", "user_s", "sys_s", "faults")}
                          for m in modes},
           "sweep": {m: {k: round(med(sweeps[m], k), 2) for k in ("wall_s", "user_s", "sys_s", "faults", "maxrss_mb")}
                     for m in modes},
           "sweep_same_bytes": same, "rounds": args.rounds, "repeats": args.repeats}
    e, s = res["evaluation"], res["sweep"]
    cpu = {m: s[m]["user_s"] + s[m]["sys_s"] for m in modes}
    res["ratios"] = {"evaluation_cpu": round((e["default"]["user_s"] + e["default"]["sys_s"]) /
                                             (e["kept"]["user_s"] + e["kept"]["sys_s"]), 3),
                     "sweep_cpu": round(cpu["default"] / cpu["kept"], 3),
                     "sweep_wall": round(s["default"]["wall_s"] / s["kept"]["wall_s"], 3)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = [
        "# Keeping freed memory in the coordinator's process (coordinator/alloc.py)", "",
        f"Machine: {res['machine']}; load average before {res['load_before']}, after {res['load_after']} "
        "(1/5/15 min). glibc's defaults (`DROPFL_MALLOC=default`) and dropfl's settings alternated, "
        f"{args.repeats} repeats each; medians.", "", f"Command: `{res['command'].strip()}`", "",
        "## The coordinator's evaluation (6 evaluations of the MimiC CNN on 10,000 images, 3 threads in turn)", "",
        "| malloc | wall s | CPU user s | CPU sys s | page faults |", "|---|---:|---:|---:|---:|"]
    for m in modes:
        r = e[m]
        lines.append(f"| {m} | {r['wall_s']:.2f} | {r['user_s']:.2f} | {r['sys_s']:.2f} | {int(r['faults']):,} |")
    lines += ["", f"## A sweep: `dropfl reproduce mimic-table3` FedAvg, MIFA, MimiC, τmax 20, 1 trial, "
              f"{args.rounds} rounds (lockstep)", "",
              "| malloc | wall s | CPU user s | CPU sys s | page faults | largest peak RSS of a process, MB |",
              "|---|---:|---:|---:|---:|---:|"]
    for m in modes:
        r = s[m]
        lines.append(f"| {m} | {r['wall_s']:.1f} | {r['user_s']:.1f} | {r['sys_s']:.1f} | {int(r['faults']):,} | "
                     f"{r['maxrss_mb']:.0f} |")
    lines += ["", "CPU and page faults: the coordinator and its worker processes together (wait4)."]
    lines += ["", f"Ratios default / kept: evaluation CPU **{res['ratios']['evaluation_cpu']}×**, sweep CPU "
              f"**{res['ratios']['sweep_cpu']}×**, sweep wall {res['ratios']['sweep_wall']}× (wall time is only "
              "comparable within this run). Models and metrics of every sweep the same bytes: "
              f"**{'yes' if same else 'NO'}**.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
