"""The batched engine (coordinator/sim/batched.py) gives the reference loop's weights (local_train).

One round mixes everything that makes clients of a round differ: data sizes that leave a smaller
last batch, epochs vs fixed steps (so clients finish at different steps and must be frozen), an
empty client, per-client learning rates, FedProx's μ and SCAFFOLD's gradient correction, and the
dropout layers of fdms-cnn and vgg11 (masks drawn from each client's generator).

The per-model test runs in float64: the batched kernels (grouped convolutions, batched matmuls) sum
in a different order than the per-client ones, and in float32 a 1-ulp difference can flip a
max-pool argmax or a ReLU at a near-tie a few steps later, which then shows up as a 1e-3 jump on
random data. In float64 such flips do not happen at this scale, so the comparison checks the
algorithm (same batches, masks, padding, freezing, prox, correction) with no rounding noise.
The float32 test runs the FMNIST workload's models on real FMNIST images at 1e-5.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coordinator.sim import kernels
from coordinator.sim.batched import BatchedEngine
from coordinator.sim.clock import Profile
from coordinator.sim.transport import SimTransport
from edge_client.models import MODELS, build_model, get_flat
from edge_client.trainer import TrainTask, local_train

TOL = 1e-5
F64_TOL = 1e-10
LENETS = ("mimic-cnn", "fdms-cnn", "cifar-lenet")   # the models with fused native layers
# the LeNets run once per kernel variant this CPU runs (coordinator/sim/kernels), where a compiler exists,
# and once in torch ops; the other models once (True: the engine's default)
NATIVE = [*(kernels.cpu_variants() if kernels.compiler() else []), False]


def engine_variants(names) -> list:
    return [pytest.param(n, v, id=f"{n}-{v or 'torch_ops'}") for n in names
            for v in (NATIVE if n in LENETS else [True])]


def shape_of(name: str) -> tuple[int, int, int]:
    return (3, 32, 32) if name in ("vgg11", "cifar-lenet") else (1, 28, 28)


def make_data(sizes: list[int], shape: tuple[int, ...], seed: int = 0,
              dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, *shape, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def mixed_tasks(w: torch.Tensor, batch: int, steps: int) -> list[TrainTask]:
    """Client 0: epochs (smaller last batch); 1: fixed steps + prox; 2: 2 epochs + SCAFFOLD; 3: fewer steps,
    other lr; 4: no data."""
    corr = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 0.01
    return [TrainTask(client=0, round=2, lr=0.05, batch_size=batch, epochs=1, seed=5),
            TrainTask(client=1, round=2, lr=0.05, batch_size=batch, steps=steps, prox_mu=0.5, seed=5),
            TrainTask(client=2, round=2, lr=0.03, batch_size=batch, epochs=2, grad_correction=corr, seed=5),
            TrainTask(client=3, round=2, lr=0.1, batch_size=batch, steps=1, seed=5),
            TrainTask(client=4, round=2, lr=0.05, batch_size=batch, steps=steps, seed=5)]


def reference(model: torch.nn.Module, w: torch.Tensor, data, tasks: list[TrainTask]):
    return [local_train(model, w, *data[t.client], t) for t in tasks]


@pytest.mark.parametrize("name,native", engine_variants(MODELS.registered()))   # built-ins (a plugin has its own tests)
def test_batched_matches_loop_under_dropouts(name: str, native: bool | str) -> None:
    small = name == "vgg11"  # VGG-11 is ~9 M parameters: very few samples keep the test fast
    sizes, batch, steps = ([2, 2, 1, 1, 0], 2, 2) if small else ([21, 16, 7, 12, 0], 4, 5)
    model = build_model(name, shape_of(name), 10, seed=3).double()
    w = get_flat(model)
    data = make_data(sizes, shape_of(name), dtype=torch.float64)
    tasks = mixed_tasks(w, batch, steps)
    ref = reference(model, w, data, tasks)
    engine = BatchedEngine(model, data, workers=0, native=native)
    if engine.device.type == "cpu":                                        # the variant asked for ran
        assert engine.native == ((native or None) if name in LENETS else None)
    out = engine.run(w, tasks)
    assert [r.steps for r in out] == [r.steps for r in ref]
    assert len(set(r.steps for r in ref)) >= 3  # clients really finish at different steps
    for task, r, o in zip(tasks, ref, out):
        assert o.num_samples == r.num_samples
        assert torch.allclose(o.delta, r.delta, atol=F64_TOL, rtol=0), (name, task.client)
        assert abs(o.loss - r.loss) < F64_TOL
    assert float(ref[0].delta.abs().max()) > 1e-3  # the clients did move (not a 0 == 0 comparison)
    assert float(ref[4].delta.abs().max()) == 0.0 and float(out[4].delta.abs().max()) == 0.0


@pytest.mark.parametrize("name,native", engine_variants(["mimic-cnn", "fdms-cnn", "mlp"]))
def test_batched_matches_loop_in_float32_on_fmnist(fmnist, name: str, native: bool | str) -> None:
    """The FMNIST workload's setting (batch 16, float32, real images), clients of different sizes."""
    model = build_model(name, (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    x, y = fmnist.train.x, fmnist.train.y
    data = [(x[0:70], y[0:70]), (x[70:118], y[70:118]), (x[118:150], y[118:150])]
    tasks = [TrainTask(client=0, round=0, lr=0.05, batch_size=16, epochs=1, seed=0),
             TrainTask(client=1, round=0, lr=0.05, batch_size=16, steps=6, seed=0),
             TrainTask(client=2, round=0, lr=0.05, batch_size=16, epochs=1, seed=0)]
    ref = reference(model, w, data, tasks)
    out = BatchedEngine(model, data, workers=0, native=native).run(w, tasks)
    assert [r.steps for r in out] == [r.steps for r in ref] == [5, 6, 2]
    for r, o in zip(ref, out):
        assert torch.allclose(o.delta, r.delta, atol=TOL, rtol=0), (name, (o.delta - r.delta).abs().max())


def test_dropout_masks_follow_each_clients_generator() -> None:
    """Same data and task for two clients but different client ids: different masks and batches, so
    different updates, each reproduced exactly (a shared or misordered generator would break this)."""
    model = build_model("fdms-cnn", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    x, y = make_data([24], (1, 28, 28))[0]
    data = [(x, y), (x, y)]
    tasks = [TrainTask(client=c, round=0, lr=0.1, batch_size=8, steps=4, seed=9) for c in (0, 1)]
    ref = reference(model, w, data, tasks)
    out = BatchedEngine(model, data, workers=0).run(w, tasks)
    assert float((ref[0].delta - ref[1].delta).abs().max()) > 1e-4
    for r, o in zip(ref, out):
        assert torch.allclose(o.delta, r.delta, atol=TOL, rtol=0)


def test_same_weights_whatever_the_number_of_workers() -> None:
    model = build_model("fdms-cnn", (1, 28, 28), 10, seed=2)
    w = get_flat(model)
    data = make_data([40, 33, 17, 64, 25, 9], (1, 28, 28), seed=4)
    tasks = [TrainTask(client=i, round=1, lr=0.05, batch_size=16, epochs=2, seed=3) for i in range(6)]
    runs = {}
    for workers in (0, 2):
        engine = BatchedEngine(model, data, workers=workers, device="cpu")   # worker processes: the CPU
        runs[workers] = torch.stack([r.delta for r in engine.run(w, tasks)])
        engine.close()
    assert torch.equal(runs[0], runs[2])  # bit for bit
    ref = torch.stack([r.delta for r in reference(model, w, data, tasks)])
    assert torch.allclose(runs[2], ref, atol=TOL, rtol=0)


def test_worker_processes_are_refused_on_a_gpu_device() -> None:
    """Worker processes train on the CPU: an engine on another device with workers > 0 would compute on the CPU
    while saying it ran on the device. Refused before anything reaches the device (no CUDA needed here)."""
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=2)
    with pytest.raises(ValueError, match="worker processes train on the CPU"):
        BatchedEngine(model, make_data([8], (1, 28, 28), seed=1), workers=2, device="cuda")


def test_sim_transport_batched_round_equals_loop_round() -> None:
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=1)
    w = get_flat(model)
    data = make_data([19, 32, 8], (1, 28, 28), seed=2)
    tasks = [TrainTask(client=i, round=0, lr=0.05, batch_size=8, epochs=1, seed=1) for i in (2, 0)]
    loop_updates, _ = SimTransport(model, data, "loop").run_round(0, w, tasks)
    transport = SimTransport(model, data, "batched")
    batched_updates, _ = transport.run_round(0, w, tasks)
    transport.batched.close()
    assert list(batched_updates) == list(loop_updates) == [2, 0]
    for c in loop_updates:
        assert batched_updates[c].steps == loop_updates[c].steps
        assert torch.allclose(batched_updates[c].delta, loop_updates[c].delta, atol=TOL, rtol=0)


def test_unknown_model_is_refused() -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

    with pytest.raises(TypeError, match="no batched forward for Odd"):
        BatchedEngine(Odd(), make_data([4], (4,)), workers=0)


def test_the_transport_records_what_ran() -> None:
    """FedDD tasks train on the loop beside the batched engine's, and the round says both; a FedDD run
    (feddd=True), a clock profile and a model without a batched forward start no batched engine."""
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=1)
    w = get_flat(model)
    data = make_data([12, 9], (1, 28, 28), seed=2)
    plain = TrainTask(client=0, round=0, lr=0.05, batch_size=4, steps=2, seed=1)
    feddd = TrainTask(client=1, round=0, lr=0.05, batch_size=4, steps=2, seed=1, dropout_rate=0.5)
    transport = SimTransport(model, data)                       # the default engine
    try:
        name = transport.batched.describe()                     # batched+native(<variant>), or batched without one
        assert transport.describe() == name
        assert name in ("batched", "batched (cuda)", *(f"batched+native({v})" for v in kernels.cpu_variants()))
        if kernels.compiler() and transport.batched.device.type == "cpu":
            assert name == f"batched+native({kernels.requested()})"   # the CPU's best, or $DROPFL_KERNEL's
        # a round's engine: the name with the native parts that actually ran (the fused conv layers at least; the
        # others where their runtime checks pass on this machine), e.g. batched+native(avx512: conv+fc+loss+round)
        ran = re.escape(name[:-1]) + r": conv(\+(fc|loss|step|round|update))*\)" if "+native(" in name else \
            re.escape(name)
        updates, _ = transport.run_round(0, w, [plain, feddd])
        assert set(updates) == {0, 1} and updates[1].mask is not None
        assert re.fullmatch(ran + re.escape(" + loop (feddd tasks)"), transport.round_info()["engine"])
        transport.run_round(1, w, [feddd])
        assert transport.round_info() == {"engine": "loop (feddd tasks)"}
        transport.run_round(2, w, [plain])
        assert re.fullmatch(ran, transport.round_info()["engine"])
    finally:
        transport.close()
    assert SimTransport(model, data, "loop").round_info() == {"engine": "loop"}
    off = SimTransport(model, data, feddd=True)
    assert off.batched is None and off.round_info() == {"engine": "loop (feddd tasks)"}
    assert "feddd tasks" in off.summary()[0]
    profile = Profile(np.full(2, 0.01), np.full(2, 1e5), np.full(2, 1e5))
    clocked = SimTransport(model, data, profile=profile)
    assert clocked.batched is None
    clocked.run_round(0, w, [plain])
    assert clocked.round_info() == {"engine": "loop (clock profile)"}

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

    odd = SimTransport(Odd(), make_data([4], (4,)))
    assert odd.batched is None and odd.describe() == "loop (no batched forward for Odd)"
