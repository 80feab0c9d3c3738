"""The coordinator's checks beyond the wire format (coordinator/field/checks.py), fed to FieldHub as paho
would deliver them: each reject is counted by its code, logged, and never reaches aggregation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from test_field_hub import BINDING, make_hub, upload

from coordinator.field.collection import RoundState
from coordinator.field.hub import FieldHub
from edge_client import wire
from edge_client.trainer import TrainTask

GOOD = {"num_samples": 10, "steps": 2}


def open_round(hub: FieldHub, t: int = 0, clients: range = range(3)) -> RoundState:
    hub.collection.round = RoundState(t, {c: TrainTask(client=c, round=t, lr=0.1, batch_size=4) for c in clients}, 0.0)
    return hub.collection.round


def announce_samples(hub: FieldHub, c: int, n: int) -> None:
    meta = {"state": "online", "device": f"d{c}", "num_samples": n} | BINDING
    hub._dispatch(f"d{c}", "status", wire.encode("status", "", -1, c, meta=meta)[0], False)


def test_oversized_update_is_rejected_at_its_first_chunk_and_nothing_is_buffered(tmp_path):
    hub = make_hub(tmp_path)  # 4 parameters: at most 8 * 4 + 64 KiB bytes
    r = open_round(hub)
    big = wire.encode("update", "run-x", 0, 0, torch.zeros(40_000), GOOD, wire.Limits(chunk_bytes=4096))
    hub._dispatch("d0", "update/delta", big[0], False)
    assert r.dropped == {0: "rejected"} and r.rejects == {"too_large": 1} and not hub.collection.reasm.pending


def test_meta_of_the_wrong_type_is_a_reject_not_a_crash(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub)
    upload(hub, 0, torch.zeros(4), rnd=0, meta=GOOD | {"train_s": "slow"})
    upload(hub, 1, torch.zeros(4), rnd=0, meta=GOOD | {"loss": [1]})
    upload(hub, 2, torch.zeros(4), rnd=0, meta=GOOD | {"num_samples": True})
    assert r.dropped == {0: "rejected", 1: "rejected", 2: "rejected"} and r.rejects == {"meta": 3}
    assert not r.updates


def test_a_device_cannot_claim_more_samples_than_it_announced(tmp_path):
    hub = make_hub(tmp_path)
    announce_samples(hub, 0, 12)
    announce_samples(hub, 1, 12)
    r = open_round(hub, clients=range(2))
    upload(hub, 0, torch.zeros(4), rnd=0, meta={"num_samples": 12, "steps": 1})
    upload(hub, 1, torch.zeros(4), rnd=0, meta={"num_samples": 10 ** 30, "steps": 1})
    assert list(r.updates) == [0] and r.dropped == {1: "rejected"} and r.rejects == {"meta": 1}


def test_invalid_stats_are_rejected_but_a_valid_update_still_counts(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub, clients=range(1))
    upload(hub, 0, torch.ones(4), rnd=0)
    stats = wire.encode("stats", "run-x", 0, 0, meta={"upload_s": "fast", "uplink_Bps": 1.0})[0]
    hub._dispatch("d0", "update/stats", stats, False)
    assert list(r.updates) == [0] and r.stats == {0: {}} and r.resolved(0) and r.rejects == {"meta": 1}


def test_nan_shape_and_replay_are_counted_by_code(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub, t=3)
    upload(hub, 0, torch.tensor([0.0, float("inf"), 0.0, 0.0]), rnd=3)
    upload(hub, 1, torch.zeros(2, 2), rnd=3)
    upload(hub, 2, torch.zeros(4), rnd=2)  # last round's update, replayed
    upload(hub, 2, torch.zeros(4), rnd=3)
    assert r.rejects == {"nonfinite": 1, "shape": 1, "round": 1} and hub.collection.rejects == r.rejects
    assert list(r.updates) == [2] and r.dropped == {0: "rejected", 1: "rejected"}


def test_eval_is_bound_to_the_run_and_only_its_fields_reach_the_log(tmp_path):
    hub = make_hub(tmp_path)
    meta = {"accuracy": 0.5, "samples": 100, "seconds": 0.1, "event": "round"}
    hub._dispatch("d0", "update/eval", wire.encode("eval", "run-x", 1, 0, meta=meta)[0], False)
    hub._dispatch("d0", "update/eval", wire.encode("eval", "old-run", 1, 0, meta=meta)[0], False)
    hub._dispatch("d0", "update/eval", wire.encode("eval", "run-x", 1, 0, meta=meta | {"accuracy": 7})[0], False)
    rows = [json.loads(line) for line in (tmp_path / "field.jsonl").read_text().splitlines()]
    evals = [row for row in rows if row["event"] != "agent"]
    assert evals == [{"event": "eval", "round": 1, "client": 0, "accuracy": 0.5, "samples": 100, "seconds": 0.1}]
    assert hub.collection.rejects == {"run": 1, "meta": 1}


def test_status_and_heartbeat_must_match_the_device_of_the_topic(tmp_path):
    hub = make_hub(tmp_path)
    forged = {"state": "online", "device": "d1"} | BINDING
    hub._dispatch("d0", "status", wire.encode("status", "", -1, 0, meta=forged)[0], False)
    hub._dispatch("d0", "status", wire.encode("status", "", -1, 2, meta={"state": "online"} | BINDING)[0], False)
    hub._dispatch("d0", "heartbeat", wire.encode("heartbeat", "", -1, 1, meta={"available": False})[0], False)
    hub._dispatch("d9", "status", wire.encode("status", "", -1, 1, meta={"state": "online"} | BINDING)[0], False)
    assert hub.collection.rejects == {"device": 1, "client": 3}
    agents = hub.registry.agents
    assert agents["d0"].client == 0 and agents["d0"].heartbeat["available"] and "d9" not in agents


def test_a_tensor_where_none_belongs_is_rejected(tmp_path):
    hub = make_hub(tmp_path)
    r = open_round(hub, clients=range(1))
    decline = wire.encode("decline", "run-x", 0, 0, torch.zeros(3), meta={"reason": "battery"})[0]
    hub._dispatch("d0", "update/decline", decline, False)
    assert r.dropped == {0: "rejected"} and r.rejects == {"too_large": 1}


def test_one_device_cannot_make_the_coordinator_buffer_more_than_a_few_partial_updates(tmp_path):
    hub = make_hub(tmp_path)
    open_round(hub, t=0)
    lim = wire.Limits(chunk_bytes=8)
    for rnd in range(1, 30):  # first chunks of updates for future rounds, never completed
        hub._dispatch("d0", "update/delta", wire.encode("update", "run-x", rnd, 0, torch.zeros(4), GOOD, lim)[0], False)
    hub._dispatch("d1", "update/delta", wire.encode("update", "run-x", 0, 1, torch.ones(4), GOOD, lim)[0], False)
    by_client = [k[2] for k in hub.collection.reasm.pending]
    assert by_client.count(0) == wire.Limits().max_pending_per_client and by_client.count(1) == 1


def test_an_unexpected_exception_is_counted_and_does_not_kill_the_network_thread(tmp_path, monkeypatch):
    hub = make_hub(tmp_path)

    def broken(*args) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(hub.connection, "deliver", broken)  # the hub's router, as the connection calls it
    msg = SimpleNamespace(topic="dropfl/v1/device/d0/update/delta", payload=b"", retain=False)
    hub.connection._on_message(None, None, msg)  # paho would let this exception end its network thread
    assert hub.collection.rejects == {"internal": 1}


def test_announcing_a_huge_sample_count_does_not_raise_the_bound_past_2_31(tmp_path):
    hub = make_hub(tmp_path)
    announce_samples(hub, 0, 10 ** 30)
    r = open_round(hub, clients=range(1))
    upload(hub, 0, torch.zeros(4), rnd=0, meta={"num_samples": 10 ** 20, "steps": 1})
    assert r.dropped == {0: "rejected"} and r.rejects == {"meta": 1}
