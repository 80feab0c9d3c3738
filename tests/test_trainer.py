import pytest
import torch

from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, batch_plan, batch_table, client_generator, local_train


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_local_train_never_writes_global_and_returns_real_delta():
    m = build_model("mimic-cnn", (1, 28, 28))
    w = get_flat(m)
    w_before = w.clone()
    x, y = _data()
    r = local_train(m, w, x, y, TrainTask(client=0, round=0, lr=0.1, batch_size=8, epochs=1))
    assert torch.equal(w, w_before)  # the global model is untouched
    assert r.steps == 5 and float(r.delta.abs().sum()) > 0
    assert torch.allclose(w - get_flat(m), r.delta)


def test_same_task_same_update_and_plan_counts():
    m = build_model("fdms-cnn", (1, 28, 28))  # has dropout: masks come from the client generator
    w = get_flat(m)
    x, y = _data()
    task = TrainTask(client=3, round=2, lr=0.05, batch_size=8, steps=7, seed=1)
    a, b = local_train(m, w, x, y, task), local_train(m, w, x, y, task)
    assert torch.equal(a.delta, b.delta) and a.steps == 7
    other = local_train(m, w, x, y, TrainTask(client=4, round=2, lr=0.05, batch_size=8, steps=7, seed=1))
    assert not torch.equal(a.delta, other.delta)
    plan = batch_plan(10, TrainTask(0, 0, 0.1, batch_size=4, epochs=2), client_generator(0, 0, 0))
    assert [len(b) for b in plan] == [4, 4, 2, 4, 4, 2]  # drop_last=False, two passes
    assert sorted(torch.cat(plan[:3]).tolist()) == list(range(10))


def _plan_before(n: int, task: TrainTask, gen: torch.Generator) -> list[torch.Tensor]:
    """batch_plan as it was written before batch_table (one slice per batch): the reference."""
    if n == 0:
        return []
    batches: list[torch.Tensor] = []
    limit = task.steps if task.steps is not None else (task.epochs or 0) * -(-n // task.batch_size)
    while len(batches) < limit:
        perm = torch.randperm(n, generator=gen)
        batches.extend(perm[i:i + task.batch_size] for i in range(0, n, task.batch_size))
    return batches[:limit]


@pytest.mark.parametrize("n,bs,epochs,steps", [(10, 4, 2, None), (12, 4, 1, None), (3, 8, 2, None), (0, 4, 1, None),
                                               (10, 4, None, 7), (10, 4, None, 0), (2000, 16, 5, None),
                                               (7, 7, 3, None), (9, 4, 0, None), (5, 2, None, 11)])
def test_batch_table_is_the_plan_and_leaves_the_generator_where_the_plan_did(n, bs, epochs, steps):
    """The batched engine reads batch_table; local_train reads batch_plan: both are the old per-slice plan,
    and the generator is left in the same state (dropout masks are drawn from it afterwards)."""
    task = TrainTask(0, 0, 0.1, batch_size=bs, epochs=epochs, steps=steps)
    g_ref, g_table, g_plan = (client_generator(5, 1, 2) for _ in range(3))
    want = _plan_before(n, task, g_ref)
    rows, sizes = batch_table(n, task, g_table)
    assert rows.dtype == sizes.dtype == torch.long and rows.shape == (len(want), bs)
    assert sizes.tolist() == [len(b) for b in want]
    for r, s, b in zip(rows, sizes.tolist(), want):
        assert torch.equal(r[:s], b) and bool((r[s:] == -1).all())
    got = batch_plan(n, task, g_plan)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    after = [torch.randint(0, 1 << 30, (4,), generator=g) for g in (g_ref, g_table, g_plan)]
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2])
