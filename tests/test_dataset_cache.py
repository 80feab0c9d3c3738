"""The coordinator decodes a dataset once per process (runsetup.load_dataset): runs share it, nothing changes it,
and a changed file is read again."""

import os

import pytest
import torch

from coordinator import runsetup
from coordinator.cli import main
from coordinator.config import SimConfig
from coordinator.errors import UserError
from edge_client import datasets

TINY = ["--dataset", "fmnist", "--clients", "4", "--model", "mimic-cnn", "--steps", "2", "--batch-size", "8",
        "--lr", "0.05", "--rounds", "2", "--no-progress"]


def _cfg(name="fmnist", data_dir=None) -> SimConfig:
    cfg = SimConfig()
    cfg.data.dataset, cfg.data.data_dir = name, data_dir
    return cfg


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_runs_share_one_decoded_dataset_and_leave_it_as_it_was(tmp_path, fmnist):
    ds = runsetup.load_dataset(_cfg())
    assert runsetup.load_dataset(_cfg()) is ds
    # a run of each engine (the batched one with its evaluator through the fused kernels) and a FedProx run
    # use the shared tensors; afterwards they still equal a fresh, uncached load bit for bit
    for i, extra in enumerate([[], ["--engine", "loop"], ["--algo", "fedprox", "--mu", "0.1"]]):
        assert main(["sim", *TINY, *extra, "--out", str(tmp_path / f"run{i}")]) == 0
    assert runsetup.load_dataset(_cfg()) is ds
    for a, b in ((ds.train, fmnist.train), (ds.test, fmnist.test)):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)


def test_a_changed_file_is_read_again(tmp_path, monkeypatch):
    """The key holds each file's path, size and modification time (the decoding is counted, not done)."""
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / stem).write_bytes(b"x")
    files = datasets.source_files("fmnist", str(tmp_path))
    assert sorted(p.name for p in files) == sorted(p.name for p in tmp_path.iterdir())
    loads = []
    monkeypatch.setattr(datasets, "load", lambda name, data_dir: loads.append(name) or object())
    cfg = _cfg(data_dir=str(tmp_path))
    first = runsetup.load_dataset(cfg)
    assert runsetup.load_dataset(cfg) is first and len(loads) == 1
    os.utime(files[0], ns=(files[0].stat().st_atime_ns, files[0].stat().st_mtime_ns + 10**9))
    second = runsetup.load_dataset(cfg)
    assert second is not first and len(loads) == 2
    files[1].write_bytes(b"xy")   # another size
    assert runsetup.load_dataset(cfg) is not second and len(loads) == 3
    assert datasets.source_files("fmnist", str(tmp_path / "none")) == []
    assert datasets.source_files("cifar10", None) == []


def test_a_missing_dataset_is_still_a_one_line_error_and_not_cached(tmp_path):
    with pytest.raises(UserError, match="fmnist not found"):
        runsetup.load_dataset(_cfg(data_dir=str(tmp_path)))
    assert all(k[1] != str(tmp_path) for k in runsetup._DATASETS)
