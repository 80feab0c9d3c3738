"""The field hub's components on their own (coordinator/field/hub.py), with no broker and no FieldHub: each is
built with hand-made collaborators in place of the others, through the interfaces it declares (registry.py
`RoundHooks` and `BrokerHealth`, absence.py `Agents` and `Broker`, outage.py's hooks). The device agent's
components likewise (edge_client/agent/__init__.py), with no broker and no Agent (work.py `Uplink` and
`Availability`, the heartbeat's and the link's callables), in a section of their own at the end."""

import csv
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from coordinator.field import outage as outage_mod
from coordinator.field.absence import Absence, EmptyFederation
from coordinator.field.collection import Collection, RoundState
from coordinator.field.connection import FieldConfig
from coordinator.field.outage import AGENT_RECONNECT_S, Outage
from coordinator.field.registry import Registry
from edge_client import wire
from edge_client.agent import config_from_dict
from edge_client.agent.config import TOPIC_ROOT, Brokers
from edge_client.agent.heartbeat import Heartbeat
from edge_client.agent.link import Link
from edge_client.agent.work import Work
from edge_client.battery import BatteryConfig, Reading
from edge_client.federation import DataBinding
from edge_client.models import build_model, get_flat
from edge_client.telemetry import Telemetry, TelemetryConfig
from edge_client.trainer import TrainTask

BINDING = DataBinding(dataset="fmnist", partition="iid", clients=4, shards_per_client=2, dirichlet_alpha=0.5,
                      seed=0, model="logreg", dropout=None)


class Rounds:
    """Stands in for the round collection: records what the registry tells it (registry.py `RoundHooks`)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.rows: list[dict] = []

    def agent_online(self, c):
        self.calls.append(("online", c))

    def agent_offline(self, c):
        self.calls.append(("offline", c))

    def heard_again(self, c, what):
        self.calls.append(("heard", c, what))
        return False

    def reject(self, device, sub, code, reason):
        self.calls.append(("reject", device, code))

    def write_log(self, row):
        self.rows.append(row)


def broker(last_contact=0.0, down_since=None):
    """Stands in for the broker's health (registry.py `BrokerHealth`)."""
    return SimpleNamespace(last_contact=last_contact, down_since=down_since, wait_for_broker=lambda what: None)


def registry(rounds=None, health=None, timeout_s=60.0):
    cfg = FieldConfig(run_id="run-x", heartbeat_timeout_s=timeout_s)
    return Registry(cfg, 4, BINDING, wire.Limits(), threading.Condition(threading.RLock()), rounds or Rounds(),
                    health or broker())


def status(reg, device, c, state="online", **meta):
    meta = {"state": state} | (BINDING.to_meta() if state == "online" else {}) | meta
    reg.on_message(device, "status", wire.encode("status", "", -1, c, meta=meta)[0], False, time.monotonic())


def heartbeat(reg, device, c, now, **meta):
    reg.on_message(device, "heartbeat", wire.encode("heartbeat", "", -1, c, meta={"available": True} | meta)[0],
                   False, now)


# --- Registry: a rejoin only on a real change of state (docs/field-mode.md, issue 36 item 5) ---

def test_registry_status_is_idempotent_and_a_rejoin_needs_a_new_connection():
    rounds = Rounds()
    reg = registry(rounds)
    status(reg, "d1", 1, session="p:1")                 # the first status of a connection: a (re)join
    status(reg, "d1", 1, session="p:1")                 # the same, re-delivered (retained, backlogged): no rejoin
    status(reg, "d1", 1, session="p:2", reply=True)     # its answer to our announce request while online: none
    status(reg, "d1", 1, session="p:3")                 # a new connection: a rejoin
    status(reg, "d1", 1, state="offline", session="p:3")
    status(reg, "d1", 1, session="p:3")                 # back online after its offline: a rejoin, same session
    assert rounds.calls == [("online", 1), ("online", 1), ("offline", 1), ("online", 1)]
    assert [r["state"] for r in rounds.rows] == ["online"] * 4 + ["offline", "online"]
    assert reg.device_of(1) == "d1" and reg.agent("d1").session == "p:3"


def test_registry_refuses_a_second_device_for_a_client_and_a_client_out_of_range():
    rounds = Rounds()
    reg = registry(rounds)
    status(reg, "d1", 1)
    status(reg, "d9", 1)                                # client 1 is d1 already
    status(reg, "d5", 7)                                # only clients 0..3
    status(reg, "d6", 2, state="offline")               # an unknown device's offline: nothing to note
    assert rounds.calls == [("online", 1), ("reject", "d9", wire.WRONG_CLIENT), ("reject", "d5", wire.WRONG_CLIENT)]
    assert set(reg.agents) == {"d1"} and reg.client_status(2, time.monotonic()) == "offline"


def test_registry_silence_counts_only_while_the_broker_answers_and_awaits_those_cut_off():
    health = broker()
    reg = registry(health=health, timeout_s=3.0)
    status(reg, "d0", 0)
    status(reg, "d1", 1)
    t0 = time.monotonic()
    heartbeat(reg, "d0", 0, t0)
    heartbeat(reg, "d1", 1, t0)
    reg.seen("d0", t0 + 2.0)                            # a chunk of an upload: life
    assert reg.is_online(reg.agent("d0"), t0 + 4.9) and not reg.is_online(reg.agent("d1"), t0 + 4.9)
    health.last_contact = t0 + 1.0                      # the broker's last delivery: its agents' silence stops there
    assert reg.is_online(reg.agent("d1"), t0 + 100.0)
    health.last_contact = 0.0
    reg.outage_began(t0 + 1.0)                          # both alive when the broker went away
    back = reg.outage_ended(t0 + 2.0)
    assert back == {"d0", "d1"} and reg.back_by == t0 + 2.0 + AGENT_RECONNECT_S + 3.0
    assert reg.awaited(t0 + 2.5) == {0, 1}
    heartbeat(reg, "d1", 1, t0 + 2.6)                   # d1 is back; d0 not yet
    assert reg.awaited(t0 + 2.7) == {0}
    health.down_since = t0 + 2.8                        # while the broker is out, nobody is awaited
    assert reg.awaited(t0 + 2.9) == set()
    health.down_since = None
    assert reg.awaited(reg.back_by) == set() and reg.expected_back == set()   # the wait for them is over


# --- Absence: an empty federation waits, its time apart from the broker's outages, then gives up ---

class Agents:
    """Stands in for the registry (absence.py `Agents`): each client's status, set by the test."""

    def __init__(self, statuses):
        self.statuses, self.settled = statuses, 0

    def client_status(self, c, now):
        return self.statuses[c]

    def online_count(self):
        return sum(s is None for s in self.statuses)

    def awaited(self, now):
        return set()

    def wait_until_settled(self, what):
        self.settled += 1


class Clock:
    """A condition under a fake clock: each wait advances it by 0.5 s and plays what was due meanwhile."""

    def __init__(self, now, events=None):
        self.now, self.events = now, events or {}

    def wait(self, timeout=None):
        self.now[0] += 0.5
        for at in [t for t in self.events if t <= self.now[0]]:
            self.events.pop(at)()
        return True

    def notify_all(self):
        pass


def absence(agents, outage_broker, cond, empty_timeout_s=300.0):
    cfg = FieldConfig(run_id="run-x", empty_federation_timeout_s=empty_timeout_s)
    return Absence(cfg, cond, len(agents.statuses), agents, outage_broker)


def test_absence_says_why_nobody_is_there_and_waits_for_the_first_one_back(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    agents = Agents(["offline", "battery", "offline"])
    cond = Clock(now, {102.0: lambda: agents.statuses.__setitem__(1, None)})
    no_outages = Outage(FieldConfig(), cond, on_began=lambda t: None, on_ended=lambda t, s: None)
    ab = absence(agents, no_outages, cond)
    assert ab.nobody_available(now[0]) == "2 offline, 1 battery" and ab.nobody_online(now[0]) is not None
    waited = ab.wait_while_empty(ab.nobody_available, "round 3 starts when one is")
    assert now[0] == 102.0 and waited == 2.0 and ab.empty_s == 2.0
    assert ab.nobody_available(now[0]) is None and ab.wait_while_empty(ab.nobody_available, "x") == 0.0
    assert agents.settled == 0                          # no outage: nothing to settle


def test_absence_gives_up_after_its_timeout_without_counting_an_outage(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    agents = Agents(["offline", "offline"])
    cond = Clock(now)
    out = Outage(FieldConfig(), cond, on_began=lambda t: None, on_ended=lambda t, s: None)

    def broker_down():
        out.began()
        cond.events[now[0] + 3.0] = out.ended           # 3 s later the broker is back

    cond.events[101.0] = broker_down
    ab = absence(agents, out, cond, empty_timeout_s=5.0)
    with pytest.raises(EmptyFederation, match="--empty-federation-timeout 5"):
        ab.wait_while_empty(ab.nobody_online, "round 1 is suspended")
    assert out.downtime(now[0]) == 3.0 and agents.settled >= 1
    assert now[0] == 108.0 and ab.empty_s == 5.0         # 8 s waited, 3 of them the broker's outage


# --- Outage: the broker's health tells the hub when an outage begins and ends ---

def test_outage_hooks_silence_and_contact(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    events = []
    out = Outage(FieldConfig(), Clock(now), on_began=lambda t: events.append(("began", t)),
                 on_ended=lambda t, lasted: events.append(("ended", t, lasted)))
    out.contact(1000.0)
    out.silence(1000.0 + outage_mod.BROKER_SILENT_S - 0.1)   # not silent for long enough
    now[0] = 1000.0 + outage_mod.BROKER_SILENT_S + 0.1
    out.silence(now[0])                                  # frozen: an outage dated from the last contact
    out.began()                                          # already in one: nothing new
    assert out.down_since == 1000.0 and out.silent and out.outages == 1
    now[0] = 1010.0
    out.contact(now[0])                                  # the broker answers again: the silence's outage ends
    assert events == [("began", 1000.0 + outage_mod.BROKER_SILENT_S + 0.1), ("ended", 1010.0, 10.0)]
    assert out.down_since is None and out.downtime(now[0]) == 10.0 and out.downtime_between(1005.0, 1020.0) == 5.0
    out.disconnected()                                   # a disconnect: not silent, ended only by a reconnect
    out.contact(1011.0)
    assert out.down_since == 1010.0 and not out.silent


# --- Collection: an outage's end undoes the `offline` drops of those it cut off ---

def test_collection_back_after_an_outage_undoes_only_offline_drops_without_an_update(tmp_path):
    coll = Collection(FieldConfig(run_id="run-x"), 4, wire.Limits(), threading.Condition(), tmp_path)
    r = coll.round = RoundState(0, {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(3)}, 0.0)
    for c in range(3):
        coll.agent_offline(c)                            # last wills a broker going down sent
    r.dropped[2] = "battery"                             # declined before: not the outage's to undo
    coll.back_after_outage({0, 1, 2})
    assert r.dropped == {2: "battery"} and not r.gone and r.open == {0, 1}


# --- The device agent's components: heartbeat, link and work, each on its own (edge_client/agent/) ---

AGENT_CFG = config_from_dict({"agent": {"client": 1, "heartbeat_s": 600.0}, "data": {"clients": 4}})
CONTROL = f"{TOPIC_ROOT}/device/client-1/control"
AGENT_TASK = {"lr": 0.1, "batch_size": 8, "steps": 2, "seed": 2}


class Battery:
    """Stands in for the agent's battery: one fixed reading; adds up the training seconds it is told of."""

    def __init__(self, reading: Reading):
        self.reading, self.trained_s = reading, 0.0

    def read(self, t):
        return self.reading

    def training(self, seconds):
        self.trained_s += seconds


def agent_rates() -> dict:
    return {"uplink_Bps": 8000.0, "downlink_Bps": None, "train_samples_per_s": 12.5}


def heartbeat_component(tmp_path, reading: Reading):
    """A heartbeat publishing into a queue: (heartbeat, what it published, connected, stopping)."""
    published: queue.Queue = queue.Queue()
    connected, stopping = threading.Event(), threading.Event()
    connected.set()
    hb = Heartbeat(AGENT_CFG, "client-1", 1, Battery(reading), SimpleNamespace(temperature=lambda: 41.5), tmp_path,
                   connected, stopping, agent_rates(), rounds_trained=lambda: 3,
                   publish=lambda sub, frames, qos: published.put((sub, frames, qos)))
    return hb, published, connected, stopping


def test_heartbeat_payload_trace_rows_and_policy_verdict(tmp_path):
    hb, published, connected, _ = heartbeat_component(tmp_path, Reading(15.0, False))
    assert hb.policy_reason() == "battery" and hb.battery_pct() == 15.0
    hb.beat()
    sub, (frame,), qos = published.get_nowait()
    m = wire.decode([frame])
    assert (sub, qos, m.kind, m.header.client) == ("heartbeat", 0, "heartbeat", 1)
    assert (m.meta["battery_pct"], m.meta["charging"], m.meta["temp_c"]) == (15.0, False, 41.5)  # the sensor's temp
    assert (m.meta["available"], m.meta["reason"], m.meta["net_up"]) == (False, "battery", True)
    assert (m.meta["rounds_trained"], m.meta["uplink_Bps"], m.meta["train_samples_per_s"]) == (3, 8000.0, 12.5)
    connected.clear()   # the broker went away: nothing published, a row of the trace all the same
    hb.beat()
    assert published.empty()
    hb.close()
    with open(tmp_path / "trace.csv", newline="") as f:
        rows = [(r["device"], r["online"], r["battery_pct"], r["charging"], r["uplink_Bps"], r["downlink_Bps"],
                 r["temp_c"]) for r in csv.DictReader(f)]
    assert rows == [("client-1", "1", "15.00", "0", "8000", "", "41.5"), ("client-1", "0", "15.00", "0", "8000", "",
                                                                          "41.5")]


def test_heartbeat_thread_beats_at_start_and_at_once_when_asked_and_ends_on_stop(tmp_path):
    hb, published, _, stopping = heartbeat_component(tmp_path, Reading(80.0, True))  # heartbeat_s 600
    hb.start()
    published.get(timeout=30)       # the first heartbeat, at the start
    hb.beat_now()                   # (the link asks for one on every connect)
    published.get(timeout=30)       # the next one now, not heartbeat_s later
    stopping.set()
    hb.stop()
    assert not hb._thread.is_alive() and published.empty()   # ended without another heartbeat
    hb.close()


def link_component():
    """A link with a paho client that never connects: (link, inbox, what it published, heartbeats asked for)."""
    inbox: queue.Queue = queue.Queue()
    beats: list[int] = []
    link = Link(AGENT_CFG, "client-1", 1, BINDING, 100, Brokers(AGENT_CFG.agent.broker, "agent.broker"),
                wire.Limits(), inbox, threading.Event(), threading.Event(), agent_rates(),
                beat_now=lambda: beats.append(1), battery_pct=lambda: 70.0)
    published: list[tuple[str, bytes, bool]] = []
    link.mqtt.publish = lambda topic, payload, qos=0, retain=False: published.append((topic, payload, retain)) or \
        SimpleNamespace(is_published=lambda: True, wait_for_publish=lambda timeout=None: None)
    return link, inbox, published, beats


def arrive(link, topic, frame, retain=False):
    """A message through paho's callback (the network thread), which passes the client."""
    link._on_message(link.mqtt, None, SimpleNamespace(topic=topic, payload=frame, retain=retain))


def test_link_says_which_newer_round_supersedes_a_round_from_the_frames_header():
    link, inbox, _, _ = link_component()
    assert link.superseded("run", 5) is None                     # nothing from the coordinator yet
    arrive(link, CONTROL, wire.encode("task", "run", 5, 1, meta=AGENT_TASK)[0])
    assert link.superseded("run", 5) is None and link.superseded("run", 4) == ("run", 5)
    arrive(link, f"{TOPIC_ROOT}/model/weights", wire.encode("model", "run", 6, -1, torch.zeros(3))[0])
    assert link.superseded("run", 5) == ("run", 6) and link.superseded("other", 6) == ("run", 6)
    arrive(link, CONTROL, b"DFL1\x00\x00\x00\x05{bad}")          # not a header: left to the reassembly
    arrive(link, f"{TOPIC_ROOT}/device/client-2/control", wire.encode("task", "run", 9, 2, meta=AGENT_TASK)[0])
    arrive(link, f"{TOPIC_ROOT}/coordinator/status", wire.encode("coordinator", "run", -1, -1,
                                                                 meta={"state": "online"})[0])
    assert link.superseded("run", 6) is None                     # none of those is a task or model of ours
    arrive(link, CONTROL, wire.encode("task", "run", 3, 1, meta=AGENT_TASK)[0])
    assert link.superseded("run", 6) == ("run", 3)               # a resumed coordinator's earlier round: 6 is over
    items = list(inbox.queue)
    assert len(items) == 6 and [i[0] for i in items][2] == CONTROL and all(isinstance(i[3], float) for i in items)


def test_link_answers_the_coordinators_announce_request_from_the_network_thread():
    link, inbox, published, beats = link_component()
    ask = wire.encode("coordinator", "run", -1, -1, meta={"state": "online", "announce": True})[0]
    arrive(link, f"{TOPIC_ROOT}/coordinator/status", ask, retain=True)   # a retained one is no request
    assert published == [] and beats == []
    arrive(link, f"{TOPIC_ROOT}/coordinator/status", ask)
    (topic, payload, retain), = published
    m = wire.decode([payload])
    assert topic == f"{TOPIC_ROOT}/device/client-1/status" and retain and beats == [1]
    assert (m.meta["state"], m.meta["reply"], m.meta["num_samples"], m.meta["device"]) == ("online", True, 100,
                                                                                           "client-1")
    assert inbox.qsize() == 2   # both still reach the main thread


def test_link_uploads_every_chunk_then_its_stats_and_abandons_a_superseded_upload():
    link, _, published, _ = link_component()
    frames = wire.encode("update", "run", 5, 1, torch.zeros(3000), {"num_samples": 10}, wire.Limits(chunk_bytes=4096))
    link.send_update("run", 5, frames)
    assert [t.rsplit("/", 2)[-2:] for t, _, _ in published] == [["update", "delta"]] * len(frames) + [
        ["update", "stats"]] and len(frames) > 1
    stats = wire.decode([published[-1][1]])
    assert stats.meta["upload_bytes"] == sum(len(f) for f in frames) and stats.meta["uplink_Bps"] == \
        link.rates["uplink_Bps"]
    published.clear()
    arrive(link, CONTROL, wire.encode("task", "run", 6, 1, meta=AGENT_TASK)[0])   # round 5 closed
    link.send_update("run", 5, frames)
    assert published == [] and link.uploads_abandoned == 1


class Uplink:
    """Stands in for the link (work.py `Uplink`): records what the work publishes and uploads; `newer` is what
    `superseded` answers."""

    def __init__(self):
        self.published: list[tuple[str, list[bytes]]] = []
        self.updates: list[tuple[str, int, list[bytes]]] = []
        self.newer: tuple[str, int] | None = None

    def publish(self, sub, frames, qos=1):
        self.published.append((sub, frames))

    def send_update(self, run, rnd, frames, record=None):
        self.updates.append((run, rnd, frames))

    def superseded(self, run, rnd):
        return self.newer


def work_component(tmp_path, reason: str | None = None):
    """Client 1's work on 32 random samples (logreg): (work, its link, its battery, connected)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    link, battery, connected = Uplink(), Battery(Reading(80.0, True)), threading.Event()
    connected.set()
    telemetry = Telemetry(TelemetryConfig(sysfs_root=str(tmp_path), vcgencmd=""), BatteryConfig(source="mains"))
    work = Work(AGENT_CFG, "client-1", 1, torch.device("cpu"), build_model("logreg", (1, 28, 28), 10, 0), x, y,
                x[:8].numpy(), y[:8].numpy(), 10, limits=wire.Limits(), battery=battery, telemetry=telemetry,
                rates=agent_rates(), connected=connected, stopping=threading.Event(), nothing_waiting=lambda: True,
                link=link, availability=SimpleNamespace(policy_reason=lambda: reason, battery_pct=lambda: 80.0))
    return work, link, battery, connected


def hand_over(work, rnd, w):
    """Round `rnd`'s task and global model, as the agent routes them, then the work's step."""
    work.on_task(wire.decode(wire.encode("task", "run", rnd, 1, meta=AGENT_TASK)), 0.0)
    work.on_model(wire.decode(wire.encode("model", "run", rnd, -1, w)), 0.0, 0.0)
    work.step()


def test_work_drops_a_superseded_task_trains_the_next_and_resends_its_cached_update(tmp_path):
    work, link, battery, _ = work_component(tmp_path)
    w = get_flat(build_model("logreg", (1, 28, 28), 10, 2))
    link.newer = ("run", 6)          # round 6's task or model reached the link first: round 5 is over
    hand_over(work, 5, w)
    assert (work.tasks_skipped, work.rounds_trained, link.updates, work.task) == (1, 0, [], None)
    link.newer = None
    hand_over(work, 6, w)
    (run, rnd, frames), = link.updates
    up = wire.decode(frames, run="run", round=6, client=1, kinds=("update",))
    assert (run, rnd, work.rounds_trained, up.meta["num_samples"], up.meta["steps"]) == ("run", 6, 1, 32, 2)
    assert battery.trained_s > 0 and work.rates["train_samples_per_s"] is not None
    work.on_task(wire.decode(wire.encode("task", "run", 6, 1, meta=AGENT_TASK)), 0.0)   # asked again
    assert link.updates[1] == ("run", 6, frames) and work.rounds_trained == 1 and work.task is None


@pytest.mark.parametrize("reason,connected,declined", [
    ("battery", True, "battery"), ("offline", True, "offline"),
    ("offline", False, None),     # reached us as the broker went away: a decline would arrive late, and untrue
    (None, True, None)])
def test_work_declines_a_task_with_the_policys_reason(tmp_path, reason, connected, declined):
    work, link, _, conn = work_component(tmp_path, reason)
    if not connected:
        conn.clear()
    work.on_task(wire.decode(wire.encode("task", "run", 0, 1, meta=AGENT_TASK)), 0.0)
    assert [wire.decode(frames).meta["reason"] for sub, frames in link.published
            if sub == "update/decline"] == ([declined] if declined else [])
    assert (work.task is not None) == (reason is None)
