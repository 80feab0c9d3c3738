"""An agent behind a slow uplink (docs/field-mode.md "Liveness on slow links", docs/protocol.md "Liveness and
stale uploads"): liveness never waits behind data, a stale upload stops the moment a newer round's task or
model arrives, and the deadline follows an upload that keeps arriving. The agent tests need no broker; the
link tests run a private mosquitto and two agent processes, agent 1 behind a real `tc tbf` rate limit on a
veth in its own network namespace (root; skipped with the reason otherwise)."""

from __future__ import annotations

import json
import re
import subprocess

import torch
from fieldkit import CLI, ROOT, kill_group
from test_field_agent import offline_agent
from test_field_empty import replay_exact
from test_netem import needs_netns

from coordinator.availability.participation import read_rows
from coordinator.field.collection import RoundState
from coordinator.trial.broker import Mosquitto
from edge_client import wire
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask

CONTROL = "dropfl/v1/device/client-1/control"
TASK = {"lr": 0.1, "batch_size": 8, "steps": 2, "seed": 2}


class Msg:
    def __init__(self, topic: str, payload: bytes):
        self.topic, self.payload, self.retain = topic, payload, False


class InFlight:
    """paho's MQTTMessageInfo of a chunk the broker has not acknowledged yet: the first wait for its PUBACK
    is when round 6's task reaches the agent (through paho's callback, as over a real link)."""

    def __init__(self, agent, arrives: list[bytes]):
        self.agent, self.arrives = agent, arrives

    def wait_for_publish(self, timeout=None):
        while self.arrives:
            self.agent.link._on_message(None, None, Msg(CONTROL, self.arrives.pop(0)))

    def is_published(self):
        return False


class Acked:
    def wait_for_publish(self, timeout=None):
        pass

    def is_published(self):
        return True


def round_5(a, w):
    """Round 5's task and model through paho's callback and the inbox, as the agent's main loop takes them."""
    for topic, frames in ((CONTROL, wire.encode("task", "run", 5, 1, meta=TASK)),
                          ("dropfl/v1/model/weights", wire.encode("model", "run", 5, -1, w))):
        for f in frames:
            a.link._on_message(None, None, Msg(topic, f))
    while not a.inbox.empty():
        a._handle(*a.inbox.get())
        a.work.step()


def test_the_first_upload_goes_in_small_chunks_and_later_ones_follow_the_measured_rate(tmp_path, monkeypatch):
    """No rate is known before the first upload: it goes in first_chunk_bytes chunks, never as one message
    that heartbeats would queue behind; the next upload's chunks take heartbeat_s at the measured rate."""
    a, sent = offline_agent(tmp_path, monkeypatch, agent={"heartbeat_s": 0.5})
    assert a.cfg.agent.chunk_bytes == 256 * 1024 and a.cfg.agent.first_chunk_bytes == 8 * 1024
    assert a.work._upload_limits().chunk_bytes == 8 * 1024
    a.rates["uplink_Bps"] = 8000.0               # an 8 kB/s uplink, measured on the last upload
    assert a.work._upload_limits().chunk_bytes == 4096
    a.rates["uplink_Bps"] = 40000.0
    assert a.work._upload_limits().chunk_bytes == 20000
    a.rates["uplink_Bps"] = 1e9                  # never above chunk_bytes
    assert a.work._upload_limits().chunk_bytes == 256 * 1024


def test_a_newer_rounds_task_stops_the_upload_in_progress_and_the_new_round_trains(tmp_path, monkeypatch):
    """Round 5's upload waits for a PUBACK when round 6's task arrives: it stops there (no further chunk, no
    stats), and round 6 trains and uploads in full."""
    a, sent = offline_agent(tmp_path, monkeypatch, agent={"first_chunk_bytes": 1024})
    w = get_flat(build_model("logreg", (1, 28, 28), 10, 2))
    task6 = wire.encode("task", "run", 6, 1, meta=TASK)
    monkeypatch.setattr(a.link.mqtt, "publish", lambda topic, payload, qos=0, retain=False:
                        sent.append((topic, payload)) or InFlight(a, task6))
    round_5(a, w)
    deltas = [wire.decode_frame(p)[0] for t, p in sent if t.endswith("/update/delta")]
    assert [h.round for h in deltas] == [5, 5] and deltas[0].chunks == 31  # the window, of 31 chunks
    assert not any(t.endswith("/update/stats") for t, _ in sent)
    assert a.link.uploads_abandoned == 1 and a.link.superseded("run", 5) == ("run", 6)
    assert a.link.superseded("run", 6) is None
    sent.clear()
    monkeypatch.setattr(a.link.mqtt, "publish", lambda topic, payload, qos=0, retain=False:
                        sent.append((topic, payload)) or Acked())
    model6 = wire.encode("model", "run", 6, -1, w + 0.01)
    for f in model6:
        a.link._on_message(None, None, Msg("dropfl/v1/model/weights", f))
    while not a.inbox.empty():
        a._handle(*a.inbox.get())
        a.work.step()
    up = wire.decode([p for t, p in sent if t.endswith("/update/delta")], run="run", round=6, client=1)
    assert up.meta["model_digest"] == wire.model_digest(w + 0.01)
    assert [wire.decode([p]).header.round for t, p in sent if t.endswith("/update/stats")] == [6]
    assert a.link.uploads_abandoned == 1 and a.work.rounds_trained == 2


def test_a_task_whose_round_is_already_over_is_not_trained(tmp_path, monkeypatch):
    """Round 5's task and model are still in the inbox when round 6's model has arrived (a device busy for a
    whole round): round 5 is not trained or uploaded; a resumed coordinator's earlier round is a new round too."""
    a, sent = offline_agent(tmp_path, monkeypatch)
    w = get_flat(build_model("logreg", (1, 28, 28), 10, 2))
    frames = [(CONTROL, f) for f in wire.encode("task", "run", 5, 1, meta=TASK)]
    frames += [("dropfl/v1/model/weights", f) for f in wire.encode("model", "run", 5, -1, w)]
    frames += [("dropfl/v1/model/weights", f) for f in wire.encode("model", "run", 6, -1, w)]
    for topic, f in frames:
        a.link._on_message(None, None, Msg(topic, f))
    while not a.inbox.empty():
        a._handle(*a.inbox.get())
        a.work.step()
    assert sent == [] and a.work.tasks_skipped == 1 and a.work.rounds_trained == 0
    a.link._on_message(None, None, Msg(CONTROL, wire.encode("task", "run", 3, 1, meta=TASK)[0]))
    assert a.link.superseded("run", 6) == ("run", 3) and a.link.superseded("run", 3) is None


def test_the_coordinator_counts_a_stale_uploads_chunks_in_the_round_they_arrive(tmp_path):
    from test_field_hub import make_hub
    hub = make_hub(tmp_path)
    r = hub.collection.round = RoundState(
        1, {c: TrainTask(client=c, round=1, lr=0.1, batch_size=4) for c in range(2)}, 0.0)
    old = wire.encode("update", "run-x", 0, 1, torch.zeros(8), {"num_samples": 1, "steps": 1},
                      wire.Limits(chunk_bytes=4))
    for f in old[:1]:   # the tail of round 0's upload, sent before the agent saw round 1's task
        hub._dispatch("d1", "update/delta", f, False)
    assert r.stale_chunks == {1: 1} and r.progress == {} and 1 not in r.dropped and r.rejects == {}


# --- over a real rate limit ---

TIMEOUT_S = 3.0     # the coordinator's heartbeat timeout
HEARTBEAT_S = 0.3   # the agents' heartbeat period
UP_BPS = 6000.0     # agent 1's uplink (its heartbeats take ~2 kB/s of it): a 31.4 kB logreg update takes ~7 s


def slow_run(tmp_path, rounds: int, deadline: float, extension: float, agent: dict) -> tuple:
    """Two agents (fmnist iid, logreg, 2 clients), agent 1 behind a UP_BPS uplink (tc tbf on its namespace's
    veth); the coordinator on the host side. Returns the round rows of field.jsonl, the participation rows,
    agent 1's log and the run directory."""
    from coordinator.field import netem

    plan = netem.LinkPlan([1e6, UP_BPS], [1e6, 1e6], [True, True])
    procs = []
    out = tmp_path / "run"
    with netem.Links(plan) as links, Mosquitto(workdir=tmp_path / "broker", hosts=links.hosts) as broker:
        try:
            for i in range(2):
                cfg = {"agent": {"client": i, "broker": f"mqtt://{links.host_address(i)}:{broker.port}",
                                 "heartbeat_s": HEARTBEAT_S, "out": str(tmp_path / f"client-{i}")} | agent,
                       "data": {"dataset": "fmnist", "partition": "iid", "clients": 2, "seed": 1},
                       "model": {"model": "logreg"}, "battery": {"source": "mains"}}
                path = tmp_path / f"client-{i}.json"
                path.write_text(json.dumps(cfg))
                with open(tmp_path / f"client-{i}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        links.exec_prefix(i) + CLI + ["client", "--config", str(path), "--log-level", "info"],
                        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
            cmd = CLI + ["coordinator", "--broker", broker.url, "--out", str(out), "--rounds", str(rounds),
                         "--algo", "fedavg", "--clients", "2", "--model", "logreg", "--partition", "iid",
                         "--seed", "1", "--steps", "2", "--threads", "1", "--deadline", str(deadline),
                         "--upload-extension", str(extension), "--heartbeat-timeout", str(TIMEOUT_S),
                         "--no-progress"]
            with open(tmp_path / "coordinator.log", "w") as log:
                coord = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
            procs.append(coord)
            assert coord.wait(timeout=180) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            for p in procs:
                kill_group(p)
    rows = [e for e in map(json.loads, open(out / "field.jsonl")) if e["event"] == "round"]
    return rows, read_rows(out / "participation.csv"), (tmp_path / "client-1.log").read_text(), out


@needs_netns
def test_a_slow_uplink_is_never_offline_and_takes_part_in_every_round(tmp_path):
    """Agent 1's update takes longer than the heartbeat timeout to send (one chunk would starve its heartbeats
    for ~5 s > 3 s: `offline`, as before the first upload was chunked). In first_chunk_bytes chunks, and then
    in chunks sized to its measured rate, it is never offline; the deadline (4 s: its first chunk is in by
    then, its last is not) follows its upload up to the extension's bound, so it is aggregated in every round,
    and the run replays bit for bit."""
    rounds = 3
    rows, part, agent_log, out = slow_run(tmp_path, rounds, deadline=4.0, extension=30.0, agent={})
    assert [r["round"] for r in rows] == list(range(rounds))
    assert all(r["participants"] == 2 and r["dropped"] == {} for r in rows), rows
    assert all(p["status"] == "participated" for p in part) and len(part) == 2 * rounds
    slow = [r["clients"]["1"] for r in rows]
    assert all(s["upload_s"] > TIMEOUT_S for s in slow), slow        # the agent's clock: longer than T
    assert all(s["upload_progress"]["done"] and s["upload_progress"]["seconds"] > TIMEOUT_S / 2 for s in slow)
    assert rows[0]["uploads"]["1"]["of"] == 4                         # 31.4 kB in 8 KiB chunks: no rate yet
    assert all(r["uploads"]["1"]["of"] == 8 for r in rows[1:])        # 4 KiB: heartbeat_s at ~6 kB/s
    assert "past the deadline, uploads still arriving: client 1" in (tmp_path / "coordinator.log").read_text()
    assert "abandoned" not in agent_log
    assert replay_exact(out, tmp_path / "replay")


@needs_netns
def test_a_stale_upload_stops_when_the_next_round_begins_and_the_drop_is_deadline(tmp_path):
    """A hard 2 s deadline that agent 1's ~5 s upload cannot make: it is dropped `deadline` (never `offline`)
    with its upload's progress recorded, and each next round's task stops its stale upload at once: of the
    stale upload only the chunks already in flight reach the coordinator, none completes (no `round` reject),
    and the agent logs each abandon, having begun each round's upload. The run replays bit for bit."""
    rounds, window = 3, 2
    rows, part, agent_log, out = slow_run(tmp_path, rounds, deadline=2.0, extension=0.0,
                                          agent={"first_chunk_bytes": 4096, "upload_window": window})
    assert [r["dropped"] for r in rows] == [{"1": "deadline"}] * rounds, rows
    assert all(r["participants"] == 1 for r in rows)
    assert {(p["client"], p["status"], p["reason"]) for p in part} == {("0", "participated", ""),
                                                                      ("1", "dropped", "deadline")}, part
    up = rows[0]["uploads"].get("1")  # it was working when time ran out: its upload had begun and not ended
    assert up is not None and 0 < up["chunks"] < up["of"] and not up["done"], rows[0]
    # (in later rounds its first chunks queue behind the stale chunks in flight: the agent's log shows them)
    for r in rows[1:]:
        assert r["stale_chunks"].get("1", 0) <= window + 1, r   # what was in flight, never the rest of it
        assert "round" not in r["rejects"], r                   # no stale upload ever completed
    for t in range(rounds - 1):
        assert re.search(rf"round {t}: upload abandoned after [1-8] of 8 chunks \(\d+ bytes acknowledged\): "
                         rf"round {t + 1}'s task or model arrived", agent_log), agent_log[-3000:]
    assert replay_exact(out, tmp_path / "replay")
