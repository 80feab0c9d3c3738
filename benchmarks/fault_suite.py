"""The fault-injection suite as a results table: every scenario of tests/faultkit.py run once, with what dropfl
recorded, whether each invariant held, and the time to recover (the fault's end, or its injection for faults
without one, to the global model of the next round: the run going on).

    .venv/bin/python benchmarks/fault_suite.py                 # mosquitto scenarios (+ netns ones as root)
    .venv/bin/python benchmarks/fault_suite.py --cluster       # also the 3-node RabbitMQ node kill
    .venv/bin/python benchmarks/fault_suite.py --only broker_freeze,agent_kill

Writes benchmarks/results/fault_suite.{json,md}. The same scenarios are the tests of
tests/test_field_fault_suite.py (and the cluster one of tests/test_field_cluster.py), which assert the
invariants; here a failing invariant is recorded in the table, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import faultkit  # noqa: E402
from machine import cpu_model  # noqa: E402

INVARIANTS = ("participants_real", "reasons_true", "nothing_lost_or_doubled", "replay_exact")


def run_cluster(d: Path) -> faultkit.Outcome:
    import rabbit
    if why := rabbit.missing():
        raise SystemExit(f"--cluster: {why}")
    rc = rabbit.RabbitCluster(d / "rabbit", nodes=3, timeout_s=240)
    try:
        for name in ["coordinator"] + [f"client-{i}" for i in range(faultkit.CLUSTER_NODE_KILL.agents)]:
            rc.add_user(name, faultkit.Trial.cluster_password)
        o = faultkit.run_scenario(faultkit.CLUSTER_NODE_KILL, d / "trial", cluster=rc, cluster_victims=(0,))
        o.notes["cluster_start_s"] = round(rc.timings["start_s"], 1)
        o.notes["node_restart_s"] = round(rc.start_node(0), 1)
        o.notes["queues_after_restart"] = rc.ctl(2, "list_queues", "name", "pid", "messages").splitlines()[2:]
    finally:
        rc.close()
    return o


def describe(row: dict) -> str:
    r = row["recorded"]
    parts = [f"participants {r['participants']}", "drops " + (", ".join(f"{k} ×{v}" for k, v in r["drops"].items())
                                                              or "none")]
    if any(r["broker_outage_s"]):
        parts.append(f"broker_outage_s {r['broker_outage_s']}")
    if any(r["empty_federation_s"]):
        parts.append(f"empty_federation_s {r['empty_federation_s']}")
    parts.append(f"sent {r['sent']}, aggregated {r['aggregated']}, discarded {r['discarded']}, "
                 f"duplicates {r['duplicates']}")
    if "reconnects" in row:
        parts.append("reconnects " + ", ".join(f"{k} {v}" for k, v in row["reconnects"].items()))
    return "; ".join(parts)


def markdown(rows: list[dict], meta: dict) -> str:
    out = ["# The fault-injection suite (measured)", "",
           f"{meta['cpus']} × {meta['cpu']}, {meta['system']}, Python {meta['python']}; mosquitto on 127.0.0.1"
           + ("; a 3-node RabbitMQ 3.10 cluster on 127.0.0.1" if meta["cluster"] else "") + ". Command: "
           f"`{meta['command']}` ({meta['wall_s']:.0f} s in all). Each scenario: 3 agent processes (fmnist "
           "shards, logreg, 2 steps; a 2 s training per round where the fault must hit an open round), FedAvg, "
           "the fault injected once round `at` is open (tests/faultkit.py). Invariants: participants real (every "
           "aggregated update logged as sent by its agent in that round), reasons true (every drop one the fault "
           "causes, and the fault's own record), nothing lost or doubled, replay bit for bit. Recovery: from the "
           "fault's end (or its injection where it has none) to the next round's global model.", "",
           "| scenario | fault | at | what dropfl recorded | invariants held | recovery (s) | run (s) |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        held = [k for k in INVARIANTS if row["invariants"].get(k)]
        failed = [k for k in INVARIANTS if not row["invariants"].get(k)]
        inv = "all 4" if not failed else f"{len(held)}/4; failed: " + "; ".join(
            f"{k}: {row['failures'].get(k, '')}" for k in failed)
        rec = "–" if row["recover_s"] is None else f"{row['recover_s']:.1f}"
        out.append(f"| {row['scenario']} | {row['fault_text']} | {row['at_round']} | {describe(row)} | {inv} | "
                   f"{rec} | {row['wall_s']:.0f} |")
    out += ["", "How to read it: `sent` counts (round, client) pairs whose agent logged every chunk of its update as "
            "acknowledged by the broker; `aggregated` the participants; `discarded` the updates the coordinator "
            "received and logged as discarded (late, after their round closed, or for a client already dropped in "
            "it); `duplicates` second copies of an update within its round (re-sent after a reconnect), aggregated "
            "once. Reconnects: the disconnects and failed connects in each process's log. Recovery for "
            "coordinator_kill_resume runs from the resumed coordinator's start (its startup included) to the "
            "interrupted round's model; for slow_uplink from the rate limit (at round 0) to round 1's model. The "
            "machine was shared with other test runs: times are indicative; the invariants are not."]
    for row in rows:
        if row.get("queues_after_restart"):
            out += ["", f"{row['scenario']}: the cluster started in {row.get('cluster_start_s')} s; the killed node "
                    f"was back {row.get('node_restart_s')} s after its restart; then it held the old client ids' "
                    "queues, without a consumer (name, pid, messages): "
                    + "; ".join(f"`{q.replace(chr(9), ' ')}`" for q in row["queues_after_restart"][1:])
                    + " (benchmarks/results/field_cluster.md: an `expires` policy deletes them)."]
    out.append("")
    skipped = meta.get("skipped")
    if skipped:
        out += [f"Not run here: {skipped}.", ""]
    return "\n".join(out)


FAULT_TEXT = {
    "broker_freeze": "mosquitto SIGSTOP 6 s, then SIGCONT (heartbeat timeout 3 s)",
    "broker_kill_restart": "mosquitto SIGKILL, restarted on its port 2 s later",
    "agent_kill": "agent 1 SIGKILL while training, not restarted",
    "agent_kill_restart": "agent 1 SIGKILL while training, restarted at once",
    "coordinator_kill_resume": "coordinator SIGKILL in round 2, then `--resume`",
    "slow_uplink": "agent 1's uplink 6 kB/s (tc tbf; heartbeat timeout 3 s)",
    "link_down": "agent 1's veth down 6 s, then up (heartbeat timeout 3 s)",
    "cluster_node_kill": "RabbitMQ node 1 of 3 (the coordinator's and agent 0's) SIGKILL, stays dead",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", action="store_true", help="also the 3-node RabbitMQ node kill (~2 min more)")
    p.add_argument("--only", help="comma-separated scenario names")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_suite"))
    p.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    args = p.parse_args()
    if args.render:
        data = json.loads(Path(args.out).with_suffix(".json").read_text())
        Path(args.out).with_suffix(".md").write_text(markdown(data["rows"], data["meta"]))
        return 0
    names = list(faultkit.SCENARIOS) + (["cluster_node_kill"] if args.cluster else [])
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    skipped = []
    if os.geteuid() != 0:
        skipped = [n for n in names if n in faultkit.NETNS_FAULTS]
        names = [n for n in names if n not in faultkit.NETNS_FAULTS]
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dropfl-faults-") as tmp:
        for name in names:
            print(f"--- {name}", flush=True)
            d = Path(tmp) / name
            try:
                o = run_cluster(d) if name == "cluster_node_kill" else \
                    faultkit.run_scenario(faultkit.SCENARIOS[name], d)
                row = o.row()
            except (AssertionError, RuntimeError, TimeoutError, OSError) as e:
                row = {"scenario": name, "fault": name, "recorded": {}, "invariants": {}, "failures":
                       {"run": f"{type(e).__name__}: {str(e)[:500]}"}, "recover_s": None, "wall_s": 0.0}
                row["recorded"] = {"participants": [], "drops": {}, "broker_outage_s": [], "empty_federation_s": [],
                                   "sent": 0, "aggregated": 0, "discarded": 0, "duplicates": 0}
            sc = faultkit.SCENARIOS.get(name) or faultkit.CLUSTER_NODE_KILL
            row["fault_text"], row["at_round"] = FAULT_TEXT[name], sc.at_round
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"cpu": cpu_model(), "cpus": os.cpu_count(), "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "cluster": args.cluster, "wall_s": time.monotonic() - t0,
            "command": "python benchmarks/fault_suite.py" + (" --cluster" if args.cluster else "")
            + (f" --only {args.only}" if args.only else ""), "skipped": ", ".join(skipped) + " (need root)"
            if skipped else ""}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, meta))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
