"""A model with buffers (BatchNorm): the global buffers are the participants' sample-weighted mean after each round
(coordinator/buffers.py), checkpointed, resumed, replayed, evaluated and saved with the model; the loop and the
generic engine agree; a model without buffers keeps its bits (no buffers anywhere)."""

from __future__ import annotations

import csv
import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coordinator import cli
from coordinator.buffers import aggregate_buffers
from coordinator.sim.transport import SimTransport
from coordinator.strategies.base import ClientUpdate
from edge_client.models import get_buffers, get_flat, set_buffers
from edge_client.trainer import TrainTask, evaluate, local_train

MOD = "dropfl_bn_plugin"   # the plugin module, written into a temporary directory put on sys.path

PLUGIN = '''
"""A BatchNorm CNN, images whose pixels are far from mean 0 / variance 1, and clients of unequal sizes."""
import numpy as np
import torch
from torch import nn

from edge_client.datasets import Dataset, Split


class BNNet(nn.Module):
    def __init__(self, input_shape, num_classes, dropout=None):
        super().__init__()
        c, h, w = input_shape
        self.conv = nn.Conv2d(c, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * h * w, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class WideBN(nn.Module):
    """3,000 normalised features: 6,001 buffer values, more than field mode's message header holds."""
    def __init__(self, input_shape, num_classes, dropout=None):
        super().__init__()
        self.lin = nn.Linear(int(np.prod(input_shape)), 3000)
        self.bn = nn.BatchNorm1d(3000)
        self.fc = nn.Linear(3000, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.lin(x.flatten(1)))))


def shifted_images(data_dir):
    g = torch.Generator().manual_seed(0)
    def split(n):
        y = torch.arange(n) % 10
        x = torch.rand(n, 1, 6, 6, generator=g) * 5.0 - 40.0  # far from BatchNorm's initial statistics
        x[torch.arange(n), 0, y % 6, y // 6] += 30.0          # each class lights one pixel
        return Split(x, y.to(torch.int64))
    return Dataset("shifted-images", split(240), split(60))


def uneven(labels, n_clients, seed):
    """Client i holds (i + 1) shares of the rows: the sample weights differ."""
    cuts = np.cumsum([0] + [i + 1 for i in range(n_clients)]) * len(labels) // sum(range(1, n_clients + 1))
    return [np.arange(cuts[i], cuts[i + 1], dtype=np.int64) for i in range(n_clients)]
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{MOD}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, MOD, raising=False)
    yield src
    sys.modules.pop(MOD, None)


def _sim(out: Path, *extra: str, rounds: int = 3, engine: str = "loop") -> None:
    args = ["sim", "--out", str(out), "--clients", "4", "--rounds", str(rounds), "--steps", "3", "--batch-size", "8",
            "--lr", "0.05", "--engine", engine, "--threads", "1", "--no-progress", "--algo", "fedavg",
            "--model", f"{MOD}:BNNet", "--dataset", f"{MOD}:shifted_images", "--partition", f"{MOD}:uneven",
            *extra]
    assert cli.main(args) == 0


STATIC = ("--availability", "static", "--p", "0.6")


def _ck(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=False)


def _participants(run: Path, t: int) -> list[int]:
    with open(run / "participation.csv") as f:
        return sorted(int(r["client"]) for r in csv.DictReader(f)
                      if int(r["round"]) == t and r["status"] == "participated")


def _data(plugin_mod, n_clients: int = 4):
    ds = plugin_mod.shifted_images(None)
    parts = plugin_mod.uneven(ds.train.y.numpy(), n_clients, 0)
    return ds, [(ds.train.x[p], ds.train.y[p]) for p in parts]


def test_global_buffers_are_the_sample_weighted_mean_of_the_participants(plugin, tmp_path):
    """Round 2's global buffers, recomputed by hand from round 1's checkpoint: each participant trains from the
    global weights and buffers, then Σ n_i·b_i / Σ n_i (float64) and the largest num_batches_tracked."""
    full, part = tmp_path / "full", tmp_path / "part"
    _sim(full, *STATIC)
    _sim(part, *STATIC, rounds=2)
    mod = importlib.import_module(MOD)
    ds, data = _data(mod)
    before, after = _ck(part), _ck(full)
    config = json.loads((full / "config.json").read_text())
    lr = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()][2]["lr"]
    who = _participants(full, 2)
    assert who, "the round has participants (else the case shows nothing)"
    outs = []
    for i in who:
        model = mod.BNNet((1, 6, 6), 10)
        task = TrainTask(client=i, round=2, lr=lr, batch_size=8, steps=3, seed=config["run"]["seed"])
        r = local_train(model, before["w"], *data[i], task, buffers=before["buffers"])
        outs.append((len(data[i][1]), r.buffers))
    total = sum(n for n, _ in outs)
    for name, b in after["buffers"].items():
        if name.endswith("num_batches_tracked"):
            assert torch.equal(b, max(bufs[name] for _, bufs in outs))
            assert int(b) == int(before["buffers"][name]) + 3   # every client took 3 steps from the global count
        else:
            mean = (sum(n * bufs[name].double() for n, bufs in outs) / total).float()
            assert torch.equal(b, mean), name
            assert not torch.equal(b, before["buffers"][name])   # the round moved them
    sizes = {len(data[i][1]) for i in who}
    assert len(sizes) == len(who)   # the participants' weights differ: a plain mean would not equal this
    # model.pt holds the final weights and these buffers
    saved = torch.load(full / "model.pt", weights_only=True)
    assert all(torch.equal(saved[n], b) for n, b in after["buffers"].items())
    model = mod.BNNet((1, 6, 6), 10)
    model.load_state_dict(saved)
    assert torch.equal(get_flat(model), after["w"])


def test_a_round_without_participants_keeps_the_buffers() -> None:
    current = {"bn.running_mean": torch.tensor([1.0, 2.0]), "bn.num_batches_tracked": torch.tensor(7)}
    assert aggregate_buffers(current, {}) is current
    u = ClientUpdate(0, torch.zeros(1), 0, 0, 0.1, buffers={n: b * 3 for n, b in current.items()})
    assert aggregate_buffers(current, {0: u}) is current   # no samples: nothing to weigh
    assert aggregate_buffers({}, {0: u}) == {}


def test_resume_and_replay_give_the_same_model_and_buffers(plugin, tmp_path):
    full, part, replay = tmp_path / "full", tmp_path / "part", tmp_path / "replay"
    _sim(full, *STATIC)
    _sim(part, *STATIC, rounds=2)
    _sim(part, *STATIC, "--resume")
    _sim(replay, "--availability", "replay", "--trace", str(full / "participation.csv"))
    a = _ck(full)
    for other in (part, replay):
        b = _ck(other)
        assert torch.equal(a["w"], b["w"])
        assert a["buffers"].keys() == b["buffers"].keys()
        assert all(torch.equal(a["buffers"][n], b["buffers"][n]) for n in a["buffers"])
        assert (full / "metrics.jsonl").read_text().count("\n") == (other / "metrics.jsonl").read_text().count("\n")


def test_evaluation_uses_the_aggregated_statistics(plugin, tmp_path):
    """The inputs are far from BatchNorm's initial statistics (mean 0, variance 1): evaluated with them, the trained
    model is another model; the run's accuracy is the one with the global buffers."""
    out = tmp_path / "run"
    _sim(out, "--availability", "always", "--lr", "0.2", rounds=5)
    mod = importlib.import_module(MOD)
    ds, _ = _data(mod)
    ck = _ck(out)
    row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    model = mod.BNNet((1, 6, 6), 10)
    initial = get_buffers(model)
    with_global = evaluate(model, ck["w"], ds.test.x, ds.test.y, buffers=ck["buffers"])
    with_initial = evaluate(model, ck["w"], ds.test.x, ds.test.y, buffers=initial)
    assert (row["accuracy"], row["loss"]) == with_global
    assert with_global[0] >= with_initial[0] + 0.3, (with_global, with_initial)


def test_loop_and_generic_engine_agree(plugin, tmp_path):
    """The generic engine (torch.func) starts every client from the global buffers as the loop does: float32 models
    and buffers within docs/engine.md's 1e-5 (buffers: or 1e-6 relative, for a running variance far above 1)."""
    loop, generic = tmp_path / "loop", tmp_path / "generic"
    _sim(loop, *STATIC)
    _sim(generic, *STATIC, engine="batched")
    rows = [json.loads(x) for x in (generic / "metrics.jsonl").read_text().splitlines()]
    assert all(r["engine"].startswith("batched (torch.func") for r in rows)
    a, b = _ck(loop), _ck(generic)
    assert torch.allclose(a["w"], b["w"], atol=1e-5, rtol=0)
    for n, x in a["buffers"].items():
        if x.is_floating_point():
            # running_var grows to ~100 here, where one float32 ulp is ~8e-6: relative 1e-6 as well
            assert torch.allclose(x, b["buffers"][n], atol=1e-5, rtol=1e-6), (n, (x - b["buffers"][n]).abs().max())
        else:
            assert torch.equal(x, b["buffers"][n]), n


def test_generic_engine_buffers_equal_the_loops_per_client(plugin) -> None:
    """In float64, each client's buffers out of the generic engine equal local_train's from the same global buffers
    (to 1e-12), also where the global buffers are not the model's initial ones."""
    from coordinator.sim.functional import FunctionalEngine
    mod = importlib.import_module(MOD)
    _, data = _data(mod)
    data = [(x.double(), y) for x, y in data]
    torch.manual_seed(1)
    model = mod.BNNet((1, 6, 6), 10).double()
    w = get_flat(model)
    start = {n: (b + 0.5 if b.is_floating_point() else b + 4) for n, b in get_buffers(model).items()}
    tasks = [TrainTask(client=i, round=1, lr=0.05, batch_size=8, steps=2 + i, seed=3) for i in range(4)]
    out = FunctionalEngine(model, data, device="cpu").run(w, tasks, buffers=start)
    for task, r in zip(tasks, out):
        ref = local_train(mod.BNNet((1, 6, 6), 10).double(), w, *data[task.client], task, buffers=start)
        for n, b in ref.buffers.items():
            assert torch.allclose(r.buffers[n], b, atol=1e-12, rtol=0), (task.client, n)
        assert int(r.buffers["bn.num_batches_tracked"]) == 4 + task.steps


def test_a_model_without_buffers_has_none_anywhere(tmp_path) -> None:
    """logreg: no buffers in the updates, none in the checkpoint (its keys as before)."""
    out = tmp_path / "run"
    assert cli.main(["sim", "--out", str(out), "--dataset", "fmnist", "--clients", "4", "--model", "logreg",
                     "--steps", "2", "--batch-size", "8", "--rounds", "2", "--engine", "loop", "--threads", "1",
                     "--no-progress"]) == 0
    assert "buffers" not in _ck(out)
    from edge_client.models import build_model
    model = build_model("logreg", (1, 28, 28))
    r = local_train(model, get_flat(model), torch.rand(8, 1, 28, 28), torch.arange(8),
                    TrainTask(client=0, round=0, lr=0.1, batch_size=4, steps=2))
    assert r.buffers is None


def test_set_buffers_refuses_other_names(plugin) -> None:
    model = importlib.import_module(MOD).BNNet((1, 6, 6), 10)
    with pytest.raises(ValueError, match="do not match"):
        set_buffers(model, {"other": torch.zeros(1)})


def test_the_hand_written_batched_engine_never_gets_a_model_with_buffers(plugin) -> None:
    """Only the generic engine carries buffers: a batched engine that is not it, built for such a model, is refused."""
    class NotGeneric:
        def __init__(self, model, data):
            pass

        def details(self):
            return {"generic": False}

    model = importlib.import_module(MOD).BNNet((1, 6, 6), 10)
    with pytest.raises(AssertionError, match="buffers"):
        SimTransport(model, [(torch.zeros(2, 1, 6, 6), torch.zeros(2, dtype=torch.long))], make_engine=NotGeneric)


def test_onnx_export_carries_the_global_buffers_in_eval_mode(plugin) -> None:
    """The field's ONNX model (export_onnx, after MqttTransport sets the global buffers): the same logits as the model
    in eval mode with those buffers, not with the initial ones."""
    ort = pytest.importorskip("onnxruntime")
    from coordinator.field.transport import export_onnx
    mod = importlib.import_module(MOD)
    ds, _ = _data(mod)
    model = mod.BNNet((1, 6, 6), 10)
    w = get_flat(model)
    glob = {n: (b * 0 - 38.0 if n.endswith("running_mean") else b * 4 if b.is_floating_point() else b + 9)
            for n, b in get_buffers(model).items()}
    set_buffers(model, glob)
    sess = ort.InferenceSession(export_onnx(model, w, (1, 6, 6)), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {"x": ds.test.x.numpy()})[0])
    with torch.no_grad():
        want = model.eval()(ds.test.x)
        set_buffers(model, get_buffers(mod.BNNet((1, 6, 6), 10)))
        initial = model(ds.test.x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(got, initial, atol=1e-2)


def test_a_model_onnx_cannot_export_is_one_notice_not_a_crash(caplog) -> None:
    """An operator ONNX has no form for (torch.special.zeta): None and one warning line; the run goes on without
    on-device evaluation (MqttTransport stops trying and sends no ONNX model)."""
    from coordinator.field.transport import export_onnx_or_none

    class Zeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(torch.special.zeta(x.flatten(1).abs() + 2, torch.tensor(2.0)))

    model = Zeta()
    with caplog.at_level("WARNING", logger="dropfl.coordinator"):
        assert export_onnx_or_none(model, get_flat(model), (1, 2, 2)) is None
    said = [r.getMessage() for r in caplog.records if r.name == "dropfl.coordinator"]
    assert len(said) == 1 and "cannot be exported to ONNX (UnsupportedOperatorError" in said[0], said
    assert "\n" not in said[0]


def test_resume_refuses_a_batchnorm_checkpoint_without_buffers(plugin, tmp_path, capsys) -> None:
    """A checkpoint of a BatchNorm model that holds no buffers cannot continue them: one line, nothing written."""
    part = tmp_path / "part"
    _sim(part, *STATIC, rounds=2)
    ck = _ck(part)
    del ck["buffers"]
    torch.save(ck, part / "checkpoint.pt")
    before = (part / "metrics.jsonl").read_text()
    capsys.readouterr()
    args = ["sim", "--out", str(part), "--clients", "4", "--rounds", "3", "--steps", "3", "--batch-size", "8",
            "--lr", "0.05", "--engine", "loop", "--threads", "1", "--no-progress", "--algo", "fedavg",
            "--model", f"{MOD}:BNNet", "--dataset", f"{MOD}:shifted_images", "--partition", f"{MOD}:uneven",
            *STATIC, "--resume"]
    assert cli.main(args) != 0
    err = capsys.readouterr().err
    assert "holds no buffers of --model" in err and "Traceback" not in err, err
    assert (part / "metrics.jsonl").read_text() == before


def test_buffers_that_do_not_fit_the_field_header_are_refused_before_anything_starts(plugin, tmp_path):
    """Field mode carries buffers as JSON in the message header (64 KiB): a model with 6,001 buffer values is one
    line at setup, naming the model and the sizes; the same model simulates, and BNNet's 9 values fit."""
    import dropfl
    from coordinator import runsetup

    def cfg(model):
        return dropfl.load_config({"data": {"dataset": f"{MOD}:shifted_images", "partition": "iid", "clients": 3},
                                   "model": {"model": f"{MOD}:{model}"}})
    with pytest.raises(dropfl.UserError) as e:
        runsetup.check_run(cfg("WideBN"), str(tmp_path / "wide"), mode="field")
    assert str(e.value).startswith(f"--model {MOD}:WideBN: its 6001 buffer values (BatchNorm's running statistics, ")
    assert "do not fit field mode's message header (65536 bytes" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "wide").exists()
    runsetup.check_run(cfg("WideBN"), str(tmp_path / "wide"), mode="sim")
    runsetup.check_run(cfg("BNNet"), str(tmp_path / "small"), mode="field")
