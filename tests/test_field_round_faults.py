"""Field-mode bugs the fault suite found, reproduced without a broker (a FieldHub fed messages by hand, a fake
clock): an agent dropped `offline` and heard from again within the round keeps its update
(collection.py `heard_again`); the time waited with nobody there never counts an outage's part from before the
wait (absence.py `empty_time`, outage.py `downtime_between`); the broker-silence bound follows what the
coordinator has just given the broker to send (outage.py `silence_bound`)."""

import time

import torch
from test_field_hub import make_hub, upload

from coordinator.field import outage
from coordinator.field.collection import RoundState
from coordinator.field.outage import BROKER_MIN_BPS, BROKER_SILENT_S, overlap_s, silence_bound
from edge_client import wire
from edge_client.trainer import TrainTask


def open_round(hub, t=2, clients=(0, 1, 2)):
    r = hub.collection.round = RoundState(
        t, {c: TrainTask(client=c, round=t, lr=0.1, batch_size=4) for c in clients}, 0.0)
    return r


def heartbeat(hub, c):
    hub._dispatch(f"d{c}", "heartbeat", wire.encode("heartbeat", "", -1, c, meta={"available": True})[0], False)


# --- 1. dropped offline, then heard from within the round ---

def test_an_update_from_a_client_dropped_offline_in_the_round_is_accepted_and_the_drop_undone(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub)
    r.dropped[1] = "offline"            # the liveness check found it silent (its heartbeats queued behind data)
    r.gone.add(1)
    r.note(1, now=0.0)
    assert 1 in r.offline and 1 not in r.open
    good = torch.arange(4, dtype=torch.float32)
    upload(hub, 1, good)                # its update of this round's model arrives within the round
    assert 1 in r.updates and torch.equal(r.updates[1].tensor, good)
    assert 1 not in r.dropped and 1 not in r.offline and r.offline_undone == {1}
    assert 1 in r.open and 1 not in r.gone   # heard from: its stats are due again


def test_other_drops_still_discard_a_later_update(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub)
    hub._dispatch("d2", "update/decline", wire.encode("decline", "run-x", 2, 2, meta={"reason": "battery"})[0],
                  False)
    upload(hub, 2, torch.zeros(4))
    assert 2 not in r.updates and r.dropped == {2: "battery"} and not r.offline_undone


def test_a_heartbeat_undoes_an_offline_drop_of_the_open_round(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub)
    r.dropped[0] = "offline"
    r.gone.add(0)
    r.note(0, now=0.0)
    heartbeat(hub, 0)
    assert 0 not in r.dropped and 0 not in r.offline and 0 in r.open and r.offline_undone == {0}
    heartbeat(hub, 0)                   # nothing more to undo
    assert r.offline_undone == {0} and not r.rejoined   # no task re-sent: its connection held


def test_a_heartbeat_after_a_last_will_undoes_nothing(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub)
    hub._dispatch("d1", "status", wire.encode("status", "", -1, 1, meta={"state": "offline"})[0], False)
    heartbeat(hub, 1)                   # a stray heartbeat after the will: not online until it announces itself
    assert r.dropped == {1: "offline"} and not r.offline_undone


def test_an_update_arriving_while_the_round_waits_with_nobody_there_is_kept(tmp_path, monkeypatch):
    """The empty-federation wait (transport.py): every selected client dropped `offline`, nobody online; an
    agent's heartbeat and update arrive before the round loop looks again. Before, the update was discarded as
    from a client already dropped, and the round ended with `deadline`."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    hub = make_hub(tmp_path)
    r = open_round(hub, clients=(0, 1))
    now[0] += 100.0                     # everyone silent for longer than the heartbeat timeout
    for c in (0, 1):
        r.dropped[c] = "offline"
        r.gone.add(c)
        r.note(c, now=now[0])
    assert hub.absence.nobody_online(now[0]) is not None and r.offline == {0, 1}
    upload(hub, 0, torch.ones(4))       # its update, then its heartbeat, while the loop waits
    heartbeat(hub, 0)
    assert 0 in r.updates and hub.absence.nobody_online(now[0]) is None
    assert r.dropped == {1: "offline"} and r.offline == {1} and r.offline_undone == {0}


# --- 2. the empty-federation time never counts an outage's part from before the wait ---

def test_overlap_of_two_intervals():
    assert overlap_s(0, 10, 5, 20) == 5 and overlap_s(5, 20, 0, 10) == 5
    assert overlap_s(0, 3, 5, 8) == 0 and overlap_s(0, 10, 2, 4) == 2


class FakeCond:
    """The hub's condition under a fake clock: each wait advances it and plays what happened meanwhile."""

    def __init__(self, clock, events):
        self.clock, self.events = clock, events

    def wait(self, timeout=None):
        self.clock[0] += 0.5
        for at in [t for t in self.events if t <= self.clock[0]]:
            self.events.pop(at)()
        return True

    def notify_all(self):
        pass


def test_the_empty_federation_time_is_clipped_to_the_wait(tmp_path, monkeypatch):
    """A frozen broker's outage is dated from the last healthy contact, which may lie before the empty wait began
    (seen: empty_federation_s -2.94 s). Only the outage's part during the wait is taken off the wait."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    hub = make_hub(tmp_path)
    hub.outage.last_contact = 990.0     # the broker's last delivery; it is frozen from then on

    def freeze():                       # the silence is noticed at 1001: an outage from 990
        hub.outage.began(since=hub.outage.last_contact)
        hub.outage.silent = True

    def thaw():                         # the broker answers again at 1002
        hub.outage.contact(now[0])
        hub.registry.expected_back = set()  # nobody awaited: the wait goes on only while nobody is there

    events = {1001.0: freeze, 1002.0: thaw}
    for part in (hub.outage, hub.registry, hub.absence):  # the components that wait on the hub's condition
        part.cond = FakeCond(now, events)
    waited = hub.absence.wait_while_empty(lambda t: None if t >= 1004.0 else "3 offline", "round 1 is suspended")
    assert now[0] == 1004.0 and hub.outage.downtime(now[0]) == 12.0   # the outage: 990 to 1002
    # 1000 to 1004, less the outage's part in it: 1000 to 1002 (before: less all 12 s of it, -8 s)
    assert waited == 2.0 and hub.absence.empty_s == 2.0 and hub.absence.empty_time(now[0]) == 2.0


# --- 4. the broker-silence bound follows the bytes the broker was just given to send ---

def test_silence_bound_grows_with_the_fan_out_just_published():
    assert silence_bound(0.0) == BROKER_SILENT_S
    assert silence_bound(310e6) == BROKER_SILENT_S + 310e6 / BROKER_MIN_BPS
    assert silence_bound(31e3 * 3) < BROKER_SILENT_S + 0.1   # a small federation: the plain bound


def test_a_busy_broker_is_not_an_outage_but_a_frozen_one_still_is(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    hub = make_hub(tmp_path)            # 5 agents known
    hub.outage.last_contact = 1000.0
    hub.connection.mqtt.publish = lambda *a, **k: None
    model = [b"x" * 1_000_000] * 10     # 10 MB of model frames to each of the 5 agents: 50 MB to send
    hub.connection.publish_frames("model/weights", model)
    assert hub.outage.owed_bytes(now[0]) == 50e6
    bound = silence_bound(50e6)
    with hub.cond:                      # as the probe thread and paho's thread hold it
        now[0] = 1000.0 + bound - 0.1   # silent, but the broker may still be sending the model
        hub.outage.silence(now[0])
        assert hub.outage.down_since is None
        now[0] = 1000.0 + bound + 0.1   # silent past what that fan-out can take: frozen
        hub.outage.silence(now[0])
        assert hub.outage.down_since == 1000.0 and hub.outage.silent   # dated from the last healthy contact
        hub.outage.contact(now[0] + 1)
        assert hub.outage.down_since is None


def test_owed_bytes_end_with_the_echo_of_a_later_probe(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    hub = make_hub(tmp_path)
    hub.connection.mqtt.publish = lambda *a, **k: None
    hub.connection.publish_frames("model/weights", [b"x" * 1000])
    hub.connection.publish_frames("device/d0/control", [b"y" * 100])   # one device's topic: sent once
    assert hub.outage.owed_bytes(now[0]) == 1000 * 5 + 100
    now[0] += 0.1
    hub.outage.contact(now[0])          # some message from the broker: not proof that it took in the model
    assert hub.outage.owed_bytes(now[0]) == 1000 * 5 + 100
    hub.outage.probe_echo(now[0], sent_at=999.0)              # the echo of a probe published before them
    assert hub.outage.owed_bytes(now[0]) == 1000 * 5 + 100
    hub.outage.probe_echo(now[0], sent_at=now[0] - 0.05)      # the echo of a probe published after them
    assert hub.outage.owed_bytes(now[0]) == 0
    assert outage.silence_bound(hub.outage.owed_bytes(now[0])) == BROKER_SILENT_S
