"""Why MIFA falls behind FedAvg in MimiC Table 3 with uniform τ: how stale its table is, and in which lr scale.

MIFA (as MimiC's released code runs it, `--mifa-storage raw`) applies the mean of every client's latest delta
every round. A delta is stored in the lr scale of the round it was trained in; the Table 3 schedule decays the lr
as max(0.01·0.95^t, 1e-5). So a table row from round s weighs lr_s / lr_t times what a fresh update of round t
would. This script reads finished Table 3 runs (participation log and the lr of each round in metrics.jsonl) and
reports, per MIFA run:

- A_t = mean_i lr_{last_i(t)} / lr_t: how much larger the raw table's step is than the lr-normalised one's,
  at rounds 50, 100 and the last (1 = every row fresh or a constant lr);
- the mean age of the table's rows (rounds since each client's last upload), averaged over rounds;
- the final accuracy of MIFA (raw), of MIFA with `--mifa-storage lr-normalised` where that run exists (same
  τmax and seed), and of FedAvg.

    python benchmarks/mifa_staleness.py [--runs runs/table3] [--lrnorm runs/table3-mifa-lrnorm]
        [--out benchmarks/results/mimic_table3_mifa]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.availability.participation import read_rows  # noqa: E402
from coordinator.rundir import read_metrics  # noqa: E402

RUN = re.compile(r"^(?P<method>[a-z]+)-tau(?P<tau>\d+)-s(?P<seed>\d+)$")


def final(path: Path) -> float | None:
    rows = read_metrics(path / "metrics.jsonl") if (path / "model.pt").exists() else []
    acc = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    return round(100 * acc[-1], 2) if acc else None


def staleness(path: Path) -> dict:
    """A_t at a few rounds and the mean row age, from the participation log and the per-round lr."""
    metrics = read_metrics(path / "metrics.jsonl")
    lr = np.array([m["lr"] for m in metrics], dtype=np.float64)
    n = json.loads((path / "config.json").read_text())["data"]["clients"]
    uploads: dict[int, list[int]] = {}
    for r in read_rows(path / "participation.csv"):
        if r["status"] == "participated":
            uploads.setdefault(int(r["round"]), []).append(int(r["client"]))
    last = np.full(n, -1, dtype=np.int64)
    amp, ages = [], []
    for t in range(len(lr)):
        last[uploads.get(t, [])] = t
        seen = last >= 0
        amp.append(float(lr[last[seen]].mean() / lr[t]))
        ages.append(float((t - last[seen]).mean()))
    pick = {f"A_{t}": round(amp[t], 2) for t in (50, 100, len(lr) - 1) if t < len(lr)}
    return {**pick, "A_max": round(max(amp), 1), "mean_age": round(statistics.fmean(ages), 1),
            "rounds": len(lr)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="runs/table3")
    p.add_argument("--lrnorm", default="runs/table3-mifa-lrnorm")
    p.add_argument("--out", default="benchmarks/results/mimic_table3_mifa")
    a = p.parse_args(argv)
    runs, lrnorm = Path(a.runs), Path(a.lrnorm)
    rows = []
    for d in sorted(runs.iterdir()):
        m = RUN.match(d.name)
        if not m or m["method"] != "mifa" or final(d) is None:
            continue
        tau, seed = int(m["tau"]), int(m["seed"])
        row = {"tau_max": tau, "seed": seed, "mifa_raw": final(d),
               "mifa_lr_normalised": final(lrnorm / d.name) if (lrnorm / d.name).exists() else None,
               "fedavg": final(runs / f"fedavg-tau{tau}-s{seed}"),
               "mimic": final(runs / f"mimic-tau{tau}-s{seed}"), **staleness(d)}
        rows.append(row)
    if not rows:
        print(f"no finished MIFA runs under {runs}", file=sys.stderr)
        return 1
    rows.sort(key=lambda r: (r["tau_max"], r["seed"]))
    cols = ["tau_max", "seed", "fedavg", "mifa_raw", "mifa_lr_normalised", "mimic", "A_50", "A_100",
            f"A_{rows[0]['rounds'] - 1}", "A_max", "mean_age"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("—" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    cmd = "python benchmarks/mifa_staleness.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.with_suffix(".md").write_text(
        "# MIFA in MimiC Table 3 (uniform τ): staleness of its table and the lr scale of its rows\n\n"
        f"Command: `{cmd.strip()}` (reads the finished runs under `{runs}` and `{lrnorm}`).\n\n"
        "Accuracies: % after the last round. A_t = mean over stored rows of lr(round the row was trained) / "
        "lr(t): how much larger MIFA's raw step is than the lr-normalised one at round t. mean_age: rounds since "
        "each client's last upload, averaged over clients and rounds. Analysis: "
        "[mimic_table3_notes.md](mimic_table3_notes.md).\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
