"""Plugins in the field: a trial whose model is a plugin of an installed distribution (tests/pluginkit.py: a tiny
package with its dist-info and a `dropfl.models` entry point) and whose strategy is a plugin of dropfl-examples
(FedAvgM, installed into .venv by tests/examples_pkg.py), over a private mosquitto on 127.0.0.1. Two agents have
the coordinator's version of the model's distribution; the third has another version (a second dist-info on its
PYTHONPATH) and is refused at join, the plugin named with what to install: unavailable for `rejected` in every
round (never selected, never `offline`). The strategy's option (`--strategy-option momentum=0.5`) reaches the field
coordinator and its config.json, and the README's replay of the run gives the field model's bits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from examples_pkg import ensure_installed
from fieldkit import (
    CLI,
    NEEDS_MOSQUITTO,
    ROOT,
    SETTINGS,
    Watcher,
    agent_config,
    coordinator_cmd,
    kill_group,
)
from pluginkit import DIST, MODEL, make_plugin

from coordinator.availability.participation import read_rows
from coordinator.trial.broker import Mosquitto

pytestmark = NEEDS_MOSQUITTO

N, ROUNDS = 3, 2


@pytest.fixture(autouse=True)
def plugin_settings(monkeypatch):
    monkeypatch.setitem(SETTINGS, "clients", N)
    monkeypatch.setitem(SETTINGS, "model", MODEL)


def _start(cmd: list[str], log: Path, path: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def test_a_trial_with_plugins_refuses_the_agent_with_another_version(tmp_path):
    ensure_installed()
    v1, v2 = make_plugin(tmp_path / "v1", "1.0"), make_plugin(tmp_path / "v2", "2.0", hidden=32)
    out, broker = tmp_path / "run", Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    logs = tmp_path / "agents"
    procs = []
    try:
        for i in range(N):
            cfg = agent_config(i, broker.url, logs)
            procs.append(_start(CLI + ["client", "--config", str(cfg)], logs / f"client-{i}.log", v2 if i == 2 else v1))
        for i in range(N):   # every agent announced: the coordinator reads all three statuses when it connects
            watcher.wait_for(lambda topic, h, i=i: topic == f"dropfl/v1/device/client-{i}/status", timeout=180)
        cmd = coordinator_cmd(broker.url, out, ROUNDS, "fedavgm", "--wait-agents", str(N - 1),
                              "--strategy-option", "momentum=0.5")
        coord = _start(cmd, tmp_path / "coordinator.log", v1)
        procs.append(coord)
        assert coord.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()
    said = (tmp_path / "coordinator.log").read_text()
    assert (f"device client-2 will not be selected: data binding differs: model plugin {MODEL!r} differs "
            f"(on the agent: {DIST} 2.0 (code digest ") in said, said[-3000:]
    assert f"on the coordinator: {DIST} 1.0 (code digest " in said and f"install {DIST} 1.0 on the device" in said
    rows = read_rows(out / "participation.csv")
    status = {(int(r["round"]), int(r["client"])): (r["status"], r["reason"]) for r in rows}
    assert status == {(t, c): ("participated", "") if c < 2 else ("unavailable", "rejected")
                      for t in range(ROUNDS) for c in range(N)}, status
    config = json.loads((out / "config.json").read_text())
    assert (config["model"]["model"], config["strategy"]["algo"]) == (MODEL, "fedavgm")
    assert config["strategy"]["options"]["momentum"] == 0.5
    refused = [json.loads(line) for line in (out / "field.jsonl").read_text().splitlines()]
    assert {e["device"] for e in refused if e.get("refused")} == {"client-2"}
    model = torch.load(out / "model.pt")
    assert [tuple(v.shape) for v in model.values()] == [(16, 784), (16,), (10, 16), (10,)]   # the v1 plugin's MLP
    # The README's replay of the field run, with the plugins installed: the option recorded in config.json is the one
    # the field coordinator used (momentum 0.5, not the default 0.9), or the replay would not give the model's bits.
    replay = tmp_path / "replay"
    run = subprocess.run(CLI + ["sim", "--config", str(out / "config.json"), "--availability", "replay", "--trace",
                                str(out / "participation.csv"), "--out", str(replay), "--quiet"],
                         cwd=ROOT, env=os.environ | {"PYTHONPATH": os.pathsep.join([str(v1), str(ROOT)])},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    replayed = torch.load(replay / "model.pt")
    assert all(torch.equal(model[k], replayed[k]) for k in model), "the replay differs from the field run's model"
