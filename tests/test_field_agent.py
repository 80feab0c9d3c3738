"""Edge agent pieces that need no broker: battery sources, availability policy, config, data binding."""

import pytest
import torch

from edge_client import agent as ag
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
