"""A reusable fault-injection harness for field mode (docs/field-mode.md "Faults and what dropfl does").

`run_scenario(scenario, workdir)` starts a small trial (a private mosquitto, or the URLs of a RabbitMQ
cluster; a few agent processes, optionally each in its own network namespace behind a veth; a coordinator
process), injects the scenario's fault once the global model of round `at_round` has been published (the
round is open; or before the coordinator starts, where the scenario is `from_start`), undoes it where the fault
has an end (SIGCONT, restart, link up), lets the run finish, tears everything down and checks the run directory
against four invariants:

- `participants_real`: every aggregated update (a `participated` row of participation.csv) is one that its
  agent logged as sent in that round of that run (the agent's `round t: update sent, ... acknowledged, run R`
  line, written once the broker has acknowledged every chunk).
- `reasons_true`: every `dropped` or `unavailable` row is one the fault can cause (`Scenario.allowed`), and the
  fault's own record is there (`Scenario.expect`: e.g. a frozen broker shows as `broker_outage_s` > 0).
- `nothing_lost_or_doubled`: one participation row per (round, client); field.jsonl's participant counts equal
  participation.csv's; every update an agent logged as sent is aggregated in its round, or accounted for by the
  coordinator (a late or already-dropped update it logged as discarded), never silently gone.
- `replay_exact`: `dropfl sim --config RUN/config.json --availability replay --trace RUN/participation.csv`
  gives the field run's model bit for bit (`torch.equal`).

Each check yields None (held) or the reason it failed, so `benchmarks/fault_suite.py` can tabulate them and the
tests can assert them. Built on tests/fieldkit.py (agent configs and processes, the coordinator command, the
MQTT watcher). Never sleeps where an event will do, except for a fault's chosen duration (`hold_s`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fieldkit import CLI, ROOT, Watcher, agent_config, coordinator_cmd, kill_group, start_coordinator

from coordinator.availability.participation import read_rows
from coordinator.rundir import read_metrics

FAULTS = ("none", "slow_uplink", "link_down", "broker_freeze", "broker_kill_restart", "agent_kill",
          "agent_kill_restart", "coordinator_kill_resume", "cluster_node_kill")
NETNS_FAULTS = ("slow_uplink", "link_down")
SENT = re.compile(r"round (\d+): update sent, \d+ chunks \(\d+ bytes\) acknowledged, run (\S+)")


@dataclass
class Scenario:
    """One fault in a small federation. `allowed(round, client, status, reason)` says which non-participations
    are true for this fault (default: none); `expect(outcome)` checks the fault's own record (None: as it
    should be, else what is wrong)."""
    name: str
    fault: str
    at_round: int = 1
    from_start: bool = False              # the fault in place before the coordinator starts (at_round 0 then)
    rounds: int = 3
    agents: int = 3
    victim: int = 1                       # the agent the fault hits (agent and link faults)
    hold_s: float = 0.0                   # how long the fault lasts before it is undone (freeze, link down)
    victim_agent: dict = field(default_factory=dict)   # agent config overrides for the victim
    agent: dict = field(default_factory=dict)          # agent config overrides for every agent
    coordinator: tuple[str, ...] = ()     # more coordinator flags
    up_Bps: float = 6000.0                # slow_uplink: the victim's uplink from at_round on
    allowed: Callable[[int, int, str, str], bool] = lambda t, c, status, reason: False
    expect: Callable[[Outcome], str | None] = lambda o: None
    timeout_s: float = 240.0              # the whole run, bounded

    def __post_init__(self):
        assert self.fault in FAULTS, self.fault
        assert not self.from_start or self.at_round == 0, "a fault in place from the start hits round 0"

    @property
    def netns(self) -> bool:
        return self.fault in NETNS_FAULTS


@dataclass
class Outcome:
    scenario: Scenario
    run: Path
    invariants: dict[str, str | None]     # name -> None (held) or why not
    recorded: dict                        # what dropfl recorded: drops, outage and empty time, duplicates, late
    recover_s: float | None               # the fault's end to the next round's model (None: no later round)
    wall_s: float
    exits: list[int]                      # the coordinator's exit codes (two for a resume)
    notes: dict = field(default_factory=dict)

    def assert_held(self) -> None:
        failed = {k: v for k, v in self.invariants.items() if v is not None}
        assert not failed, f"{self.scenario.name}: {failed}; recorded {self.recorded}"

    def row(self) -> dict:
        return {"scenario": self.scenario.name, "fault": self.scenario.fault, "recorded": self.recorded,
                "invariants": {k: v is None for k, v in self.invariants.items()},
                "failures": {k: v for k, v in self.invariants.items() if v is not None},
                "recover_s": None if self.recover_s is None else round(self.recover_s, 2),
                "wall_s": round(self.wall_s, 1), "exits": self.exits, **self.notes}


# --- the trial ---

class Trial:
    """Broker, agents and coordinator of one scenario. `brokers`: a RabbitMQ cluster's URLs (node i first for
    agent i % nodes), else a private mosquitto is started here (with listeners on the veths' host ends when the
    agents are in namespaces)."""

    def __init__(self, sc: Scenario, d: Path, cluster=None):
        self.sc, self.dir, self.cluster = sc, d, cluster
        self.out = d / "run"
        self.links = self.broker = self.watcher = None
        self.agents: dict[int, subprocess.Popen] = {}
        self.coord: subprocess.Popen | None = None
        self.models: list[tuple[float, int]] = []  # (monotonic time, round) of every global model broadcast
        self.exits: list[int] = []

    # set up
    def start(self) -> None:
        from coordinator.trial.broker import Mosquitto
        sc = self.sc
        if sc.netns:
            from coordinator.field import netem
            self.links = netem.Links(netem.LinkPlan([1e7] * sc.agents, [1e7] * sc.agents, [True] * sc.agents))
            self.links.__enter__()
        if self.cluster is None:
            self.broker = Mosquitto(workdir=self.dir / "broker", hosts=self.links.hosts if self.links else ())
            port = self.broker.port
        else:
            port = self.cluster.mqtt_ports[-1]  # the last node: a cluster_node_kill scenario kills others
        self.watcher = Watcher(port)
        self.watcher.hooks.append(self._note_model)
        for i in range(sc.agents):
            self.start_agent(i)
        for i in range(sc.agents):
            self.watcher.wait_for(lambda topic, h, i=i: topic == f"dropfl/v1/device/client-{i}/status"
                                  and h.meta.get("state") == "online", timeout=120)

    def _note_model(self, topic: str, h) -> None:
        if topic == "dropfl/v1/model/weights" and h.chunk == 0:
            self.models.append((time.monotonic(), h.round))

    def agent_urls(self, i: int) -> str:
        if self.cluster is not None:
            k = len(self.cluster.mqtt_ports)
            return ",".join(self.cluster.url((i + j) % k) for j in range(k))
        host = self.links.host_address(i) if self.links else "127.0.0.1"
        return f"mqtt://{host}:{self.broker.port}"

    def broker_urls(self) -> str:
        if self.cluster is not None:
            return ",".join(self.cluster.url(j) for j in range(len(self.cluster.mqtt_ports)))
        return self.broker.url

    def agent_config(self, i: int) -> Path:
        sc = self.sc
        extra = sc.agent | (sc.victim_agent if i == sc.victim else {})
        path = agent_config(i, self.agent_urls(i), self.dir / "agents", **extra)
        cfg = json.loads(path.read_text())
        cfg["data"]["clients"] = sc.agents  # a federation of sc.agents clients (fieldkit's SETTINGS has 5)
        if self.cluster is not None:
            cfg["agent"]["password"] = self.cluster_password
        path.write_text(json.dumps(cfg))
        return path

    cluster_password = "fault-suite"

    def start_agent(self, i: int) -> None:
        prefix = self.links.exec_prefix(i) if self.links else []
        with open(self.dir / f"client-{i}.log", "a") as f:
            self.agents[i] = subprocess.Popen(prefix + CLI + ["client", "--config", str(self.agent_config(i))],
                                              stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)

    def coordinator_cmd(self, *extra: str) -> list[str]:
        sc = self.sc
        cmd = coordinator_cmd(self.broker_urls(), self.out, sc.rounds, "fedavg", *sc.coordinator, *extra)
        cmd[cmd.index("--clients") + 1] = str(sc.agents)
        if self.cluster is not None:
            cmd += ["--broker-config", str(self.dir / "coordinator.json")]
            (self.dir / "coordinator.json").write_text(json.dumps(
                {"broker": self.cluster.url(0), "username": "coordinator", "password": self.cluster_password}))
        return cmd

    def start_coordinator(self, *extra: str) -> None:
        self.coord = start_coordinator(self.coordinator_cmd(*extra), self.dir / "coordinator.log")

    def wait_coordinator(self, timeout: float) -> int:
        rc = self.coord.wait(timeout=timeout)
        self.exits.append(rc)
        return rc

    def wait_model(self, t: int, timeout: float = 180.0, since: int = 0) -> None:
        self.watcher.wait_for(lambda topic, h: topic == "dropfl/v1/model/weights" and h.round == t,
                              timeout=timeout, since=since)

    def close(self) -> None:
        procs = [p for p in [*self.agents.values(), self.coord] if p is not None]
        for p in procs:  # signal all first, then wait for each
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                kill_group(p, signal.SIGTERM)
            except subprocess.TimeoutExpired:
                kill_group(p, signal.SIGKILL)
        if self.watcher is not None:
            self.watcher.close()
        if self.broker is not None:
            if self.broker.proc is not None and self.broker.proc.poll() is None:
                os.killpg(self.broker.proc.pid, signal.SIGCONT)  # never leave a frozen broker behind
            self.broker.close()
        if self.links is not None:
            self.links.__exit__(None, None, None)


# --- the faults: each returns the monotonic time the fault ended (the run can recover from then on) ---

def _fault(trial: Trial) -> float:
    sc = trial.sc
    f = sc.fault
    if f == "none":
        return time.monotonic()
    if f == "slow_uplink":
        trial.links.set_rates(sc.victim, up_Bps=sc.up_Bps)
        return time.monotonic()
    if f == "link_down":
        trial.links.set_online(sc.victim, False)
        time.sleep(sc.hold_s)  # the outage itself: its length is the scenario's
        trial.links.set_online(sc.victim, True)
        return time.monotonic()
    if f == "broker_freeze":
        os.kill(trial.broker.proc.pid, signal.SIGSTOP)
        time.sleep(sc.hold_s)
        os.kill(trial.broker.proc.pid, signal.SIGCONT)
        return time.monotonic()
    if f == "broker_kill_restart":
        os.killpg(trial.broker.proc.pid, signal.SIGKILL)
        trial.broker.proc.wait(timeout=10)
        time.sleep(sc.hold_s)
        trial.broker.stop()
        trial.broker.start()  # the same port
        return time.monotonic()
    if f in ("agent_kill", "agent_kill_restart"):
        kill_group(trial.agents[sc.victim], signal.SIGKILL)
        if f == "agent_kill_restart":
            time.sleep(sc.hold_s)
            trial.start_agent(sc.victim)
        return time.monotonic()
    if f == "coordinator_kill_resume":
        kill_group(trial.coord, signal.SIGKILL)
        trial.exits.append(trial.coord.returncode)
        trial.start_coordinator("--resume")
        return time.monotonic()
    if f == "cluster_node_kill":
        for node in sorted(set(trial.cluster_victims)):
            trial.cluster.kill_node(node)
        return time.monotonic()
    raise AssertionError(f)


def run_scenario(sc: Scenario, d: Path, cluster=None, cluster_victims: tuple[int, ...] = ()) -> Outcome:
    """Run `sc` in directory `d` (a RabbitMQ `cluster` from tests/rabbit.py, else a private mosquitto) and
    check the invariants. `cluster_victims`: the nodes cluster_node_kill kills."""
    d.mkdir(parents=True, exist_ok=True)
    trial = Trial(sc, d, cluster)
    trial.cluster_victims = cluster_victims
    t0 = time.monotonic()
    ended: list[float] = []
    try:
        trial.start()
        if sc.from_start:
            # e.g. a link slow from the first upload on. Waiting for round 0's model would race the agents: a
            # logreg update goes at loopback speed before `tc` takes effect (and round 1's chunks are then sized
            # from that rate: a rate drop between uploads, docs/field-mode.md's bound, not a slow link)
            ended.append(_fault(trial))
            trial.start_coordinator()
        else:
            trial.start_coordinator()
            # the fault: once round at_round's model is out (round at_round is open)
            trial.wait_model(sc.at_round, timeout=sc.timeout_s)
            ended.append(_fault(trial))
        rc = trial.wait_coordinator(timeout=max(sc.timeout_s - (time.monotonic() - t0), 30))
        assert rc == 0, f"coordinator exit {rc}:\n" + (d / "coordinator.log").read_text()[-3000:]
    finally:
        trial.close()
    wall = time.monotonic() - t0
    # a resumed coordinator redoes the round it was killed in; otherwise the next round shows the recovery
    first = sc.at_round if sc.fault == "coordinator_kill_resume" else sc.at_round + 1
    later = [at for at, t in trial.models if ended and at >= ended[0] and t >= first]
    recover = later[0] - ended[0] if later else None
    o = check(sc, trial.out, d, wall, recover, trial.exits)
    o.notes["reconnects"] = reconnects(d)
    return o


# --- the invariants ---

def reconnects(d: Path) -> dict[str, int]:
    """Per process (client-i, coordinator): the reconnects its log shows (disconnects and failed connects)."""
    out = {}
    for log in sorted(d.glob("client-*.log")) + [d / "coordinator.log"]:
        text = log.read_text(errors="replace") if log.exists() else ""
        out[log.stem] = len(re.findall(r"disconnected from the broker|could not connect to", text))
    return out


def sent_updates(logs: list[Path], run_id: str) -> set[tuple[int, int]]:
    """(round, client) of every update an agent logged as sent (all chunks acknowledged) in run `run_id`."""
    out = set()
    for log in logs:
        c = int(log.stem.split("-")[1])
        for m in SENT.finditer(log.read_text(errors="replace") if log.exists() else ""):
            if m.group(2) == run_id:
                out.add((int(m.group(1)), c))
    return out


def discarded_by_coordinator(run: Path) -> Counter:
    """Per client: updates the coordinator received and logged as discarded (late, stale or replayed; or for a
    client already dropped in the round): accounted for, not lost."""
    out: Counter = Counter()
    log = run / "log.jsonl"
    for line in (log.read_text().splitlines() if log.exists() else []):
        r = json.loads(line)
        msg = r.get("message", "")
        if "(late, stale or replayed)" in msg and r.get("topic", "").startswith("update"):
            m = re.search(r"of client-(\d+)", msg)
            if m:
                out[int(m.group(1))] += 1
        elif (m := re.search(r"discarded the update of client-(\d+), already dropped", msg)):
            out[int(m.group(1))] += 1
    return out


def replay_exact(run: Path, out: Path) -> str | None:
    """The README's replay command (no --engine): None if it reproduces the field model bit for bit."""
    from strategy_helpers import cache_dataset_loads

    from coordinator.cli import main
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        rc = main(["sim", "--config", str(run / "config.json"), "--availability", "replay", "--trace",
                   str(run / "participation.csv"), "--out", str(out), "--no-progress"])
    if rc != 0:
        return f"dropfl sim exit {rc}"
    a, b = torch.load(run / "model.pt"), torch.load(out / "model.pt")
    if a.keys() != b.keys():
        return "the replay's model has other tensors"
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return None if all(torch.equal(a[k], b[k]) for k in a) else f"max difference {diff:.3e}"


def check(sc: Scenario, run: Path, d: Path, wall: float, recover: float | None, exits: list[int]) -> Outcome:
    rows = read_rows(run / "participation.csv")
    field_rows = [json.loads(x) for x in (run / "field.jsonl").read_text().splitlines()]
    rounds = [r for r in field_rows if r["event"] == "round"]
    metrics = read_metrics(run / "metrics.jsonl")
    run_id = json.loads((run / "field.json").read_text())["run_id"]
    sent = sent_updates(sorted(d.glob("client-*.log")), run_id)
    aggregated = {(int(r["round"]), int(r["client"])) for r in rows if r["status"] == "participated"}
    absent = [(int(r["round"]), int(r["client"]), r["status"], r["reason"]) for r in rows
              if r["status"] in ("dropped", "unavailable")]
    inv: dict[str, str | None] = {}

    fake = sorted(aggregated - sent)
    inv["participants_real"] = None if not fake else f"aggregated but never sent by its agent: {fake}"

    untrue = [a for a in absent if not sc.allowed(*a)]
    why = sc.expect(_partial(sc, run, rows, rounds, metrics, recover, wall, exits))
    inv["reasons_true"] = None if not untrue and why is None else \
        "; ".join(([f"drops the fault cannot cause: {untrue}"] if untrue else []) + ([why] if why else []))

    problems = []
    keys = [(int(r["round"]), int(r["client"])) for r in rows]
    if len(keys) != len(set(keys)):
        problems.append(f"rows repeated: {sorted(k for k, n in Counter(keys).items() if n > 1)}")
    if [m["round"] for m in metrics] != list(range(sc.rounds)):
        problems.append(f"metrics rounds {[m['round'] for m in metrics]}")
    last = {}
    for r in rounds:  # a resumed run logs a redone round again: its last record counts
        last[r["round"]] = r
    for t, r in sorted(last.items()):
        n = sum(1 for x in aggregated if x[0] == t)
        if r["participants"] != n:
            problems.append(f"round {t}: field.jsonl {r['participants']} participants, participation.csv {n}")
    accounted = discarded_by_coordinator(run)
    missing = Counter(c for (t, c) in sent - aggregated if t < sc.rounds)
    lost = {c: n - accounted[c] for c, n in missing.items() if n > accounted[c]}
    if lost:
        problems.append(f"sent, neither aggregated nor logged as discarded: {sorted(sent - aggregated)} "
                        f"(discarded per client {dict(accounted)})")
    inv["nothing_lost_or_doubled"] = "; ".join(problems) or None

    inv["replay_exact"] = replay_exact(run, d / "replay")
    return _partial(sc, run, rows, rounds, metrics, recover, wall, exits, inv, sent, aggregated, accounted)


def _partial(sc, run, rows, rounds, metrics, recover, wall, exits, inv=None, sent=(), aggregated=(),
             accounted=None) -> Outcome:
    drops = Counter(f"{r['status']} {r['reason']}" for r in rows if r["status"] in ("dropped", "unavailable"))
    recorded = {"participants": [sum(1 for r in rows if int(r["round"]) == t and r["status"] == "participated")
                                 for t in range(sc.rounds)],
                "drops": dict(sorted(drops.items())),
                "broker_outage_s": [round(m.get("broker_outage_s", 0.0), 2) for m in metrics],
                "empty_federation_s": [round(m.get("empty_federation_s", 0.0), 2) for m in metrics],
                "duplicates": sum(r.get("duplicates", 0) for r in rounds),
                "late_total": max([r.get("late_total", 0) for r in rounds] or [0]),
                "sent": len(sent), "aggregated": len(aggregated),
                "discarded": sum((accounted or Counter()).values())}
    return Outcome(sc, run, inv or {}, recorded, recover, wall, exits)


# --- the scenarios (tests/test_field_fault_suite.py runs each; benchmarks/fault_suite.py tabulates them) ---

SLOW = {"slowdown_s_per_step": 1.0}  # 2 steps: 2 s of training, so a fault injected at a round's start hits it open


def drops_of(victim: int, reasons: set[str], rounds: range) -> Callable[[int, int, str, str], bool]:
    """Only `victim` may miss rounds `rounds`, and only for `reasons`."""
    return lambda t, c, status, reason: c == victim and t in rounds and reason in reasons


def outage_in(t: int) -> Callable[[Outcome], str | None]:
    def expect(o: Outcome) -> str | None:
        out = o.recorded["broker_outage_s"]
        if not (len(out) > t and out[t] > 0):
            return f"no broker outage recorded in round {t}: broker_outage_s {out}"
        if any(v > 0 for i, v in enumerate(out) if i != t):
            return f"broker outage recorded outside round {t}: {out}"
        return None
    return expect


def slow_uploads(victim: int, timeout_s: float) -> Callable[[Outcome], str | None]:
    """The fault was real: the victim's uploads after it took longer than the heartbeat timeout."""
    def expect(o: Outcome) -> str | None:
        rows = [json.loads(x) for x in (o.run / "field.jsonl").read_text().splitlines()]
        ups = [r["clients"].get(str(victim), {}).get("upload_s") for r in rows if r["event"] == "round"]
        return None if any(u is not None and u > timeout_s for u in ups) else \
            f"no upload of client {victim} took over {timeout_s} s: {ups}"
    return expect


HB_TIMEOUT = ("--heartbeat-timeout", "3")
SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("broker_freeze", "broker_freeze", hold_s=6.0, agent=SLOW, coordinator=HB_TIMEOUT,
             expect=outage_in(1)),
    Scenario("broker_kill_restart", "broker_kill_restart", hold_s=2.0, agent=SLOW, coordinator=HB_TIMEOUT,
             expect=outage_in(1)),
    Scenario("agent_kill", "agent_kill", agent=SLOW,
             allowed=drops_of(1, {"offline"}, range(1, 3))),
    Scenario("agent_kill_restart", "agent_kill_restart", agent=SLOW, coordinator=("--round-wait", "60"),
             allowed=drops_of(1, {"offline"}, range(1, 2))),
    Scenario("coordinator_kill_resume", "coordinator_kill_resume", at_round=2, rounds=4, agent=SLOW),
    Scenario("slow_uplink", "slow_uplink", at_round=0, from_start=True, coordinator=HB_TIMEOUT,
             expect=slow_uploads(1, 3.0)),
    Scenario("link_down", "link_down", hold_s=6.0, agent=SLOW, coordinator=HB_TIMEOUT + ("--round-wait", "30"),
             allowed=drops_of(1, {"offline"}, range(1, 2))),
]}

# a 3-node RabbitMQ cluster (tests/rabbit.py), agent i on node i % 3 first, the coordinator on node 0 first: node 0
# (the coordinator's and agent 0's) is killed with SIGKILL while round 1 is open and stays dead
CLUSTER_NODE_KILL = Scenario("cluster_node_kill", "cluster_node_kill", agent=SLOW, expect=outage_in(1),
                             timeout_s=300.0)
