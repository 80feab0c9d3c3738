"""The agent on small devices: it reads only its own rows (bitwise the simulation's), and an evaluation
never delays training."""

import gzip
import struct

import numpy as np
import pytest
import torch
from test_field_agent import offline_agent

from edge_client import agent as ag
from edge_client import datasets, federation, wire


def _write_idx(path, arr: np.ndarray) -> None:
    head = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(">" + "I" * arr.ndim, *arr.shape)
    data = head + arr.astype(np.uint8).tobytes()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:  # closed: 3.12+ buffers gzip writes
        f.write(data)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_rows_reads_the_given_rows_in_order(tmp_path, suffix):
    arr = np.random.default_rng(0).integers(0, 256, size=(37, 3, 4), dtype=np.uint8)
    p = tmp_path / f"x-idx3-ubyte{suffix}"
    _write_idx(p, arr)
    rows = np.array([36, 0, 5, 5, 17, 1, 35])  # unsorted, repeated, across block boundaries
    got, n = datasets.read_idx_rows(p, rows, block_rows=4)
    assert n == 37 and np.array_equal(got, datasets.read_idx(p)[rows]) and np.array_equal(got, arr[rows])
    assert datasets.read_idx_rows(p, np.array([], dtype=np.int64))[0].shape == (0, 3, 4)
    with pytest.raises(datasets.DatasetError, match="rows outside"):
        datasets.read_idx_rows(p, np.array([37]))


@pytest.mark.parametrize("partition,client", [("shards", 3), ("iid", 0), ("dirichlet", 5)])
def test_the_agents_shard_equals_the_full_loads_rows_bitwise(fmnist, partition, client):
    cfg = ag.config_from_dict({"agent": {"client": client}, "data": {"clients": 6, "partition": partition, "seed": 4}})
    labels, x, y, tx, ty = ag.load_shard(cfg)
    b = ag.binding_of(cfg, fmnist)
    assert ag.binding_of(cfg, labels) == b and b.data_digest  # the digest needs only the labels
    idx = torch.as_tensor(federation.client_shards(fmnist, b)[client])
    tidx = torch.as_tensor(federation.test_shards(fmnist, b)[client])
    assert x.dtype == torch.float32 and x.shape[1:] == fmnist.train.x.shape[1:]
    assert torch.equal(x.view(torch.int32), fmnist.train.x[idx].view(torch.int32))  # bitwise
    assert torch.equal(y, fmnist.train.y[idx])
    assert np.array_equal(tx.view(np.int32), fmnist.test.x[tidx].numpy().view(np.int32))
    assert np.array_equal(ty, fmnist.test.y[tidx].numpy())


def _agent(tmp_path, monkeypatch, **agent):
    return offline_agent(tmp_path, monkeypatch, {"source": "mains"}, agent={"eval_batch": 100} | agent)


def _onnx(model, w, rnd):
    from coordinator.field.transport import export_onnx
    return wire.encode("onnx", "run", rnd, -1, torch.frombuffer(
        bytearray(export_onnx(model, w, (1, 28, 28))), dtype=torch.uint8))


def _drain(a):
    """The agent's main loop (Agent.run) without the broker: handle each queued message, then work."""
    while not a.inbox.empty():
        a._handle(*a.inbox.get())
        a.work.step()


def test_a_slow_evaluation_never_delays_the_next_task(tmp_path, monkeypatch):
    from edge_client.models import build_model, get_flat

    a, sent = _agent(tmp_path, monkeypatch)
    model = build_model("logreg", (1, 28, 28), 10, 2)
    w = get_flat(model)
    task = {"lr": 0.1, "batch_size": 8, "steps": 2, "seed": 2}
    events = []
    eval_batch, train = a.work._eval_batch, a.work._train_and_upload

    def slow_eval_batch(*args):
        events.append("eval-batch")
        if events.count("eval-batch") == 1:  # round 1's task and model arrive during the first batch
            for f in wire.encode("task", "run", 1, 1, meta=task) + wire.encode("model", "run", 1, -1, w):
                a.inbox.put(("dropfl/v1/device/client-1/control", f, False, 0.0))
        return eval_batch(*args)

    def recording_train(run, t, *args, **kw):
        events.append(f"train-{t.round}")
        return train(run, t, *args, **kw)

    monkeypatch.setattr(a.work, "_eval_batch", slow_eval_batch)
    monkeypatch.setattr(a.work, "_train_and_upload", recording_train)
    for f in _onnx(model, w, 0):  # round 0's global model to evaluate, the agent idle
        a.inbox.put(("dropfl/v1/model/onnx", f, False, 0.0))
    _drain(a)
    n_batches = -(-len(a.work.test_y) // 100)
    assert events[:2] == ["eval-batch", "train-1"]  # trains right after the batch in progress
    assert events.count("eval-batch") == n_batches and "train-1" not in events[2:]  # then the evaluation resumes
    topics = [t.rsplit("/", 1)[1] for t, _ in sent]
    runs = [x for i, x in enumerate(topics) if i == 0 or x != topics[i - 1]]   # an update's chunks: one run
    assert runs == ["delta", "stats", "eval"]  # round 1's update went out before round 0's accuracy
    m = wire.decode([sent[topics.index("eval")][1]])
    assert m.header.round == 0 and m.meta["samples"] == len(a.work.test_y)


def test_evaluation_every_k_and_skipped_when_the_next_model_comes_first(tmp_path, monkeypatch):
    from edge_client.models import build_model, get_flat

    a, sent = _agent(tmp_path, monkeypatch, eval_every=2)
    model = build_model("logreg", (1, 28, 28), 10, 2)
    w = get_flat(model)
    for rnd in (0, 1, 2, 3):
        for f in _onnx(model, w, rnd):
            a._handle("dropfl/v1/model/onnx", f, False, 0.0)
        a.work.step()
    assert [wire.decode([p]).header.round for _, p in sent] == [0, 2]  # rounds 1 and 3: not a multiple of 2

    b, sent = _agent(tmp_path / "b", monkeypatch)
    seen = []
    monkeypatch.setattr(b.work, "_eval_batch", lambda *args: seen.append(1) or 0)
    for f in _onnx(model, w, 0):
        b.inbox.put(("dropfl/v1/model/onnx", f, False, 0.0))
    for f in _onnx(model, w, 1):  # round 1's model queued behind round 0's: round 0 is still being evaluated
        b.inbox.put(("dropfl/v1/model/onnx", f, False, 0.0))
    _drain(b)
    assert [wire.decode([p]).header.round for _, p in sent] == [1] and b.work.evals_skipped == 1
