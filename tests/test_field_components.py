"""The field hub's components on their own (coordinator/field/hub.py), with no broker and no FieldHub: each is
built with hand-made collaborators in place of the others, through the interfaces it declares (registry.py
`RoundHooks` and `BrokerHealth`, absence.py `Agents` and `Broker`, outage.py's hooks)."""

import threading
import time
from types import SimpleNamespace

import pytest

from coordinator.field import outage as outage_mod
from coordinator.field.absence import Absence, EmptyFederation
from coordinator.field.collection import Collection, RoundState
from coordinator.field.connection import FieldConfig
from coordinator.field.outage import AGENT_RECONNECT_S, Outage
from coordinator.field.registry import Registry
from edge_client import wire
from edge_client.federation import DataBinding
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
