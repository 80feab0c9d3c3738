"""Edge agent pieces that need no broker: battery sources, availability policy, config, data binding."""

import pytest
import torch

from edge_client import agent as ag
from edge_client import wire
from edge_client.battery import BatteryConfig, BatteryError, ModelBattery, Reading, TraceBattery, make_battery
from edge_client.monitor import PolicyConfig, decide


def test_model_battery_drains_idle_and_training_and_charges_when_plugged():
    b = ModelBattery(BatteryConfig(source="model", capacity_j=100, start_pct=50, idle_w=1, train_w=11,
                                   charge_w=5, plugged=[[10, 20]]))
    assert b.read(10).pct == pytest.approx(40)          # 10 s idle at 1 W = 10 J of 100 J
    assert b.read(10).charging is True and not b.plugged(9.99)  # the window [10, 20) starts at 10
    b.training(2)                                        # (11 − 1) W · 2 s = 20 J extra
    assert b.read(10).pct == pytest.approx(20)
    r = b.read(20)                                       # plugged 10..20: +4 W net for 10 s
    assert r.pct == pytest.approx(60) and b.plugged(15) and not b.plugged(20)


def test_model_battery_clamps_and_repeats_its_plug_schedule():
    b = ModelBattery(BatteryConfig(source="model", capacity_j=10, start_pct=10, idle_w=1, charge_w=0,
                                   plugged=[[0, 1]], plug_period_s=5))
    assert b.read(100).pct == 0.0
    assert b.plugged(5.5) and b.plugged(10.2) and not b.plugged(6.5)


def test_trace_battery_is_a_step_function_per_device(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps\n"
                 "a,0,1,80,0,,\nb,0,1,10,1,,\na,5,0,70,,,\n")
    b = TraceBattery(p, "a")
    assert b.read(-1) == Reading(None, None, online=False)
    assert b.read(4.9) == Reading(80.0, False, True)
    assert b.read(5) == Reading(70.0, None, False)
    with pytest.raises(BatteryError, match="no rows for device 'zz'"):
        TraceBattery(p, "zz")


def test_psutil_source_without_a_battery_says_what_to_use(monkeypatch):
    import psutil
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    with pytest.raises(BatteryError, match=r"sensors_battery\(\) is None.*'model'"):
        make_battery(BatteryConfig(source="psutil"), "d")


@pytest.mark.parametrize("reading,connected,policy,reason", [
    (Reading(50, False), True, PolicyConfig(), None),
    (Reading(50, False), False, PolicyConfig(), "offline"),
    (Reading(50, False, online=False), True, PolicyConfig(), "offline"),
    (Reading(50, False, online=False), True, PolicyConfig(require_network=False), None),
    (Reading(19.9, True), True, PolicyConfig(), "battery"),
    (Reading(5, False), False, PolicyConfig(), "offline"),         # offline is checked first
    (Reading(80, False), True, PolicyConfig(require_charging=True), "charging"),
    (Reading(None, None), True, PolicyConfig(require_charging=True), None),  # unknown never blocks
])
def test_policy_reason(reading, connected, policy, reason):
    assert decide(policy, reading, connected) == reason


def test_config_rejects_unknown_keys_and_bad_client(tmp_path):
    with pytest.raises(ag.AgentError, match="unknown key agent.nope"):
        ag.config_from_dict({"agent": {"nope": 1}})
    with pytest.raises(ag.AgentError, match="client 7 outside 0..4"):
        ag.config_from_dict({"agent": {"client": 7}, "data": {"clients": 5}})
    p = tmp_path / "a.toml"
    p.write_text('[agent]\nclient = 2\nbroker = "mqtt://127.0.0.1:1999"\n[data]\nclients = 4\n')
    cfg = ag.load_config(str(p))
    assert cfg.device_id == "client-2" and ag.broker_address(cfg.agent.broker) == ("127.0.0.1", 1999)


def test_agent_shard_is_the_simulation_shard(fmnist):
    from edge_client import partition
    cfg = ag.config_from_dict({"agent": {"client": 3}, "data": {"clients": 6, "partition": "shards", "seed": 4}})
    _, x, y, tx, ty = ag.load_shard(cfg)
    idx = partition.partition("shards", fmnist.train.y.numpy(), 6, 4, shards_per_client=2)[3]
    assert torch.equal(y, fmnist.train.y[torch.as_tensor(idx)]) and torch.equal(x, fmnist.train.x[torch.as_tensor(idx)])
    assert len(ty) == 10000 // 6 + (1 if 3 < 10000 % 6 else 0)


def test_the_agent_does_not_import_coordinator_or_cvxpy():
    import subprocess
    import sys
    code = ("import sys, edge_client.agent, edge_client.wire, edge_client.battery, edge_client.monitor; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('coordinator', 'cvx', 'cvxpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class Published:
    """Stands in for paho's MQTTMessageInfo of a publish that the broker acknowledged."""

    def wait_for_publish(self, timeout=None):
        pass

    def is_published(self):
        return True


def offline_agent(tmp_path, monkeypatch, battery: dict | None = None, agent: dict | None = None, **sections):
    """Client 1 of 4 (iid, logreg) with no broker: publishes go to the returned list. `agent` adds [agent] keys,
    `sections` replace whole sections (policy, telemetry, ...); the battery is mains unless given."""
    cfg = ag.config_from_dict({"agent": {"client": 1, "out": str(tmp_path)} | (agent or {}),
                               "battery": battery or {"source": "mains"},
                               "data": {"clients": 4, "partition": "iid", "seed": 2}, "model": {"model": "logreg"}}
                              | sections)
    a = ag.Agent(cfg)
    sent: list[tuple[str, bytes]] = []
    monkeypatch.setattr(a.link.mqtt, "publish", lambda topic, payload, qos=0, retain=False:
                        sent.append((topic, payload)) or Published())
    a.connected.set()
    return a, sent


def deliver(a, topic, frames):
    for f in frames:
        a._handle(topic, f, False, 0.0)
    a.work.step()


def test_agent_trains_exactly_like_the_simulation_and_resends_its_cached_update(tmp_path, monkeypatch):
    from coordinator.field.transport import export_onnx
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask, evaluate, local_train

    a, sent = offline_agent(tmp_path, monkeypatch, {"source": "mains"})
    model = build_model("logreg", (1, 28, 28), 10, 2)
    w = get_flat(model) + 0.01
    task = {"lr": 0.1, "batch_size": 8, "epochs": 1, "steps": 3, "prox_mu": 0.0, "seed": 2}
    deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 5, 1, meta=task))
    assert sent == []  # it waits for the round's model
    deliver(a, "dropfl/v1/model/weights", wire.encode("model", "run", 5, -1, w))
    deliver(a, "dropfl/v1/model/onnx", wire.encode("onnx", "run", 5, -1, torch.frombuffer(
        bytearray(export_onnx(model, w, (1, 28, 28))), dtype=torch.uint8)))
    topics = [t.rsplit("/", 1)[1] for t, _ in sent]
    k = topics.count("delta")  # the first upload goes in first_chunk_bytes chunks (link.py: the rate is not known)
    assert topics == ["delta"] * k + ["stats", "eval"] and k == -(-7850 * 4 // 8192)  # logreg: 4 chunks
    frames = [p for _, p in sent[:k]]
    up = wire.decode(frames, run="run", round=5, client=1, kinds=("update",))
    ref = local_train(build_model("logreg", (1, 28, 28), 10, 0), w, a.work.x, a.work.y,
                      TrainTask(client=1, round=5, lr=0.1, batch_size=8, epochs=1, steps=3, seed=2))
    assert torch.equal(up.tensor, ref.delta) and up.meta["steps"] == 3 and up.meta["num_samples"] == len(a.work.y)
    acc = wire.decode([sent[k + 1][1]]).meta["accuracy"]
    assert acc == pytest.approx(evaluate(model, w, torch.from_numpy(a.work.test_x), torch.from_numpy(a.work.test_y))[0])
    deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 5, 1, meta=task))  # asked again
    assert [p for _, p in sent[k + 2:2 * k + 2]] == frames and a.work.rounds_trained == 1  # the same bytes, no training


def test_agent_declines_with_its_policy_reason_and_rejects_anothers_task(tmp_path, monkeypatch):
    a, sent = offline_agent(tmp_path, monkeypatch, {"source": "model", "start_pct": 10, "idle_w": 0})
    task = {"lr": 0.1, "batch_size": 8, "steps": 1, "seed": 2}
    deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 0, 3, meta=task))
    assert sent == []  # addressed to client 3: ignored
    deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 0, 1, meta=task))
    (topic, payload), = sent
    m = wire.decode([payload])
    assert topic.endswith("/update/decline") and m.meta == {"reason": "battery"} and m.header.round == 0


def test_agent_survives_malformed_tasks_models_and_onnx(tmp_path, monkeypatch):
    a, sent = offline_agent(tmp_path, monkeypatch, {"source": "mains"})
    deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 0, 1, meta={"lr": "fast"}))
    deliver(a, "dropfl/v1/model/weights", wire.encode("model", "run", 0, -1, torch.zeros(3)))
    deliver(a, "dropfl/v1/model/onnx", wire.encode("onnx", "run", 0, -1, torch.zeros(5, dtype=torch.uint8)))
    assert a.work.task is None and a.work.weights is None and sent == [] and a.work.evaluated == ("run", 0)
