import torch

from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask, batch_plan, client_generator, local_train


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
