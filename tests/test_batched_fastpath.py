"""The batched engine's per-step fast paths give the bits of the plain path they replace.

- The SGD update: where every client has one lr and there is no FedProx term and no SCAFFOLD
  correction, all parameters are updated with one `torch._foreach_add_` call instead of one `add_` per
  parameter. Same arithmetic per tensor, so the weights must be bitwise equal: a zero SCAFFOLD
  correction (g + 0 = g) sends the same round through the per-parameter loop. (The LeNet step by hand
  updates each parameter inside the step instead, with `add_`: no one-call update there.)
- The step tables: each step's index rows, labels, padding weights and batch sizes are sliced from
  tables built once per `train` call; they must equal, element for element, what the per-step
  construction gives (written out here as it was).
- The LeNets' step by hand (`batched._lenet_step`): with both layers fused, each step's forward, loss and
  gradients are computed without autograd, by the ops autograd runs, and each parameter is updated inside the
  step as soon as its gradient is final; the weights and losses must be bitwise those of the autograd path
  (`Group.by_hand = False`), which updates after the step. With plain SGD, a fully connected weight's gradient
  and its step are one pass (`kernels.fc_sgd`), where its bits are the torch ops' (its runtime check: they copy
  one BLAS's summation order, so whether they run depends on the CPU and BLAS build, never asserted here).
- The FedProx / SCAFFOLD update with one lr (`kernels.sgd_update`, through `kernels.sgd_updater`): one fused pass per
  parameter instead of the torch ops g + μ(w − w_global), + c, w.add_(g, alpha=−lr); the weights must be bitwise those
  of the torch ops (`kernels.fused_update` turned off), from one start (a serial slice) and from one start per task
  (lockstep); and with per-task terms (`Group.train(terms=...)`), plain, FedProx and SCAFFOLD clients trained as one
  computation get the bits each gets in a computation of its own kind (how a lockstep sweep merges them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coordinator.sim import batched
from coordinator.sim.batched import BatchedEngine, Group
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, batch_plan, batch_table, client_generator


def _fused() -> bool:
    from coordinator.sim import kernels
    return kernels.available() and kernels.fused_update(kernels.chosen(), torch.float32)


FUSED = _fused()
FUSED_OFF = ("the fused FedProx/SCAFFOLD update is off here: it runs with the native kernels of a variant whose fma "
             "is an instruction (avx512, avx2, aarch64) and whose bits match torch's (kernels.fused_update)")


def _data(sizes: list[int], shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in sizes]


@pytest.mark.parametrize("name", ["mimic-cnn", "fdms-cnn", "mlp"])
def test_one_sgd_call_gives_the_per_parameter_updates_bits(name: str, monkeypatch) -> None:
    sizes = [23, 16, 9, 0, 30]   # a smaller last batch, fewer steps, an empty client
    model = build_model(name, (1, 28, 28), 10, seed=1)
    w = get_flat(model)
    engine = BatchedEngine(model, _data(sizes, (1, 28, 28)), workers=0, device="cpu")   # the CPU's fast path
    fast = [TrainTask(client=c, round=1, lr=0.05, batch_size=8, epochs=2, seed=3) for c in range(len(sizes))]
    zero = torch.zeros_like(w)
    plain = [TrainTask(client=c, round=1, lr=0.05, batch_size=8, epochs=2, seed=3, grad_correction=zero)
             for c in range(len(sizes))]
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    by_hand = Group(model, x, y, [0], [8]).by_hand   # the LeNet step by hand: each add_ inside the step
    calls = []
    foreach = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: calls.append(1) or foreach(*a, **k))
    a = engine.run(w, fast)
    assert bool(calls) != by_hand, "the one-call update did not run" if not by_hand else "the step by hand did not"
    calls.clear()
    b = engine.run(w, plain)
    assert not calls, "the per-parameter update did not run"
    assert [r.steps for r in a] == [r.steps for r in b] and max(r.steps for r in a) > 1
    for ra, rb in zip(a, b):
        assert torch.equal(ra.delta, rb.delta)
        assert ra.loss == rb.loss


def _steps_per_step(group: Group, tasks: list[TrainTask], plans: list, data: list[int]):
    """The per-step construction the step tables replace (batched.py before them), for comparison."""
    width = max([t.batch_size for t, p in zip(tasks, plans) if p], default=1)
    padded = []
    for d, plan in zip(data, plans):
        if not plan:
            padded.append((torch.zeros(0, width, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
            continue
        n = torch.tensor([len(b) for b in plan])
        rows = torch.nn.utils.rnn.pad_sequence(plan, batch_first=True, padding_value=-1)
        if rows.shape[1] < width:
            rows = F.pad(rows, (0, width - rows.shape[1]), value=-1)
        rows = torch.where(rows < 0, rows[:, :1], rows) + group.offsets[d]
        padded.append((rows, n))
    n_steps = [len(p) for p in plans]
    for j in range(max(n_steps, default=0)):
        k = sum(1 for n in n_steps if n > j)
        rows = torch.stack([padded[i][0][j] for i in range(k)])
        sizes = [int(padded[i][1][j]) for i in range(k)]
        weight = (torch.arange(width).unsqueeze(0) < torch.tensor(sizes).unsqueeze(1)).to(group.x_all.dtype)
        yield k, rows, group.y_all[rows], weight, sizes


def test_step_tables_equal_the_per_step_construction() -> None:
    sizes = [21, 8, 0, 13, 5]
    data = _data(sizes, (1, 28, 28))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    model = build_model("mlp", (1, 28, 28), 10, seed=1)
    group = Group(model, torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]), offsets, sizes)
    tasks = [TrainTask(client=0, round=0, lr=0.1, batch_size=4, epochs=2, seed=2),
             TrainTask(client=1, round=0, lr=0.1, batch_size=4, steps=5, seed=2),
             TrainTask(client=2, round=0, lr=0.1, batch_size=4, epochs=1, seed=2),
             TrainTask(client=3, round=0, lr=0.1, batch_size=3, epochs=1, seed=2),
             TrainTask(client=4, round=0, lr=0.1, batch_size=4, steps=1, seed=2)]
    plans = [batch_plan(sizes[t.client], t, client_generator(t.seed, t.round, t.client)) for t in tasks]
    tables = [batch_table(sizes[t.client], t, client_generator(t.seed, t.round, t.client)) for t in tasks]
    order = sorted(range(len(tasks)), key=lambda i: -len(plans[i]))   # as `Group._train` sorts them
    tasks, plans, tables = [tasks[i] for i in order], [plans[i] for i in order], [tables[i] for i in order]
    data_idx = [t.client for t in tasks]
    got = list(group._steps(group._tables(tasks, tables, data_idx)))
    want = list(_steps_per_step(group, tasks, plans, data_idx))
    assert len(got) == len(want) == max(len(p) for p in plans)
    for step, (k, rows, y, weight, n) in zip(got, want):
        assert isinstance(step, batched._Step) and step.k == k and step.sizes == n
        assert torch.equal(step.rows, rows) and torch.equal(step.y, y) and torch.equal(step.weight, weight)
        assert torch.equal(step.size, torch.tensor(n, dtype=group.x_all.dtype))


@pytest.mark.skipif(not __import__("coordinator.sim.kernels", fromlist=["x"]).available(),
                    reason="the step by hand runs only with the fused kernels")
@pytest.mark.parametrize("name,shape,dtype", [("mimic-cnn", (1, 28, 28), torch.float32),
                                              ("mimic-cnn", (1, 28, 28), torch.float64),
                                              ("cifar-lenet", (3, 32, 32), torch.float32)])
def test_the_lenet_step_by_hand_gives_autograd_s_bits(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    sizes = [40, 23, 16, 9, 0, 30]   # smaller last batches, fewer steps, an empty client
    data = [(x.to(dtype), y) for x, y in _data(sizes, shape)]
    x_all, y_all = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    model = build_model(name, shape, 10, seed=1).to(dtype)
    w = get_flat(model)
    corr = 0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    rounds = {   # one lr (the one-call update), several lrs with FedProx, a SCAFFOLD correction
        "plain": [TrainTask(client=c, round=1, lr=0.05, batch_size=8, epochs=2, seed=3) for c in range(len(sizes))],
        "prox": [TrainTask(client=c, round=1, lr=0.02 + 0.01 * c, batch_size=8, epochs=1, seed=3, prox_mu=0.1 * (c % 2))
                 for c in range(len(sizes))],
        "scaffold": [TrainTask(client=c, round=1, lr=0.05, batch_size=8, steps=3, seed=3, grad_correction=corr)
                     for c in range(len(sizes))]}
    from coordinator.sim import kernels
    one_pass: list[bool] = []   # what kernels.fc_sgd did, step by step (the weights it updated in one pass)
    native_fc: list[bool] = []  # whether each Group.train ran the fully connected layers' steps natively
    whole: list[bool] = []      # whether a round ran in one native call (`kernels.LeNetStep.steps`)

    def fc_sgd(*args, **kwargs) -> bool:
        one_pass.append(real(*args, **kwargs))
        return one_pass[-1]

    def make(*args, **kwargs):
        made = real_make(*args, **kwargs)
        native_fc.append(made is not None and made.steps)
        return made
    def steps(self, *args, **kwargs):
        whole.append(True)
        return real_steps(self, *args, **kwargs)
    real, real_make, real_steps = kernels.fc_sgd, kernels.FcLayers.make, kernels.LeNetStep.steps
    for kind, tasks in rounds.items():
        out = {}
        for by_hand in (True, False):
            group = Group(model, x_all, y_all, offsets, sizes, threads=1)
            assert group.by_hand, "the LeNet with both fused layers takes the step by hand"
            group.by_hand = by_hand
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(kernels, "fc_sgd", fc_sgd)
                mp.setattr(kernels.FcLayers, "make", staticmethod(make))
                mp.setattr(kernels.LeNetStep, "steps", steps)
                out[by_hand] = group.train(w, tasks)
        for a, b in zip(out[True], out[False]):
            assert torch.equal(a.delta, b.delta) and a.loss == b.loss and a.steps == b.steps
        if kind == "plain":   # the native layers ran exactly where their runtime checks pass on this machine
            exact = _fc_exact(model, dtype, batch=8)
            assert any(native_fc) == exact, f"native fully connected layers ran: {any(native_fc)}, exact: {exact}"
            one_call = (exact and dtype == torch.float32 and kernels.loss_exact(kernels.chosen(), 10)
                        and kernels.fused_update(kernels.chosen(), dtype))
            assert bool(whole) == one_call, f"the round in one native call ran: {bool(whole)}, expected: {one_call}"
        if kind != "plain":
            assert not one_pass and not any(native_fc) and not whole, \
                "the one-pass weight step and native steps are plain SGD's only"
        one_pass.clear()
        native_fc.clear()
        whole.clear()


def _fc_exact(model: torch.nn.Module, dtype: torch.dtype, batch: int) -> bool:
    """Whether the runtime check (`kernels.fc_layer_exact`) passes for every fully connected layer of `model` at
    `batch` rows on this machine: where the native layers give the torch ops' bits (they copy one BLAS's order,
    which another CPU or BLAS build need not have)."""
    from coordinator.sim import kernels
    return all(kernels.fc_layer_exact(kernels.chosen(), dtype, batch, m.in_features, m.out_features)
               for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_models_without_both_fused_layers_use_autograd() -> None:
    x, y = torch.rand(20, 1, 28, 28), torch.randint(0, 10, (20,))
    assert not Group(build_model("fdms-cnn", (1, 28, 28)), x, y, [0], [20], native=True).by_hand
    assert not Group(build_model("mimic-cnn", (1, 28, 28)), x, y, [0], [20], native=False).by_hand
    assert not Group(build_model("mlp", (1, 28, 28)), x, y, [0], [20]).by_hand


@pytest.mark.skipif(not FUSED, reason=FUSED_OFF)
@pytest.mark.parametrize("name,dtype", [("mimic-cnn", torch.float32), ("mimic-cnn", torch.float64),
                                        ("fdms-cnn", torch.float32)])
def test_the_fused_fedprox_scaffold_update_gives_the_torch_ops_bits(name: str, dtype: torch.dtype,
                                                                      monkeypatch) -> None:
    from coordinator.sim import kernels
    sizes = [40, 23, 16, 9, 0, 30]   # smaller last batches, fewer steps, an empty client
    data = [(x.to(dtype), y) for x, y in _data(sizes, (1, 28, 28))]
    x_all, y_all = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    model = build_model(name, (1, 28, 28), 10, seed=1).to(dtype)
    w = get_flat(model)
    g = torch.Generator().manual_seed(2)
    corr = [0.01 * torch.randn(w.shape, generator=g, dtype=dtype) for _ in sizes]
    starts = torch.stack([w, w + 0.01 * torch.randn(w.shape, generator=g, dtype=dtype)])
    rounds = {   # FedProx (μ = 0 for one client: its term adds 0), SCAFFOLD, both
        "prox": [TrainTask(client=c, round=1, lr=0.05, batch_size=8, epochs=1, seed=3, prox_mu=0.1 * (c % 3))
                 for c in range(len(sizes))],
        "scaffold": [TrainTask(client=c, round=1, lr=0.05, batch_size=8, steps=3, seed=3, grad_correction=corr[c])
                     for c in range(len(sizes))],
        "both": [TrainTask(client=c, round=2, lr=0.03, batch_size=8, steps=4, seed=5, prox_mu=0.01,
                           grad_correction=corr[c]) for c in range(len(sizes))]}
    calls = []
    update = kernels.sgd_updater
    monkeypatch.setattr(kernels, "sgd_updater", lambda *a, **k: calls.append(1) or update(*a, **k))
    group = Group(model, x_all, y_all, offsets, sizes, threads=1)
    for tasks in rounds.values():
        for start in (None, [c % 2 for c in range(len(sizes))]):
            w0 = w if start is None else starts
            calls.clear()
            fused = group.train(w0, tasks, start=start)
            assert calls, "the fused update did not run"
            monkeypatch.setattr(kernels, "fused_update", lambda *a: False)
            calls.clear()
            ops = group.train(w0, tasks, start=start)
            assert not calls, "the torch ops did not run"
            monkeypatch.undo()
            monkeypatch.setattr(kernels, "sgd_updater", lambda *a, **k: calls.append(1) or update(*a, **k))
            for a, b in zip(fused, ops):
                assert torch.equal(a.delta, b.delta) and a.loss == b.loss and a.steps == b.steps


@pytest.mark.skipif(not FUSED, reason=FUSED_OFF)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_fedprox_and_scaffold_clients_merged_with_terms_keep_their_bits(dtype: torch.dtype) -> None:
    sizes = [40, 23, 16, 9, 30, 33]   # smaller last batches, different step counts
    data = [(x.to(dtype), y) for x, y in _data(sizes, (1, 28, 28))]
    x_all, y_all = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    model = build_model("mimic-cnn", (1, 28, 28), 10, seed=1).to(dtype)
    w = get_flat(model)
    g = torch.Generator().manual_seed(4)
    starts = torch.stack([w + 0.01 * torch.randn(w.shape, generator=g, dtype=dtype) for _ in range(3)])
    corr = [0.01 * torch.randn(w.shape, generator=g, dtype=dtype) for _ in sizes]
    group = Group(model, x_all, y_all, offsets, sizes, threads=1)

    def task(c: int, kind: str) -> TrainTask:
        return TrainTask(client=c, round=2, lr=0.04, batch_size=8, epochs=1, seed=7,
                         prox_mu=0.05 if kind == "prox" else 0.0,
                         grad_correction=corr[c] if kind == "scaffold" else None)
    kinds = {"plain": (0, [0, 3]), "prox": (1, [1, 4]), "scaffold": (2, [2, 5])}   # terms, clients
    alone = {}
    for kind, (_, clients) in kinds.items():   # each kind as a computation of its own (the serial slices)
        out = group.train(starts, [task(c, kind) for c in clients], start=[c % 3 for c in clients])
        alone |= {c: r for c, r in zip(clients, out)}
    order = [5, 0, 4, 1, 3, 2]   # interleaved kinds, one computation
    kind_of = {c: k for k, (_, cs) in kinds.items() for c in cs}
    merged = group.train(starts, [task(c, kind_of[c]) for c in order], start=[c % 3 for c in order],
                         terms=[kinds[kind_of[c]][0] for c in order])
    for c, r in zip(order, merged):
        assert torch.equal(r.delta, alone[c].delta) and r.loss == alone[c].loss and r.steps == alone[c].steps, c
