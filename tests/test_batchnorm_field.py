"""BatchNorm buffers on the wire, with a real mosquitto on 127.0.0.1: a field run of a BatchNorm plugin model (three
agents, FedAvg, two rounds) sends the global buffers with the model and each agent's buffers with its update; its
final model.pt (weights and buffers) equals the simulation's replay of its participation log, and the buffers moved
from their initial values."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
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
    sim_model,
)

from coordinator.trial.broker import Mosquitto
from edge_client.models import build_model

pytestmark = NEEDS_MOSQUITTO

N, ROUNDS = 3, 2
DIST = PACKAGE = "bnplug"
MODEL = "bnplug-cnn"
SOURCE = '''"""A plugin model for the tests: a convolution, BatchNorm and a linear layer."""
from torch import nn


def build(input_shape, num_classes, dropout=None):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 5, stride=3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * ((h - 5) // 3 + 1) * ((w - 5) // 3 + 1), num_classes))
'''


def make_plugin(root: Path) -> Path:
    (root / PACKAGE).mkdir(parents=True)
    (root / PACKAGE / "__init__.py").write_text(SOURCE)
    info = root / f"{DIST}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[dropfl.models]\n{MODEL} = {PACKAGE}:build\n")
    (info / "top_level.txt").write_text(f"{PACKAGE}\n")
    return root


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    root = make_plugin(tmp_path / "plugin")
    monkeypatch.setitem(SETTINGS, "clients", N)
    monkeypatch.setitem(SETTINGS, "model", MODEL)
    monkeypatch.syspath_prepend(str(root))   # the in-process simulation resolves the entry point too
    return root


def _start(cmd: list[str], log: Path, path: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)


def test_a_field_run_of_a_batchnorm_model_equals_its_simulated_replay(tmp_path, plugin):
    out, broker = tmp_path / "run", Mosquitto(workdir=tmp_path / "broker")
    watcher = Watcher(broker.port)
    logs = tmp_path / "agents"
    procs = []
    try:
        for i in range(N):
            cfg = agent_config(i, broker.url, logs)
            procs.append(_start(CLI + ["client", "--config", str(cfg)], logs / f"client-{i}.log", plugin))
        for i in range(N):
            watcher.wait_for(lambda topic, h, i=i: topic == f"dropfl/v1/device/client-{i}/status", timeout=180)
        coord = _start(coordinator_cmd(broker.url, out, ROUNDS, "fedavg", "--wait-agents", str(N)),
                       tmp_path / "coordinator.log", plugin)
        procs.append(coord)
        assert coord.wait(timeout=300) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill_group(p, signal.SIGTERM)
        watcher.close()
        broker.close()
    said = (tmp_path / "coordinator.log").read_text()
    assert "does not carry model buffers" not in said and "no usable buffers" not in said, said[-3000:]
    field = torch.load(out / "model.pt")
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(field)
    assert not torch.equal(field["1.running_var"], torch.ones(4))   # the agents' statistics reached the model
    assert int(field["1.num_batches_tracked"]) == 2 * ROUNDS        # 2 steps a round, from the global count
    sim = sim_model(tmp_path / "sim", ROUNDS, "fedavg", out / "participation.csv")
    assert max_diff(field, sim) <= 1e-5
    # the final ONNX model is model.pt in eval mode, the global buffers included
    model = build_model(MODEL, (1, 28, 28), 10)
    model.load_state_dict(field)
    x = torch.rand(16, 1, 28, 28)
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], model.eval()(x).detach().numpy(), atol=1e-5)
