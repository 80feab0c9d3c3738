"""Broker outages (docs/field-mode.md "Broker outage"): while the coordinator is disconnected from the
broker no round is opened or closed because of it; the open round's deadline is suspended. A broker
that stays away longer than --broker-outage-timeout stops the run (exit 1, a one-line message that
says how to resume) with its finished rounds checkpointed, and `dropfl trial --resume RUN` continues the
whole trial. Each test starts and stops its own mosquitto on a free 127.0.0.1 port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import torch
from fieldkit import (
    CLI,
    NEEDS_MOSQUITTO,
    ROOT,
    SETTINGS,
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

from coordinator.cli import main
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto

pytestmark = NEEDS_MOSQUITTO

HEARTBEAT_TIMEOUT = 2.0
ALL = set(range(SETTINGS["clients"]))


def model_of_round(run_prefix: str, t: int):
    return lambda topic, h: topic == "dropfl/v1/model/weights" and h.run.startswith(run_prefix) and h.round == t


def test_broker_down_three_heartbeat_timeouts_mid_round_suspends_the_round(tmp_path):
    """The broker stops while round 1 is open, for 3× the heartbeat timeout, and comes back on the same
    port: round 1 waits (nobody dropped, no empty rounds), the run completes and replays exactly."""
    out, n = tmp_path / "run", SETTINGS["clients"]
    broker = Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    slow = {"slowdown_s_per_step": 1.0}  # client 4 trains for 2 s: round 1 is still open when the broker stops
    configs = {i: agent_config(i, broker.url, tmp_path / "agents", **(slow if i == 4 else {})) for i in range(n)}
    agents = {i: start_agent(configs[i], tmp_path / "agents" / f"client-{i}.log") for i in range(n)}
    coord = None
    try:
        coord = start_coordinator(coordinator_cmd(broker.url, out, 4, "fedavg", "--heartbeat-timeout",
                                                  str(HEARTBEAT_TIMEOUT), "--broker-outage-timeout", "60"),
                                  tmp_path / "coordinator.log")
        watcher.wait_for(model_of_round("run-", 1), timeout=120)
        broker.stop()
        time.sleep(3 * HEARTBEAT_TIMEOUT)  # the outage itself: nothing to wait for but the clock
        assert coord.poll() is None
        broker.start()
        assert coord.wait(timeout=120) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in [*agents.values(), *([coord] if coord else [])]:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()

    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2, 3]
    assert participants(out / "participation.csv") == {t: ALL for t in range(4)}  # nobody lost to the outage
    assert metrics[1]["broker_outage_s"] >= 2 * HEARTBEAT_TIMEOUT  # round 1 waited through it
    assert sum(m["broker_outage_s"] for m in metrics if m["round"] != 1) == 0
    log = (tmp_path / "coordinator.log").read_text()
    assert re.search(r"waiting for the broker .*unreachable for \d+ s so far; round 1 is suspended", log)
    assert max_diff(torch.load(out / "model.pt"), sim_model(tmp_path / "sim", 4, "fedavg",
                                                            out / "participation.csv")) <= 1e-5


def _trial_cmd(out: Path, *extra: str) -> list[str]:
    return CLI + ["trial", "--agents", "3", "--rounds", "4", "--algo", "fedavg", "--model", SETTINGS["model"],
                  "--partition", SETTINGS["partition"], "--seed", str(SETTINGS["seed"]), "--steps", "2",
                  "--lr", "0.05", "--threads", "1", "--profiles", "mains", "--deadline", "30", "--heartbeat", "0.3",
                  "--out", str(out), "--no-progress", *extra]


def stop_by_broker_loss(cmd: list[str]) -> str:
    """Start the trial `cmd` (with a short --broker-outage-timeout), kill its broker for good once rounds 0
    and 1 are done; the trial must stop with exit 1. Returns what it wrote on stderr after the kill."""
    trial = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port, seen = None, []
        for line in trial.stderr:  # "[trial] broker mqtt://127.0.0.1:PORT": the trial's first info line
            seen.append(line)
            m = re.search(r"broker mqtt://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port is not None, "".join(seen)
        mosquitto = _broker_of(trial)
        watcher = Watcher(port)
        try:
            watcher.wait_for(model_of_round("run-", 2), timeout=120)  # rounds 0 and 1 are done
        finally:
            watcher.close()
        os.kill(mosquitto.pid, signal.SIGKILL)
        rest = trial.stderr.read()
        assert trial.wait(timeout=120) == 1, rest
        return rest
    finally:
        kill_group(trial, signal.SIGTERM)


def _broker_of(trial: subprocess.Popen) -> psutil.Process:
    """The trial's private mosquitto: a child process of `dropfl trial`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for c in psutil.Process(trial.pid).children():
            if c.name() == "mosquitto":
                return c
        time.sleep(0.1)
    raise AssertionError("the trial's mosquitto never started")


def test_broker_never_back_stops_the_trial_and_trial_resume_finishes_it(tmp_path, monkeypatch):
    """The trial's broker dies after round 1 and never comes back: exit 1, one line saying how to resume,
    round 1 checkpointed (though --checkpoint-every had not saved it). `dropfl trial --resume RUN` then
    starts a new broker, the agents and the coordinator, and ends with the uninterrupted run's model."""
    out = tmp_path / "run"
    rest = stop_by_broker_loss(_trial_cmd(out, "--broker-outage-timeout", "3", "--checkpoint-every", "100"))
    last = rest.strip().splitlines()[-1]
    assert last.startswith("dropfl: error: ") and f"dropfl trial --resume {out}" in last, rest
    assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 1
    coordinator_log = (out / "coordinator.log").read_text()
    assert "--broker-outage-timeout 3" in coordinator_log and "--resume" in coordinator_log

    again = subprocess.run(_trial_cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.stderr  # never over a run by accident

    resumed = subprocess.run(CLI + ["trial", "--resume", str(out), "--no-progress"], cwd=ROOT, capture_output=True,
                             text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:] + (out / "coordinator.log").read_text()[-3000:]
    assert [m["round"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert participants(out / "participation.csv") == {t: {0, 1, 2} for t in range(4)}
    assert json.loads((out / "trial.json").read_text())["agents"] == 3
    monkeypatch.setitem(SETTINGS, "clients", 3)  # the same federation in simulation, everyone every round
    assert max_diff(torch.load(out / "model.pt"), sim_model(tmp_path / "sim", 4, "fedavg", None)) <= 1e-5


def test_trial_resume_refuses_what_it_cannot_resume(tmp_path):
    not_a_trial = tmp_path / "plain"
    not_a_trial.mkdir()
    (not_a_trial / "checkpoint.pt").write_bytes(b"")
    r = subprocess.run(CLI + ["trial", "--resume", str(not_a_trial)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not a `dropfl trial` run" in r.stderr, r.stderr
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "trial.json").write_text("{}")
    r = subprocess.run(CLI + ["trial", "--resume", str(trial)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nothing to resume" in r.stderr, r.stderr
    r = subprocess.run(CLI + ["trial", "--resume", str(trial), "--agents", "3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--agents" in r.stderr, r.stderr


def test_broker_frozen_with_its_socket_open_is_an_outage_not_dropouts(tmp_path, monkeypatch):
    """The broker is SIGSTOPped while round 1 is open (its TCP connections stay open) for longer than the
    heartbeat timeout, then SIGCONTed: the coordinator notices the silence (its own probe is not echoed) within
    3 s, before any agent times out, and treats it as an outage from the last healthy contact: round 1 is
    suspended, nobody is dropped `offline`, `broker_outage_s` counts it, and the run replays bit for bit."""
    monkeypatch.setitem(SETTINGS, "clients", 3)
    out, log = tmp_path / "run", tmp_path / "coordinator.log"
    broker = Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    slow = {"slowdown_s_per_step": 1.0}  # 2 s of training: round 1 is open when the broker freezes
    configs = {i: agent_config(i, broker.url, tmp_path / "agents", **slow) for i in range(3)}
    agents = [start_agent(configs[i], tmp_path / "agents" / f"client-{i}.log") for i in range(3)]
    coord, frozen = None, False
    heartbeat_timeout = 10.0  # coordinator_cmd's
    try:
        coord = start_coordinator(coordinator_cmd(broker.url, out, 3, "fedavg"), log)
        watcher.wait_for(model_of_round("run-", 1), timeout=180)
        os.kill(broker.proc.pid, signal.SIGSTOP)
        frozen = True
        deadline = time.monotonic() + 60
        while "has not answered for" not in log.read_text():  # the coordinator's own line: the event
            assert time.monotonic() < deadline and coord.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(heartbeat_timeout)  # frozen past the heartbeat timeout: nothing to wait for but the clock
        os.kill(broker.proc.pid, signal.SIGCONT)
        frozen = False
        assert coord.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        if frozen:
            os.kill(broker.proc.pid, signal.SIGCONT)
        for p in [*agents, *([coord] if coord else [])]:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert participants(out / "participation.csv") == {t: {0, 1, 2} for t in range(3)}  # no invented dropout
    assert metrics[1]["broker_outage_s"] >= heartbeat_timeout  # from the last contact to the thaw
    assert metrics[0]["broker_outage_s"] == metrics[2]["broker_outage_s"] == 0
    text = log.read_text()
    assert re.search(r"waiting for the broker \S+: not answering for \d+ s so far; round 1 is suspended", text)
    assert "the broker is back after" in text
    replay = tmp_path / "replay"
    assert main(["sim", "--config", str(out / "config.json"), "--availability", "replay", "--trace",
                 str(out / "participation.csv"), "--out", str(replay), "--no-progress"]) == 0
    field, replayed = torch.load(out / "model.pt"), torch.load(replay / "model.pt")
    assert all(torch.equal(field[k], replayed[k]) for k in field)
