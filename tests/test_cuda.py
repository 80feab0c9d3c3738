"""The batched engine on a CUDA device: exact against the reference loop, deterministic, no TF32.

Runs wherever `torch.cuda.is_available()`; skipped, with the reason, elsewhere. Needs only torch,
numpy and this repository (random tensors, no dataset): `python -m pytest tests/test_cuda.py`.

- the loop reference (`local_train` on the CPU) and `BatchedEngine(device="cuda")`, float64, one round
  of clients that differ (a smaller last batch, fixed steps with FedProx, two epochs with a SCAFFOLD
  correction, fewer steps with another lr): the same updates to 1e-10 (mimic-cnn; fdms-cnn adds
  dropout masks, drawn on the CPU generator and moved to the device);
- two CUDA engines, float32, same tasks: bit-identical updates (cuDNN autotuning off, deterministic
  algorithms only; edge_client/determinism.py);
- after an engine is built on CUDA: TF32 off for matmuls and cuDNN, no cuDNN benchmark, deterministic
  algorithms on, CUBLAS_WORKSPACE_CONFIG set;
- the generic engine (`FunctionalEngine(device="cuda")`, vmap) on a CNN with dropout (its masks drawn on threads
  into pinned memory) and a ResNet with BatchNorm: the CPU loop's updates, losses and buffers to 1e-10 in float64;
  two float32 runs bit-identical and within 1e-5 of the loop.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from coordinator.sim.batched import BatchedEngine
from edge_client import determinism
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, local_train
from tests.test_functional_engine import TinyCNN, TinyResNet
from tests.test_functional_engine import make_data as generic_data

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device: torch {torch.__version__} "
           f"({'built without CUDA' if torch.version.cuda is None else f'CUDA {torch.version.cuda}, no usable GPU'})")

SHAPE = (1, 28, 28)


@pytest.fixture(autouse=True, scope="module")
def _restore_global_settings():
    """The engine's settings are process-wide; give the next test module the ones it had."""
    with determinism.settings_restored():
        yield


def make_data(sizes: list[int], dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, *SHAPE, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def mixed_tasks(w: torch.Tensor, batch: int = 4, steps: int = 4) -> list[TrainTask]:
    corr = torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=w.dtype) * 0.01
    return [TrainTask(client=0, round=2, lr=0.05, batch_size=batch, epochs=1, seed=5),                 # 15: 4,4,4,3
            TrainTask(client=1, round=2, lr=0.05, batch_size=batch, steps=steps, prox_mu=0.5, seed=5),
            TrainTask(client=2, round=2, lr=0.03, batch_size=batch, epochs=2, grad_correction=corr, seed=5),
            TrainTask(client=3, round=2, lr=0.1, batch_size=batch, steps=1, seed=5)]


@pytest.mark.parametrize("name", ["mimic-cnn", "fdms-cnn"])
def test_cuda_engine_matches_the_cpu_loop_in_float64(name: str) -> None:
    model = build_model(name, SHAPE, 10, seed=3).double()
    w = get_flat(model)
    data = make_data([15, 12, 6, 9], torch.float64)
    tasks = mixed_tasks(w)
    ref = [local_train(model, w, *data[t.client], t) for t in tasks]
    engine = BatchedEngine(model, data, workers=0, device="cuda")
    assert engine.describe() == "batched (cuda)" and engine.local is not None and engine.local.device.type == "cuda"
    out = engine.run(w, tasks)
    assert [r.steps for r in out] == [r.steps for r in ref] == [4, 4, 4, 1]
    for task, r, o in zip(tasks, ref, out):
        assert o.delta.device.type == "cpu" and o.delta.dtype == torch.float64
        err = float((o.delta - r.delta).abs().max())
        assert err <= 1e-10, (name, task.client, err)
        assert abs(o.loss - r.loss) <= 1e-10
    assert float(ref[0].delta.abs().max()) > 1e-3  # the clients did move (not a 0 == 0 comparison)


@pytest.mark.parametrize("name", ["mimic-cnn", "fdms-cnn"])
def test_two_cuda_runs_are_bit_identical(name: str) -> None:
    model = build_model(name, SHAPE, 10, seed=0)
    w = get_flat(model)
    data = make_data([40, 33, 17, 24], torch.float32, seed=4)
    tasks = [TrainTask(client=i, round=1, lr=0.05, batch_size=16, epochs=2, seed=3) for i in range(4)]
    runs = [torch.stack([r.delta for r in BatchedEngine(model, data, workers=0, device="cuda").run(w, tasks)])
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    ref = torch.stack([local_train(model, w, *data[t.client], t).delta for t in tasks])
    assert torch.allclose(runs[0], ref, atol=1e-5, rtol=0)   # float32: the loop's result to rounding


def test_tf32_is_off_once_the_engine_is_built() -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = True
    torch.use_deterministic_algorithms(False)        # as a fresh process may have them: the engine must set them
    model = build_model("mimic-cnn", SHAPE, 10, seed=0)
    BatchedEngine(model, make_data([8], torch.float32), workers=0, device="cuda")
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8")


GENERIC = {"cnn": (TinyCNN, (1, 14, 14)), "resnet": (TinyResNet, (3, 8, 8))}


@pytest.mark.parametrize("name", list(GENERIC))
def test_the_generic_engine_on_cuda_matches_the_cpu_loop_in_float64(name: str) -> None:
    from coordinator.sim.functional import FunctionalEngine
    cls, shape = GENERIC[name]
    torch.manual_seed(0)
    model = cls().double()
    w = get_flat(model)
    data = generic_data([15, 12, 6, 9], shape, torch.float64, seed=2)
    tasks = mixed_tasks(w)
    engine = FunctionalEngine(model, data, device="cuda")
    try:
        assert engine.describe() == "batched (torch.func, cuda)" and engine.draw_threads >= 1
        out = engine.run(w, tasks)
    finally:
        engine.close()
    for i, task in enumerate(tasks):
        m = copy.deepcopy(model)
        ref = local_train(m, w, *data[task.client], task)
        assert out[i].steps == ref.steps and out[i].delta.device.type == "cpu"
        err = float((out[i].delta - ref.delta).abs().max())
        assert err <= 1e-10, (name, task.client, err)
        assert abs(out[i].loss - ref.loss) <= 1e-10
        for n, b in m.named_buffers():   # BatchNorm: this client's running statistics
            assert torch.allclose(out[i].buffers[n].to(b.dtype), b, atol=1e-10, rtol=0), n
    assert float(out[0].delta.abs().max()) > 1e-3


@pytest.mark.parametrize("name", list(GENERIC))
def test_two_generic_cuda_runs_are_bit_identical(name: str) -> None:
    from coordinator.sim.functional import FunctionalEngine
    cls, shape = GENERIC[name]
    torch.manual_seed(0)
    model = cls()
    w = get_flat(model)
    data = generic_data([40, 33, 17, 24], shape, torch.float32, seed=4)
    tasks = [TrainTask(client=i, round=1, lr=0.05, batch_size=16, epochs=2, seed=3) for i in range(4)]
    runs = []
    for _ in range(2):
        engine = FunctionalEngine(model, data, device="cuda")
        try:
            runs.append(torch.stack([r.delta for r in engine.run(w, tasks)]))
        finally:
            engine.close()
    assert torch.equal(runs[0], runs[1])
    ref = torch.stack([local_train(copy.deepcopy(model), w, *data[t.client], t).delta for t in tasks])
    assert torch.allclose(runs[0], ref, atol=1e-5, rtol=0)
