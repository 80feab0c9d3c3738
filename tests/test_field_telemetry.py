"""End to end with a real mosquitto: 5 agents, 2 rounds. Every aggregated device's round has its row in
telemetry.jsonl: modelled energy on this machine (no power sensor), the sensor's name for an agent given a
fake Jetson sysfs tree; an agent above its thermal limit (a fake thermal zone) declines every round with
reason `thermal`, and the participation log replays in simulation to the same model. `dropfl report`
then shows energy per round and time-to-accuracy against energy."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from fieldkit import (
    CLI,
    NEEDS_MOSQUITTO,
    ROOT,
    Watcher,
    agent_config,
    coordinator_cmd,
    kill_group,
    max_diff,
    participants,
    sim_model,
    start_agent,
    start_coordinator,
)
from test_telemetry import jetson_hwmon, thermal

from coordinator.availability.participation import read_rows
from coordinator.field import telemetry
from coordinator.trial.broker import Mosquitto
from edge_client.telemetry import reset_peak_rss

pytestmark = [pytest.mark.slow, *NEEDS_MOSQUITTO]

SENSED, HOT = 3, 4  # client 3: a fake Jetson (5 W input rail, 50 °C); client 4: 90 °C, limit 80 °C


def test_telemetry_rows_for_every_aggregated_device_and_round_and_thermal_declines(tmp_path):
    broker = Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    agents = {}
    try:
        for i in range(5):
            cfg_path = agent_config(i, broker.url, tmp_path / "agents")
            if i in (SENSED, HOT):
                root = tmp_path / f"sys-{i}"
                thermal(root, [90000 if i == HOT else 50000])
                if i == SENSED:
                    jetson_hwmon(root, {"VDD_IN": (5000, 1000), "VDD_CPU_GPU_CV": (5000, 300)})
                cfg = json.loads(cfg_path.read_text())
                cfg["telemetry"] = {"sysfs_root": str(root), "vcgencmd": "", "interval_s": 0.05}
                if i == HOT:
                    cfg["policy"] = {"thermal_limit_c": 80.0}
                cfg_path.write_text(json.dumps(cfg))
            agents[i] = start_agent(cfg_path, tmp_path / "agents" / f"client-{i}.log")
        for i in range(5):
            watcher.wait_for(lambda topic, h, i=i: topic == f"dropfl/v1/device/client-{i}/status"
                             and h.meta.get("state") == "online")
        out = tmp_path / "run"
        coord = start_coordinator(coordinator_cmd(broker.url, out, 2, "fedavg", "--round-wait", "60"),
                                  tmp_path / "coordinator.log")
        assert coord.wait(timeout=180) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in agents.values():
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()

    rows = {(int(r["round"]), int(r["client"])): (r["status"], r["reason"])
            for r in read_rows(out / "participation.csv")}
    assert rows[(0, HOT)] == rows[(1, HOT)] == ("unavailable", "thermal")
    aggregated = {(t, c) for t, cs in participants(out / "participation.csv").items() for c in cs}
    assert aggregated == {(t, c) for t in (0, 1) for c in range(4)}

    tel = [json.loads(line) for line in open(out / "telemetry.jsonl")]
    resettable = reset_peak_rss()
    assert {(r["round"], r["client"]) for r in tel} == aggregated and len(tel) == len(aggregated)
    for r in tel:
        assert list(r) == list(telemetry.ROW) and r["device"] == f"client-{r['client']}"
        assert r["energy_source"] == ("ina3221:VDD_IN" if r["client"] == SENSED else "modelled")
        assert r["energy_j"] > 0 and r["train_s"] > 0 and r["upload_s"] > 0 and r["upload_bytes"] > 0
        assert r["download_bytes"] > 0 and r["cpu_pct"] is not None
        if resettable:  # Linux lets a process reset its peak RSS (telemetry.reset_peak_rss); a sandbox may not
            assert r["rss_peak_bytes"] > 0
        assert r["temp_c"] == (50.0 if r["client"] == SENSED else None)  # this machine has no thermal zone
        assert r["battery_before_pct"] is None  # mains: no battery
        assert r["eval_round"] is None or r["eval_round"] < r["round"]
        if r["energy_source"] == "modelled":  # the battery model's watts: 5 W training, 1 W otherwise
            assert r["train_energy_j"] == pytest.approx(5.0 * r["train_s"], rel=0.05, abs=0.05)

    # the thermal declines replay like battery and charging ones: the same participation, the same model
    sim = sim_model(tmp_path / "sim", 2, "fedavg", out / "participation.csv")
    assert participants(tmp_path / "sim" / "participation.csv") == participants(out / "participation.csv")
    assert max_diff(torch.load(out / "model.pt"), sim) <= 1e-5

    report = subprocess.run(CLI + ["report", str(out), "--out", str(tmp_path / "report"), "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    md = (tmp_path / "report" / "energy.md").read_text()
    assert "ina3221:VDD_IN, modelled" in md and "| run | 2 |" in md
    assert (tmp_path / "report" / "accuracy_vs_energy.png").stat().st_size > 0
