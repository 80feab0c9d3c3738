"""ResNet-8 with BatchNorm: its shape, and that it trains on dropfl's default engine."""

from __future__ import annotations

import dropfl
import pytest
import torch
from torch import nn

from dropfl_examples.resnet import resnet8


@pytest.mark.parametrize("shape, params", [((1, 28, 28), 77_754), ((3, 32, 32), 78_042)])
def test_shapes_and_size(shape, params):
    torch.manual_seed(0)
    m = resnet8(shape, 10)
    assert m(torch.zeros(2, *shape)).shape == (2, 10)
    assert sum(p.numel() for p in m.parameters()) == params
    assert sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) == 9   # stem 1, blocks 2 + 2 + 3 (2 shortcuts)


def test_registry_and_refusals():
    entry = dropfl.MODELS.entry("resnet8")   # the installed entry point
    assert entry.obj is resnet8 and entry.origin.startswith("entry point dropfl-examples==")
    with pytest.raises(ValueError, match="no dropout layers"):
        resnet8((1, 28, 28), 10, dropout=0.5)


def test_trains_on_the_default_engine(tmp_path):
    # 4 clients on IID FMNIST, 3 rounds of 6 SGD steps: the mean training loss falls from round 0 to round 2.
    # (Accuracy is not asserted: three short rounds say little about it, and dropfl's buffer rule, the
    # participants' running statistics averaged, is tested in dropfl's own tests/test_batchnorm.py; evaluated in
    # the last round only, as it is most of the run's time.)
    cfg = dropfl.SimConfig()
    cfg.data.clients, cfg.data.partition = 4, "iid"
    cfg.model.model = "resnet8"
    cfg.train.steps, cfg.train.lr = 6, 0.05
    cfg.run.rounds, cfg.run.threads, cfg.run.eval_every = 3, 1, 100
    run = dropfl.simulate(cfg, out=tmp_path / "run")
    rows = run.metrics()
    # the generic engine: per client, as ResNet-8 is above the size where vmap over the clients pays
    assert [r["engine"] for r in rows] == ["batched (per client, channels-last)"] * 3 or all(
        r["engine"] == "batched (per client)" for r in rows)   # NCHW where the native kernels do not build
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
