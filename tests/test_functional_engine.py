"""The generic batched engine (coordinator/sim/functional.py, torch.func) gives the reference loop's updates
(`local_train`) for models without a hand-written batched forward.

Contract tested here, per model (a small MLP with element dropout, a small CNN with channel dropout and max-pool,
a small ResNet with BatchNorm and a strided shortcut):
- float64, one round mixing a smaller last batch, fixed steps with FedProx, two epochs with SCAFFOLD, another lr,
  an empty client and three epochs: delta, loss, steps and samples = the loop's, deltas to 1e-10 (observed ~1e-16);
- BatchNorm's per-client buffers = the buffers the loop leaves in a fresh model after that client's round (1e-12);
- float32, batch 16: deltas to 1e-5 of the loop's (observed ~1e-8; the batched kernels sum in another order);
- the same round twice gives the same bits;
- SimTransport trains such a model on this engine and records "batched (torch.func)"; `engine="loop"` still
  forces the loop; a forward torch.func cannot run leaves the model on the loop, with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coordinator.sim import kernels
from coordinator.sim.batched import BatchedEngine, Evaluator
from coordinator.sim.functional import GENERIC_SLICES, FunctionalEngine, GenericEngine
from coordinator.sim.transport import SimTransport
from edge_client.models import SeededDropout, build_model, get_flat
from edge_client.trainer import TrainTask, local_train

F64_TOL = 1e-10
F32_TOL = 1e-5


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 32), nn.Linear(32, 10)
        self.drop = SeededDropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x.flatten(1)))))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.d2 = SeededDropout(0.25, channel=True)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.c1(x)), 2)
        x = F.max_pool2d(torch.relu(self.d2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
        self.c2, self.b2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.short = nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.short(x))


class TinyResNet(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.l1, self.l2 = Block(width, width, 1), Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, 10)

    def forward(self, x):
        h = self.l2(self.l1(torch.relu(self.bn(self.stem(x)))))
        return self.fc(h.mean((2, 3)))


MODELS = {"mlp": (TinyMLP, (1, 8, 8)), "cnn": (TinyCNN, (1, 14, 14)), "resnet": (TinyResNet, (3, 8, 8))}


def make(name: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[int, ...]]:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    return cls().to(dtype), shape


def make_data(sizes: list[int], shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, *shape, generator=g).to(dtype), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


def mixed_tasks(w: torch.Tensor, batch: int) -> list[TrainTask]:
    """0: one epoch (smaller last batch); 1: fixed steps + FedProx; 2: two epochs + SCAFFOLD, another lr;
    3: no data; 4: three epochs of a data set smaller than a batch."""
    corr = torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=w.dtype) * 0.01
    return [TrainTask(client=0, round=2, lr=0.05, batch_size=batch, epochs=1, seed=5),
            TrainTask(client=1, round=2, lr=0.05, batch_size=batch, steps=5, prox_mu=0.5, seed=5),
            TrainTask(client=2, round=2, lr=0.03, batch_size=batch, epochs=2, grad_correction=corr, seed=5),
            TrainTask(client=3, round=2, lr=0.05, batch_size=batch, epochs=1, seed=5),
            TrainTask(client=4, round=2, lr=0.05, batch_size=batch, epochs=3, seed=5)]


def loop(model: nn.Module, w: torch.Tensor, data, task: TrainTask):
    """The reference on a fresh copy of the model (its buffers as the engine's start: see the module docstring)."""
    m = copy.deepcopy(model)
    return local_train(m, w, *data[task.client], task), m


@pytest.mark.parametrize("name", list(MODELS))
def test_float64_equals_the_loop(name: str) -> None:
    model, shape = make(name, torch.float64)
    w = get_flat(model)
    data = make_data([19, 32, 8, 0, 5], shape, torch.float64)
    tasks = mixed_tasks(w, 8)
    engine = FunctionalEngine(model, data, device="cpu")
    got = engine.run(w, tasks)
    assert [r.steps for r in got] == [3, 5, 2, 0, 3]
    for i, task in enumerate(tasks):
        ref, m = loop(model, w, data, task)
        assert (got[i].steps, got[i].num_samples) == (ref.steps, ref.num_samples)
        assert torch.allclose(got[i].delta, ref.delta, atol=F64_TOL, rtol=0)
        assert got[i].loss == pytest.approx(ref.loss, abs=1e-12)
        for n, b in m.named_buffers():   # BatchNorm: this client's running statistics and step count
            assert torch.allclose(engine.last_buffers[n][i].to(b.dtype), b, atol=1e-12, rtol=0), n
    if name == "resnet":
        assert int(engine.last_buffers["bn.num_batches_tracked"][1]) == 5


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_within_tolerance_and_deterministic(name: str) -> None:
    model, shape = make(name, torch.float32)
    w = get_flat(model)
    data = make_data([40, 23, 16, 7], shape, torch.float32, seed=3)
    tasks = [TrainTask(client=c, round=1, lr=0.05, batch_size=16, epochs=2, seed=9) for c in range(4)]
    engine = FunctionalEngine(model, data, device="cpu")
    first, again = engine.run(w, tasks), engine.run(w, tasks)
    for i, task in enumerate(tasks):
        ref, _ = loop(model, w, data, task)
        assert first[i].steps == ref.steps
        assert torch.allclose(first[i].delta, ref.delta, atol=F32_TOL, rtol=0)
        assert first[i].loss == pytest.approx(ref.loss, abs=1e-5)
        assert torch.equal(first[i].delta, again[i].delta) and first[i].loss == again[i].loss


def test_dropout_masks_come_from_each_clients_generator() -> None:
    """Two clients on the same data differ only by their generator: their updates differ, and each is the loop's."""
    model, shape = make("mlp", torch.float64)
    w = get_flat(model)
    x, y = make_data([16], shape, torch.float64)[0]
    data = [(x, y), (x.clone(), y.clone())]
    tasks = [TrainTask(client=c, round=0, lr=0.1, batch_size=16, steps=1, seed=0) for c in (0, 1)]
    got = FunctionalEngine(model, data, device="cpu").run(w, tasks)
    assert not torch.allclose(got[0].delta, got[1].delta)
    for i, task in enumerate(tasks):
        assert torch.allclose(got[i].delta, loop(model, w, data, task)[0].delta, atol=F64_TOL, rtol=0)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_masks_drawn_on_threads_are_the_masks_drawn_in_turn(name: str) -> None:
    """On a GPU the clients' dropout masks are drawn on a pool of threads (`draw_threads`); each client's generator
    has its own state, so the round's bits are those of drawing client after client (checked here on the CPU, the
    threads forced: float32, clients of different sizes so that the batches and size groups differ)."""
    model, shape = make(name, torch.float32)
    w = get_flat(model)
    data = make_data([40, 23, 16, 7, 31], shape, torch.float32, seed=8)
    tasks = [TrainTask(client=c, round=3, lr=0.05, batch_size=8, epochs=1, seed=4) for c in range(5)]
    in_turn = FunctionalEngine(model, data, device="cpu")
    threaded = FunctionalEngine(model, data, device="cpu")
    assert in_turn.draw_threads == 0 and in_turn.drops   # the model has dropout, drawn in this thread on the CPU
    threaded.draw_threads = 4
    try:
        a, b = in_turn.run(w, tasks), threaded.run(w, tasks)
        assert threaded._drawers is not None   # the threads did draw
    finally:
        threaded.close()
    assert threaded._drawers is None
    for x, y in zip(a, b):
        assert torch.equal(x.delta, y.delta) and x.loss == y.loss


def test_the_transport_trains_other_models_on_it() -> None:
    model, shape = make("resnet", torch.float32)
    w = get_flat(model)
    data = make_data([12, 20, 9], shape, torch.float32, seed=4)
    tasks = [TrainTask(client=c, round=0, lr=0.05, batch_size=8, epochs=1, seed=2) for c in (2, 0, 1)]
    transport = SimTransport(copy.deepcopy(model), data, device="cpu")   # (auto: a GPU where there is one)
    assert isinstance(transport.batched, GenericEngine)
    assert transport.describe() == "batched (torch.func)"
    line, fields = transport.summary()
    assert "torch.func" in line and fields["generic"] and fields["slices"] == GENERIC_SLICES
    got, _ = transport.run_round(0, w, tasks)
    assert transport.round_info() == {"engine": "batched (torch.func)"}
    ref, _ = SimTransport(copy.deepcopy(model), data, "loop").run_round(0, w, tasks)
    assert list(got) == list(ref) == [2, 0, 1]
    for c in ref:   # the loop's model carries BatchNorm buffers from client to client: they never reach a delta
        assert got[c].steps == ref[c].steps
        assert torch.allclose(got[c].delta, ref[c].delta, atol=F32_TOL, rtol=0)
    looped = SimTransport(copy.deepcopy(model), data, "loop")
    assert looped.batched is None and looped.describe() == "loop"
    # the shipped models keep their hand-written engine
    lenet = SimTransport(build_model("mimic-cnn", (1, 28, 28), 10, seed=1), make_data([4], (1, 28, 28), torch.float32))
    try:
        assert isinstance(lenet.batched, BatchedEngine)
    finally:
        lenet.close()
    # nor does the evaluation look for fused kernels the model does not have
    assert not Evaluator(model, data[0][0], data[0][1]).available()


def test_a_forward_torch_func_cannot_run_stays_on_the_loop() -> None:
    class Branchy(nn.Module):   # data-dependent control flow: vmap cannot batch it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) if float(x.sum()) > 0 else -self.fc(x)

    with pytest.raises(TypeError, match="torch.func cannot train Branchy"):
        FunctionalEngine(Branchy(), make_data([4], (4,), torch.float32))
    transport = SimTransport(Branchy(), make_data([4], (4,), torch.float32))
    assert transport.batched is None and transport.describe() == "loop (no batched forward for Branchy)"


def test_the_slices_give_the_same_bits_in_workers_and_in_this_process(caplog) -> None:
    """GenericEngine (what SimTransport runs): the round in GENERIC_SLICES slices fixed by the tasks, so 2 worker
    processes and none give the same bits; a model that does not pickle runs its slices here, said once."""
    model, shape = make("resnet", torch.float32)
    w = get_flat(model)
    data = make_data([12, 20, 9, 16, 5], shape, torch.float32, seed=4)
    tasks = [TrainTask(client=c, round=1, lr=0.05, batch_size=8, epochs=1, seed=2) for c in (3, 0, 4, 1, 2)]
    start = {n: b.detach().clone() + 0.5 for n, b in model.named_buffers()}
    here = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=0)
    pooled = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=2)
    try:
        assert (here.details()["workers"], pooled.details()["workers"]) == (0, 2)
        assert [len(p) for p in here.slices(tasks)] == [2, 3]
        a, b = here.run(w, tasks, buffers=start), pooled.run(w, tasks, buffers=start)
    finally:
        pooled.close()
    for x, y in zip(a, b):
        assert torch.equal(x.delta, y.delta) and x.steps == y.steps and x.loss == y.loss
        assert all(torch.equal(x.buffers[n], y.buffers[n]) for n in x.buffers)
    for task, r in zip(tasks, a):   # and each slice is the loop's result to the stated tolerance
        ref, _ = loop(model, w, data, task)
        assert torch.allclose(r.delta, ref.delta, atol=F32_TOL, rtol=0)

    class Local(nn.Module):   # defined in a function: pickle cannot name it, so no worker can build it
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3 * 8 * 8, 10)

        def forward(self, x):
            return self.fc(x.flatten(1))

    torch.manual_seed(0)
    local = Local()
    with caplog.at_level("WARNING", logger="dropfl.sim"):
        engine = GenericEngine(local, data, device="cpu", workers=2)
    assert engine.details()["workers"] == 0 and "Local does not pickle" in engine.details()["in_process"]
    assert [r.message for r in caplog.records].count(
        f"the generic engine runs its {GENERIC_SLICES} slices in this process, one after the other: "
        f"{engine.details()['in_process']}") == 1
    w2 = get_flat(local)
    got = engine.run(w2, tasks)
    ref = GenericEngine(copy.deepcopy(local), data, device="cpu", workers=0).run(w2, tasks)
    assert all(torch.equal(x.delta, y.delta) for x, y in zip(got, ref))


def test_float32_batchnorm_as_close_to_float64_as_the_loop() -> None:
    """A ResNet with BatchNorm at CIFAR size (width 16, 3×32×32, batch 32, 2 steps; the example ResNet-8's
    layers): the engine's float32 updates are within 1e-5 of the loop's, and over the clients as far from the
    float64 result as the loop's (median over 4 clients at most 2× + 1e-7). Where the BatchNorm input stayed
    channels-last (before `channels_last.nchw_input`), torch's less precise channels-last BatchNorm backward put every
    client 30-400× farther from float64 than the loop (3e-5 to 6e-5 of updates ~1e-2; 8e-6 to 1.4e-5 here) and this
    fails. One client alone can be farther: with torch's AVX2 or portable kernels (ATEN_CPU_CAPABILITY=avx2 or
    default, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2 on an AVX-512 machine, 1 thread) one of the 4 was
    2.8e-6 or 4.2e-6 from float64 where the loop was 1e-7 or 9e-7, and the loop itself was 2e-6 from it for another:
    float32 rounding decides some step differently in either path, hence the median."""
    torch.manual_seed(0)
    m32 = TinyResNet(width=16)
    m64 = copy.deepcopy(m32).double()
    data32 = make_data([64] * 4, (3, 32, 32), torch.float32, seed=3)
    data64 = [(x.double(), y) for x, y in data32]
    tasks = [TrainTask(client=c, round=1, lr=0.05, batch_size=32, steps=2, seed=9) for c in range(4)]
    got = FunctionalEngine(m32, data32, device="cpu").run(get_flat(m32), tasks)
    gen_err, loop_err = [], []
    for t in tasks:
        ref32, _ = loop(m32, get_flat(m32), data32, t)
        ref64, _ = loop(m64, get_flat(m64), data64, t)
        assert torch.allclose(got[t.client].delta, ref32.delta, atol=F32_TOL, rtol=0)
        gen_err.append((got[t.client].delta.double() - ref64.delta).abs().max().item())
        loop_err.append((ref32.delta.double() - ref64.delta).abs().max().item())
    median = lambda v: float(torch.tensor(v).median())   # noqa: E731
    assert median(gen_err) <= 2 * median(loop_err) + 1e-7, (gen_err, loop_err)


def test_the_mode_follows_the_models_flops_per_sample_never_timings() -> None:
    """`choose_mode`, a rule on the model's training FLOPs per sample (benchmarks/results/generic_mode.md): vmap for
    the small models; vmap for a convolutional model under PER_CLIENT_FLOPS_PER_SAMPLE (mimic-cnn's LeNet), but
    per-client from there on (a width-16 ResNet at 3×32×32); per-client for a model of linear layers from
    PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE on (dropfl's mlp); the same answer every time; vmap on a GPU."""
    from coordinator.sim.functional import (
        PER_CLIENT_FLOPS_PER_SAMPLE,
        PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE,
        choose_mode,
        training_flops,
    )
    cpu = torch.device("cpu")
    for name in MODELS:
        model, shape = make(name, torch.float32)
        x = torch.rand(2, *shape)
        assert training_flops(model, x)[0] < PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE
        assert choose_mode(model, x, cpu)[0] == "vmap"
    lenet, x = build_model("mimic-cnn", (1, 28, 28)), torch.rand(2, 1, 28, 28)
    f, conv = training_flops(lenet, x)
    assert PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE < f < PER_CLIENT_FLOPS_PER_SAMPLE and conv > f / 2
    assert choose_mode(lenet, x, cpu)[0] == "vmap"
    mlp = build_model("mlp", (1, 28, 28))
    f, conv = training_flops(mlp, x)
    assert f >= PER_CLIENT_LINEAR_FLOPS_PER_SAMPLE and conv == 0
    mode, why = choose_mode(mlp, x, cpu)
    assert mode == "per-client" and "0% in convolutions" in why
    torch.manual_seed(0)
    big, x = TinyResNet(width=16), torch.rand(2, 3, 32, 32)
    assert training_flops(big, x)[0] >= PER_CLIENT_FLOPS_PER_SAMPLE
    modes = {choose_mode(big, x, cpu) for _ in range(3)}
    assert len(modes) == 1 and next(iter(modes))[0] == "per-client" and "MFLOP per sample" in next(iter(modes))[1]
    assert choose_mode(big, x, torch.device("cuda"))[0] == "vmap"


@pytest.mark.parametrize("layout", ["channels-last", "NCHW"])
@pytest.mark.parametrize("workers,cores", [(0, 2), (2, 2), (0, 5), (0, 40)])
def test_per_client_mode_is_local_train_on_one_thread_bit_for_bit(workers: int, cores: int, layout: str,
                                                                   monkeypatch) -> None:
    """Per-client mode (a model above the FLOP rule's line): each client's delta, loss, steps and BatchNorm buffers are
    `local_train`'s on one thread from the global weights and buffers, bit for bit, whatever its slice, the number
    of slices (one per core, at most 16: 5 on a 5-core machine, 16 on a 40-core one) and the number of workers;
    FedProx, SCAFFOLD, several epochs and an empty client included (`mixed_tasks`). This BatchNorm ResNet trains on
    its channels-last copy (`channels_last_copy`; the images as they are); with DROPFL_CHANNELS_LAST=0 on the model
    itself (NCHW)."""
    from coordinator.sim import functional
    from coordinator.sim.channels_last import channels_last_copy
    from coordinator.sim.functional import GenericEngine, PerClientEngine
    monkeypatch.setattr(functional, "cpus", lambda: cores)
    if layout == "NCHW":
        monkeypatch.setenv("DROPFL_CHANNELS_LAST", "0")   # the workers inherit it
    elif not kernels.available():
        pytest.skip(f"channels-last needs the native kernels, which do not build here ({kernels.error()})")
    torch.manual_seed(0)
    model = TinyResNet(width=16)
    w = get_flat(model)
    data = make_data([19, 32, 8, 0, 5], (3, 32, 32), torch.float32, seed=6)
    tasks = mixed_tasks(w, 8)
    start = {n: b.detach().clone() + 0.25 for n, b in model.named_buffers()}
    engine = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=workers)
    try:
        assert engine.mode == "per-client" and isinstance(engine.local, PerClientEngine)
        name = "batched (per client, channels-last)" if layout == "channels-last" else "batched (per client)"
        assert engine.describe() == name and engine.details()["workers"] == workers
        assert engine.details()["layout"] == layout
        assert engine.details()["slices"] == min(max(GENERIC_SLICES, cores), 16)   # one per core, at most 16
        got = engine.run(w, tasks, buffers=start)
    finally:
        engine.close()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for task, r in zip(tasks, got):
            m = channels_last_copy(model) if layout == "channels-last" else copy.deepcopy(model)
            ref = local_train(m, w, *data[task.client], task, buffers=start)
            assert torch.equal(r.delta, ref.delta) and (r.loss, r.steps, r.num_samples) == \
                (ref.loss, ref.steps, ref.num_samples)
            assert all(torch.equal(r.buffers[n], ref.buffers[n]) for n in ref.buffers)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("mode", ["per-client", "vmap"])
def test_the_workers_deltas_come_back_through_blocks_the_engine_keeps(mode: str) -> None:
    """With worker processes each slice's deltas are written into a shared-memory block the engine keeps from round to
    round (`_DeltaBlocks`): after a failed round, over rounds of 3, then 7 (its blocks grow), then 2 tasks, every
    result is the in-process engine's bit for bit, owns its delta (not a view of a block) and keeps it when later
    rounds overwrite the blocks."""
    torch.manual_seed(0)
    model, shape = (TinyResNet(width=16), (3, 32, 32)) if mode == "per-client" else make("resnet", torch.float32)
    data = make_data([10, 12, 9, 16, 5, 8, 11], shape, torch.float32, seed=3)
    w = get_flat(model)
    rounds = [[TrainTask(client=c, round=r, lr=0.05, batch_size=4, steps=2, seed=1) for c in clients]
              for r, clients in enumerate([(0, 1, 2), (6, 5, 4, 3, 2, 1, 0), (3, 4)])]
    pooled = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=2, mode=mode)
    here = GenericEngine(copy.deepcopy(model), data, device="cpu", workers=0, mode=mode)
    try:
        # a slice that fails (batch size 0) fails the round; the other slice's worker is waited for, and the next
        # rounds through the same blocks are right
        broken = [TrainTask(client=0, round=9, lr=0.05, batch_size=0, steps=2), rounds[0][1]]
        with pytest.raises(ZeroDivisionError):
            pooled.run(w, broken)
        kept, sizes = [], []
        for tasks in rounds:
            got = pooled.run(w, tasks)
            kept.append((got, [r.delta.clone() for r in got], here.run(w, tasks)))
            sizes.append({k: b.shape[0] for k, b in pooled.blocks.blocks.items()})
        block_storages = {b.untyped_storage().data_ptr() for b in pooled.blocks.blocks.values()}
    finally:
        pooled.close()
    assert sizes == [{0: 1, 1: 2}, {0: 3, 1: 4}, {0: 3, 1: 4}]   # grown once (from the failed round's 1 and 1), kept
    for got, copies, ref in kept:
        for r, c, x in zip(got, copies, ref):
            assert torch.equal(r.delta, c) and torch.equal(r.delta, x.delta) and (r.loss, r.steps) == (x.loss, x.steps)
            assert not r.delta.is_shared() and r.delta.untyped_storage().data_ptr() not in block_storages
            assert r.delta.untyped_storage().nbytes() == r.delta.numel() * r.delta.element_size()
            # the buffers came back by value (`by_value`), not in a shared-memory file each
            assert r.buffers.keys() == x.buffers.keys() and all(
                torch.equal(b, x.buffers[n]) and b.dtype == x.buffers[n].dtype and not b.is_shared()
                for n, b in r.buffers.items())


def test_buffers_cross_to_and_from_the_workers_by_value_with_their_bits() -> None:
    """`by_value`: a small buffer as a numpy array (pickled into the stream, no shared-memory file), back as a tensor
    with the same dtype, shape and bits (a 0-dim count, a non-contiguous view, NaN and -0.0 included); a buffer of
    BY_VALUE_BELOW bytes or more, or of a dtype numpy lacks (bfloat16), stays a tensor; None stays None."""
    import pickle

    import numpy as np

    from coordinator.sim.functional import BY_VALUE_BELOW, by_value, from_value
    big = torch.zeros(BY_VALUE_BELOW // 4)
    bufs = {"mean": torch.tensor([1.5, float("nan"), -0.0, 3e-39]), "count": torch.tensor(7),
            "strided": torch.arange(12.0, dtype=torch.float64).reshape(3, 4)[:, ::2], "bf16": torch.ones(3).bfloat16(),
            "big": big}
    sent = by_value(bufs)
    assert {k for k, v in sent.items() if isinstance(v, np.ndarray)} == {"mean", "count", "strided"}
    assert sent["big"] is big and isinstance(sent["bf16"], torch.Tensor)
    back = from_value(pickle.loads(pickle.dumps({k: v for k, v in sent.items() if k != "big"})))
    for k, v in back.items():
        assert v.dtype == bufs[k].dtype and v.shape == bufs[k].shape
        assert torch.equal(v.view(-1).view(torch.uint8) if v.dtype != torch.bfloat16 else v,
                           bufs[k].contiguous().view(-1).view(torch.uint8) if v.dtype != torch.bfloat16 else bufs[k])
    assert by_value(None) is None and from_value(None) is None


def test_the_transport_records_per_client_mode() -> None:
    """SimTransport on a model above the rule's line: the generic engine in per-client mode, its name in the run's
    records, and the round's updates within float tolerance of the loop (2 threads there, 1 here)."""
    torch.manual_seed(0)
    model = TinyResNet(width=16)
    data = make_data([16, 16, 16], (3, 32, 32), torch.float32, seed=1)
    transport = SimTransport(copy.deepcopy(model), data, engine="batched", device="cpu")
    try:
        layout = ", channels-last" if kernels.available() else ""   # (it needs the native kernels)
        assert transport.describe() == f"batched (per client{layout})"
        assert transport.batched.details()["mode"] == "per-client"
        assert "each client after client" in transport.summary()[0] and "does not pay" in transport.summary()[0]
        said = "on a channels-last copy (Conv2d with BatchNorm2d; BatchNorm summed in double" in transport.summary()[0]
        assert said == kernels.available()
    finally:
        transport.batched.close()


def test_closing_the_generic_engine_stops_its_mask_drawing_threads() -> None:
    """GenericEngine.close stops what its in-process engine started (on a GPU the threads that draw the masks;
    forced here on the CPU) as well as its worker processes."""
    model, shape = make("mlp", torch.float32)
    data = make_data([12, 9, 8, 10], shape, torch.float32, seed=2)
    engine = GenericEngine(model, data, device="cpu", workers=0, mode="vmap")
    engine.local.draw_threads = 2   # (2 slices of 2 clients: each slice's masks drawn on the threads)
    engine.run(get_flat(model), [TrainTask(client=c, round=0, lr=0.1, batch_size=4, steps=2, seed=1) for c in range(4)])
    assert engine.local._drawers is not None
    engine.close()
    assert engine.local._drawers is None
