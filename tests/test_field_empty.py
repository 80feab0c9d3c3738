"""An empty federation (docs/field-mode.md "Nobody there"): with no agent there to take part, the coordinator
burns no round and records no empty round; it waits, and after --empty-federation-timeout stops with exit 1,
a one-line error that says how to resume, and its finished rounds checkpointed. Agents that come back in time
continue the suspended round. Every test starts and stops its own mosquitto on a free 127.0.0.1 port and
three agent processes; the faults are injected (SIGKILL, flat batteries), never simulated."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from fieldkit import (
    NEEDS_MOSQUITTO,
    ROOT,
    SETTINGS,
    Watcher,
    agent_config,
    coordinator_cmd,
    kill_group,
    participants,
    start_agent,
    start_coordinator,
)
from strategy_helpers import cache_dataset_loads

from coordinator.cli import main
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto
from coordinator.trial.run import battery_profile

pytestmark = NEEDS_MOSQUITTO

N = 3
ALL = set(range(N))
SLOW = {"slowdown_s_per_step": 1.0}  # 2 steps: a round stays open ~2 s, so the agents can be killed in it


@pytest.fixture(autouse=True)
def three_clients(monkeypatch):
    monkeypatch.setitem(SETTINGS, "clients", N)


def model_of_round(t: int):
    return lambda topic, h: topic == "dropfl/v1/model/weights" and h.run.startswith("run-") and h.round == t


def start_agents(configs: dict[int, Path], logs: Path) -> dict[int, subprocess.Popen]:
    return {i: start_agent(c, logs / f"client-{i}.log") for i, c in configs.items()}


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """The first line of `path` (a process's log) that matches `pattern`, as the process writes it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text() if path.exists() else "")
        if m:
            return m.group(0)
        assert proc.poll() is None, path.read_text()[-3000:]
        time.sleep(0.1)  # polling the log for the line: it is the event
    raise AssertionError(f"{pattern!r} never appeared in {path}")


def replay_exact(run: Path, out: Path) -> bool:
    """The README's replay command (no --engine) of the field run: the same model, bit for bit."""
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert main(["sim", "--config", str(run / "config.json"), "--availability", "replay",
                     "--trace", str(run / "participation.csv"), "--out", str(out), "--no-progress"]) == 0
    field, replay = torch.load(run / "model.pt"), torch.load(out / "model.pt")
    return field.keys() == replay.keys() and all(torch.equal(field[k], replay[k]) for k in field)


def test_nobody_available_burns_no_round_and_stops_with_exit_1(tmp_path):
    """Every agent online but declining (flat battery, the agents' own policy): round 0 never starts; after
    --empty-federation-timeout the coordinator stops with exit 1, says why and how to go on, and records no
    round (no metrics, no participation rows, no checkpoint)."""
    out, broker = tmp_path / "run", Mosquitto(workdir=tmp_path / "broker")
    configs = {}
    for i in range(N):
        path = agent_config(i, broker.url, tmp_path / "agents")
        cfg = json.loads(path.read_text())
        cfg["battery"], policy = battery_profile(i, SETTINGS["seed"], "flat")
        cfg["policy"] = {"min_battery_pct": 20.0} | policy
        path.write_text(json.dumps(cfg))
        configs[i] = path
    agents = start_agents(configs, tmp_path / "agents")
    try:
        r = subprocess.run(coordinator_cmd(broker.url, out, 3, "fedavg", "--empty-federation-timeout", "2"),
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        for p in agents.values():
            kill_group(p, signal.SIGTERM)
        broker.close()
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"dropfl: error: no agent has been there to take part for \d+ s \(3 battery; "
                        r"--empty-federation-timeout 2\); no round had finished: once agents are back, start the "
                        r"run again \(the same command; .*\)", last), last
    assert re.search(r"waiting for agents: none there to take part for \d+ s so far \(3 battery\); round 0 "
                     r"starts when one is \(giving up after 2 s, --empty-federation-timeout\)", r.stderr)
    assert not (out / "checkpoint.pt").exists()
    assert not (out / "metrics.jsonl").exists() or read_metrics(out / "metrics.jsonl") == []
    assert not (out / "participation.csv").exists() or participants(out / "participation.csv") == {}
    assert "no participant" not in r.stderr


def test_everyone_gone_mid_round_suspends_it_then_stops_and_resume_finishes(tmp_path):
    """All agents SIGKILLed while round 1 is open (nobody has delivered): round 1 is suspended, not closed;
    nobody comes back, so after --empty-federation-timeout: exit 1, rounds 0..0 checkpointed, round 1 not
    recorded. With the agents restarted, --resume runs rounds 1 and 2 with everyone, and the README's replay
    command gives the same model bit for bit."""
    out, broker = tmp_path / "run", Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    configs = {i: agent_config(i, broker.url, tmp_path / "agents", **SLOW) for i in range(N)}
    agents = start_agents(configs, tmp_path / "agents")
    cmd = coordinator_cmd(broker.url, out, 3, "fedavg", "--empty-federation-timeout", "3")
    coord, log = None, tmp_path / "coordinator.log"
    try:
        coord = start_coordinator(cmd, log)
        watcher.wait_for(model_of_round(1), timeout=180)
        for p in agents.values():
            kill_group(p)
        assert coord.wait(timeout=120) == 1, log.read_text()[-3000:]
        text = log.read_text()
        last = text.strip().splitlines()[-1]
        assert re.fullmatch(rf"dropfl: error: no agent has been there to take part for \d+ s \(3 offline; "
                            rf"--empty-federation-timeout 3\); rounds 0\.\.0 are checkpointed in {out}: once agents "
                            rf"are back, resume with the same command plus --resume .*", last), last
        assert re.search(r"waiting for agents: none there to take part for \d+ s so far \(3 offline\); round 1 is "
                         r"suspended", text)
        assert [m["round"] for m in read_metrics(out / "metrics.jsonl")] == [0]  # no empty round 1
        assert participants(out / "participation.csv") == {0: ALL}
        assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 0

        agents = start_agents(configs, tmp_path / "agents")
        coord = start_coordinator(cmd + ["--resume"], log)
        assert coord.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        for p in [*agents.values(), *([coord] if coord else [])]:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert participants(out / "participation.csv") == {t: ALL for t in range(3)}
    assert replay_exact(out, tmp_path / "replay")


def test_everyone_back_in_time_continues_the_suspended_round(tmp_path):
    """All agents SIGKILLed while round 1 is open; once the coordinator says round 1 is suspended, they are
    started again: they rejoin, get round 1's task again, and the run ends with everyone in every round (no
    `offline` drop invented for the gap), round 1's `empty_federation_s` > 0, exit 0, replayed bit for bit."""
    out, broker = tmp_path / "run", Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    configs = {i: agent_config(i, broker.url, tmp_path / "agents", **SLOW) for i in range(N)}
    agents = start_agents(configs, tmp_path / "agents")
    coord, log = None, tmp_path / "coordinator.log"
    try:
        coord = start_coordinator(coordinator_cmd(broker.url, out, 3, "fedavg", "--empty-federation-timeout", "120"),
                                  log)
        watcher.wait_for(model_of_round(1), timeout=180)
        for p in agents.values():
            kill_group(p)
        wait_for_line(log, r"waiting for agents: .*round 1 is suspended", coord)
        agents = start_agents(configs, tmp_path / "agents")
        assert coord.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        for p in [*agents.values(), *([coord] if coord else [])]:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert participants(out / "participation.csv") == {t: ALL for t in range(3)}
    assert metrics[1]["empty_federation_s"] > 0
    assert metrics[0]["empty_federation_s"] == metrics[2]["empty_federation_s"] == 0
    assert metrics[2]["empty_federation_s_total"] == metrics[1]["empty_federation_s"]
    assert "agents are back after" in log.read_text()
    assert replay_exact(out, tmp_path / "replay")
