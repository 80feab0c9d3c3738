"""The coordinator's evaluation through the fused LeNet kernels (`coordinator.sim.batched.Evaluator`) against
the reference (`edge_client.trainer.evaluate`, the model's own forward), and which one a run uses."""

from __future__ import annotations

import json
import os

import pytest
import torch

from coordinator.sim import kernels
from coordinator.sim.batched import Evaluator
from edge_client.models import build_model, get_flat
from edge_client.trainer import evaluate

pytestmark = [
    pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler: the fused kernels cannot be built"),
    pytest.mark.skipif(os.environ.get("DROPFL_NATIVE", "1") == "0", reason="DROPFL_NATIVE=0 turns the kernels off"),
    pytest.mark.skipif(os.environ.get("DROPFL_KERNEL", "").lower() == "off", reason="DROPFL_KERNEL=off"),
]

LENETS = [("mimic-cnn", (1, 28, 28), 0.0), ("cifar-lenet", (3, 32, 32), 0.0), ("fdms-cnn", (1, 28, 28), 0.5)]


def _setup(name: str, shape: tuple[int, ...], dropout: float, dtype: torch.dtype, n: int = 250):
    g = torch.Generator().manual_seed(7)
    x = torch.rand((n, *shape), generator=g, dtype=dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    model = build_model(name, shape, 10, seed=3, dropout=dropout).to(dtype)
    w = get_flat(model)
    w = w + 0.05 * torch.randn(w.shape, generator=g, dtype=dtype)   # not the initialisation: logits far apart
    return model, x, y, w


@pytest.mark.parametrize("name,shape,dropout", LENETS)
def test_equals_the_reference_in_float64(name: str, shape: tuple[int, ...], dropout: float) -> None:
    """The same accuracy and loss as the model's own forward in eval mode (dropout off), up to the order of
    each output's sum: 1e-12 in float64. A batch size that does not divide the test set."""
    model, x, y, w = _setup(name, shape, dropout, torch.float64)
    ev = Evaluator(build_model(name, shape, 10, seed=0, dropout=dropout).double(), x, y, batch=100)
    assert ev.available() and ev.native in kernels.VARIANTS
    acc, loss = ev(w)
    ref_acc, ref_loss = evaluate(model, w, x, y, batch=100)
    assert acc == ref_acc
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    model.eval()
    with torch.no_grad():
        ref = model(x)
    assert torch.allclose(ev.logits(ev.params(w), 0, len(y)), ref, rtol=0, atol=1e-12)


def test_float32_on_real_images_agrees_with_the_reference() -> None:
    """Float32 FMNIST test images: the same accuracy, the loss to float rounding."""
    from edge_client.datasets import load_fmnist
    ds = load_fmnist()
    x, y = ds.test.x[:3000], ds.test.y[:3000]
    model = build_model("mimic-cnn", tuple(x.shape[1:]), 10, seed=1)
    w = get_flat(model) + 0.02 * torch.randn(get_flat(model).shape, generator=torch.Generator().manual_seed(1))
    acc, loss = Evaluator(build_model("mimic-cnn", tuple(x.shape[1:])), x, y)(w)
    ref_acc, ref_loss = evaluate(model, w, x, y)
    assert abs(acc - ref_acc) <= 1 / len(y)          # an argmax at a float32 near-tie may flip, none here so far
    assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_an_evaluation_is_the_same_bits_whatever_ran_before() -> None:
    """A run's metrics are the same bits on every evaluation of the same weights, in a fresh Evaluator or after
    others evaluated other weights and batches in between (what keeps a sweep's executors and resume equal). Not
    that a sample's logits are the same in any batch: BLAS may pick its GEMM kernel by the batch's shape (on an
    AMD EPYC with MKL a sample's logits changed with its batch, torch's own forward's too), so the batches of an
    evaluation are fixed (`batch`), never chosen by what else runs."""
    model, x, y, w = _setup("mimic-cnn", (1, 28, 28), 0.0, torch.float32)
    ev = Evaluator(model, x, y, batch=100)
    first = ev(w)
    whole = ev.logits(ev.params(w), 0, len(y))
    other = Evaluator(build_model("mimic-cnn", (1, 28, 28)), x[:37], y[:37], batch=7)
    other(w + 0.1)
    ev.logits(ev.params(w * 0.5), 3, 40)
    assert ev(w) == first
    assert Evaluator(build_model("mimic-cnn", (1, 28, 28), 10, seed=9), x, y, batch=100)(w) == first
    assert torch.equal(ev.logits(ev.params(w), 0, len(y)), whole)


def test_models_without_fused_layers_use_the_reference() -> None:
    x, y = torch.rand(20, 1, 28, 28), torch.randint(0, 10, (20,))
    assert not Evaluator(build_model("mlp", (1, 28, 28)), x, y).available()
    assert not Evaluator(build_model("mimic-cnn", (1, 28, 28)), x, y, native=False).available()


def _eval_field(out) -> str:
    for line in open(out / "log.jsonl"):
        rec = json.loads(line)
        if "eval" in rec:
            return rec["eval"]
    raise AssertionError("no evaluation record in log.jsonl")


@pytest.mark.parametrize("engine,kernel,expected", [("batched", None, "batched+native"), ("loop", None, "reference"),
                                                    ("batched", "off", "reference")])
def test_a_run_records_which_evaluation_ran(tmp_path, monkeypatch, engine, kernel, expected) -> None:
    """--engine loop evaluates with the reference, like it trains; DROPFL_KERNEL=off too."""
    from coordinator.cli import main
    if kernel:
        monkeypatch.setenv("DROPFL_KERNEL", kernel)
    out = tmp_path / "run"
    assert main(["sim", "--model", "mimic-cnn", "--clients", "3", "--rounds", "1", "--steps", "1",
                 "--batch-size", "8", "--threads", "1", "--engine", engine, "--out", str(out), "--quiet"]) == 0
    assert _eval_field(out).startswith(expected)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= row["accuracy"] <= 1.0 and row["loss"] > 0


def test_evaluators_of_one_test_set_share_its_split_images() -> None:
    """The runs of a sweep share the test set (runsetup.load_dataset), and their Evaluators one split of it
    (batched._shared_split): the same tensor, and the same results as an Evaluator of a copy of the images."""
    model, x, y, w = _setup("mimic-cnn", (1, 28, 28), 0.0, torch.float32)
    a, b, c = Evaluator(model, x, y), Evaluator(model, x, y), Evaluator(model, x.clone(), y)
    assert a.x_split is b.x_split and a.x_split is not c.x_split and torch.equal(a.x_split, c.x_split)
    assert a(w) == b(w) == c(w)
