"""The generic engine's max pooling (coordinator/sim/functional.py).

vmap mode (`_ClientsMaxPool`, `_ClientPooling`): under vmap a model's 2-D max pools run on the clients' channels at
once, in the grouped convolutions' layout. Tested: the values and the input gradients are torch's own batching
rule's bit for bit (ties and NaN included, for every argument form and several kernels, on the engine's
channels-last layout and on a contiguous one); outside vmap the function is `F.max_pool2d`; the three ways a model
pools go through it; what it leaves to torch.

Per-client mode (`_ChannelsLastMaxPool`, `_LargePooling`): a big pool runs on a channels-last copy. Tested: values,
indices' gradient routing and gradients are `F.max_pool2d`'s bit for bit for the same forms; a model with such a
pool trains to `local_train`'s bits; small pools are left to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from coordinator.sim import functional
from coordinator.sim.functional import _ClientPooling, _ClientsMaxPool

K, B, C, H, W = 3, 4, 5, 12, 10


def images(channels_last: bool, dtype=torch.float32) -> torch.Tensor:
    """[K, B, C, H, W] with ties (ReLU's zeros, repeated values) and a NaN; stored as the engine stores inputs
    ([B, H, W, K, C]: vmap's grouped convolution reads them channels-last) or contiguous."""
    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(K, B, C, H, W, generator=g, dtype=dtype)).round(decimals=1)
    x[1, 2, 3, 4, 4] = float("nan")   # (even row and column: in a window of every form below)
    if channels_last:
        x = x.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2)
    return x


POOLS = {   # the forms a model's forward calls, each a function of one client's [B, C, H, W]
    "F.max_pool2d(x, 2)": lambda x: F.max_pool2d(x, 2),
    "torch.max_pool2d(x, 2)": lambda x: torch.max_pool2d(x, 2),
    "nn.MaxPool2d(2)": nn.MaxPool2d(2),
    "F.max_pool2d(x, kernel_size=(2, 2), stride=2)": lambda x: F.max_pool2d(x, kernel_size=(2, 2), stride=2),
    "nn.MaxPool2d(3, 2, 1)": nn.MaxPool2d(3, 2, 1),
    "F.max_pool2d(x, 3, ceil_mode=True)": lambda x: F.max_pool2d(x, 3, ceil_mode=True),
    "nn.MaxPool2d(2, dilation=2)": nn.MaxPool2d(2, dilation=2),
}


def _pooled(f, xc):
    with _ClientPooling():
        return f(xc)


def pooled_and_grad(pool, x: torch.Tensor, ours: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vmap of `pool` over the clients (with the engine's rule or torch's), and the gradient of a fixed linear
    function of its output with respect to the input."""
    x = x.detach().requires_grad_()
    y = vmap((lambda xc: _pooled(pool, xc)) if ours else pool)(x)
    weight = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)
    (g,) = torch.autograd.grad((y.nan_to_num(0.0) * weight).sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("form", list(POOLS))
def test_values_and_gradients_are_torchs_rule_bit_for_bit(form: str, channels_last: bool) -> None:
    x = images(channels_last)
    y_ref, g_ref = pooled_and_grad(POOLS[form], x, ours=False)
    y, g = pooled_and_grad(POOLS[form], x, ours=True)
    assert y.shape == y_ref.shape
    assert torch.equal(y.isnan(), y_ref.isnan()) and y.isnan().any()   # the NaN's window: NaN, on both rules
    assert torch.equal(y.nan_to_num(-7.0), y_ref.nan_to_num(-7.0))
    assert torch.equal(g, g_ref)


def test_float64_and_a_batch_of_one() -> None:
    x = images(True, torch.float64)[:, :1]
    y_ref, g_ref = pooled_and_grad(POOLS["nn.MaxPool2d(2)"], x, ours=False)
    y, g = pooled_and_grad(POOLS["nn.MaxPool2d(2)"], x, ours=True)
    assert torch.equal(y.nan_to_num(-7.0), y_ref.nan_to_num(-7.0)) and torch.equal(g, g_ref)


@pytest.fixture
def rule_calls(monkeypatch) -> list:
    """The arguments of each call of `_ClientsMaxPool`'s vmap rule (which still runs)."""
    calls = []
    rule = _ClientsMaxPool.vmap

    def counted(info, in_dims, x, args):
        calls.append(args)
        return rule(info, in_dims, x, args)

    monkeypatch.setattr(_ClientsMaxPool, "vmap", staticmethod(counted))
    return calls


def test_every_form_goes_through_the_rule(rule_calls) -> None:
    calls = rule_calls
    for form, pool in POOLS.items():
        calls.clear()
        pooled_and_grad(pool, images(True), ours=True)
        assert len(calls) == 1, form


def test_a_tensor_shared_by_all_clients_is_pooled_once() -> None:
    """A pool of a tensor that is not the clients' (captured, not vmapped over): torch's pool of it, once (torch.func
    calls the function itself, not its vmap rule, when none of its inputs is batched)."""
    shared = images(False)[0]
    y = vmap(lambda xc: _pooled(lambda v: F.max_pool2d(shared, 2) + v.sum(), xc))(images(False).nan_to_num(0.0))
    assert y.shape == (K, B, C, H // 2, W // 2)
    assert torch.equal(y[0].nan_to_num(-7.0), (F.max_pool2d(shared, 2) + images(False)[0].nan_to_num(0.0).sum())
                       .nan_to_num(-7.0))


def test_outside_vmap_it_is_torchs_pool() -> None:
    x = images(False)[0].detach().requires_grad_()
    y = _ClientsMaxPool.apply(x, (2, 2, 0, 1, False))
    y_ref = F.max_pool2d(x, 2)
    assert torch.equal(y.nan_to_num(-7.0), y_ref.nan_to_num(-7.0))
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_ref, x, g)[0])


def test_what_it_leaves_to_torch(monkeypatch) -> None:
    """Pools that return their indices, unbatched 3-D inputs and every other op go to torch as they are."""
    monkeypatch.setattr(_ClientsMaxPool, "vmap", staticmethod(lambda *a: pytest.fail("the rule ran")))
    x = images(True)
    with_indices = vmap(lambda xc: _pooled(lambda v: F.max_pool2d(v, 2, return_indices=True)[0], xc))(x)
    assert torch.equal(with_indices.nan_to_num(-7.0), vmap(lambda xc: F.max_pool2d(xc, 2))(x).nan_to_num(-7.0))
    unbatched = vmap(lambda xc: _pooled(lambda v: F.max_pool2d(v[0], 2), xc))(x)
    assert unbatched.shape == (K, C, H // 2, W // 2)
    assert torch.equal(vmap(lambda xc: _pooled(torch.relu, xc))(x).nan_to_num(-7.0), torch.relu(x).nan_to_num(-7.0))


def test_the_engine_calls_the_models_forward_under_the_rule(rule_calls) -> None:
    """FunctionalEngine's vmapped forward runs inside `_ClientPooling` (a model with a pool: the rule runs)."""
    calls = rule_calls
    from edge_client.models import build_model, get_flat
    from edge_client.trainer import TrainTask
    model = build_model("mimic-cnn", (1, 28, 28))
    g = torch.Generator().manual_seed(0)
    data = [(torch.rand(20, 1, 28, 28, generator=g), torch.randint(0, 10, (20,), generator=g)) for _ in range(3)]
    engine = functional.FunctionalEngine(model, data, "cpu", threads=1)
    calls.clear()
    engine.run(get_flat(model), [TrainTask(c, 0, 0.01, 8, steps=2) for c in range(3)])
    assert len(calls) == 2 * 2   # two pools per forward, two steps


# --- per-client mode: big pools on a channels-last copy ---------------------------------------------------------

def big_images(dtype=torch.float32) -> torch.Tensor:
    """[B, C, H, W] NCHW with CHANNELS_LAST_POOL_MIN or more elements per sample, ties and a NaN."""
    g = torch.Generator().manual_seed(2)
    x = torch.relu(torch.randn(3, 40, 16, 14, generator=g, dtype=dtype)).round(decimals=1)
    x[1, 7, 4, 4] = float("nan")
    assert x[0].numel() >= functional.CHANNELS_LAST_POOL_MIN
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", list(POOLS))
def test_channels_last_pool_is_torchs_pool_bit_for_bit(form: str, dtype: torch.dtype) -> None:
    x = big_images(dtype)
    pool = POOLS[form].double() if dtype == torch.float64 and isinstance(POOLS[form], nn.Module) else POOLS[form]
    g = torch.randn(pool(x).shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    results = []
    for ours in (False, True):
        xr = x.clone().requires_grad_()
        mode = functional._LargePooling()
        if ours:
            with mode:
                y = pool(xr)
            assert mode.seen, form
        else:
            y = pool(xr)
        assert y.is_contiguous()
        results.append((y.detach(), torch.autograd.grad(y, xr, g)[0]))
    (y_ref, g_ref), (y, gx) = results
    assert torch.equal(y.isnan(), y_ref.isnan()) and y.isnan().any()
    assert torch.equal(y.nan_to_num(-7.0), y_ref.nan_to_num(-7.0))
    assert torch.equal(gx, g_ref)


def test_small_pools_and_other_calls_are_left_to_torch(monkeypatch) -> None:
    monkeypatch.setattr(functional._ChannelsLastMaxPool, "forward", staticmethod(lambda *a: pytest.fail("ran")))
    mode = functional._LargePooling()
    with mode:
        F.max_pool2d(torch.rand(4, 6, 24, 24), 2)                     # LeNet's first pool: 3,456 per sample
        F.max_pool2d(big_images(), 2, return_indices=True)            # indices asked for
        F.max_pool2d(big_images().contiguous(memory_format=torch.channels_last), 2)   # already channels-last
        torch.relu(big_images())
    assert not mode.seen


class BigPoolCNN(nn.Module):
    """A conv 3→32 3×3 on 3×20×20 then a 2×2 max pool of 32×18×18 = 10,368 elements per sample, a BatchNorm-free
    head with SeededDropout: per-client mode pools it on a channels-last copy."""

    def __init__(self) -> None:
        super().__init__()
        from edge_client.models import SeededDropout
        self.conv, self.pool = nn.Conv2d(3, 32, 3), nn.MaxPool2d(2)
        self.drop, self.fc = SeededDropout(0.25), nn.Linear(32 * 9 * 9, 10)

    def forward(self, x):
        return self.fc(self.drop(self.pool(torch.relu(self.conv(x))).flatten(1)))


def test_per_client_mode_with_big_pools_is_local_train_bit_for_bit() -> None:
    import copy

    from edge_client.models import get_flat
    from edge_client.trainer import TrainTask, local_train
    torch.manual_seed(0)
    model = BigPoolCNN()
    g = torch.Generator().manual_seed(4)
    data = [(torch.relu(torch.randn(n, 3, 20, 20, generator=g)), torch.randint(0, 10, (n,), generator=g))
            for n in (24, 9, 0)]
    engine = functional.PerClientEngine(model, data)
    assert engine.large_pools and engine.details()["channels_last_pools"] is True
    w = get_flat(model)
    tasks = [TrainTask(0, 1, 0.05, 8, epochs=2, seed=3), TrainTask(1, 1, 0.05, 4, steps=5, prox_mu=0.1, seed=3),
             TrainTask(2, 1, 0.05, 8, seed=3)]
    got = engine.run(w, tasks)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t, r in zip(tasks, got):
            ref = local_train(copy.deepcopy(model), w, *data[t.client], t)
            assert torch.equal(r.delta, ref.delta) and r.loss == ref.loss and r.steps == ref.steps
    finally:
        torch.set_num_threads(saved)
    from edge_client.models import build_model
    lenet = build_model("mimic-cnn", (1, 28, 28))
    assert not functional.PerClientEngine(lenet, [(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))]) \
        .large_pools
