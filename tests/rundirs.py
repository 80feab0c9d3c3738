"""Hand-written run directories for the report and reading tests: config.json, metrics.jsonl and participation.csv
as coordinator/rundir.py writes them (docs/run-directory.md), from per-round accuracies and per-client statuses."""

import csv
import json

P, N = ("participated", ""), ("not_selected", "")


def make_run(path, algo, accs, statuses, availability=None, files=()):
    """A run of `algo` with accuracy accs[t] (None: not evaluated) and statuses[t][client] = (status, reason);
    participants and (cumulative) client uploads are counted from the statuses."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"strategy": {"algo": algo},
                                                  "availability": availability or {"kind": "bounded"}}))
    uploads = 0
    with open(path / "metrics.jsonl", "w") as f:
        for t, a in enumerate(accs):
            part = sum(s == "participated" for s, _ in statuses[t])
            uploads += part
            f.write(json.dumps({"round": t, "uploads": t + 1, "client_uploads": uploads, "participants": part,
                                "accuracy": a}) + "\n")
    with open(path / "participation.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "client", "status", "reason"])
        for t, row in enumerate(statuses):
            for c, (status, reason) in enumerate(row):
                w.writerow([t, c, status, reason])
    for name in files:
        (path / name).write_text("{}")
    return path
