"""Bad updates from an authenticated device, against a real mosquitto with TLS (a `dropfl provision`
broker directory in a temp dir, on a free 127.0.0.1 port, torn down after).

Two honest `dropfl client` processes and one rogue device log in with their own bundles. The rogue
is the real agent (in this process) with its upload replaced: round 0 honest; round 1 it replays its
round-0 update, then sends NaN; round 2 a tensor of the wrong shape; round 3 one larger than the
model. Every round completes with the honest agents, each crafted message is logged with its reason
and counted by code, and the final model is the simulation's with the same participation (so nothing
rejected was aggregated). Waits are on the coordinator's exit, bounded; no sleeps.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path

import torch
from fieldkit import (
    NEEDS_MOSQUITTO,
    SETTINGS,
    agent_config,
    coordinator_cmd,
    kill_group,
    max_diff,
    participants,
    sim_model,
    start_agent,
    start_coordinator,
)

from coordinator.availability.participation import read_rows
from coordinator.cli import main as dropfl
from coordinator.rundir import read_metrics
from coordinator.trial.tls import ProvisionedBroker, device_agent_keys
from edge_client import wire
from edge_client.agent import Agent, config_from_dict
from edge_client.trainer import TrainTask

pytestmark = NEEDS_MOSQUITTO
ROUNDS = 4
ROGUE = 2


def rogue_agent(cfg) -> Agent:
    """A provisioned device that trains honestly in round 0 and afterwards publishes crafted updates on
    its own update topic (the broker's ACL lets it: they are its topics): its work's training is replaced."""
    agent = Agent(cfg)
    work, honest = agent.work, agent.work._train_and_upload

    def train_and_upload(run: str, task: TrainTask, w: torch.Tensor, download_s: float, wait_s: float = 0.0) -> None:
        t = task.round
        if t == 0:
            honest(run, task, w, download_s, wait_s)
            return
        n, meta = w.numel(), {"num_samples": len(work.y), "steps": 2}
        if t == 1:
            assert work.cache is not None and work.cache[1] == 0
            work.link.publish("update/delta", work.cache[3])  # round 0's update again (the cache's frames)
            bad = torch.full((n,), float("nan"))
        elif t == 2:
            bad = torch.zeros(10, n // 10)                  # the model's size, not its shape
        else:
            bad = torch.zeros(8 * n)                        # larger than any update of this model
        work.link.publish("update/delta", wire.encode("update", run, t, work.client_idx, bad, meta, work.limits))

    work._train_and_upload = train_and_upload
    return agent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_replayed_nan_wrong_shape_and_oversized_updates_are_rejected_and_rounds_complete(tmp_path, monkeypatch):
    monkeypatch.setitem(SETTINGS, "clients", 3)
    bdir, out, agents_dir = tmp_path / "broker", tmp_path / "run", tmp_path / "agents"
    assert dropfl(["provision", "init", str(bdir), "--port", str(free_port())]) == 0
    keys = device_agent_keys(bdir, 3)  # devices client-0 .. client-2, added with add-device

    def config(i: int) -> Path:  # the trial's sections plus the device's bundle keys
        k = dict(keys[i])
        return agent_config(i, k.pop("broker"), agents_dir, **k)

    procs, rogue, thread = [], None, None
    with ProvisionedBroker(bdir) as broker:
        try:
            for i in (0, 1):
                procs.append(start_agent(config(i), agents_dir / f"client-{i}.log"))
            rogue = rogue_agent(config_from_dict(json.loads(config(ROGUE).read_text())))
            thread = threading.Thread(target=rogue.run, name="rogue", daemon=True)
            thread.start()
            cmd = coordinator_cmd(broker.url, out, ROUNDS, "fedavg", "--broker-config", str(broker.coordinator_json))
            coord = start_coordinator(cmd, tmp_path / "coordinator.log")
            procs.append(coord)
            assert coord.wait(timeout=120) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
        finally:
            if rogue is not None:
                rogue.stop()
                thread.join(timeout=10)
            for p in procs:
                kill_group(p, signal.SIGTERM)

    status = {(int(r["round"]), int(r["client"])): (r["status"], r["reason"])
              for r in read_rows(out / "participation.csv")}
    assert status[(0, ROGUE)] == ("participated", "")
    assert [status[(t, ROGUE)] for t in range(1, ROUNDS)] == [("dropped", "rejected")] * (ROUNDS - 1)
    assert participants(out / "participation.csv") == {0: {0, 1, 2}, 1: {0, 1}, 2: {0, 1}, 3: {0, 1}}

    rounds = [json.loads(line) for line in (out / "field.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if r["event"] == "round"]
    assert [r["rejects"] for r in rounds] == [{}, {"round": 1, "nonfinite": 1}, {"shape": 1}, {"too_large": 1}]
    assert rounds[-1]["rejects_total"] == {"round": 1, "nonfinite": 1, "shape": 1, "too_large": 1}
    assert [m["rejected_messages"] for m in read_metrics(out / "metrics.jsonl")] == [0, 2, 1, 1]
    log = (tmp_path / "coordinator.log").read_text()
    for code, why in (("round", "wrong round 0 (expected 1)"), ("nonfinite", "NaN or infinite"),
                      ("shape", "expected a float32 tensor of shape [7850]"), ("too_large", "exceeds the")):
        assert f"rejected update/delta of client-{ROGUE} [{code}]: " in log and why in log

    # nothing rejected reached aggregation: the same model as the simulation with this participation
    same = sim_model(tmp_path / "sim", ROUNDS, "fedavg", out / "participation.csv")
    assert max_diff(torch.load(out / "model.pt"), same) <= 1e-5
