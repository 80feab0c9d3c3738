"""--sim-device: where the batched engine trains (docs/engine.md, "CUDA").

auto picks the CPU for the LeNets (their fused CPU kernels beat a GPU at batch 16, measured on an H100 machine) and a
GPU for the other models where there is one. These tests decide devices with `torch.cuda.is_available` patched either
way, so they run the same on machines with and without a GPU; nothing here touches CUDA itself.
"""

from __future__ import annotations

import json

import pytest
import torch

from coordinator.cli import main
from coordinator.config import SimConfig
from coordinator.sim import batched
from coordinator.sim.batched import BatchedEngine, auto_device, engine_device
from coordinator.sim.lockstep import why_not
from edge_client.models import MODELS, build_model

SHAPES = {"cifar-lenet": (3, 32, 32), "vgg11": (3, 32, 32)}
TINY = ["--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "2", "--batch-size", "8",
        "--rounds", "1", "--no-progress"]


def model(name: str) -> torch.nn.Module:
    return build_model(name, SHAPES.get(name, (1, 28, 28)), 10)


def gpu(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present)


def cpu_first() -> set[str]:
    """The models registered cpu_first (edge_client/models.py: the one place the fact is declared)."""
    return {n for n in MODELS.registered() if MODELS.meta(n, "cpu_first")}


def test_the_cpu_first_models_are_the_models_with_fused_cpu_kernels():
    """auto decides by --model name where no model is built yet (the lockstep planner, from the registry's
    cpu_first) and by the model itself in the engine: both must name the same models."""
    assert cpu_first() == {"mimic-cnn", "cifar-lenet", "fdms-cnn"}
    assert cpu_first() == {n for n in MODELS.registered()
                           if batched.batched_forward(model(n)) in (batched._lenet, batched._fdms)}


def test_the_batch_independent_models_are_those_the_engine_finds_independent():
    """The lockstep planner decides by the registry's batch_independent before any model is built; the engine
    decides from the model (`batched.batch_independent`, the LeNets with their native kernels): the same models."""
    declared = {n for n in MODELS.registered() if MODELS.meta(n, "batch_independent")}
    assert declared == {"mimic-cnn", "cifar-lenet", "mlp", "logreg"}
    if batched.kernels.available():
        native = batched.kernels.chosen()
        assert declared == {n for n in MODELS.registered()
                            if batched.batch_independent(model(n), native, torch.float32, torch.device("cpu"))}


@pytest.mark.parametrize("present", [True, False])
def test_auto_is_the_cpu_for_lenets_and_a_gpu_for_the_rest_where_there_is_one(monkeypatch, present):
    gpu(monkeypatch, present)
    for name in MODELS.registered():
        want = "cpu" if name in cpu_first() or not present else "cuda"
        assert engine_device("auto", model(name)).type == want, name
        assert engine_device(None, model(name)).type == want, name
        assert auto_device(name) == want, name
        assert engine_device("cpu", model(name)).type == "cpu"


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    gpu(monkeypatch, False)
    with pytest.raises(ValueError, match="no usable GPU"):
        engine_device("cuda", model("mlp"))
    with pytest.raises(ValueError, match="no usable GPU"):
        BatchedEngine(model("mlp"), [(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))], workers=0,
                      device="cuda")


def test_a_lenet_engine_stays_on_the_cpu_on_a_gpu_machine(monkeypatch):
    """The engine's default is auto: on a machine with a GPU a LeNet trains on the CPU, with its fused kernels where
    they build; its name says so (no CUDA call is made: the device is decided before anything moves)."""
    gpu(monkeypatch, True)
    data = [(torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))) for _ in range(2)]
    engine = BatchedEngine(model("mimic-cnn"), data, workers=0)
    try:
        assert engine.device.type == "cpu" and engine.local is not None and engine.local.device.type == "cpu"
        assert "cuda" not in engine.describe() and engine.details()["device"] == "cpu"
    finally:
        engine.close()


def test_sim_device_cuda_without_a_gpu_is_one_line_and_writes_nothing(monkeypatch, capsys, tmp_path):
    gpu(monkeypatch, False)
    out = tmp_path / "run"
    assert main(["sim", *TINY, "--sim-device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dropfl: error: --sim-device cuda") and "--sim-device auto" in err[0]
    assert not out.exists()


def test_sim_device_cuda_with_the_loop_engine_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["sim", *TINY, "--engine", "loop", "--sim-device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sim-device cuda" in err[0] and "--engine loop" in err[0]
    assert not out.exists()


def test_sim_device_cpu_runs_on_the_cpu_and_is_recorded(monkeypatch, capsys, tmp_path):
    """--sim-device cpu on a machine with a GPU: logreg (a GPU model under auto) trains on the CPU; the run's log
    and metrics say so, and config.json records the choice (part of what --resume checks)."""
    gpu(monkeypatch, True)
    out = tmp_path / "run"
    assert main(["sim", *TINY, "--sim-device", "cpu", "--out", str(out)]) == 0
    assert "[sim] engine: batched — a round's clients as one computation on cpu" in capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["batched"]
    assert json.loads((out / "config.json").read_text())["train"]["device"] == "cpu"


def test_the_lockstep_planner_follows_the_device_choice(monkeypatch):
    """Lockstep groups merge runs on the CPU only: with a GPU, LeNet runs (auto: the CPU) still merge; a run on the
    GPU (--sim-device cuda, or auto for a model without fused kernels) runs on its own and says why."""
    gpu(monkeypatch, True)
    cfg = SimConfig()
    cfg.model.model = "mimic-cnn"
    assert why_not(cfg) is None
    cfg.train.device = "cuda"
    assert why_not(cfg).startswith("CUDA (--sim-device cuda")
    cfg.train.device, cfg.model.model = "auto", "mlp"
    assert why_not(cfg).startswith("CUDA (--sim-device auto")
    cfg.train.device = "cpu"
    assert why_not(cfg) is None
    gpu(monkeypatch, False)
    cfg.train.device = "auto"
    assert why_not(cfg) is None


@pytest.mark.parametrize("name", MODELS.registered())   # built-ins (a plugin has its own tests)
def test_auto_slices_follow_the_cores_only_where_they_cannot_change_the_results(monkeypatch, name):
    """--slices 0 (auto, the default): one slice per core, at least 2 and at most AUTO_SLICES_MAX, for the models
    whose clients' results do not depend on their computation's other clients (batch_independent: mlp, logreg, the
    LeNets with both fused layers); 2, as before auto, for the others. An explicit count is kept."""
    gpu(monkeypatch, False)
    m = model(name)
    native = batched.kernels.chosen() if batched.kernels.available() else None
    lenet = batched.batched_forward(m) is batched._lenet
    independent = name in ("mlp", "logreg") or (lenet and native is not None)
    assert batched.batch_independent(m, native if lenet or name == "fdms-cnn" else None, torch.float32,
                                      torch.device("cpu")) == independent
    for cores, want in ((1, 2), (2, 2), (6, 6), (64, batched.AUTO_SLICES_MAX)):
        monkeypatch.setattr(batched, "cpus", lambda cores=cores: cores)
        got = batched.slices_for(0, m, native, torch.float32, torch.device("cpu"))
        assert got == (want if independent else 2), (cores, got)
        assert batched.slices_for(3, m, native, torch.float32, torch.device("cpu")) == 3
    assert batched.slices_for(0, m, native, torch.float32, torch.device("cuda")) == 2   # a GPU: not checked there
    assert not batched.batch_independent(m, native, torch.float32, torch.device("cuda"))


def test_the_engine_takes_auto_slices_and_says_how_many(monkeypatch):
    gpu(monkeypatch, False)
    monkeypatch.setattr(batched, "cpus", lambda: 5)
    data = [(torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))) for _ in range(7)]
    engine = BatchedEngine(model("mlp"), data, workers=0, groups=0)
    try:
        assert engine.details()["slices"] == 5 and len(engine.slices(list(range(7)))) == 5
    finally:
        engine.close()


def test_a_run_made_with_two_slices_resumes_with_auto_and_back(tmp_path, capsys):
    """Before auto the default was 2; auto is 2 wherever the number of slices could change the results, so --resume
    takes either for the other. Another count is still a changed setting."""
    out = tmp_path / "run"
    args = [*[a if a != "1" else "2" for a in TINY], "--out", str(out)]
    assert main(["sim", *args, "--slices", "2", "--rounds", "1"]) == 0
    assert main(["sim", *args, "--resume"]) == 0   # auto (0) against the run's 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(["sim", *args, "--slices", "3", "--rounds", "3", "--resume"]) == 2
    assert "train.slices (0 → 3)" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mimic-cnn", "mlp", "logreg"])
def test_a_clients_result_is_the_same_alone_or_beside_any_other_client(name):
    """--slices auto's premise for the batch-independent models: how a round's tasks are cut into slices does not
    change any client's result. A client with fewer samples than its batch size (3 of 16), or a smaller last batch,
    trains alone, beside a like client, or beside a client with full batches, and gets the same bits each time:
    every computation is padded to the tasks' batch size, so the products are the same matrices (MKL sums a 1 to 5
    row product in another order than a 16 row one, measured: the width must not follow the data)."""
    from coordinator.sim.batched import Group
    from edge_client.models import get_flat
    from edge_client.trainer import TrainTask
    g = torch.Generator().manual_seed(0)
    sizes = [3, 3, 100, 34]
    x, y = torch.rand(sum(sizes), 1, 28, 28, generator=g), torch.randint(0, 10, (sum(sizes),), generator=g)
    m = model(name)
    group = Group(m, x, y, [sum(sizes[:i]) for i in range(len(sizes))], sizes, threads=1)
    if not batched.batch_independent(m, group.native, x.dtype, group.device):
        pytest.skip("mimic-cnn without its native kernels runs torch grouped convolutions: not batch-independent")
    w = get_flat(m)

    def task(c: int) -> TrainTask:
        return TrainTask(client=c, round=1, lr=0.05, batch_size=16, epochs=2, seed=3)
    for c in (0, 3):
        alone = group.train(w, [task(c)])[0].delta
        for others in ([1], [2], [1, 2]):
            assert torch.equal(group.train(w, [task(c)] + [task(o) for o in others])[0].delta, alone), (c, others)
