"""Field-mode load: 100 agents (10 per process) × 20 rounds through one private mosquitto on 127.0.0.1.

Checks that no update is lost or duplicated (every agent counts the updates it trained and uploaded;
the coordinator counts what it aggregated and what it discarded as a redelivery), and reports the
round overhead = round wall time − the slowest participant's download + train + upload time. Then a
normal `dropfl trial` (10 agents with modelled batteries × 20 rounds) for the same overhead figure,
its battery dropouts, and its replay in simulation.

    .venv/bin/python benchmarks/field_load.py            # writes benchmarks/results/field_load.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ["--model", "logreg", "--partition", "iid", "--steps", "2", "--lr", "0.05", "--seed", "0",
            "--threads", "1", "--algo", "fedavg"]


def worker(args) -> int:
    """Run agents first..first+count-1 in this process, one thread each; write their upload counts."""
    import torch

    from edge_client import logs
    from edge_client.agent import Agent, config_from_dict

    logs.setup()  # the agents' `[agent client-i] ...` lines go to this worker's log, as before
    torch.set_num_threads(1)
    agents = []
    for i in range(args.first, args.first + args.count):
        cfg = config_from_dict({
            "agent": {"client": i, "broker": args.broker, "heartbeat_s": 2.0, "out": f"{args.out}/client-{i}",
                      "exit_when_done": True},
            "data": {"dataset": "fmnist", "partition": "iid", "clients": args.clients, "seed": 0},
            "model": {"model": "logreg"}, "battery": {"source": "mains"}})
        agents.append(Agent(cfg))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [a.stop() for a in agents])
    threads = [threading.Thread(target=a.run, name=a.id) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = {a.client_idx: a.rounds_trained for a in agents}
    Path(args.out, f"uploads-{args.first}.json").write_text(json.dumps(counts))
    return 0


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1], "n": len(xs)}


def round_events(run: Path) -> list[dict]:
    return [e for e in map(json.loads, open(run / "field.jsonl")) if e["event"] == "round"]


def load_test(agents: int, per_proc: int, rounds: int, tmp: Path) -> dict:
    from coordinator.availability.participation import read_rows
    from coordinator.trial.broker import Mosquitto

    run = tmp / "load"
    procs = []
    try:
        with Mosquitto(workdir=tmp / "broker") as broker:
            for first in range(0, agents, per_proc):
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--broker", broker.url, "--clients", str(agents),
                     "--first", str(first), "--count", str(min(per_proc, agents - first)),
                     "--out", str(tmp / "agents")],
                    stdout=subprocess.DEVNULL, stderr=open(tmp / f"worker-{first}.log", "w"), start_new_session=True))
            start = time.perf_counter()
            coord = subprocess.run(
                [sys.executable, "-m", "coordinator.cli", "coordinator", "--broker", broker.url,
                 "--clients", str(agents), "--rounds", str(rounds), "--out", str(run), "--deadline", "120",
                 "--wait-timeout", "600", "--heartbeat-timeout", "30", "--no-progress", *SETTINGS],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp / "coordinator.log", "w"))
            total_s = time.perf_counter() - start
            if coord.returncode != 0:
                raise SystemExit(f"coordinator failed; see {tmp / 'coordinator.log'}")
            for p in procs:
                p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    sent: dict[int, int] = {}
    for f in (tmp / "agents").glob("uploads-*.json"):
        sent |= {int(k): v for k, v in json.loads(f.read_text()).items()}
    rows = read_rows(run / "participation.csv")
    aggregated: dict[int, int] = {}
    for r in rows:
        if r["status"] == "participated":
            aggregated[int(r["client"])] = aggregated.get(int(r["client"]), 0) + 1
    ev = round_events(run)
    selected = sum(e["selected"] for e in ev)
    return {
        "agents": agents, "agents_per_process": per_proc, "rounds": rounds, "total_s": total_s,
        "selected": selected, "aggregated": sum(aggregated.values()), "uploads_sent": sum(sent.values()),
        "lost": selected - sum(aggregated.values()),
        "agents_whose_sent_differs_from_aggregated": sum(1 for c in sent if sent[c] != aggregated.get(c, 0)),
        "redeliveries_discarded": sum(e["duplicates"] for e in ev), "rejected": sum(e["rejected"] for e in ev),
        "dropped": sum(len(e["dropped"]) for e in ev),
        "round_wall_s": stats([e["wall_s"] for e in ev]),
        "slowest_participant_s": stats([e["slowest_participant_s"] for e in ev]),
        "overhead_s": stats([e["overhead_s"] for e in ev]),
        "overhead_excl_agent_wait_s": stats([e["overhead_excl_agent_wait_s"] for e in ev]),
        "onnx_export_s": stats([e["export_s"] for e in ev]),
    }


def normal_trial(agents: int, rounds: int, tmp: Path) -> dict:
    import torch

    run = tmp / "trial"
    cmd = [sys.executable, "-m", "coordinator.cli", "trial", "--agents", str(agents), "--rounds", str(rounds),
           "--out", str(run), "--no-progress", *SETTINGS]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=open(tmp / "trial.log", "w"))
    sim = tmp / "trial-sim"
    subprocess.run([sys.executable, "-m", "coordinator.cli", "sim", "--clients", str(agents), "--rounds", str(rounds),
                    "--availability", "replay", "--trace", str(run / "participation.csv"), "--out", str(sim),
                    "--no-progress", *SETTINGS], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    a, b = torch.load(run / "model.pt"), torch.load(sim / "model.pt")
    from coordinator.availability.participation import read_rows
    reasons: dict[str, int] = {}
    for r in read_rows(run / "participation.csv"):
        if r["status"] in ("unavailable", "dropped"):
            key = f"{r['status']}:{r['reason']}"
            reasons[key] = reasons.get(key, 0) + 1
    ev = round_events(run)
    return {"agents": agents, "rounds": rounds, "absences": reasons,
            "participants_per_round": [e["participants"] for e in ev],
            "replay_max_abs_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "round_wall_s": stats([e["wall_s"] for e in ev if e["overhead_s"] is not None]),
            "slowest_participant_s": stats([e["slowest_participant_s"] for e in ev if e["overhead_s"] is not None]),
            "overhead_s": stats([e["overhead_s"] for e in ev if e["overhead_s"] is not None]),
            "overhead_excl_agent_wait_s": stats([e["overhead_excl_agent_wait_s"] for e in ev
                                                 if e["overhead_s"] is not None])}


def markdown(res: dict) -> str:
    L, T = res["load"], res["trial"]
    absences = ", ".join(f"{k} {v}" for k, v in sorted(T["absences"].items()))

    def ms(s: dict) -> str:
        return f"{1000 * s['median']:.1f} / {1000 * s['p90']:.1f} / {1000 * s['max']:.1f}"

    return "\n".join([
        "# Field-mode load (benchmarks/field_load.py)", "",
        f"Machine: {res['machine']}. One private mosquitto 2.0.11 on 127.0.0.1; model logreg (7,850 parameters, "
        "31 KB per update), FMNIST iid, 2 local SGD steps, FedAvg, mains-powered agents in the load test.", "",
        f"## Load: {L['agents']} agents ({L['agents_per_process']} per process) × {L['rounds']} rounds", "",
        "| metric | value |", "|---|---|",
        f"| updates requested (selected) | {L['selected']} |",
        f"| updates uploaded by agents | {L['uploads_sent']} |",
        f"| updates aggregated | {L['aggregated']} |",
        f"| **lost** (selected − aggregated) | **{L['lost']}** |",
        f"| agents whose uploads ≠ aggregated | {L['agents_whose_sent_differs_from_aggregated']} |",
        f"| **duplicates aggregated** | **0** (a client aggregates at most once per round; "
        f"{L['redeliveries_discarded']} redeliveries discarded) |",
        f"| rejected / dropped | {L['rejected']} / {L['dropped']} |",
        f"| total wall time (incl. agent start-up) | {L['total_s']:.1f} s |", "",
        "| per round, ms (median / p90 / max) | |", "|---|---|",
        f"| round wall time | {ms(L['round_wall_s'])} |",
        f"| slowest participant: download + train + upload | {ms(L['slowest_participant_s'])} |",
        f"| **round overhead** = wall − slowest participant | **{ms(L['overhead_s'])}** |",
        f"| of which ONNX export of the global model | {ms(L['onnx_export_s'])} |",
        f"| overhead without the agents' own queueing (10 agents share a process: messages wait while "
        f"the others train) | {ms(L['overhead_excl_agent_wait_s'])} |", "",
        f"## Normal trial: `dropfl trial --agents {T['agents']} --rounds {T['rounds']}` (modelled batteries)", "",
        "| metric | value |", "|---|---|",
        f"| absences (status:reason → client-rounds) | {absences} |",
        f"| participants per round | {' '.join(map(str, T['participants_per_round']))} |",
        f"| replay in `dropfl sim`: max abs weight difference | {T['replay_max_abs_diff']:.2e} |",
        f"| round wall time, ms (median / p90 / max) | {ms(T['round_wall_s'])} |",
        f"| slowest participant, ms | {ms(T['slowest_participant_s'])} |",
        f"| **round overhead**, ms | **{ms(T['overhead_s'])}** |",
        f"| overhead without the agents' own queueing, ms | {ms(T['overhead_excl_agent_wait_s'])} |", "",
        "Round overhead is the coordinator's share of a round: ONNX export, publishing the model and tasks, "
        "the broker's fan-out and the wait for the last upload's stats, plus scheduling on a 2-core machine "
        "shared by all processes (agents, broker and coordinator compete for the same cores).", ""])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--per-process", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--trial-agents", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "field_load"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import platform
    with tempfile.TemporaryDirectory(prefix="dropfl-field-load-") as tmp:
        t = Path(tmp)
        res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
               "load": load_test(args.agents, args.per_process, args.rounds, t),
               "trial": normal_trial(args.trial_agents, args.rounds, t)}
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(res))
    print(markdown(res))
    return 0 if res["load"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
