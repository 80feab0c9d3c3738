"""Field-mode fleet: 100, 300 and 1,000 agents × 20 rounds through one private mosquitto on 127.0.0.1.

Agents run in-process, many per worker process (`edge_client.agent.Agent` objects, one thread each plus
its heartbeat thread and paho's network thread; the labels and the partition are loaded once per
process, `edge_client/agent/data.py` `_federation`, and each agent reads its own rows). For every fleet
size it checks that no update is lost or duplicated (every agent counts the updates it trained and
uploaded; the coordinator counts what it aggregated and what it discarded as a redelivery;
participation.csv must show every selected client as a participant every round) and measures:

- the coordinator's CPU seconds per round (psutil at each round's `field.jsonl` row; total from
  wait4's rusage) and its peak RSS (rusage `ru_maxrss`);
- the round overhead = round wall time − the slowest participant's download + train + upload
  (`field.jsonl` `overhead_s`, and `overhead_excl_agent_wait_s`);
- the broker's and the agent workers' CPU per round and their memory.

At the largest size the run's participation log is replayed in `dropfl sim` (same model expected).
Then a normal `dropfl trial` (10 agents with modelled batteries) for its dropouts and its replay.
`--profile N` instead runs N agents under py-spy (the coordinator's CPU by function).

`--synthetic S` runs `SynthAgent`s instead: the agent's protocol with no training and no evaluation, each
update ready S seconds after its task and model arrive, hundreds per worker process on one thread (paho's
external loop), so that 10,000 fit on one machine; no replay (their updates are not trained). `--compare DIR`
runs each size with the coordinator of another checkout DIR (a git worktree of an earlier commit), then with
this one, one after the other: a before/after of the coordinator alone.

    .venv/bin/python benchmarks/field_load.py        # writes benchmarks/results/field_load.{json,md,png}
    .venv/bin/python benchmarks/field_load.py --profile 1000 --rounds 5   # field_load_profile.md
    git worktree add /tmp/fl_before REV
    .venv/bin/python benchmarks/field_load.py --compare /tmp/fl_before --synthetic 0.1 --agents 1000,10000 \
        --only-after 10000 --rounds 10 --rounds-at 10000=5 --per-process 500   # field_load_closing.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine import cpu_model, git_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ["--model", "logreg", "--partition", "iid", "--steps", "1", "--lr", "0.05", "--seed", "0",
            "--threads", "1", "--algo", "fedavg"]
DEADLINE_S, WAIT_TIMEOUT_S, HEARTBEAT_TIMEOUT_S = 600, 900, 120  # generous: 1,000 agents on 2 cores


def raise_nofile() -> None:
    """Open files: a worker holds a socket, paho's wakeup pair and a trace file per agent; mosquitto
    (started from this process, inheriting the limit) one socket per client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def worker(args) -> int:
    """Run agents first..first+count-1 in this process, one thread each; write their upload counts."""
    import torch

    from edge_client import logs
    from edge_client.agent import Agent, config_from_dict

    raise_nofile()
    logs.setup("warning")  # the agents' `[agent client-i] ...` warnings go to this worker's log
    torch.set_num_threads(1)
    agents = []
    for i in range(args.first, args.first + args.count):
        cfg = config_from_dict({
            "agent": {"client": i, "broker": args.broker, "heartbeat_s": args.heartbeat_s,
                      "out": f"{args.out}/client-{i}", "exit_when_done": True},
            "data": {"dataset": "fmnist", "partition": "iid", "clients": args.clients, "seed": 0},
            "model": {"model": "logreg"}, "battery": {"source": "mains"}})
        agents.append(Agent(cfg))  # the dataset and its partition: loaded once per process (data.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [a.stop() for a in agents])
    threads = [threading.Thread(target=a.run, name=a.id) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = {a.client_idx: a.work.rounds_trained for a in agents}
    Path(args.out, f"uploads-{args.first}.json").write_text(json.dumps(counts))
    return 0


class SynthAgent:
    """One synthetic agent: the agent's protocol (docs/protocol.md: status with the data binding, heartbeats, the
    task and the global model in, the update's chunks and its stats out after the last PUBACK) with no training
    and no evaluation: the update is a fixed float32 tensor, ready `compute_s` after the task and the model are
    both in. Many share one thread: their paho clients run on the worker's selector (paho's external loop)."""

    def __init__(self, i: int, host: str, port: int, binding: dict, num_params: int, samples: int, heartbeat_s: float,
                 compute_s: float, fleet: SynthFleet):
        import torch
        from paho.mqtt import client as mqtt

        from edge_client import wire
        from edge_client.agent.config import TOPIC_ROOT

        self.wire, self.root, self.fleet = wire, TOPIC_ROOT, fleet
        self.c, self.id, self.samples, self.compute_s = i, f"client-{i}", samples, compute_s
        self.base = f"{TOPIC_ROOT}/device/{self.id}"
        self.binding, self.heartbeat_s = binding, heartbeat_s
        self.delta = torch.full((num_params,), 1e-4 * (i % 7), dtype=torch.float32)
        self.task = self.model = None        # (run, round, digest, arrival)
        self.last_round, self.trained, self.done = -1, 0, False
        self.upload: tuple | None = None     # (run, round, mid of the last chunk, start, bytes)
        m = self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"dropfl-{self.id}",
                                    clean_session=True)
        m.username_pw_set(self.id)
        m.will_set(f"{self.base}/status", self._status("offline"), qos=1, retain=True)
        m.max_inflight_messages_set(100)
        m.on_connect, m.on_message, m.on_publish = self._on_connect, self._on_message, self._on_publish
        m.on_socket_open = lambda c, u, sock: fleet.sel.register(sock, fleet.READ, self)
        m.on_socket_close = lambda c, u, sock: fleet.sel.unregister(sock)
        m.on_socket_register_write = lambda c, u, sock: fleet.sel.modify(sock, fleet.READ | fleet.WRITE, self)
        m.on_socket_unregister_write = lambda c, u, sock: fleet.sel.modify(sock, fleet.READ, self)
        m.connect(host, port, keepalive=60)

    def _status(self, state: str, reply: bool = False) -> bytes:
        meta = {"state": state, "device": self.id}
        if state == "online":
            meta |= self.binding | {"num_samples": self.samples} | ({"reply": True} if reply else {})
        return self.wire.encode("status", "", -1, self.c, meta=meta)[0]

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        client.subscribe([(f"{self.base}/control", 1), (f"{self.root}/model/weights", 1),
                          (f"{self.root}/coordinator/status", 1)])
        client.publish(f"{self.base}/status", self._status("online"), qos=1, retain=True)
        self.beat()

    def beat(self) -> None:
        meta = {"available": True, "reason": None, "battery_pct": 100.0, "charging": True}
        self.mqtt.publish(f"{self.base}/heartbeat", self.wire.encode("heartbeat", "", -1, self.c, meta=meta)[0], qos=0)

    def _on_message(self, client, userdata, msg) -> None:
        """Only the frame's header is read (as the agent's network thread does, edge_client/agent/link.py
        `_note_round`): the synthetic agent needs the model's round and digest, not its weights."""
        now, p = time.monotonic(), msg.payload
        if len(p) < 8 or p[:4] != self.wire.MAGIC:
            return
        h = json.loads(p[8:8 + int.from_bytes(p[4:8], "big")])
        kind, meta = h.get("kind"), h.get("meta") or {}
        if kind == "coordinator":
            if msg.retain:
                return
            if meta.get("announce"):
                client.publish(f"{self.base}/status", self._status("online", reply=True), qos=1, retain=True)
            elif meta.get("state") == "finished":
                self.done = True
            return
        if kind == "task":
            self.task = (h["run"], h["round"], meta.get("model_digest"), now)
        elif kind == "model" and h["chunk"] == h["chunks"] - 1:
            self.model = (h["run"], h["round"], meta.get("model_digest"), now)
        else:
            return
        t, m = self.task, self.model
        if t and m and t[:2] == m[:2] and t[2] in (None, m[2]) and t[1] > self.last_round:
            self.last_round = t[1]
            self.fleet.at(now + self.compute_s, self._upload, (t, m, now + self.compute_s))

    def _upload(self, t: tuple, m: tuple, due: float) -> None:
        """The synthetic training is done: upload the update, then (after its last PUBACK) the stats."""
        now = time.monotonic()
        if self.task is not None and self.task[:2] != t[:2]:  # a newer round's task came first: this one is over
            return
        start = min(t[3], m[3])
        meta = {"num_samples": self.samples, "steps": 1, "loss": 0.0, "train_s": self.compute_s,
                "download_s": m[3] - start if m[3] > start else None, "wait_s": max(now - due, 0.0),
                "model_digest": m[2]}
        frames = self.wire.encode("update", t[0], t[1], self.c, self.delta, meta, self.fleet.limits)
        mid = None
        for f in frames:
            mid = self.mqtt.publish(f"{self.base}/update/delta", f, qos=1).mid
        self.upload = (t[0], t[1], mid, time.perf_counter(), sum(len(f) for f in frames))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        u = self.upload
        if u is None or mid != u[2]:
            return
        self.upload = None
        upload_s = time.perf_counter() - u[3]
        meta = {"upload_s": upload_s, "upload_bytes": u[4], "uplink_Bps": u[4] / upload_s if upload_s > 0 else None}
        client.publish(f"{self.base}/update/stats", self.wire.encode("stats", u[0], u[1], self.c, meta=meta)[0], qos=1)
        self.trained += 1


class SynthFleet:
    """Synthetic agents first..first+count-1 in one thread: a selector over their sockets (paho's external loop),
    a timer heap for their heartbeats (spread over the period) and their synthetic compute."""

    def __init__(self, args):
        import heapq
        import selectors

        from edge_client import wire
        from edge_client.agent import binding_of, config_from_dict

        self.heapq, self.sel = heapq, selectors.DefaultSelector()
        self.READ, self.WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
        self.limits, self.timers, self.seq = wire.Limits(), [], 0
        cfg = config_from_dict({"agent": {"client": args.first, "broker": args.broker},
                                "data": {"dataset": "fmnist", "partition": "iid", "clients": args.clients, "seed": 0},
                                "model": {"model": "logreg"}})
        binding = binding_of(cfg).to_meta()  # without data_digest (not computed: no data is read)
        host, port = args.broker.removeprefix("mqtt://").rsplit(":", 1)
        self.agents = []
        for i in range(args.first, args.first + args.count):
            u = (i * 0.6180339887498949) % 1.0  # spread evenly over [0, 1) whatever the range of indices
            self.agents.append(SynthAgent(i, host, int(port), binding, args.num_params, 60000 // args.clients,
                                          args.heartbeat_s, args.synthetic * (1 + args.spread * (u - 0.5)), self))
            k = len(self.agents)
            self.at(time.monotonic() + args.heartbeat_s * k / args.count, self._beat, (self.agents[-1],))
            if k % 50 == 0:
                self.poll(0)  # let the broker's CONNACKs in while connecting the rest

    def at(self, when: float, fn, args: tuple) -> None:
        self.seq += 1
        self.heapq.heappush(self.timers, (when, self.seq, fn, args))

    def _beat(self, a: SynthAgent) -> None:
        if not a.done:
            a.beat()
            self.at(time.monotonic() + a.heartbeat_s, self._beat, (a,))

    def poll(self, timeout: float) -> None:
        for key, mask in self.sel.select(timeout):
            a = key.data
            if mask & self.READ:
                a.mqtt.loop_read()
            if mask & self.WRITE:
                a.mqtt.loop_write()

    def run(self) -> None:
        last_misc = 0.0
        while not all(a.done for a in self.agents):
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn, args = self.heapq.heappop(self.timers)
                fn(*args)
            self.poll(min(max(self.timers[0][0] - now, 0.0), 0.5) if self.timers else 0.5)
            if now - last_misc >= 1.0:
                last_misc = now
                for a in self.agents:
                    a.mqtt.loop_misc()
        for a in self.agents:
            a.mqtt.disconnect()
            a.mqtt.loop_write()


def synth_worker(args) -> int:
    """Run synthetic agents first..first+count-1 in this process; write their upload counts."""
    raise_nofile()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fleet = SynthFleet(args)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: [setattr(a, "done", True) for a in fleet.agents])
    fleet.run()
    Path(args.out, f"uploads-{args.first}.json").write_text(json.dumps({a.c: a.trained for a in fleet.agents}))
    return 0


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1], "n": len(xs)}


def close_lags(ev: list[dict]) -> list[float]:
    """Per round: its close − the arrival of its last update at the coordinator (`wall_s` − the latest
    `arrived_s`): the wait for that client's stats and the round loop's own latency in closing."""
    return [e["wall_s"] - max(c["arrived_s"] for c in e["clients"].values()) for e in ev if e["clients"]]


def round_events(run: Path) -> list[dict]:
    return [e for e in map(json.loads, open(run / "field.jsonl")) if e["event"] == "round"]


class Sampler(threading.Thread):
    """Every 0.1 s: has the coordinator started its rounds (its log says `agents online`), has a round
    ended (a round row in field.jsonl)? At each such moment the CPU seconds of the coordinator, the broker
    and the workers (psutil). Every second the RSS of all of them (peaks)."""

    def __init__(self, coord_pid: int, broker_pid: int, worker_pids: list[int], log: Path, field_log: Path):
        super().__init__(daemon=True)
        import psutil
        self.psutil = psutil
        self.coord, self.broker = psutil.Process(coord_pid), psutil.Process(broker_pid)
        self.workers = [psutil.Process(p) for p in worker_pids]
        self.log, self.field_log = log, field_log
        self.marks: list[dict] = []  # {t, coord, broker, workers}: rounds start, then one per round row
        self.peak = {"coord": 0, "broker": 0, "workers": 0}
        self.done = threading.Event()

    def _cpu(self, procs) -> float:
        total = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                total += c.user + c.system
            except self.psutil.Error:
                pass
        return total

    def _rss(self, procs) -> int:
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except self.psutil.Error:
                pass
        return total

    def mark(self) -> None:
        self.marks.append({"t": time.monotonic(), "coord": self._cpu([self.coord]),
                           "coord_rss": self._rss([self.coord]),
                           "broker": self._cpu([self.broker]), "workers": self._cpu(self.workers)})

    def run(self) -> None:
        started, log_pos, field_pos, last_rss = False, 0, 0, 0.0
        while not self.done.wait(0.1):
            if not started:
                if self.log.exists():
                    with open(self.log, "rb") as f:
                        f.seek(log_pos)
                        chunk = f.read()
                        log_pos += len(chunk)
                    if b"agents online" in chunk:
                        started = True
                        self.mark()
            elif self.field_log.exists():
                with open(self.field_log, "rb") as f:
                    f.seek(field_pos)
                    chunk = f.read()
                if b"\n" in chunk:
                    chunk = chunk[:chunk.rindex(b"\n") + 1]
                    field_pos += len(chunk)
                    for _ in range(chunk.count(b'"event": "round"')):
                        self.mark()
            if time.monotonic() - last_rss >= 1.0:
                last_rss = time.monotonic()
                for k, procs in (("coord", [self.coord]), ("broker", [self.broker]), ("workers", self.workers)):
                    self.peak[k] = max(self.peak[k], self._rss(procs))


def coordinator_cmd(broker_url: str, agents: int, rounds: int, run: Path) -> list[str]:
    """The coordinator's command (run from the checkout `fleet` is given: `python -m` imports from the cwd)."""
    return [sys.executable, "-m", "coordinator.cli", "coordinator", "--broker", broker_url, "--clients", str(agents),
            "--rounds", str(rounds), "--out", str(run), "--deadline", str(DEADLINE_S),
            "--wait-timeout", str(WAIT_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--no-progress",
            *SETTINGS]


def fleet(agents: int, per_proc: int, rounds: int, heartbeat_s: float, tmp: Path, replay: bool,
          profile: Path | None = None, synthetic: float | None = None, code: Path = ROOT, spread: float = 0.0) -> dict:
    """One fleet: mosquitto, the agents' worker processes, the coordinator; measurements and checks.
    `synthetic`: synthetic agents (`SynthAgent`) whose update is ready this many seconds after the task and model
    arrive (times `1 + spread × (u − 0.5)`, `SynthFleet`), instead of `Agent`s that train; `code`: the checkout the
    coordinator runs from (before/after)."""
    from coordinator.availability.participation import read_rows
    from coordinator.trial.broker import Mosquitto

    tmp.mkdir(parents=True)
    run, procs = tmp / "run", []
    raise_nofile()
    try:
        with Mosquitto(workdir=tmp / "broker") as broker:
            t0 = time.monotonic()
            for first in range(0, agents, per_proc):
                synth = [] if synthetic is None else ["--synthetic", str(synthetic), "--spread", str(spread),
                                                      "--num-params", "7850"]
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--broker", broker.url, "--clients", str(agents),
                     "--first", str(first), "--count", str(min(per_proc, agents - first)),
                     "--heartbeat-s", str(heartbeat_s), "--out", str(tmp / "agents"), *synth],
                    stdout=subprocess.DEVNULL, stderr=open(tmp / f"worker-{first}.log", "w"), start_new_session=True))
            coord_log = tmp / "coordinator.log"
            coord = subprocess.Popen(coordinator_cmd(broker.url, agents, rounds, run), cwd=code,
                                     stdout=subprocess.DEVNULL, stderr=open(coord_log, "w"))
            sampler = Sampler(coord.pid, broker.proc.pid, [p.pid for p in procs], coord_log, run / "field.jsonl")
            sampler.start()
            spy = None
            if profile is not None:  # attach py-spy once the rounds start: their CPU, not the start-up's
                while not sampler.marks and coord.poll() is None:
                    time.sleep(0.05)
                spy_bin = Path(sys.executable).parent / "py-spy"
                spy = subprocess.Popen([str(spy_bin) if spy_bin.exists() else "py-spy", "record", "--pid",
                                        str(coord.pid), "--format", "raw", "--rate", "100", "--threads", "--output",
                                        str(profile)], stdout=subprocess.DEVNULL, stderr=open(tmp / "py-spy.log", "w"))
            _, status, usage = os.wait4(coord.pid, 0)
            if spy is not None:
                spy.wait(timeout=60)
            coord.returncode = os.waitstatus_to_exitcode(status)
            total_s = time.monotonic() - t0
            sampler.done.set()
            sampler.join()
            if coord.returncode != 0:
                raise SystemExit(f"coordinator failed; see {coord_log}")
            for p in procs:
                p.wait(timeout=300)
            broker_cpu = sampler._cpu([sampler.broker])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    marks = sampler.marks
    if len(marks) == rounds:  # the coordinator exited before the sampler saw the last round's row
        marks.append({"t": marks[-1]["t"], "coord": usage.ru_utime + usage.ru_stime,
                      "coord_rss": marks[-1]["coord_rss"],
                      "broker": broker_cpu,
                      "workers": marks[-1]["workers"]})
    if len(marks) != rounds + 1:
        raise SystemExit(f"expected {rounds + 1} CPU marks (rounds start + one per round), got {len(marks)}")

    def per_round(key: str) -> list[float]:
        return [b[key] - a[key] for a, b in zip(marks, marks[1:])]

    sent: dict[int, int] = {}
    for f in (tmp / "agents").glob("uploads-*.json"):
        sent |= {int(k): v for k, v in json.loads(f.read_text()).items()}
    rows = read_rows(run / "participation.csv")
    aggregated: dict[int, int] = {}
    by_round: dict[int, dict[str, int]] = {}
    for r in rows:
        counts = by_round.setdefault(int(r["round"]), {})
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        if r["status"] == "participated":
            aggregated[int(r["client"])] = aggregated.get(int(r["client"]), 0) + 1
    ev = round_events(run)
    selected = sum(e["selected"] for e in ev)
    rounds_s = marks[-1]["t"] - marks[0]["t"]
    coord_cpu_total = usage.ru_utime + usage.ru_stime
    res = {
        "agents": agents, "agents_per_process": per_proc, "synthetic_compute_s": synthetic, "spread": spread,
        "code": str(code),
        "worker_processes": len(procs), "rounds": rounds,
        "heartbeat_s": heartbeat_s, "total_s": total_s, "startup_s": marks[0]["t"] - t0, "rounds_s": rounds_s,
        "selected": selected, "aggregated": sum(aggregated.values()), "uploads_sent": sum(sent.values()),
        "lost": selected - sum(aggregated.values()),
        "agents_whose_sent_differs_from_aggregated": sum(1 for c in range(agents)
                                                         if sent.get(c, 0) != aggregated.get(c, 0)),
        "rounds_with_all_participating": sum(1 for t, c in by_round.items()
                                             if c.get("participated", 0) == agents == len(ev[t]["clients"])),
        "participation_status_counts": {s: sum(c.get(s, 0) for c in by_round.values())
                                        for s in sorted({s for c in by_round.values() for s in c})},
        "redeliveries_discarded": sum(e["duplicates"] for e in ev), "rejected": sum(e["rejected"] for e in ev),
        "dropped": sum(len(e["dropped"]) for e in ev),
        "round_wall_s": stats([e["wall_s"] for e in ev]),
        "slowest_participant_s": stats([e["slowest_participant_s"] for e in ev]),
        "overhead_s": stats([e["overhead_s"] for e in ev]),
        "overhead_excl_agent_wait_s": stats([e["overhead_excl_agent_wait_s"] for e in ev]),
        "onnx_export_s": stats([e["export_s"] for e in ev]),
        "close_after_last_update_s": stats(close_lags(ev)),
        "coordinator": {
            "cpu_s_total": coord_cpu_total, "cpu_s_startup": marks[0]["coord"],
            "cpu_s_per_round": (marks[-1]["coord"] - marks[0]["coord"]) / rounds,
            "cpu_s_round": stats(per_round("coord")),
            "cpu_share_of_wall": (marks[-1]["coord"] - marks[0]["coord"]) / rounds_s,
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # incl. start-up (torch, the dataset for its evaluation)
            "rss_bytes_rounds_start": marks[0]["coord_rss"], "rss_bytes_rounds_end": marks[-1]["coord_rss"],
            "peak_rss_bytes_sampled": sampler.peak["coord"]},
        "broker": {"cpu_s_per_round": (marks[-1]["broker"] - marks[0]["broker"]) / rounds,
                   "cpu_s_total": broker_cpu, "peak_rss_bytes": sampler.peak["broker"]},
        "workers": {"cpu_s_per_round": (marks[-1]["workers"] - marks[0]["workers"]) / rounds,
                    "peak_rss_bytes": sampler.peak["workers"],
                    "peak_rss_bytes_per_agent": sampler.peak["workers"] / agents,
                    "peak_rss_bytes_per_process": sampler.peak["workers"] / len(procs),
                    "threads_per_process": 3 * per_proc + 1},
    }
    if replay:
        res["replay_max_abs_diff"] = replay_diff(run, agents, rounds, tmp / "sim")
    return res


def replay_diff(run: Path, agents: int, rounds: int, sim: Path) -> float:
    """`dropfl sim` replaying the run's participation log: max |w_run − w_sim| (0: the same model)."""
    import torch

    subprocess.run([sys.executable, "-m", "coordinator.cli", "sim", "--clients", str(agents), "--rounds", str(rounds),
                    "--availability", "replay", "--trace", str(run / "participation.csv"), "--out", str(sim),
                    "--no-progress", *SETTINGS], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    a, b = torch.load(run / "model.pt"), torch.load(sim / "model.pt")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def normal_trial(agents: int, rounds: int, tmp: Path) -> dict:
    from coordinator.availability.participation import read_rows

    run = tmp / "trial"
    cmd = [sys.executable, "-m", "coordinator.cli", "trial", "--agents", str(agents), "--rounds", str(rounds),
           "--out", str(run), "--no-progress", *SETTINGS]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=open(tmp / "trial.log", "w"))
    reasons: dict[str, int] = {}
    for r in read_rows(run / "participation.csv"):
        if r["status"] in ("unavailable", "dropped"):
            key = f"{r['status']}:{r['reason']}"
            reasons[key] = reasons.get(key, 0) + 1
    ev = [e for e in round_events(run) if e["overhead_s"] is not None]
    return {"agents": agents, "rounds": rounds, "absences": reasons,
            "participants_per_round": [e["participants"] for e in round_events(run)],
            "replay_max_abs_diff": replay_diff(run, agents, rounds, tmp / "trial-sim"),
            "round_wall_s": stats([e["wall_s"] for e in ev]),
            "slowest_participant_s": stats([e["slowest_participant_s"] for e in ev]),
            "overhead_s": stats([e["overhead_s"] for e in ev]),
            "overhead_excl_agent_wait_s": stats([e["overhead_excl_agent_wait_s"] for e in ev])}


def profile_summary(raw: Path, top: int = 400) -> dict:
    """py-spy's raw (collapsed) stacks → share of the coordinator's samples by thread, by function (self),
    and by function anywhere on the stack (inclusive)."""
    total, by_thread, self_t, incl = 0, {}, {}, {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        n = int(n)
        frames = stack.split(";")
        total += n
        thread = frames[0]
        by_thread[thread] = by_thread.get(thread, 0) + n
        funcs = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f for f in frames[1:]]
        if funcs:
            self_t[funcs[-1]] = self_t.get(funcs[-1], 0) + n
        for f in set(funcs):
            incl[f] = incl.get(f, 0) + n

    def top_of(d: dict) -> list:
        return [[k, v / total] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"samples": total, "threads": top_of(by_thread), "self": top_of(self_t), "inclusive": top_of(incl)}


# --- report ---

def _mb(b: float) -> str:
    return f"{b / 2 ** 20:.0f}"


def _ms(s: dict) -> str:
    return f"{1000 * s['median']:.0f} / {1000 * s['p90']:.0f} / {1000 * s['max']:.0f}"


def markdown(res: dict) -> str:
    F, T = res["fleet"], res.get("trial")
    L = [
        "# Field-mode fleet (benchmarks/field_load.py)", "",
        f"Machine: {res['machine']}; load average before the run {res['loadavg_before']}. "
        f"One private mosquitto ({res['mosquitto']}) on 127.0.0.1; model logreg (7,850 parameters, 31 KB per "
        f"update), FMNIST iid, 1 local SGD step, FedAvg, every agent selected every round, mains-powered "
        f"agents ({F[0]['agents_per_process']} per worker process, heartbeat every {F[0]['heartbeat_s']:g} s); "
        f"coordinator `--deadline {DEADLINE_S} --wait-timeout {WAIT_TIMEOUT_S} --heartbeat-timeout "
        f"{HEARTBEAT_TIMEOUT_S}`. Everything (coordinator, broker, agents) shares the 2 cores.", "",
        "Command:", "", "```", res["command"], "```", "",
        "## Lost or duplicated updates", "",
        "| agents | selected | uploaded by agents | aggregated | **lost** | agents whose uploads ≠ aggregated "
        "| rounds with all agents aggregated | duplicates aggregated (redeliveries discarded) | rejected / dropped "
        "| replay in `dropfl sim`: max abs weight diff |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for f in F:
        rp = f"{f['replay_max_abs_diff']:.1e}" if "replay_max_abs_diff" in f else "—"
        L.append(f"| {f['agents']} | {f['selected']} | {f['uploads_sent']} | {f['aggregated']} | **{f['lost']}** | "
                 f"{f['agents_whose_sent_differs_from_aggregated']} | {f['rounds_with_all_participating']} / "
                 f"{f['rounds']} | 0 ({f['redeliveries_discarded']}) | {f['rejected']} / {f['dropped']} | {rp} |")
    L += ["", "## Coordinator cost and round overhead", "",
          "| agents | coordinator CPU s / round | coordinator CPU, share of round wall time | coordinator peak RSS, "
          "MB | round wall time, ms (median / p90 / max) | slowest participant, ms | **round overhead**, ms "
          "| overhead excl. agents' queueing, ms | ONNX export, ms (median) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for f in F:
        c = f["coordinator"]
        L.append(f"| {f['agents']} | **{c['cpu_s_per_round']:.2f}** | {100 * c['cpu_share_of_wall']:.0f} % | "
                 f"**{_mb(c['peak_rss_bytes'])}** | {_ms(f['round_wall_s'])} | {_ms(f['slowest_participant_s'])} | "
                 f"**{_ms(f['overhead_s'])}** | {_ms(f['overhead_excl_agent_wait_s'])} | "
                 f"{1000 * f['onnx_export_s']['median']:.0f} |")
    L += ["", "## Everything else on the machine", "",
          "| agents | worker processes | threads per worker | agents' CPU s / round (all workers) | broker CPU s / "
          "round | broker peak RSS, MB | workers' peak RSS, MB (per agent) | coordinator start-up: "
          "wall s / CPU s | rounds wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for f in F:
        w, b, c = f["workers"], f["broker"], f["coordinator"]
        L.append(f"| {f['agents']} | {f['worker_processes']} | {w['threads_per_process']} | {w['cpu_s_per_round']:.2f} "
                 f"| {b['cpu_s_per_round']:.2f} | {_mb(b['peak_rss_bytes'])} | {_mb(w['peak_rss_bytes'])} "
                 f"({w['peak_rss_bytes_per_agent'] / 2 ** 20:.1f}) | {f['startup_s']:.0f} / {c['cpu_s_startup']:.1f} "
                 f"| {f['rounds_s']:.0f} |")
    L += ["", "CPU per round: psutil's process CPU seconds at the coordinator's `agents online` log line and at each "
          "round row of `field.jsonl`, (last − first) / rounds; start-up (imports, the agents' announces) is not "
          "counted in it. Peak RSS: the coordinator's `ru_maxrss` (wait4), the others sampled every second. "
          "Round overhead = round wall time − the slowest participant's download + train + upload "
          "(`field.jsonl` `overhead_s`); without the agents' queueing: also minus its `wait_s` (task and model "
          "received, but its worker process busy with other agents).", ""]
    if res.get("limit"):
        L += ["## What limits the next step", "", res["limit"], ""]
    if T:
        absences = ", ".join(f"{k} {v}" for k, v in sorted(T["absences"].items()))
        L += [f"## Normal trial: `dropfl trial --agents {T['agents']} --rounds {T['rounds']}` (modelled batteries)", "",
              "| metric | value |", "|---|---|",
              f"| absences (status:reason → client-rounds) | {absences or 'none'} |",
              f"| participants per round | {' '.join(map(str, T['participants_per_round']))} |",
              f"| replay in `dropfl sim`: max abs weight difference | {T['replay_max_abs_diff']:.2e} |",
              f"| round wall time, ms (median / p90 / max) | {_ms(T['round_wall_s'])} |",
              f"| slowest participant, ms | {_ms(T['slowest_participant_s'])} |",
              f"| **round overhead**, ms | **{_ms(T['overhead_s'])}** |",
              f"| overhead without the agents' own queueing, ms | {_ms(T['overhead_excl_agent_wait_s'])} |", ""]
    return "\n".join(L)


def limits(res: dict, prof: dict | None) -> str:
    """'What limits the next step', from the measurements (and the py-spy profile, if there is one)."""
    F = res["fleet"]
    f = F[-1]
    a, c, b = f["workers"]["cpu_s_per_round"], f["coordinator"]["cpu_s_per_round"], f["broker"]["cpu_s_per_round"]
    wall = f["rounds_s"] / f["rounds"]
    per_agent = ", ".join(f"{1000 * x['coordinator']['cpu_s_per_round'] / x['agents']:.2f} ms at {x['agents']}"
                          for x in F)
    text = [
        f"**CPU, on this 2-core machine.** At {f['agents']} agents a round takes {wall:.2f} s of wall time on "
        f"average, and in it the agents use {a:.2f} CPU s, the coordinator {c:.2f}, mosquitto {b:.2f}: "
        f"{a + c + b:.2f} of the {2 * wall:.2f} CPU s the two cores have ({100 * (a + c + b) / (2 * wall):.0f} %). "
        f"The agents' own work (decoding the model, 1 SGD step, encoding and uploading the update, and an "
        f"onnxruntime session per agent per round to evaluate the global model) is {100 * a / (a + c + b):.0f} % "
        f"of it, so a larger fleet on one machine is limited by the emulated agents first: more agents need "
        f"more cores, or agents on other machines.",
        f"**The coordinator** is one Python process whose work is serialised by the GIL: paho's network thread "
        f"(every inbound message: update, stats, eval, heartbeat; every PUBACK of the tasks it sends) and the "
        f"round loop. Its CPU per agent per round: {per_agent}, i.e. about {c:.1f} CPU s per round at "
        f"{f['agents']} agents; it can use at most one core, so with the agents elsewhere one coordinator "
        f"process would close a round of N agents in no less than about N × {1000 * c / f['agents']:.1f} ms "
        f"(≈ {10 * c / f['agents'] * 1000:.0f} s for 10,000 agents if it stayed linear)."]
    if prof:
        th = {("paho" if "paho" in k else "main" if "MainThread" in k else "other"): v
              for k, v in prof["profile"]["threads"]}
        inc = dict(prof["profile"]["inclusive"])
        slf = dict(prof["profile"]["self"])

        def share(d: dict, *names: str) -> float:
            return 100 * sum(v for k, v in d.items() if any(k.startswith(n) for n in names))
        text.append(
            f"Where its CPU goes (py-spy, {prof['fleet'][0]['agents']} agents, field_load_profile.md): paho's network "
            f"thread {100 * th.get('paho', 0):.0f} % of the samples — of which dropfl's message handling "
            f"(`FieldHub._dispatch`: decode, checks, reassembly) {share(inc, 'FieldHub._dispatch'):.0f} % and "
            f"paho's own packet handling most of the rest (reading packets, PUBACKs; its `_update_inflight`, "
            f"{share(slf, 'Client._update_inflight'):.0f} % self, walks every message in flight on each PUBACK: "
            f"quadratic in the tasks sent at once); the round loop's thread {100 * th.get('main', 0):.0f} % — "
            f"`run_round` {share(inc, 'MqttTransport.run_round'):.0f} %, mostly waking on every incoming message "
            f"(`Condition.wait` there and `notify` in paho's thread: {share(slf, 'Condition.'):.0f} % self) "
            f"and re-checking all selected clients (`Registry.is_online` {share(slf, 'Registry.is_online'):.0f} % "
            f"self): O(N) per message, O(N²) per round. These two quadratic terms are the next coordinator limit.")
    text.append(
        f"**Memory** is not the limit: the coordinator's RSS is {_mb(f['coordinator']['rss_bytes_rounds_end'])} MB "
        f"at {f['agents']} agents (peak {_mb(f['coordinator']['peak_rss_bytes'])} MB, mostly torch and the test set "
        f"it evaluates on), mosquitto's {_mb(f['broker']['peak_rss_bytes'])} MB; an agent worker is about "
        f"{_mb(f['workers']['peak_rss_bytes_per_process'])} MB per {f['agents_per_process']} agents (≈ 460 MB of "
        f"torch, onnxruntime and the shared FMNIST partition per process, then ~1.7 MB per agent). "
        f"**Threads and file descriptors** were no problem: {f['workers']['threads_per_process']} threads per worker "
        f"(3 per agent), {f['agents'] + 1} broker connections (the harness raises RLIMIT_NOFILE to its hard limit; "
        f"mosquitto's `max_connections` is unlimited by default).")
    return "\n\n".join(text)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    F = res["fleet"]
    n = [f["agents"] for f in F]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot(n, [f["round_wall_s"]["median"] for f in F], "o-", label="round wall time")
    ax[0].plot(n, [f["slowest_participant_s"]["median"] for f in F], "s-", label="slowest participant")
    ax[0].plot(n, [f["overhead_s"]["median"] for f in F], "^-", label="round overhead (median)")
    ax[0].fill_between(n, [f["overhead_s"]["median"] for f in F], [f["overhead_s"]["p90"] for f in F], alpha=0.2,
                       color="C2", label="overhead median–p90")
    ax[0].set(title="Round time", xlabel="agents", ylabel="seconds")
    ax[1].plot(n, [f["coordinator"]["cpu_s_per_round"] for f in F], "o-", label="coordinator")
    ax[1].plot(n, [f["broker"]["cpu_s_per_round"] for f in F], "s-", label="mosquitto")
    ax[1].plot(n, [f["workers"]["cpu_s_per_round"] for f in F], "^-", label="agents (all workers)")
    ax[1].set(title="CPU seconds per round", xlabel="agents", ylabel="CPU s")
    ax[2].plot(n, [f["coordinator"]["peak_rss_bytes"] / 2 ** 20 for f in F], "o-", label="coordinator (peak, start-up)")
    ax[2].plot(n, [f["coordinator"]["rss_bytes_rounds_end"] / 2 ** 20 for f in F], "o--", color="C0",
               label="coordinator (after the last round)")
    ax[2].plot(n, [f["broker"]["peak_rss_bytes"] / 2 ** 20 for f in F], "s-", label="mosquitto")
    ax[2].plot(n, [f["workers"]["peak_rss_bytes"] / 2 ** 30 * 1024 / 10 for f in F], "^-",
               label="agents (all workers) / 10")
    ax[2].set(title="Memory (RSS)", xlabel="agents", ylabel="MiB")
    for a in ax:
        a.set_xscale("log")
        a.minorticks_off()
        a.set_xticks(n, [str(x) for x in n])
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"dropfl field mode: one mosquitto, {F[0]['rounds']} rounds, logreg; {res['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def profile_markdown(res: dict) -> str:
    P, f = res["profile"], res["fleet"][0]
    L = ["# Where the coordinator's CPU goes (benchmarks/field_load.py --profile)", "",
         f"Machine: {res['machine']}. {f['agents']} agents × {f['rounds']} rounds, as in field_load.md; the "
         f"coordinator gets `py-spy record --rate 100 --threads` attached when its rounds start (all threads, "
         f"idle samples excluded): "
         f"{P['samples']} samples. Coordinator CPU {f['coordinator']['cpu_s_per_round']:.2f} s / round under the "
         f"profiler.", "", "Command:", "", "```", res["command"], "```", "",
         "| thread | share of samples |", "|---|---|"]
    L += [f"| {k} | {100 * v:.1f} % |" for k, v in P["threads"][:6]]
    L += ["", "| function (inclusive: anywhere on the stack) | share |", "|---|---|"]
    L += [f"| `{k}` | {100 * v:.1f} % |" for k, v in P["inclusive"][:25]]
    L += ["", "| function (self) | share |", "|---|---|"]
    L += [f"| `{k}` | {100 * v:.1f} % |" for k, v in P["self"][:20]]
    return "\n".join(L) + "\n"


def compare(args, res: dict, sizes: list[int], base: Path) -> int:
    """Each fleet size with the coordinator of `args.compare` (before), then of this checkout (after), one after
    the other on the same broker settings and agents; sizes in --only-after with this checkout only."""
    before = Path(args.compare).resolve()
    only_after = {int(x) for x in args.only_after.split(",") if x}
    rounds_at = {int(k): int(v) for k, v in (x.split("=") for x in args.rounds_at.split(",") if x)}
    res |= {"cpu_model": cpu_model(), "before": {"code": str(before), "commit": git_commit(before)},
            "after": {"code": str(ROOT), "commit": git_commit(ROOT) + " + the working tree"}, "compare": []}
    if args.append:  # the rows of earlier invocations (other settings), kept with their own command and load
        earlier = json.loads(Path(args.out + ".json").read_text())
        res["compare"] = earlier["compare"]
        res["runs"] = earlier.get("runs", [{k: earlier[k] for k in ("command", "loadavg_before", "loadavg_after")
                                            if k in earlier}])
    res.setdefault("runs", []).append({"command": res["command"], "loadavg_before": res["loadavg_before"]})
    for n in sizes:
        row = {"agents": n, "synthetic_compute_s": args.synthetic, "spread": args.spread}
        for side, code in (("before", before), ("after", ROOT)):
            if side == "before" and n in only_after:
                continue
            row[side] = fleet(n, args.per_process, rounds_at.get(n, args.rounds), args.heartbeat_s,
                              base / f"{side}-{n}", replay=False, synthetic=args.synthetic, code=code,
                              spread=args.spread)
            f = row[side]
            print(f"{side} {n} agents: lost {f['lost']}, coordinator {f['coordinator']['cpu_s_per_round']:.2f} CPU "
                  f"s/round, overhead median {f['overhead_s']['median']:.3f} s", file=sys.stderr)
        res["compare"].append(row)
        Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")  # what is done so far
    res["loadavg_after"] = res["runs"][-1]["loadavg_after"] = open("/proc/loadavg").read().split()[0]
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    Path(args.out + ".md").write_text(compare_markdown(res))
    print(compare_markdown(res))
    fs = [row[s] for row in res["compare"] for s in ("before", "after") if s in row]
    return 0 if all(f["lost"] == 0 and f["agents_whose_sent_differs_from_aggregated"] == 0 and f["dropped"] == 0
                    and f["rounds_with_all_participating"] == f["rounds"] for f in fs) else 1


def compare_markdown(res: dict) -> str:
    rows = res["compare"]
    f0 = (rows[0].get("before") or rows[0]["after"])
    runs = res.get("runs") or [{"command": res["command"], "loadavg_before": res["loadavg_before"],
                                "loadavg_after": res.get("loadavg_after", "?")}]
    L = ["# Field-mode fleet: the round loop before and after the closing rule (benchmarks/field_load.py)", "",
         f"Machine: {res['cpu_model']} ({res['machine']}), shared with other work (its load average, below, was far "
         f"above its 2 cores): timings vary by ±30 % and more from run to run, so read the medians over each run's "
         f"rounds, and compare before with after only within one size and setting. One private mosquitto "
         f"({res['mosquitto']}) on 127.0.0.1. Synthetic agents ({f0['agents_per_process']} per worker process, "
         f"one thread each process, paho's external loop; heartbeat every {f0['heartbeat_s']:g} s): the agent's "
         f"protocol with no training and no evaluation (they take the global weights, not the ONNX model); each "
         f"update (logreg's 7,850 float32 parameters, 31 KB) is ready a compute time after its task and model "
         f"arrive: S for every agent (spread 0: all upload at once), or S × (1 + F × (u − 0.5)) with u spread evenly "
         f"over the agents (spread F). The coordinator is the real one: FedAvg over the updates it gets, an "
         f"evaluation of the global model and its ONNX export every round, with `--deadline {DEADLINE_S} "
         f"--wait-timeout {WAIT_TIMEOUT_S} --heartbeat-timeout {HEARTBEAT_TIMEOUT_S}`. Every agent is selected "
         f"every round. Before: the coordinator of commit {res['before']['commit']} (a git worktree); after: "
         f"commit {res['after']['commit']}. Each row pair ran before, then after, one after the other.", "",
         "Commands (load average before → after):", "", "```"]
    L += [f"{r['command']}    # load {r.get('loadavg_before', '?')} → {r.get('loadavg_after', '?')}" for r in runs]
    L += ["```", "",
          "| agents | compute S, s (spread) | code | rounds | selected | uploaded by agents | aggregated | **lost** | "
          "dropped | round wall time, ms (median / p90 / max) | **round overhead**, ms (median / p90 / max) | "
          "overhead excl. agents' queueing, ms | close after the last update, ms | coordinator CPU s / round |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for side in ("before", "after"):
            f = row.get(side)
            if f is None:
                continue
            L.append(f"| {row['agents']} | {f['synthetic_compute_s']:g} ({f.get('spread', 0.0):g}) | {side} | "
                     f"{f['rounds']} | {f['selected']} | {f['uploads_sent']} | {f['aggregated']} | **{f['lost']}** | "
                     f"{f['dropped']} | {_ms(f['round_wall_s'])} | **{_ms(f['overhead_s'])}** | "
                     f"{_ms(f['overhead_excl_agent_wait_s'])} | {_ms(f['close_after_last_update_s'])} | "
                     f"{f['coordinator']['cpu_s_per_round']:.2f} |")
    L += ["", "Round overhead = the round's wall time (from the start of its ONNX export to its close) − the slowest "
          "participant's download + train + upload as the agent measured them (`field.jsonl` `overhead_s`): "
          "publishing the tasks and the model, the broker's fan-out, the coordinator's handling of the updates and "
          "the wait for the last stats; with synthetic agents, train is the compute time. Without the agents' "
          "queueing: also minus the slowest's `wait_s` (its update ready but its worker process busy with other "
          "agents). Close after the last update: the round's close − the arrival of its last update at the "
          "coordinator (the wait for that client's stats, then the round loop's own latency). "
          "Medians over the rounds of one run. Coordinator CPU per round: psutil at the `agents online` log "
          "line and at each round row, (last − first) / rounds. Lost = selected − aggregated; uploaded = the updates "
          "the agents counted as sent (their stats after the last PUBACK).", ""]
    if res.get("notes"):
        L += ["## Notes", "", *res["notes"], ""]
    return "\n".join(L)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", default="100,300,1000", help="fleet sizes, comma-separated")
    p.add_argument("--per-process", type=int, default=100, help="agents per worker process")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--heartbeat-s", type=float, default=10.0, help="agents' heartbeat period")
    p.add_argument("--replay", choices=("largest", "all", "none"), default="largest")
    p.add_argument("--trial-agents", type=int, default=10, help="the normal trial's agents (0: skip it)")
    p.add_argument("--profile", type=int, default=0, help="instead: N agents with the coordinator under py-spy")
    p.add_argument("--keep", help="keep the run directories here")
    p.add_argument("--out", help="results path without suffix (default benchmarks/results/field_load, with "
                                 "--compare field_load_closing)")
    p.add_argument("--synthetic", type=float, metavar="S",
                   help="synthetic agents (the protocol, no training or evaluation; many per process, one thread): "
                        "each update is ready S seconds after its task and model arrive")
    p.add_argument("--spread", type=float, default=0.0, metavar="F",
                   help="with --synthetic S: agent i's compute time is S × (1 + F × (u_i − 0.5)), u_i spread evenly "
                        "over [0, 1) (0: the same S for every agent, all uploads at once)")
    p.add_argument("--compare", metavar="DIR",
                   help="before/after: each fleet size with the coordinator of the checkout DIR (e.g. a git worktree "
                        "of the earlier commit), then of this one, side by side; writes OUT.{json,md}")
    p.add_argument("--only-after", default="", help="with --compare: fleet sizes run with this checkout only")
    p.add_argument("--append", action="store_true", help="with --compare: keep the rows already in OUT.json")
    p.add_argument("--rounds-at", default="", help="with --compare: other round counts by size, e.g. 10000=5")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-params", type=int, help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args) if args.synthetic is None else synth_worker(args)
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / "results" / ("field_load_closing" if args.compare else "field_load"))
    sizes = [int(x) for x in args.agents.split(",")]
    mosq = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True).stdout.splitlines()[0]
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                      f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB, "
                      f"Python {platform.python_version()}",
           "mosquitto": mosq.replace("mosquitto version ", ""),
           "loadavg_before": open("/proc/loadavg").read().split()[0],
           "command": " ".join([".venv/bin/python", "benchmarks/field_load.py", *sys.argv[1:]]),
           "fleet": []}
    tmp_ctx = tempfile.TemporaryDirectory(prefix="dropfl-field-load-")
    base = Path(args.keep) if args.keep else Path(tmp_ctx.name)
    with tmp_ctx:
        if args.profile:
            raw = base / "profile.txt"
            res["fleet"].append(fleet(args.profile, args.per_process, args.rounds, args.heartbeat_s,
                                      base / f"profile-{args.profile}", replay=False, profile=raw,
                                      synthetic=args.synthetic))
            res["profile"] = profile_summary(raw)
            Path(args.out + "_profile.json").write_text(json.dumps(res, indent=2) + "\n")
            Path(args.out + "_profile.md").write_text(profile_markdown(res))
            print(profile_markdown(res))
            return 0
        if args.compare:
            return compare(args, res, sizes, base)
        for n in sizes:
            # synthetic agents train nothing, so there is no model to replay
            replay = args.synthetic is None and (args.replay == "all" or (args.replay == "largest" and n == max(sizes)))
            res["fleet"].append(fleet(n, args.per_process, args.rounds, args.heartbeat_s, base / f"fleet-{n}", replay,
                                      synthetic=args.synthetic, spread=args.spread))
            f = res["fleet"][-1]
            print(f"{n} agents: lost {f['lost']}, coordinator {f['coordinator']['cpu_s_per_round']:.2f} CPU s/round, "
                  f"overhead median {f['overhead_s']['median']:.3f} s", file=sys.stderr)
        if args.trial_agents:
            res["trial"] = normal_trial(args.trial_agents, args.rounds, base)
    prof = Path(args.out + "_profile.json")
    res["limit"] = limits(res, json.loads(prof.read_text()) if prof.exists() else None)
    Path(args.out + ".json").write_text(json.dumps(res, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(res))
    plot(res, Path(args.out + ".png"))
    print(markdown(res))
    ok = all(f["lost"] == 0 and f["agents_whose_sent_differs_from_aggregated"] == 0 and f["dropped"] == 0
             and f["rounds_with_all_participating"] == f["rounds"] and f.get("replay_max_abs_diff", 0.0) == 0.0
             for f in res["fleet"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
