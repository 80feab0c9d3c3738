"""Field mode over real links (docs/field-mode.md "Liveness", docs/protocol.md): every message from an
agent is life, an upload still arriving keeps its round open past the deadline, download times are
measured on one host's clock, a rejoin sends the model to the rejoining agent alone, and updates are
bound to the digest of the model they were trained on. Hub and agent tests need no broker; the last two
run a private mosquitto (one of them behind a `tc tbf`-limited veth, as root)."""

import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from fieldkit import (
    CLI,
    ROOT,
    SETTINGS,
    Watcher,
    agent_config,
    coordinator_cmd,
    kill_group,
    max_diff,
    sim_model,
    start_agent,
    start_coordinator,
)
from paho.mqtt import client as mqtt
from test_field_agent import deliver, offline_agent
from test_field_hub import make_hub
from test_netem import needs_netns

from coordinator.field.collection import RoundState, UploadProgress, keeps_open
from coordinator.field.transport import MqttTransport, client_report
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto
from edge_client import wire
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def chunks(c: int, rnd: int = 0, digest: str | None = None, n: int = 16) -> list[bytes]:
    meta = {"num_samples": 1, "steps": 1} | ({} if digest is None else {"model_digest": digest})
    return wire.encode("update", "run-x", rnd, c, torch.zeros(4), meta, wire.Limits(chunk_bytes=1))[:n]


# --- 1. liveness ---

def test_chunks_keep_an_agent_online_past_the_heartbeat_timeout_and_silence_marks_it_offline(tmp_path, monkeypatch):
    clock = Clock(1000.0)
    monkeypatch.setattr(time, "monotonic", clock)
    hub = make_hub(tmp_path)   # statuses and one heartbeat each at t = 1000
    hub.cfg.heartbeat_timeout_s = 2.0
    r = hub.collection.round = RoundState(0, {0: TrainTask(client=0, round=0, lr=0.1, batch_size=4)}, clock.t)
    frames = chunks(0)         # 16 one-byte chunks: a slow upload, one chunk every 1.5 s
    for i, f in enumerate(frames[:-1]):
        clock.t += 1.5
        hub._dispatch("d0", "update/delta", f, False)
        # no heartbeat for 1.5 (i + 1) s, still online
        assert hub.registry.is_online(hub.registry.by_client[0], clock.t + 1.9), i
    agents = hub.registry
    assert agents.is_online(agents.by_client[0], clock.t) and not agents.is_online(agents.by_client[1], clock.t)
    p = r.progress[0]
    assert p.row() == {"chunks": 15, "of": 16, "bytes": 15, "seconds": pytest.approx(1.5 * 14), "done": False}
    # silent for longer than the timeout: offline
    assert not hub.registry.is_online(hub.registry.by_client[0], clock.t + 2.01)
    clock.t += 1.5
    hub._dispatch("d0", "update/delta", frames[-1], False)
    assert 0 in r.updates and r.progress[0].row()["done"]


def test_the_deadline_follows_an_upload_that_keeps_arriving_within_its_bound():
    p = UploadProgress("s", chunks=10, first_at=0.0, last_at=0.0)
    for i in range(5):          # 5 of 10 chunks, one per second
        p.add(i, 1000, float(i))
    assert p.chunk_rate() == pytest.approx(1.0)
    # at the deadline t = 4.5: 5 chunks missing at 1/s -> done at 9 s
    assert keeps_open(p, 4.5, timeout_s=2.0, hard_end=9.0)
    assert not keeps_open(p, 4.5, timeout_s=2.0, hard_end=8.9)   # would finish past the bound
    assert keeps_open(p, 6.9, timeout_s=2.0, hard_end=60.0)      # 3 chunk intervals (3 s) of slack at 1/s
    assert not keeps_open(p, 7.1, timeout_s=2.0, hard_end=60.0)  # stalled: no chunk for > 3 intervals
    assert keeps_open(p, 7.5, timeout_s=4.0, hard_end=60.0)      # the timeout, if longer, is the slack
    assert not keeps_open(p, 9.0, timeout_s=20.0, hard_end=9.0)  # never past the bound
    one = UploadProgress("s", chunks=10, first_at=3.0, last_at=3.0)
    one.add(0, 1000, 3.0)
    assert one.chunk_rate() is None and keeps_open(one, 4.0, 2.0, 9.0) and not keeps_open(one, 5.5, 2.0, 9.0)


@needs_netns
def test_an_upload_slower_than_three_heartbeat_timeouts_is_aggregated(tmp_path):
    from coordinator.field import netem

    timeout_s = 2.0
    # agent 1: 4 KB/s up; its 31 KB logreg update in 1 KiB chunks (one takes ~0.3 s, far below the timeout:
    # docs/field-mode.md's bound), heartbeats in between, takes ~10 s: 5 timeouts without a heartbeat-only life
    plan = netem.LinkPlan([1e6, 4000.0], [1e6, 1e6], [True, True])
    procs = []
    with netem.Links(plan) as links, Mosquitto(workdir=tmp_path / "broker", hosts=links.hosts) as broker:
        try:
            for i in range(2):
                cfg = {"agent": {"client": i, "broker": f"mqtt://{links.host_address(i)}:{broker.port}",
                                 "heartbeat_s": 0.5, "chunk_bytes": 1024, "out": str(tmp_path / f"client-{i}")},
                       "data": {"dataset": "fmnist", "partition": "iid", "clients": 2, "seed": 1},
                       "model": {"model": "logreg"}, "battery": {"source": "mains"}}
                path = tmp_path / f"client-{i}.json"
                path.write_text(json.dumps(cfg))
                with open(tmp_path / f"client-{i}.log", "w") as log:
                    procs.append(subprocess.Popen(
                        links.exec_prefix(i) + CLI + ["client", "--config", str(path)], stdout=log,
                        stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True))
            out = tmp_path / "run"
            cmd = CLI + ["coordinator", "--broker", broker.url, "--out", str(out), "--rounds", "1", "--algo",
                         "fedavg", "--clients", "2", "--model", "logreg", "--partition", "iid", "--seed", "1",
                         "--steps", "2", "--threads", "1", "--deadline", "4", "--upload-extension", "40",
                         "--heartbeat-timeout", str(timeout_s), "--no-progress"]
            with open(tmp_path / "coordinator.log", "w") as log:
                coord = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       cwd=ROOT, start_new_session=True)
            procs.append(coord)
            assert coord.wait(timeout=90) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            for p in procs:
                kill_group(p)
    row = next(e for e in map(json.loads, open(out / "field.jsonl")) if e["event"] == "round")
    assert row["participants"] == 2 and row["dropped"] == {}, row
    slow = row["clients"]["1"]
    assert slow["upload_s"] >= 3 * timeout_s, slow          # the agent's own clock: publish to last PUBACK
    assert slow["upload_progress"]["seconds"] >= 2 * timeout_s and slow["upload_progress"]["done"]
    assert row["wall_s"] > 4.0                               # past the deadline: the upload kept it open
    assert [m["round"] for m in read_metrics(out / "metrics.jsonl")] == [0]


# --- 3. one clock per measurement ---

class Msg:
    def __init__(self, topic, payload):
        self.topic, self.payload, self.retain = topic, payload, False


@pytest.mark.parametrize("skew_s", [0.0, 3600.0, -3600.0])
def test_a_skewed_agent_clock_gives_the_same_feddd_inputs(tmp_path, monkeypatch, skew_s):
    a, sent = offline_agent(tmp_path, monkeypatch, {"source": "mains"})
    w = get_flat(build_model("logreg", (1, 28, 28), 10, 2)) + 0.01
    task = wire.encode("task", "run", 3, 1, meta={"lr": 0.1, "batch_size": 8, "steps": 2, "seed": 2,
                                                   "model_digest": wire.model_digest(w)})
    model = wire.encode("model", "run", 3, -1, w, {}, wire.Limits(chunk_bytes=4096))  # the coordinator's clock
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew_s)    # the agent's wall clock is off
    for topic, frames in (("dropfl/v1/device/client-1/control", task), ("dropfl/v1/model/weights", model)):
        for f in frames:
            a.link._on_message(None, None, Msg(topic, f))
            time.sleep(0.01)                                         # a link: 10 ms per frame
    while not a.inbox.empty():
        a._handle(*a.inbox.get())
        a.work.step()
    up, stats = (wire.decode([p for t, p in sent if t.endswith(sub)]) for sub in ("/update/delta", "/update/stats"))
    assert abs(up.header.sent_at - real() - skew_s) < 60          # the skew is real on this agent
    report = client_report(up.meta, stats.meta, up.header.nbytes, w.numel() * 4)
    frames_s = len(model) * 0.01                                   # task, then 8 chunks 10 ms apart
    assert frames_s * 0.9 <= up.meta["download_s"] < frames_s * 3, up.meta
    assert report.down_Bps == pytest.approx(w.numel() * 4 / up.meta["download_s"])
    assert 0 < report.compute_s < 5 and report.up_Bps > 0


# --- 4. a rejoin sends the model to the rejoining agent alone ---

def open_round(tmp_path, clients: int = 3, heartbeat_timeout_s: float | None = None):
    """Round 0 of a logreg federation opened by MqttTransport.run_round in a thread, on a broker-less hub
    whose publishes are recorded as (topic, bytes); returns once the round's ONNX model is out."""
    model = build_model("logreg", (1, 28, 28), 10, 0)
    n = sum(p.numel() for p in model.parameters())
    hub = make_hub(tmp_path)
    if heartbeat_timeout_s is not None:
        hub.cfg.heartbeat_timeout_s = heartbeat_timeout_s
    hub.collection.num_params, hub.collection.max_update_bytes = n, 8 * n + 64 * 1024
    published: list[tuple[str, int]] = []
    hub.connection.publish_frames = lambda topic, frames: published.extend((topic, len(f)) for f in frames)
    transport = MqttTransport(hub, model, (1, 28, 28), tmp_path / "model.onnx")
    w = get_flat(model)
    tasks = [TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(clients)]
    out = {}
    th = threading.Thread(target=lambda: out.update(result=transport.run_round(0, w, tasks)))
    th.start()
    deadline = time.monotonic() + 60
    while not any(t == "model/onnx" for t, _ in published) and time.monotonic() < deadline:
        time.sleep(0.01)
    return hub, transport, w, n, published, th, out


def test_a_rejoin_publishes_the_model_only_on_the_rejoining_agents_topic(tmp_path):
    hub, transport, w, n, published, th, out = open_round(tmp_path)
    deadline = time.monotonic() + 60
    first = len(published)
    status = {"state": "online"} | make_hub.__globals__["BINDING"]

    def send(device, sub, frames):
        with hub.cond:
            for f in frames:
                hub._dispatch(device, sub, f, False)
            hub.cond.notify_all()

    send("d1", "status", wire.encode("status", "", -1, 1, meta={"state": "offline"}))  # it drops out ...
    send("d1", "status", wire.encode("status", "", -1, 1, meta=status))                # ... and rejoins
    while not any(t == "device/d1/control" for t, _ in published[first:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    rejoin = {}
    for t, nbytes in published[first:]:
        rejoin[t] = rejoin.get(t, 0) + nbytes
    digest = wire.model_digest(w)
    for c in range(3):
        send(f"d{c}", "update/delta", wire.encode("update", "run-x", 0, c, torch.zeros(n),
                                                  {"num_samples": 1, "steps": 1, "model_digest": digest}))
        send(f"d{c}", "update/stats", wire.encode("stats", "run-x", 0, c, meta={"upload_s": 0.1}))
    th.join(timeout=60)
    updates, dropped = out["result"]
    assert sorted(updates) == [0, 1, 2] and dropped == {}
    assert set(rejoin) == {"device/d1/control"}, rejoin      # nothing broadcast, nothing to the others
    assert rejoin["device/d1/control"] > 4 * n                # the task, the weights and the ONNX model
    assert sum(b for t, b in published[:first] if t == "model/weights") > 4 * n  # the round's one broadcast


def test_a_burst_of_messages_that_change_no_decision_does_not_wake_the_round(tmp_path):
    """The round loop waits on `hub.wake`, notified only by what may change the closing rule's decision
    (coordinator/field/closing.py): 2,000 heartbeats and the first two clients' updates and stats wake it not
    at all; the last client's stats close the round with every update. Before, every message woke the loop and
    a pass over all selected clients ran at most every 50 ms (once per message before that: ~2,000 passes)."""
    hub, transport, w, n, _, th, out = open_round(tmp_path)
    with hub.cond:  # the round has started waiting (its first evaluations: the start, the liveness check)
        hub.wake.wait_for(lambda: transport.scans >= 1, timeout=60)
    start_scans = transport.scans
    hb = wire.encode("heartbeat", "", -1, 0, meta={"available": True, "reason": None})[0]
    for _ in range(2000):
        with hub.cond:
            hub._dispatch("d0", "heartbeat", hb, False)
            hub.cond.notify_all()
        time.sleep(0)   # let the round loop run between messages, as paho's thread would
    digest = wire.model_digest(w)
    for c in range(3):
        with hub.cond:
            for f in wire.encode("update", "run-x", 0, c, torch.zeros(n),
                                 {"num_samples": 1, "steps": 1, "model_digest": digest}):
                hub._dispatch(f"d{c}", "update/delta", f, False)
            hub._dispatch(f"d{c}", "update/stats", wire.encode("stats", "run-x", 0, c, meta={"upload_s": 0.1})[0],
                          False)
            hub.cond.notify_all()
        if c < 2:
            time.sleep(0.05)
            assert th.is_alive() and transport.scans == start_scans, (c, transport.scans, start_scans)
    th.join(timeout=60)
    updates, dropped = out["result"]
    assert sorted(updates) == [0, 1, 2] and dropped == {}
    assert transport.scans == start_scans + 1, (transport.scans, start_scans)  # the last stats: one evaluation


def test_a_silent_client_is_dropped_offline_by_the_liveness_timer_with_no_message_to_wake_the_round(tmp_path):
    """Clients 0 and 1 deliver; client 2 never sends anything after the round opens. No message can wake the round
    loop for it: the closing rule's decision names the time its heartbeat timeout lapses (closing.py `check_at`),
    and the round closes then with client 2 dropped `offline`, long before the 60 s deadline (`deadline`)."""
    hub, transport, w, n, _, th, out = open_round(tmp_path, heartbeat_timeout_s=5.0)
    digest = wire.model_digest(w)
    for c in range(2):
        with hub.cond:
            for f in wire.encode("update", "run-x", 0, c, torch.zeros(n),
                                 {"num_samples": 1, "steps": 1, "model_digest": digest}):
                hub._dispatch(f"d{c}", "update/delta", f, False)
            hub._dispatch(f"d{c}", "update/stats", wire.encode("stats", "run-x", 0, c, meta={"upload_s": 0.1})[0],
                          False)
    th.join(timeout=50)
    assert not th.is_alive()
    updates, dropped = out["result"]
    assert sorted(updates) == [0, 1] and dropped == {2: "offline"}


# --- 5. updates bound to the model they were trained on ---

def test_an_update_trained_on_another_model_is_rejected_with_its_reason(tmp_path):
    hub = make_hub(tmp_path)
    tasks = {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4) for c in range(2)}
    r = hub.collection.round = RoundState(0, tasks, 0.0, digest="a" * 16)
    for f in chunks(0, digest="b" * 16):
        hub._dispatch("d0", "update/delta", f, False)
    assert 0 not in r.updates and 0 not in r.dropped and r.rejects == {"model": 1}
    assert hub.collection.rejects == {"model": 1}
    for f in chunks(0, digest="a" * 16):     # the fresh one, trained on this round's model, still counts
        hub._dispatch("d0", "update/delta", f, False)
    for f in chunks(1):                      # an update without a digest is not checked
        hub._dispatch("d1", "update/delta", f, False)
    assert sorted(r.updates) == [0, 1]


def test_the_agents_resend_cache_is_keyed_by_run_round_and_model(tmp_path, monkeypatch):
    a, sent = offline_agent(tmp_path, monkeypatch, {"source": "mains"})
    wa = get_flat(build_model("logreg", (1, 28, 28), 10, 2))
    wb = wa + 0.01
    task = {"lr": 0.1, "batch_size": 8, "steps": 2, "seed": 2}
    control = "dropfl/v1/device/client-1/control"
    deliver(a, control, wire.encode("task", "run", 5, 1, meta=task | {"model_digest": wire.model_digest(wa)}))
    deliver(a, "dropfl/v1/model/weights", wire.encode("model", "run", 5, -1, wa))
    first = [p for t, p in sent if t.endswith("/delta")]
    assert wire.decode(first).meta["model_digest"] == wire.model_digest(wa)
    # a resumed coordinator's round 5 runs on another model: the cached update is not re-sent
    deliver(a, control, wire.encode("task", "run", 5, 1, meta=task | {"model_digest": wire.model_digest(wb)}))
    assert [p for t, p in sent if t.endswith("/delta")] == first  # nor trained on the old model it holds
    deliver(a, "dropfl/v1/model/weights", wire.encode("model", "run", 5, -1, wb))
    second = [p for t, p in sent if t.endswith("/delta")][len(first):]
    assert wire.decode(second).meta["model_digest"] == wire.model_digest(wb) and a.work.rounds_trained == 2
    deliver(a, control, wire.encode("task", "run", 5, 1, meta=task | {"model_digest": wire.model_digest(wb)}))
    assert [p for t, p in sent if t.endswith("/delta")][-len(second):] == second and a.work.rounds_trained == 2


class Capture:
    """Keeps the raw frames of one device's update/delta per (run, round); `on_model` runs on every global
    model (a hook to inject frames at the start of a round)."""

    def __init__(self, port: int, device: str):
        self.frames: dict[tuple[str, int], list[bytes]] = {}
        self.on_model = lambda h: None
        self.topic = f"dropfl/v1/device/{device}/update/delta"
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-capture")
        self.c.on_connect = lambda c, *a: c.subscribe([(self.topic, 1), ("dropfl/v1/model/weights", 1)])
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        h, _ = wire.decode_frame(msg.payload)
        if msg.topic == self.topic:
            self.frames.setdefault((h.run, h.round), []).append(msg.payload)
        else:
            self.on_model(h)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_coordinator_resume_rejects_an_update_of_another_model_and_matches_the_replay(tmp_path):
    """checkpoint_every 3: the coordinator is killed in round 5 and resumes from round 3's start. In the first
    incarnation agent 2 was stopped during round 3, so its round 4 ran on another model than the resumed
    round 4; agent 1's update of that first round 4, replayed into the resumed round 4, is rejected
    (`model`), and the resumed run equals the uninterrupted simulation."""
    algo = "fedavg"
    with Mosquitto(workdir=tmp_path / "broker") as broker:
        watcher, capture = Watcher(broker.port), Capture(broker.port, "client-1")
        slow = {"slowdown_s_per_step": 0.5}  # agent 1: ~1 s per round, so the replay arrives before its own
        configs = {i: agent_config(i, broker.url, tmp_path / "agents", **(slow if i == 1 else {}))
                   for i in range(SETTINGS["clients"])}
        agents = {i: start_agent(configs[i], tmp_path / "agents" / f"client-{i}.log") for i in configs}
        stopped = threading.Event()

        def stop_agent_2(topic, h):  # its round-2 update is in: stop it, round 3 goes on without it
            if topic == "dropfl/v1/device/client-2/update/stats" and h.round == 2 and not stopped.is_set():
                stopped.set()
                os.killpg(agents[2].pid, signal.SIGSTOP)

        watcher.hooks.append(stop_agent_2)
        out = tmp_path / "run"
        cmd = coordinator_cmd(broker.url, out, 6, algo, "--checkpoint-every", "3", "--heartbeat-timeout", "2")
        try:
            for i in configs:
                watcher.wait_for(lambda t, h, i=i: t == f"dropfl/v1/device/client-{i}/status"
                                 and h.meta.get("state") == "online")
            coord = start_coordinator(cmd, tmp_path / "coordinator.log")
            watcher.wait_for(lambda t, h: t == "dropfl/v1/model/weights" and h.round == 5, timeout=120)
            kill_group(coord, signal.SIGKILL)
            os.killpg(agents[2].pid, signal.SIGCONT)
            assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 2
            run_id = json.loads((out / "field.json").read_text())["run_id"]
            stale = capture.frames[(run_id, 4)]
            injected = threading.Event()

            def inject(h):  # the resumed round 4 begins: replay agent 1's update of the first round 4
                if h.run == run_id and h.round == 4 and not injected.is_set():
                    injected.set()
                    for f in stale:
                        capture.c.publish(capture.topic, f, qos=1)

            capture.on_model = inject
            coord = start_coordinator(cmd + ["--resume"], tmp_path / "coordinator.log")
            assert coord.wait(timeout=180) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            watcher.close()
            capture.close()
            for p in agents.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGCONT)
                kill_group(p)
    assert injected.is_set()
    rounds = [e for e in map(json.loads, open(out / "field.jsonl")) if e["event"] == "round"]
    first_round_3 = next(e for e in rounds if e["round"] == 3)
    assert first_round_3["dropped"] == {"2": "offline"}       # the first incarnation's round 3 differed
    resumed = [e for e in rounds if e["round"] >= 3][-3:]
    assert [e["round"] for e in resumed] == [3, 4, 5] and all(e["participants"] == 5 for e in resumed)
    assert resumed[1]["rejects"].get("model", 0) >= 1, resumed[1]  # the stale update, with its reason
    assert "this round's model is" in (tmp_path / "coordinator.log").read_text()
    assert [m["round"] for m in read_metrics(out / "metrics.jsonl")][-3:] == [3, 4, 5]
    assert max_diff(torch.load(out / "model.pt"), sim_model(tmp_path / "sim", 6, algo, None)) <= 1e-5
