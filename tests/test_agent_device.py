"""The agent's `--device auto|cpu|cuda` (edge_client/agent/device.py).

Everywhere: the option parses and overrides the config, `auto` is the CPU where CUDA is absent, `cuda`
there is refused with one line (exit 2) before any data is read, a bad `[agent] device` is refused, the
agent's update says where it trained (`train_device`, checked by the coordinator), and an agent on the
CPU uploads exactly `local_train`'s delta.

Where `torch.cuda.is_available()` (skipped, with the reason, elsewhere): an agent on CUDA uploads a CPU
float32 update equal to the CPU agent's within docs/engine.md's float32 tolerance (1e-5), two CUDA
agents upload bit-identical updates (deterministic settings on), and `local_train` / FedDD's client
round on CUDA equal the CPU in float64 to 1e-10 (the tolerance docs/engine.md states for CUDA).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest
import torch

from coordinator.field import checks
from edge_client import agent as ag
from edge_client import datasets, determinism, feddd, wire
from edge_client.agent import device as dev
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, local_train

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = (f"no CUDA device: torch {torch.__version__} "
           f"({'built without CUDA' if torch.version.cuda is None else f'CUDA {torch.version.cuda}, no usable GPU'})")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)


@pytest.fixture(autouse=True)
def _restore_global_settings():
    """`resolve('cuda')` sets process-wide deterministic settings; give the next test the ones it had."""
    with determinism.settings_restored():
        yield


# --- everywhere ---

def test_the_option_parses_and_refuses_other_values(capsys):
    parser = argparse.ArgumentParser(prog="dropfl")
    ag.add_parser(parser.add_subparsers())
    for choice in ("auto", "cpu", "cuda"):
        assert parser.parse_args(["client", "--config", "a.toml", "--device", choice]).device == choice
    assert parser.parse_args(["client", "--config", "a.toml"]).device is None  # then the config's, cpu by default
    assert ag.config_from_dict({}).agent.device == "cpu"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["client", "--config", "a.toml", "--device", "gpu"])
    assert e.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


def test_a_bad_device_in_the_config_is_one_line():
    with pytest.raises(ag.AgentError, match=r"^agent\.device must be one of: auto, cpu, cuda \(got \"gpu\""):
        ag.config_from_dict({"agent": {"device": "gpu"}})


def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused(monkeypatch):
    assert dev.resolve("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert dev.resolve("cpu") == torch.device("cpu") and dev.describe(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.resolve("auto") == torch.device("cpu")
    with pytest.raises(ag.AgentError) as e:
        dev.resolve("cuda")
    assert "\n" not in str(e.value) and str(e.value).startswith("device cuda (--device or [agent] device): torch ")
    # the Agent checks it first: nothing is read (this config's data_dir does not exist)
    with pytest.raises(ag.AgentError, match="^device cuda"):
        ag.Agent(ag.config_from_dict({"agent": {"device": "cuda"}, "data": {"data_dir": "/nonexistent"}}))


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is present here: `--device cuda` is not refused")
def test_the_cli_refuses_cuda_without_cuda_in_one_line(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nclient = 0\ndevice = "cpu"\n[data]\ndata_dir = "/nonexistent"\n')
    p = subprocess.run([sys.executable, "-m", "edge_client.agent", "--config", str(cfg), "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dropfl: error: device cuda (--device or [agent] device): ")
    assert "use cpu or auto" in lines[0]


def test_the_coordinator_checks_train_device():
    meta = {"num_samples": 5, "steps": 1}
    assert checks.update_meta(meta, 5) is None
    for ok in ("cpu", "cuda"):
        assert checks.update_meta(meta | {"train_device": ok}, 5) is None
    for bad in ("CUDA", "cuda:0", 3, "x" * 17, ""):
        code, why = checks.update_meta(meta | {"train_device": bad}, 5)
        assert code == checks.META and "train_device" in why


# --- the agent's whole path: task and model in, update out (no broker) ---

class _Published:
    def wait_for_publish(self, timeout=None):
        pass

    def is_published(self):
        return True


N_TRAIN, N_TEST = 40, 8


def _fake_shard(cfg):
    """A small synthetic shard in place of the dataset (`load_shard`'s return value): no files needed."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.rand(N_TRAIN, 1, 28, 28, generator=g), torch.randint(0, 10, (N_TRAIN,), generator=g)
    labels = datasets.Labels("fmnist", None, y.numpy(), np.zeros(N_TEST, dtype=np.int64))
    return labels, x, y, np.zeros((N_TEST, 1, 28, 28), np.float32), np.zeros(N_TEST, np.int64)


def _agent_update(tmp_path, monkeypatch, device: str, model: str, task: dict, w: torch.Tensor) -> wire.Message:
    """One round through the agent: a task and the global model arrive, it trains and uploads; the update."""
    monkeypatch.setattr(ag, "load_shard", _fake_shard)
    cfg = ag.config_from_dict({"agent": {"client": 1, "out": str(tmp_path / device), "device": device},
                               "battery": {"source": "mains"}, "data": {"clients": 4, "seed": 2},
                               "model": {"model": model}})
    a = ag.Agent(cfg)
    assert a.device.type == device and a.work.x.device.type == device \
        and next(a.work.model.parameters()).device.type == device
    sent: list[tuple[str, bytes]] = []
    monkeypatch.setattr(a.link.mqtt, "publish", lambda topic, payload, qos=0, retain=False:
                        sent.append((topic, payload)) or _Published())
    a.connected.set()
    for f in wire.encode("task", "run", 1, 1, meta=task) + wire.encode("model", "run", 1, -1, w):
        a._handle("dropfl/v1/device/client-1/control", f, False, 0.0)
    a.work.step()
    delta = [p for t, p in sent if t.endswith("/update/delta")]
    assert delta, [t for t, _ in sent]
    return wire.decode(delta)


def _reference(model_name: str, task: dict, w: torch.Tensor) -> torch.Tensor:
    _, x, y, _, _ = _fake_shard(None)
    model = build_model(model_name, (1, 28, 28), 10, 2)
    t = TrainTask(client=1, round=1, lr=task["lr"], batch_size=task["batch_size"], steps=task["steps"],
                  seed=task["seed"])
    return local_train(model, w, x, y, t).delta


TASK = {"lr": 0.05, "batch_size": 8, "steps": 6, "seed": 3}


@pytest.mark.parametrize("model", ["mimic-cnn", "fdms-cnn"])
def test_a_cpu_agent_uploads_exactly_local_trains_delta(tmp_path, monkeypatch, model):
    w = get_flat(build_model(model, (1, 28, 28), 10, 2))
    m = _agent_update(tmp_path, monkeypatch, "cpu", model, TASK, w)
    assert m.meta["train_device"] == "cpu" and m.tensor.dtype == torch.float32
    ref = _reference(model, TASK, w)
    assert torch.equal(m.tensor, ref) and float(ref.abs().max()) > 1e-4


# --- where CUDA is present ---

@needs_cuda
@pytest.mark.parametrize("model", ["mimic-cnn", "fdms-cnn"])
def test_a_cuda_agent_equals_the_cpu_agent_and_repeats_bit_for_bit(tmp_path, monkeypatch, model):
    w = get_flat(build_model(model, (1, 28, 28), 10, 2))
    cpu = _agent_update(tmp_path / "a", monkeypatch, "cpu", model, TASK, w)
    runs = [_agent_update(tmp_path / f"c{i}", monkeypatch, "cuda", model, TASK, w) for i in range(2)]
    for m in runs:  # the upload stays CPU float32 on the wire
        assert m.meta["train_device"] == "cuda" and m.tensor.dtype == torch.float32 and m.tensor.device.type == "cpu"
    assert torch.equal(runs[0].tensor, runs[1].tensor)                       # deterministic: bit for bit
    assert torch.allclose(runs[0].tensor, cpu.tensor, atol=1e-5, rtol=0)     # docs/engine.md, float32
    assert abs(runs[0].meta["loss"] - cpu.meta["loss"]) <= 1e-5
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cudnn.benchmark and torch.are_deterministic_algorithms_enabled()


@needs_cuda
@pytest.mark.parametrize("model", ["mimic-cnn", "fdms-cnn"])
def test_local_train_and_feddd_on_cuda_equal_the_cpu_in_float64(model):
    cuda = dev.resolve("cuda")
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(15, 1, 28, 28, generator=g, dtype=torch.float64), torch.randint(0, 10, (15,), generator=g)
    m_cpu = build_model(model, (1, 28, 28), 10, 3).double()
    w = get_flat(m_cpu)
    corr = torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.01
    tasks = [TrainTask(client=0, round=2, lr=0.05, batch_size=4, epochs=1, seed=5),   # batches 4, 4, 4, 3
             TrainTask(client=0, round=2, lr=0.05, batch_size=4, steps=5, prox_mu=0.5, seed=5),
             TrainTask(client=0, round=2, lr=0.03, batch_size=4, epochs=2, grad_correction=corr, seed=5)]
    m_gpu, xg, yg = dev.place(build_model(model, (1, 28, 28), 10, 3).double(), x, y, cuda)
    for t in tasks:
        ref, out = local_train(m_cpu, w, x, y, t), local_train(m_gpu, w, xg, yg, t)
        assert out.delta.device.type == "cpu" and out.delta.dtype == torch.float64
        assert float((out.delta - ref.delta).abs().max()) <= 1e-10 and abs(out.loss - ref.loss) <= 1e-10
    layout = feddd.unit_layout(m_cpu)
    t = TrainTask(client=0, round=2, lr=0.05, batch_size=4, steps=4, seed=5, dropout_rate=0.5)
    ref, _ = feddd.client_round(m_cpu, layout, w, x, y, t, None)
    out, _ = feddd.client_round(m_gpu, layout, w, xg, yg, t, None)
    assert torch.equal(out.mask, ref.mask) and float((out.delta - ref.delta).abs().max()) <= 1e-10
