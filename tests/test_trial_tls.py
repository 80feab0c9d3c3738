"""`dropfl trial --broker-dir DIR`: bundles from `add-device` let `dropfl client` join a trial over TLS.

A broker directory made by `dropfl provision init` in a temp dir (TLS only, passwords, ACL, on a free
127.0.0.1 port); the trial starts mosquitto with its mosquitto.conf, adds devices client-0..2 and
runs three agents with their bundles and the coordinator with coordinator.json for two rounds.
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
from pathlib import Path

import torch
from fieldkit import CLI, NEEDS_MOSQUITTO, ROOT, SETTINGS, max_diff, participants, sim_model

from coordinator.cli import main as dropfl
from coordinator.trial.tls import device_agent_keys
from provisioning import broker as prov

pytestmark = NEEDS_MOSQUITTO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_device_bundles_are_added_once_and_reused(tmp_path):
    bdir = tmp_path / "b"
    assert dropfl(["provision", "init", str(bdir), "--port", str(free_port())]) == 0
    first = device_agent_keys(bdir, 2)
    assert [k["device_id"] for k in first] == ["client-0", "client-1"]
    assert device_agent_keys(bdir, 3)[:2] == first  # existing bundles are used as they are
    assert set(prov.read_passwd(bdir / "passwd")) == {"coordinator", "client-0", "client-1", "client-2"}
    assert all(k["broker"].startswith("mqtts://127.0.0.1:") and Path(k["ca_file"]).is_absolute() for k in first)


def test_trial_on_a_provisioned_broker_over_tls(tmp_path, monkeypatch):
    bdir, out = tmp_path / "broker", tmp_path / "run"
    port = free_port()
    assert dropfl(["provision", "init", str(bdir), "--port", str(port)]) == 0
    cmd = CLI + ["trial", "--broker-dir", str(bdir), "--agents", "3", "--rounds", "2", "--algo", "fedavg",
                 "--model", SETTINGS["model"], "--partition", SETTINGS["partition"], "--seed", str(SETTINGS["seed"]),
                 "--steps", "2", "--lr", "0.05", "--threads", "1", "--profiles", "mains", "--deadline", "30",
                 "--out", str(out), "--no-progress"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:] + (out / "coordinator.log").read_text()[-3000:]
    assert f"broker mqtts://127.0.0.1:{port}" in run.stderr

    assert participants(out / "participation.csv") == {0: {0, 1, 2}, 1: {0, 1, 2}}
    events = [json.loads(line) for line in (out / "field.jsonl").read_text().splitlines()]
    online = {e["device"] for e in events if e["event"] == "agent" and e["state"] == "online"}
    assert online == {"client-0", "client-1", "client-2"}  # the bundles' usernames, announced over TLS
    assert json.loads((out / "field.json").read_text())["broker"] == f"mqtts://127.0.0.1:{port}"
    for i in range(3):
        agent = out / "agents" / f"client-{i}" / "agent.json"
        assert stat.S_IMODE(agent.stat().st_mode) == 0o600  # it holds the device's password
        bundle = json.loads((bdir / "devices" / f"client-{i}" / "agent.json").read_text())["agent"]
        assert json.loads(agent.read_text())["agent"]["password"] == bundle["password"]

    monkeypatch.setitem(SETTINGS, "clients", 3)  # the same federation in simulation
    assert max_diff(torch.load(out / "model.pt"), sim_model(tmp_path / "sim", 2, "fedavg", None)) <= 1e-5
