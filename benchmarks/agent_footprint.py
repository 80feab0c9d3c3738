"""The edge agent's memory footprint: one real agent process (`dropfl client --config`) training the FMNIST
CNN (mimic-cnn, CPU torch) for a few rounds against a coordinator, through a private mosquitto.

Samples the agent's RSS (psutil, every 50 ms, the process and its children) from its start to its exit,
and records the peak, the steady RSS (median of the samples after the agent is online), and the time from
the process's start to online (its first status message seen on the broker).

`--full-load` runs the agent with the old data path (the whole dataset loaded as float32, then the
client's rows taken), for the before/after comparison; the agent itself has no such option.

    .venv/bin/python benchmarks/agent_footprint.py               # writes benchmarks/results/agent_footprint.{json,md}
    .venv/bin/python benchmarks/agent_footprint.py --full-load   # the old loading path, for comparison
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def agent_full_load(config: str) -> int:
    """The agent with the pre-change data path: datasets.load (everything as float32), then the rows."""
    import torch

    import edge_client.agent as ag
    from edge_client import datasets, federation

    def load_shard(cfg):
        ds = datasets.load(cfg.data.dataset, cfg.data.data_dir)
        kept.append(ds)  # the old path kept the dataset (data.py's lru_cache'd `_federation`)
        b = ag.binding_of(cfg)
        idx = torch.as_tensor(federation.client_shards(ds, b)[cfg.agent.client])
        tidx = torch.as_tensor(federation.test_shards(ds, b)[cfg.agent.client])
        return ds, ds.train.x[idx], ds.train.y[idx], ds.test.x[tidx].numpy(), ds.test.y[tidx].numpy()

    kept: list = []
    ag.load_shard = load_shard  # Agent.__init__ looks it up in the package's namespace
    return ag.run_agent(ag.load_config(config))


def sample_rss(pid: int, samples: list, stop: threading.Event) -> None:
    import psutil
    try:
        p = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        try:
            rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.Error:
            break
        samples.append((time.monotonic(), rss))
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--clients", type=int, default=30)
    ap.add_argument("--full-load", action="store_true", help="the old data path (whole dataset as float32)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--agent-full-load", metavar="CONFIG", help=argparse.SUPPRESS)  # the child, --full-load
    args = ap.parse_args()
    if args.agent_full_load:
        return agent_full_load(args.agent_full_load)

    import paho.mqtt.client as mqtt

    from coordinator.trial.broker import Mosquitto
    from edge_client import wire

    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="dropfl-footprint-") as tmp, Mosquitto(workdir=Path(tmp) / "broker") as b:
        tmp = Path(tmp)
        cfg = {"agent": {"client": 0, "broker": b.url, "out": str(tmp / "agent"), "threads": 1, "heartbeat_s": 1.0},
               "data": {"dataset": "fmnist", "partition": "shards", "clients": args.clients, "seed": 0},
               "model": {"model": "mimic-cnn"}, "battery": {"source": "mains"}}
        (tmp / "agent.json").write_text(json.dumps(cfg))
        online: list[float] = []
        watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="footprint-watch")
        watcher.on_message = lambda c, u, m: online.append(time.monotonic()) if not online and \
            wire.decode([m.payload]).meta.get("state") == "online" else None
        watcher.connect(*b.url.removeprefix("mqtt://").split(":")[:1], int(b.url.rsplit(":", 1)[1]))
        watcher.subscribe("dropfl/v1/device/client-0/status", qos=1)
        watcher.loop_start()
        time.sleep(0.5)
        coord_cmd = [py, "-m", "coordinator.cli", "coordinator", "--broker", b.url, "--out", str(tmp / "run"),
                     "--model", "mimic-cnn", "--dataset", "fmnist", "--partition", "shards", "--clients",
                     str(args.clients), "--rounds", str(args.rounds), "--steps", str(args.steps), "--seed", "0",
                     "--wait-agents", "1", "--threads", "1", "--no-progress"]
        conf = str(tmp / "agent.json")
        agent_cmd = ([py, str(Path(__file__).resolve()), "--agent-full-load", conf] if args.full_load
                     else [py, "-m", "coordinator.cli", "client", "--config", conf])
        alog = open(tmp / "agent.log", "w")
        started = time.monotonic()
        agent = subprocess.Popen(agent_cmd, cwd=ROOT, stdout=alog, stderr=subprocess.STDOUT)
        samples: list = []
        stop = threading.Event()
        th = threading.Thread(target=sample_rss, args=(agent.pid, samples, stop), daemon=True)
        th.start()
        coord = subprocess.run(coord_cmd, cwd=ROOT, capture_output=True, text=True)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.terminate()
            agent.wait()
        stop.set()
        th.join()
        watcher.loop_stop()
        alog.close()
        if coord.returncode != 0:
            print(coord.stdout[-2000:], coord.stderr[-2000:], (tmp / "agent.log").read_text()[-2000:], file=sys.stderr)
            return 1
        rounds = [json.loads(line) for line in (tmp / "run" / "field.jsonl").read_text().splitlines()
                  if json.loads(line).get("event") == "round"]
    mib = 1024 ** 2
    after = [r for t, r in samples if online and t >= online[0]]
    res = {
        "command": " ".join(["benchmarks/agent_footprint.py"] + sys.argv[1:]),
        "loading": "full dataset (old path)" if args.full_load else "own rows only",
        "model": "mimic-cnn", "dataset": "fmnist", "partition": "shards", "clients": args.clients,
        "rounds": args.rounds, "steps": args.steps, "rounds_completed": len(rounds),
        "peak_rss_mib": round(max(r for _, r in samples) / mib, 1),
        "steady_rss_mib": round(statistics.median(after) / mib, 1) if after else None,
        "start_to_online_s": round(online[0] - started, 2) if online else None,
        "samples": len(samples), "agent_exit": agent.returncode,
        "python": platform.python_version(), "machine": platform.machine(),
        "torch": __import__("torch").__version__,
    }
    print(json.dumps(res, indent=1))
    out = Path(args.out)
    name = "agent_footprint_full_load" if args.full_load else "agent_footprint"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(out)
    return 0


def write_md(out: Path) -> None:
    """agent_footprint.md from the results present (this change's path, and the old one if measured)."""
    rows = [json.loads((out / f"{n}.json").read_text()) for n in ("agent_footprint_full_load", "agent_footprint")
            if (out / f"{n}.json").exists()]
    lines = ["# Edge agent memory footprint", "",
             "One agent process (`dropfl client --config`), FMNIST, mimic-cnn, CPU torch, through a private "
             "mosquitto with a coordinator (`benchmarks/agent_footprint.py`). RSS sampled every 50 ms (psutil); "
             "steady = median after the agent is online.", "",
             "| data loading | peak RSS | steady RSS | start to online | rounds | command |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['loading']} | {r['peak_rss_mib']} MiB | {r['steady_rss_mib']} MiB | "
                     f"{r['start_to_online_s']} s | {r['rounds_completed']} × {r['steps']} steps, "
                     f"{r['clients']} clients ({r['partition']}) | `.venv/bin/python {r['command']}` |")
    if rows:
        r = rows[-1]
        lines += ["", f"Python {r['python']}, torch {r['torch']}, {r['machine']}. `import torch` alone is ~218 MiB."]
    lines += ["", "The full-dataset row runs the old data path with this version's other savings (onnxruntime's basic "
              "graph optimizations, the heap given back after each round); the agent before them measured "
              "560–651 MiB peak and 484–499 MiB steady."]
    (out / "agent_footprint.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
