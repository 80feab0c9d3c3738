"""Field mode beyond one broker: broker URL lists with failover, the announce protocol (no retained
message needed), and a 2-node RabbitMQ cluster (tests/rabbit.py; one cluster for the module's cluster
tests, started on first use).

Fast tests: URL-list parsing, `Brokers.rotate`, a failover re-send of an update counted once, an
announce reply that is no rejoin. Slow: on mosquitto with the retained statuses cleared, a coordinator
that starts after its agents registers them, both connecting through a dead first URL; on the RabbitMQ
cluster (where retained messages never reach the coordinator's `device/+/status`), agents split across
the nodes run a short logreg federation equal to its simulation replay, then one node is stopped
mid-run, its agents fail over to the other, and the run completes, equal to its replay, no update
aggregated twice. And on a 3-node cluster of its own, the coordinator's node killed with SIGKILL mid-round
(tests/faultkit.py's cluster scenario). Fast: the reconnect policy (backoff with jitter, a fresh client id
after a refusal) and the registry's idempotent statuses."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import pytest
import rabbit
import torch
from fieldkit import (
    CLI,
    SETTINGS,
    Watcher,
    coordinator_cmd,
    kill_group,
    max_diff,
    participants,
    sim_model,
    start_agent,
    start_coordinator,
)
from paho.mqtt import client as mqtt

from coordinator.availability.participation import read_rows
from coordinator.field.collection import RoundState
from coordinator.field.connection import FieldConfig
from coordinator.field.hub import FieldHub
from coordinator.trial.broker import Mosquitto, free_port
from edge_client import wire
from edge_client.agent.config import AgentError, Brokers, broker_urls, config_from_dict
from edge_client.federation import DataBinding
from edge_client.trainer import TrainTask

N, ROUNDS, ALGO = 4, 3, "fedavg"
PASSWORD = "cluster-test"
BINDING = DataBinding(dataset="fmnist", partition="iid", clients=3, shards_per_client=2, dirichlet_alpha=0.5,
                      seed=0, model="logreg", dropout=None).to_meta()


# --- fast: URL lists ---
def test_broker_lists_parse_and_rotate():
    assert broker_urls("mqtt://a:1, mqtt://b:2") == ["mqtt://a:1", "mqtt://b:2"]
    assert broker_urls(["mqtts://a", "mqtts://b:8884"]) == ["mqtts://a", "mqtts://b:8884"]
    for bad in ("mqtt://a,mqtts://b", "mqtt://a,", "", [], ["mqtt://a", 3], "http://a", "mqtt://a:99999"):
        with pytest.raises(AgentError):
            broker_urls(bad)
    b = Brokers("mqtts://a:1,mqtts://b:2")
    assert b.tls and b.address == ("a", 1)

    class Client:  # paho's attributes that reconnect() reads
        _host, _port = "a", 1
    c = Client()
    assert b.rotate(c) == "mqtts://b:2" and (c._host, c._port) == ("b", 2)
    assert b.rotate(c) == "mqtts://a:1" and (c._host, c._port) == ("a", 1)
    cfg = config_from_dict({"agent": {"client": 0, "broker": ["mqtt://x:1", "mqtt://y:2"]}, "data": {"clients": 2}})
    assert cfg.agent.broker == "mqtt://x:1,mqtt://y:2"
    with pytest.raises(AgentError, match="mixes"):
        config_from_dict({"agent": {"client": 0, "broker": "mqtt://x,mqtts://y"}, "data": {"clients": 2}})


# --- fast: the hub, messages fed as paho delivers them ---
def make_hub(tmp_path) -> FieldHub:
    hub = FieldHub(FieldConfig(run_id="run-x", heartbeat_timeout_s=60, broker="mqtt://127.0.0.1:1,mqtt://[::1]:2"),
                   3, DataBinding(**BINDING), 4, tmp_path)
    for c in range(3):
        status(hub, c, "online")
        hub._dispatch(f"d{c}", "heartbeat", wire.encode("heartbeat", "", -1, c, meta={"available": True})[0], False)
    return hub


def status(hub, c, state, **meta):
    hub._dispatch(f"d{c}", "status", wire.encode("status", "", -1, c, meta={"state": state} | BINDING | meta)[0],
                  state == "offline")


def test_a_failover_resend_of_an_update_is_aggregated_once(tmp_path):
    hub = make_hub(tmp_path)
    r = hub.collection.round = RoundState(
        0, {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(3)}, 0.0)
    w = torch.arange(4, dtype=torch.float32)
    frames = wire.encode("update", "run-x", 0, 1, w, {"num_samples": 5, "steps": 1}, wire.Limits(chunk_bytes=4))
    assert len(frames) == 4
    for f in frames[:2]:  # the node holding its connection stops mid-upload
        hub._dispatch("d1", "update/delta", f, False)
    status(hub, 1, "offline")                     # its last will
    assert r.dropped == {1: "offline"}
    status(hub, 1, "online")                      # reconnected to the other node: a rejoin, the task again
    assert 1 in r.rejoined and not r.dropped
    for f in frames:                              # the cached update, re-sent whole
        hub._dispatch("d1", "update/delta", f, False)
    for f in reversed(frames):                    # and once more (the coordinator re-sent the task too)
        hub._dispatch("d1", "update/delta", f, False)
    assert torch.equal(r.updates[1].tensor, w) and r.duplicates == 1 and list(r.updates) == [1]


def test_an_announce_reply_is_no_rejoin_but_a_reconnect_is(tmp_path):
    hub = make_hub(tmp_path)
    r = hub.collection.round = RoundState(
        0, {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(3)}, 0.0)
    status(hub, 0, "online", reply=True)   # answers our announce request: it lost nothing
    assert not r.rejoined
    status(hub, 0, "online")               # announced on a (re)connect: re-send its task
    assert r.rejoined == {0}
    status(hub, 2, "offline")
    status(hub, 2, "online", reply=True)   # held offline: a reply brings it back, as a rejoin
    assert 2 in r.rejoined and 2 not in r.dropped


def test_reconnect_backs_off_with_jitter_and_takes_a_fresh_id_after_a_refusal():
    """reconnect.py: the delay is drawn from [0.2, min(2, 0.2 * 2^k)] for k consecutive failures, a CONNACK
    alone does not reset it (RabbitMQ accepts, then drops at the subscription), a SUBACK does; a connection
    dropped before its SUBACK makes the next CONNECT use a fresh client id."""
    import random

    from edge_client.agent.reconnect import Reconnect

    class Client:  # what on_lost sets on paho's client
        _client_id = b"dropfl-client-0"

        def reconnect_delay_set(self, min_delay, max_delay):
            self.delay = (min_delay, max_delay)

    r, c = Reconnect("dropfl-client-0", rng=random.Random(1)), Client()
    r.on_connect(mid=7)
    assert r.on_subscribe(7) and not r.on_subscribe(7)       # healthy once
    assert r.on_lost(c) is None and c._client_id == b"dropfl-client-0"
    assert c.delay[0] == c.delay[1] and 0.2 <= c.delay[0] <= 0.4   # k = 1 after a healthy connection
    delays = []
    for n in range(1, 8):                                      # accepted, then dropped before the SUBACK
        r.on_connect(mid=10 + n)
        assert r.on_lost(c) == f"dropfl-client-0-r{n}" and c._client_id == f"dropfl-client-0-r{n}".encode()
        delays.append(c.delay[0])
        assert 0.2 <= c.delay[0] <= min(2.0, 0.2 * 2 ** (n + 1))
    assert max(delays) > 1.0 and len(set(delays)) == len(delays)    # growing, and jittered
    assert r.reconnects == 8 and r.fresh_ids == 7 and r.sessions == 8
    r.on_lost(c)                                               # a failed connect (no CONNACK): no new id
    assert r.client_id == "dropfl-client-0-r7"
    r.on_connect(mid=99)
    assert r.on_subscribe(99) and r.failures == 0


def test_a_status_of_the_connection_already_held_online_is_no_rejoin(tmp_path):
    """A broker that re-delivers or backlogs an agent's statuses (RabbitMQ after a node returns): an online
    status naming the connection (`session`) the coordinator already holds online re-sends nothing; one
    naming a new connection is a rejoin."""
    hub = make_hub(tmp_path)
    r = hub.collection.round = RoundState(
        0, {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(3)}, 0.0)
    status(hub, 1, "online", session="ab:1")
    assert r.rejoined == {1}                 # the first status naming its session: a (re)connect
    r.rejoined.clear()
    for _ in range(50):                      # the same status, delivered again and again
        status(hub, 1, "online", session="ab:1")
    assert not r.rejoined
    status(hub, 1, "online", session="ab:2")  # it reconnected
    assert r.rejoined == {1}
    r.rejoined.clear()
    status(hub, 1, "offline")
    status(hub, 1, "online", session="ab:2")  # held offline: back, whatever the session
    assert r.rejoined == {1}


# --- slow: real brokers ---
def agent_config(i: int, brokers: list[str], out: Path, clients: int, **agent) -> Path:
    cfg = {"agent": {"client": i, "broker": brokers, "heartbeat_s": 0.3, "out": str(out / f"client-{i}"),
                     "exit_when_done": False} | agent,
           "data": {"dataset": "fmnist", "partition": SETTINGS["partition"], "clients": clients,
                    "seed": SETTINGS["seed"]},
           "model": {"model": SETTINGS["model"]}, "battery": {"source": "mains"}}
    path = out / f"client-{i}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def status_is(i: int, state: str):
    return lambda topic, h: topic == f"dropfl/v1/device/client-{i}/status" and h.meta.get("state") == state


def stop_all(agents) -> None:
    for p in agents:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in agents:
        kill_group(p, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_mosquitto_coordinator_after_agents_without_retained_and_a_dead_first_url(tmp_path):
    """Retained statuses cleared: the coordinator learns of agents that came first only through its
    announce request. Everyone's first URL is a closed port: failover on a failed connect."""
    with Mosquitto(workdir=tmp_path / "broker") as broker:
        dead = f"mqtt://127.0.0.1:{free_port()}"
        watcher = Watcher(broker.port)
        agents = [start_agent(agent_config(i, [dead, broker.url], tmp_path / "agents", 3), tmp_path / f"a{i}.log")
                  for i in range(2)]
        try:
            for i in range(2):
                watcher.wait_for(status_is(i, "online"), timeout=90)
            clear = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-clear")
            clear.connect("127.0.0.1", broker.port)
            clear.loop_start()
            for i in range(2):  # an empty retained payload deletes the retained status
                clear.publish(f"dropfl/v1/device/client-{i}/status", b"", qos=1, retain=True).wait_for_publish(5)
            clear.disconnect()
            clear.loop_stop()
            binding = DataBinding(dataset="fmnist", partition=SETTINGS["partition"], clients=3, shards_per_client=2,
                                  dirichlet_alpha=0.5, seed=SETTINGS["seed"], model=SETTINGS["model"], dropout=None)
            hub = FieldHub(FieldConfig(run_id="late-coordinator", broker=f"{dead},{broker.url}"), 3, binding, 7850,
                           tmp_path)
            t0 = time.monotonic()
            hub.start()
            try:
                assert hub.registry.wait_for_agents(2, 30) == 2
                registered_s = time.monotonic() - t0
            finally:
                hub.stop(finished=False)
            rows = [json.loads(line) for line in (tmp_path / "field.jsonl").read_text().splitlines()]
            assert {r["device"] for r in rows if r["event"] == "agent" and r["state"] == "online"} == \
                {"client-0", "client-1"}
            assert not any(r.get("retained") for r in rows if r["event"] == "agent")  # all came as answers
            print(f"registered 2 agents {registered_s:.2f} s after the coordinator's start")
        finally:
            stop_all(agents)
            watcher.close()
    for i in range(2):
        log = (tmp_path / f"a{i}.log").read_text()
        assert f"could not connect to {dead}" in log and f"connected to {broker.url}" in log


@dataclass
class Cluster:
    dir: Path
    rabbit: rabbit.RabbitCluster
    agents: dict[int, Popen]
    watcher: Watcher

    def first_url(self, i: int) -> str:
        return self.rabbit.url(i % 2)  # even agents: node 1 first; odd agents: node 2 first

    def coordinator(self, name: str, *extra: str) -> Path:
        out = self.dir / name
        cmd = coordinator_cmd(f"{self.rabbit.url(0)},{self.rabbit.url(1)}", out, ROUNDS, ALGO,
                              "--round-wait", "30", "--broker-config", str(self.dir / "coordinator.json"), *extra)
        cmd[cmd.index("--clients") + 1] = str(N)
        cmd[cmd.index("--steps") + 1] = "1"
        assert cmd[:len(CLI)] == CLI
        p = start_coordinator(cmd, self.dir / f"{name}.log")
        try:
            assert p.wait(timeout=300) == 0, (self.dir / f"{name}.log").read_text()[-4000:]
        finally:
            kill_group(p)
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if why := rabbit.missing():
        pytest.skip(why)
    d = tmp_path_factory.mktemp("cluster")
    rc = rabbit.RabbitCluster(d / "rabbit")
    print(f"RabbitMQ 2-node cluster up in {rc.timings['start_s']:.1f} s, MQTT ports {rc.mqtt_ports}")
    agents: dict[int, Popen] = {}
    watcher = None
    try:
        for name in ["coordinator"] + [f"client-{i}" for i in range(N)]:  # RabbitMQ checks every username
            rc.add_user(name, PASSWORD)
        (d / "coordinator.json").write_text(json.dumps({"broker": rc.url(0), "username": "coordinator",
                                                        "password": PASSWORD}))  # --broker names both nodes
        watcher = Watcher(rc.mqtt_ports[0])
        slow = {"slowdown_s_per_step": 2.0}  # node 2's agents: still training when the node stops
        for i in range(N):
            urls = [rc.url(i % 2), rc.url(1 - i % 2)]
            agents[i] = start_agent(agent_config(i, urls, d / "agents", N, password=PASSWORD,
                                                 **(slow if i % 2 else {})),
                                    d / f"client-{i}.log")
        for i in range(N):  # live deliveries across the nodes: the watcher is on node 1, half the agents on node 2
            watcher.wait_for(status_is(i, "online"), timeout=120)
        yield Cluster(d, rc, agents, watcher)
    finally:
        stop_all(agents.values())
        if watcher is not None:
            watcher.close()
        rc.close()


def replay_equal(run: Path, tmp: Path) -> float:
    sim = sim_model(tmp, ROUNDS, ALGO, run / "participation.csv", clients=N, steps=1)
    return max_diff(torch.load(run / "model.pt"), sim)


def round_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "field.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "round"]


def assert_each_update_once(run: Path) -> int:
    """participation.csv has one row per (round, client); field.jsonl's participants match it. Returns the
    duplicates the hub discarded."""
    keys = [(int(r["round"]), int(r["client"])) for r in read_rows(run / "participation.csv")]
    assert len(keys) == len(set(keys)) == ROUNDS * N
    parts = participants(run / "participation.csv")
    rows = round_rows(run)
    assert [r["round"] for r in rows] == list(range(ROUNDS))
    for r in rows:
        assert r["participants"] == len(parts[r["round"]]) <= r["selected"]
        assert not set(r["dropped"]) & {str(c) for c in parts[r["round"]]}
    return sum(r["duplicates"] for r in rows)


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_agents_on_both_nodes_equal_their_replay(cluster):
    """Agents that connected before the coordinator, half on each node: the coordinator (node 1) gets
    no retained status through `device/+/status` on RabbitMQ, only the answers to its announce request."""
    t0 = time.monotonic()
    run = cluster.coordinator("split")
    wall = time.monotonic() - t0
    assert all(p.poll() is None for p in cluster.agents.values())
    for i in range(N):
        assert f"connected to {cluster.first_url(i)}" in (cluster.dir / f"client-{i}.log").read_text()
    agent_rows = [json.loads(line) for line in (run / "field.jsonl").read_text().splitlines()
                  if '"event": "agent"' in line]
    assert {r["device"] for r in agent_rows if r["state"] == "online"} == {f"client-{i}" for i in range(N)}
    assert not any(r["retained"] for r in agent_rows)  # learnt from live answers to the announce request
    assert participants(run / "participation.csv") == {t: set(range(N)) for t in range(ROUNDS)}
    dups = assert_each_update_once(run)
    diff = replay_equal(run, cluster.dir / "split-sim")
    print(f"split run {wall:.1f} s, duplicates {dups}, max diff to replay {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_node_stopped_mid_run_agents_fail_over_and_run_equals_replay(cluster, tmp_path):
    """Node 2 stops while round 1 is in progress (its agents are in their 2 s training): they fail over
    to node 1, are given their task again, and the run completes; re-sent updates are discarded as
    duplicates, never aggregated twice, and the model equals its replay."""
    cmd_done: dict = {}

    def stop_node_2():
        cluster.watcher.wait_for(lambda topic, h: topic == "dropfl/v1/model/weights" and h.run.startswith("failover-")
                                 and h.round == 1, timeout=240)
        cmd_done["stop_s"] = cluster.rabbit.stop_node(1)
        cmd_done["at"] = time.monotonic()

    stopper = threading.Thread(target=stop_node_2, daemon=True)
    stopper.start()
    t0 = time.monotonic()
    run = cluster.coordinator("failover")
    wall = time.monotonic() - t0
    stopper.join(timeout=150)
    assert "stop_s" in cmd_done, "node 2 was never stopped"
    for i in (1, 3):  # node 2's agents: now on node 1
        log = (cluster.dir / f"client-{i}.log").read_text()
        assert f"reconnecting to {cluster.rabbit.url(0)}" in log and \
            log.count(f"connected to {cluster.rabbit.url(0)}") >= 1
    assert all(p.poll() is None for p in cluster.agents.values())
    dups = assert_each_update_once(run)
    last = participants(run / "participation.csv")[ROUNDS - 1]
    assert last == set(range(N)), f"round {ROUNDS - 1}: {last}"  # everyone is back on node 1
    diff = replay_equal(run, tmp_path / "sim")
    rows = round_rows(run)
    print(f"failover run {wall:.1f} s, node 2 stop took {cmd_done['stop_s']:.1f} s; per round participants "
          f"{[r['participants'] for r in rows]}, dropped {[r['dropped'] for r in rows]}, duplicates "
          f"{[r['duplicates'] for r in rows]} (total {dups}), max diff to replay {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.cluster
def test_three_nodes_the_coordinators_node_killed_everyone_resumes_on_the_others(tmp_path):
    """A 3-node cluster; node 1 (the coordinator's and agent 0's first URL) is killed with SIGKILL while round 1
    is open and stays dead. The clients that were on it reconnect to the live nodes with their old client id,
    and RabbitMQ 3.10 then takes one of two paths (both seen here, the first in most runs): (a) it keeps the
    clean session's QoS 1 queue homed on the dead node and refuses the client on every node (`home node ... is
    down`) until the node returns; the clients take a fresh client id after such a refusal
    (edge_client/agent/reconnect.py) and resume on the live nodes; the old queues stay on the dead node and an
    `expires` policy deletes them once it is back. (b) The plugin's clean-session `queue.delete` at the
    reconnect force-deletes the old queue (`master node is down ... Forcing queue deletion` in the live node's
    log) and the client is not refused on its old id (a fresh one only where the broker drops a connection before
    its SUBACK for another reason, as after any such drop). Each client takes its own path (one run: the coordinator's
    queue force-deleted, agent 0's kept). Which one each took is read from the broker's own records (its queue
    list while the node is down, its logs), and that path's consequences are asserted. Either way the run
    completes with the fault harness's invariants held (tests/faultkit.py: participants real, drops true,
    nothing lost or aggregated twice, replay bit for bit), the coordinator's outage recorded in round 1, a few
    reconnects per process (no storm), and no old queue left once the node is back."""
    if why := rabbit.missing():
        pytest.skip(why)
    from faultkit import CLUSTER_NODE_KILL, Trial, run_scenario
    rc = rabbit.RabbitCluster(tmp_path / "rabbit", nodes=3, timeout_s=240)
    try:
        for name in ["coordinator"] + [f"client-{i}" for i in range(CLUSTER_NODE_KILL.agents)]:
            rc.add_user(name, Trial.cluster_password)
        # the operator's policy that deletes the old client ids' queues (no consumer for 10 s) once their node is back
        rc.ctl(0, "set_policy", "mqtt-expires", "^mqtt-subscription-", '{"expires": 10000}', "--apply-to", "queues")
        o = run_scenario(CLUSTER_NODE_KILL, tmp_path / "trial", cluster=rc, cluster_victims=(0,))
        queues = rc.ctl(2, "list_queues", "name", "pid")
        live_logs, dead_log = {k: rc.log_text(k) for k in (1, 2)}, rc.log_text(0)
        restart_s = rc.start_node(0)
        after, t_back = rc.ctl(2, "list_queues", "name", "pid"), time.monotonic()
        while "mqtt-subscription-" in (left := rc.ctl(2, "list_queues", "name")) and time.monotonic() < t_back + 120:
            time.sleep(1)  # polling the broker's queue list: the expiry is the event
        expired_s = time.monotonic() - t_back
    finally:
        rc.close()
    print(f"3 nodes up in {rc.timings['start_s']:.1f} s; recorded {o.recorded}; recovered in {o.recover_s} s; "
          f"reconnects {o.notes['reconnects']}; node 1 back in {restart_s:.1f} s\nqueues while down:\n{queues}"
          f"\nqueues after its restart:\n{after}\nold queues gone {expired_s:.1f} s after the node was back")
    o.assert_held()
    assert "mqtt-subscription-" not in left, left  # gone once the node is back (path a: by the expires policy)
    # the dead node's clients: agent 0 and the coordinator (its first client id from the brokers' logs); each takes
    # its own path (one run had the coordinator's old queue force-deleted and agent 0's kept)
    coordinator = re.search(r"client id: (dropfl-coordinator-[0-9a-f]+)\)", dead_log + "".join(live_logs.values()))
    assert coordinator, "the coordinator's connection is in no node's log"
    for base, log in (("dropfl-client-0", tmp_path / "trial" / "client-0.log"),
                      (coordinator.group(1), tmp_path / "trial" / "coordinator.log")):
        text, old_queue = log.read_text(), f"mqtt-subscription-{base}qos1"
        if old_queue in queues:  # path (a): the old queue stayed on the dead node
            print(f"{base}: RabbitMQ path (a), its old queue stayed on the dead node; refused, then a fresh id")
            assert f"as {base}-r1" in text  # refused on its old id, then a fresh one
        else:  # path (b): force-deleted at the reconnect, by the broker's own account
            forced = [line for k in (1, 2) for line in live_logs[k].splitlines()
                      if "Forcing queue deletion" in line and old_queue in line]
            assert forced, f"{old_queue} neither on the dead node nor force-deleted:\n{queues}"
            # its old id is not refused; a fresh one only where the broker dropped a connection for another reason
            # before its SUBACK (seen: `queue.bind ... no queue '...qos0'` while the dead node's transient queues
            # were being deleted), as after any such drop
            print(f"{base}: RabbitMQ path (b), its old queue force-deleted at the reconnect; "
                  + ("then a fresh id after a dropped subscription" if f"as {base}-r" in text else "kept its id"))
    assert all(n <= 10 for n in o.notes["reconnects"].values()), o.notes["reconnects"]  # no storm
    assert o.recorded["participants"][-1] == CLUSTER_NODE_KILL.agents


@pytest.mark.slow
@pytest.mark.mosquitto
def test_tls_broker_list_fails_over_with_one_ca(tmp_path):
    """mqtts:// URLs: the first is a closed port, the second a provisioned (TLS, password) mosquitto;
    the coordinator fails over and connects with the one CA file, its host name checked."""
    from coordinator.cli import main as dropfl
    from coordinator.trial.tls import ProvisionedBroker

    root = tmp_path / "b"
    assert dropfl(["provision", "init", str(root), "--port", str(free_port())]) == 0
    with ProvisionedBroker(root) as broker:
        creds = json.loads(broker.coordinator_json.read_text())
        urls = f"mqtts://127.0.0.1:{free_port()},{broker.url}"
        hub = FieldHub(FieldConfig(run_id="tls-list", broker=urls, username=creds["username"],
                                   password=creds["password"], ca_file=str(root / creds["ca_file"])),
                       3, DataBinding(**BINDING), 4, tmp_path)
        hub.start()
        try:
            with hub.cond:
                assert hub.cond.wait_for(lambda: hub.connection.connects >= 1, timeout=30)
            assert hub.connection.brokers.url == broker.url
        finally:
            hub.stop(finished=False)
