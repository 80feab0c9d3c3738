"""Loaders for data on disk: `.npz` arrays, an image-folder tree, LEAF's JSON layout (docs/datasets.md).

Each registers in the dataset registry as a plugin would (`DATASETS.register(name, loader, files=...)`) and returns
map-style splits with `targets` (the labels, read without the images) and `rows(indices)`: an agent reads the
labels, then only its own rows, and the full load is the same `rows` over every row, so a row read alone is
bitwise equal to that row of the full load. Every error is one line (`DatasetError`) naming the file and the fix.

    npz          --data-dir FILE.npz (x_train, y_train, x_test, y_test), or a directory with train.npz and test.npz
                 (x and y in each); rows are streamed out of the zip member, never the whole array in memory
    imagefolder  --data-dir DIR with train/<class>/* and test/<class>/* images (torchvision's ImageFolder layout),
                 read with Pillow; classes sorted by name; one image shape, or `load_image_folder(dir, size=...)`
    leaf         --data-dir DIR with LEAF's train/*.json and test/*.json (FEMNIST, Shakespeare); each user is a
                 writer (`owners`) for --partition natural; the JSON is parsed file by file (LEAF keeps the labels
                 beside the pixels), an agent keeps only its own rows
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np

from edge_client.datasets import DATASETS, Dataset, DatasetError

# --- npz -------------------------------------------------------------------------------------------------------------

NPZ_FILE_KEYS = {"train": ("x_train", "y_train"), "test": ("x_test", "y_test")}
NPZ_PAIR_KEYS = (("x", "y"),)   # in train.npz / test.npz; x_train, y_train (x_test, y_test) are accepted too
CHANNELS = (1, 3)               # a 4-D array's channel axis (NCHW: axis 1, NHWC: axis 3) holds 1 or 3 channels
NPZ_HELP = ("pass --data-dir FILE.npz holding arrays x_train, y_train, x_test, y_test, or a directory holding "
            "train.npz and test.npz (arrays x and y)")


def _npz_sources(data_dir: str | None) -> dict[str, tuple[Path, str, str]]:
    """{split: (file, x key, y key)} for --data-dir; DatasetError if the file or a key is missing."""
    if not data_dir:
        raise DatasetError(f"npz: no file given: {NPZ_HELP}")
    root = Path(data_dir)
    if root.is_dir():
        out = {}
        for split in ("train", "test"):
            f = root / f"{split}.npz"
            if not f.is_file():
                raise DatasetError(f"npz: {f} not found: a --data-dir directory must hold train.npz and test.npz "
                                   f"(arrays x and y), or pass the .npz file itself")
            keys = _npz_keys(f)
            pair = next((p for p in (*NPZ_PAIR_KEYS, NPZ_FILE_KEYS[split]) if set(p) <= keys), None)
            if pair is None:
                raise DatasetError(f"npz: {f} has no arrays x and y (it has {', '.join(sorted(keys)) or 'none'}): "
                                   f"save them as x and y (np.savez(f, x=..., y=...))")
            out[split] = (f, *pair)
        return out
    if not root.is_file():
        raise DatasetError(f"npz: {root} not found: {NPZ_HELP}")
    keys = _npz_keys(root)
    for pair in NPZ_FILE_KEYS.values():
        for k in pair:
            if k not in keys:
                raise DatasetError(f"npz: {root} has no array {k!r} (it has {', '.join(sorted(keys)) or 'none'}): "
                                   f"save the arrays as x_train, y_train, x_test, y_test")
    return {split: (root, *pair) for split, pair in NPZ_FILE_KEYS.items()}


def _npz_keys(path: Path) -> set[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return {n[:-4] for n in zf.namelist() if n.endswith(".npy")}
    except (zipfile.BadZipFile, OSError) as e:
        raise DatasetError(f"npz: {path} is not a .npz file ({e}): save it with numpy.savez") from None


def _npy_header(f, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
    except ValueError as e:
        raise DatasetError(f"npz: {where} is not a numpy array ({e}): save it with numpy.savez") from None
    return (), True, np.dtype(object)   # another format version: read whole (`_npz_rows`)


def _npz_array(path: Path, key: str) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as z:
            return z[key]
    except ValueError as e:
        raise DatasetError(f"npz: {path} array {key!r} cannot be read without pickle ({e}): save numeric "
                           f"arrays") from None


def _npz_rows(path: Path, key: str, rows: np.ndarray, block_rows: int = 1024) -> np.ndarray:
    """The given rows of the array `key` of an .npz, streamed out of its zip member `block_rows` rows at a time
    (compressed or not; only the rows asked for are kept). A Fortran-ordered array is read whole."""
    with zipfile.ZipFile(path) as zf, zf.open(key + ".npy") as f:
        shape, fortran, dtype = _npy_header(f, f"{path} array {key!r}")
        if fortran or dtype.hasobject or not shape:
            return _npz_array(path, key)[rows]
        n, row_shape = shape[0], shape[1:]
        row_bytes = math.prod(row_shape) * dtype.itemsize
        out = np.empty((rows.size, *row_shape), dtype=dtype)
        order = np.argsort(rows, kind="stable")
        sorted_rows = rows[order]
        done = 0
        for start in range(0, n, block_rows):
            if done == rows.size:
                break
            count = min(block_rows, n - start)
            buf = f.read(count * row_bytes)
            if len(buf) != count * row_bytes:
                raise DatasetError(f"npz: {path} array {key!r} is shorter than its shape {shape}: save it again")
            end = int(np.searchsorted(sorted_rows, start + count, side="left"))
            if end > done:
                block = np.frombuffer(buf, dtype=dtype).reshape(count, *row_shape)
                out[order[done:end]] = block[sorted_rows[done:end] - start]
                done = end
    return out


class NpzSplit:
    """One split of an .npz as a map-style dataset: `targets` read at once, images by `rows` (streamed).
    Images: uint8 (scaled to [0, 1] by the conversion) or float (kept), of shape [n, H, W] (one channel),
    [n, C, H, W] or [n, H, W, C] with C in 1 or 3 (the channel axis is the one that holds 1 or 3; returned as
    NCHW), or [n, F] (feature vectors)."""

    def __init__(self, path: Path, xkey: str, ykey: str):
        self.path, self.xkey, where = path, xkey, f"npz: {path} array {xkey!r}"
        with zipfile.ZipFile(path) as zf, zf.open(xkey + ".npy") as f:
            shape, fortran, dtype = _npy_header(f, where)
        if not shape:   # another format version: its shape from the array itself
            arr = _npz_array(path, xkey)
            shape, dtype = arr.shape, arr.dtype
        if dtype != np.uint8 and not np.issubdtype(dtype, np.floating):
            raise DatasetError(f"{where} holds {dtype}: give uint8 images (scaled to [0, 1]) or float (kept as is)")
        self.nhwc = False
        if len(shape) == 4:
            first, last = shape[1] in CHANNELS, shape[3] in CHANNELS
            if first == last:
                raise DatasetError(f"{where} has shape {tuple(shape)}: cannot tell NCHW from NHWC; give images "
                                   f"with 1 or 3 channels on axis 1 (NCHW) or axis 3 (NHWC), not both or neither")
            self.nhwc = last
        elif len(shape) not in (2, 3):
            raise DatasetError(f"{where} has shape {tuple(shape)}: give images [n, H, W], [n, C, H, W] or "
                               f"[n, H, W, C], or features [n, F]")
        self.shape = tuple(int(d) for d in shape)
        self.sample_shape = (self.shape[3], *self.shape[1:3]) if self.nhwc else self.shape[1:]
        y = _npz_array(path, ykey)
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(f"npz: {path} array {ykey!r} is {y.dtype} of shape {y.shape}: give integer class "
                               f"indices, one per image (shape [n])")
        if len(y) != self.shape[0]:
            raise DatasetError(f"npz: {path} has {self.shape[0]} images in {xkey!r} but {len(y)} labels in "
                               f"{ykey!r}: give one label per image")
        self.targets = y.astype(np.int64)

    def __len__(self) -> int:
        return len(self.targets)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        x = _npz_rows(self.path, self.xkey, rows)
        return (np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if self.nhwc else x), self.targets[rows]

    def __getitem__(self, i: int):
        x, y = self.rows(np.array([i]))
        return x[0], int(y[0])


def _npz_num_classes(sources: dict, splits: dict[str, NpzSplit]) -> int:
    """The file's `num_classes` array if it has one, else the largest label + 1."""
    for path, _, _ in sources.values():
        if "num_classes" in _npz_keys(path):
            k = _npz_array(path, "num_classes")
            if k.shape not in ((), (1,)) or not np.issubdtype(k.dtype, np.integer) or int(k.reshape(())) < 1:
                raise DatasetError(f"npz: {path} array 'num_classes' is {k!r}: give one integer >= 1")
            return int(k.reshape(()))
    return max(int(s.targets.max(initial=-1)) for s in splits.values()) + 1


def load_npz(data_dir: str | None) -> Dataset:
    """`--dataset npz --data-dir FILE.npz|DIR` (class docstring of NpzSplit: what the arrays may be)."""
    sources = _npz_sources(data_dir)
    splits = {split: NpzSplit(*src) for split, src in sources.items()}
    if splits["train"].sample_shape != splits["test"].sample_shape:
        raise DatasetError(f"npz: the test images are {splits['test'].sample_shape} (NCHW), the training images "
                           f"{splits['train'].sample_shape}: give both splits one shape")
    k = _npz_num_classes(sources, splits)
    for split, s in splits.items():
        path, _, ykey = sources[split]
        if len(s) and (s.targets.min() < 0 or s.targets.max() >= k):
            raise DatasetError(f"npz: {path} array {ykey!r} has labels outside 0..{k - 1} (found "
                               f"{s.targets.min()} to {s.targets.max()}): labels must be class indices "
                               f"0..num_classes-1 (num_classes: the file's num_classes array, else the largest "
                               f"label + 1)")
    return Dataset("npz", splits["train"], splits["test"], num_classes=k)


def npz_files(data_dir: str | None) -> list[Path]:
    return sorted({p for p, _, _ in _npz_sources(data_dir).values()})


DATASETS.register("npz", load_npz, files=npz_files)

# --- image folder ----------------------------------------------------------------------------------------------------

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
GRAY_MODES = ("1", "L", "LA")   # read as 8-bit grayscale (one channel); every other mode as RGB


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError("imagefolder needs Pillow to read images: pip install pillow") from None
    return Image


def _image_mode(mode: str) -> str:
    return "L" if mode in GRAY_MODES else "RGB"


class ImageFolderSplit:
    """One split of an image-folder tree as a map-style dataset: `targets` from the directory names (no image is
    opened for them), images by `rows` (each opened, converted to L or RGB, checked against `shape`)."""

    def __init__(self, files: list[Path], targets: np.ndarray, shape: tuple[int, int, int], first: Path,
                 size: tuple[int, int] | None):
        self.files, self.targets, self.shape, self.first, self.size = files, targets, shape, first, size

    def __len__(self) -> int:
        return len(self.files)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((rows.size, *self.shape), dtype=np.uint8)
        for k, i in enumerate(rows):
            out[k] = read_image(self.files[i], self.shape, self.first, self.size)
        return out, self.targets[rows]

    def __getitem__(self, i: int):
        x, y = self.rows(np.array([i]))
        return x[0], int(y[0])


def _open(path: Path):
    Image = _pil()
    try:
        return Image.open(path)
    except (OSError, Image.UnidentifiedImageError) as e:
        raise DatasetError(f"imagefolder: {path} is not an image Pillow can read ({e}): replace or remove it") from None


def image_shape(path: Path, size: tuple[int, int] | None) -> tuple[int, int, int]:
    """(C, H, W) of an image as it will be read (from its header; nothing decoded)."""
    with _open(path) as im:
        c = 1 if _image_mode(im.mode) == "L" else 3
        w, h = im.size if size is None else (size[1], size[0])
    return c, h, w


def read_image(path: Path, shape: tuple[int, int, int], first: Path, size: tuple[int, int] | None) -> np.ndarray:
    """uint8 [C, H, W] of one image, converted to L or RGB (resized to `size` (H, W) if given, bilinear); its shape
    must be `shape` (the first training image's)."""
    with _open(path) as im:
        try:
            im = im.convert(_image_mode(im.mode))
            if size is not None:
                im = im.resize((size[1], size[0]), _pil().Resampling.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
        except OSError as e:
            raise DatasetError(f"imagefolder: {path} cannot be decoded ({e}): replace or remove it") from None
    a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    if a.shape != shape:
        fix = ("give every image the same size and colour mode (grayscale and colour are not mixed), or load with "
               "edge_client.datasets_files.load_image_folder(dir, size=(H, W)) to resize")
        raise DatasetError(f"imagefolder: {path} is {'x'.join(map(str, a.shape))} (CxHxW), but the first training "
                           f"image {first} is {'x'.join(map(str, shape))}: {fix}")
    return a


def _class_files(root: Path, split: str, classes: list[str] | None) -> tuple[list[str], list[Path], np.ndarray]:
    d = root / split
    if not d.is_dir():
        raise DatasetError(f"imagefolder: {d} not found: --data-dir must hold train/<class>/ and test/<class>/ "
                           f"directories of images")
    found = sorted(p.name for p in d.iterdir() if p.is_dir())
    if not found:
        raise DatasetError(f"imagefolder: {d} holds no class directories: put each class's images in "
                           f"{d}/<class>/")
    if classes is not None:
        extra = [c for c in found if c not in classes]
        if extra:
            raise DatasetError(f"imagefolder: {d / extra[0]} is a class that {root / 'train'} does not have: "
                               f"give train/ every class, or remove it from {split}/")
    classes = found if classes is None else classes
    files, labels = [], []
    for c in found:
        mine = sorted(p for p in (d / c).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not mine:
            raise DatasetError(f"imagefolder: {d / c} holds no images ({', '.join(IMAGE_SUFFIXES)}): add images "
                               f"or remove the directory")
        files += mine
        labels += [classes.index(c)] * len(mine)
    return classes, files, np.array(labels, dtype=np.int64)


def load_image_folder(data_dir: str | None, size: tuple[int, int] | None = None) -> Dataset:
    """`--dataset imagefolder --data-dir DIR`: DIR/train/<class>/* and DIR/test/<class>/* (subdirectories of a
    class included), classes sorted by name (label i: the i-th name), files sorted by path. Images are read with
    Pillow, as 8-bit grayscale (modes 1, L, LA) or RGB (every other mode), and must all have the first training
    image's shape; `size=(H, W)` resizes each (bilinear) instead. The test classes are a subset of train's."""
    if not data_dir:
        raise DatasetError("imagefolder: no directory given: pass --data-dir DIR holding train/<class>/ and "
                           "test/<class>/ directories of images")
    root = Path(data_dir)
    classes, train_files, train_y = _class_files(root, "train", None)
    _, test_files, test_y = _class_files(root, "test", classes)
    shape = image_shape(train_files[0], size)
    split = {"train": ImageFolderSplit(train_files, train_y, shape, train_files[0], size),
             "test": ImageFolderSplit(test_files, test_y, shape, train_files[0], size)}
    return Dataset("imagefolder", split["train"], split["test"], num_classes=len(classes), classes=tuple(classes))


def image_folder_files(data_dir: str | None) -> list[Path]:
    if not data_dir:
        return []
    root = Path(data_dir)
    classes, train_files, _ = _class_files(root, "train", None)
    return train_files + _class_files(root, "test", classes)[1]


DATASETS.register("imagefolder", load_image_folder, files=image_folder_files)

# --- LEAF ------------------------------------------------------------------------------------------------------------

# LEAF's Shakespeare alphabet (leaf/models/utils/language_utils.py ALL_LETTERS): a character's index is its label
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _leaf_files(root: Path, split: str) -> list[Path]:
    d = root / split
    files = sorted(d.glob("*.json")) if d.is_dir() else []
    if not files:
        raise DatasetError(f"leaf: no .json files in {d}: --data-dir must hold LEAF's train/ and test/ "
                           f"directories of JSON files (users, num_samples, user_data)")
    return files


def _leaf_parse(path: Path) -> list[tuple[str, list, list]]:
    """[(user, x, y)] of one LEAF JSON file, in its `users` order, checked."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise DatasetError(f"leaf: {path} is not JSON ({e}): give LEAF's JSON files") from None
    if not isinstance(d, dict) or not isinstance(d.get("users"), list) or not isinstance(d.get("user_data"), dict):
        raise DatasetError(f"leaf: {path} has no 'users' list and 'user_data' map: give LEAF's JSON layout "
                           f"({{\"users\": [...], \"num_samples\": [...], \"user_data\": {{user: {{\"x\": [...], "
                           f"\"y\": [...]}}}}}})")
    counts = d.get("num_samples")
    out = []
    for k, u in enumerate(d["users"]):
        data = d["user_data"].get(u)
        if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
            raise DatasetError(f"leaf: {path} user {u!r} has no user_data with lists x and y: fix the file")
        x, y = data["x"], data["y"]
        if len(x) != len(y) or (isinstance(counts, list) and k < len(counts) and counts[k] != len(y)):
            raise DatasetError(f"leaf: {path} user {u!r} has {len(x)} x, {len(y)} y"
                               f"{f', num_samples {counts[k]}' if isinstance(counts, list) and k < len(counts) else ''}"
                               f": give each user as many x as y (and num_samples)")
        out.append((str(u), x, y))
    return out


def _leaf_text(s: object, path: Path, user: str) -> list[int]:
    idx = [LEAF_LETTERS.find(c) for c in s] if isinstance(s, str) else [-1]
    if -1 in idx:
        bad = s[idx.index(-1)] if isinstance(s, str) else s
        raise DatasetError(f"leaf: {path} user {user!r} has {bad!r}, not a character of LEAF's Shakespeare "
                           f"alphabet: give LEAF's preprocessed data")
    return idx


def _leaf_x(xs: list, text: bool, path: Path, user: str) -> np.ndarray:
    """One user's x rows: character indices (Shakespeare) or numbers (FEMNIST: 784 floats), as float32."""
    try:
        if text:
            return np.array([_leaf_text(s, path, user) for s in xs], dtype=np.float32).reshape(len(xs), -1)
        return np.array(xs, dtype=np.float32).reshape(len(xs), -1)
    except (ValueError, TypeError):
        what = "strings" if text else "lists of numbers"
        raise DatasetError(f"leaf: {path} user {user!r} has x rows that are not {what} of one length: give LEAF's "
                           f"preprocessed data") from None


def _leaf_y(ys: list, text: bool, path: Path, user: str) -> np.ndarray:
    if text:
        bad = next((c for c in ys if not (isinstance(c, str) and len(c) == 1)), None)
        if bad is not None:
            raise DatasetError(f"leaf: {path} user {user!r} has the label {bad!r}, not one character: give LEAF's "
                               f"preprocessed Shakespeare data")
        return np.array([_leaf_text(c, path, user)[0] for c in ys], dtype=np.int64)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ys):
        raise DatasetError(f"leaf: {path} user {user!r} has labels that are not integers: give class indices")
    return np.array(ys, dtype=np.int64)


class LeafSplit:
    """One split of a LEAF dataset as a map-style dataset: rows in file order (files sorted by name), then the
    file's `users` order, then sample order; `targets` and `owners` (the writer of each row: its user's index
    among the training users, -1 for a test user who has no training data) kept, x re-read by `rows` from the
    files that hold the rows asked for."""

    def __init__(self, files: list[Path], users: dict[str, int] | None, text: bool | None = None):
        self.files, self.text = files, text
        ys, owners, self.starts, self.users = [], [], [], dict(users or {})
        n = 0
        for path in files:
            self.starts.append(n)
            for u, x, y in _leaf_parse(path):
                if self.text is None and x:
                    self.text = isinstance(x[0], str)   # Shakespeare: strings; FEMNIST: lists of numbers
                text = bool(self.text)
                if users is None:
                    if u in self.users:
                        raise DatasetError(f"leaf: {path} repeats user {u!r} of an earlier file: give each user "
                                           f"once per split")
                    if not y:
                        raise DatasetError(f"leaf: {path} user {u!r} has no samples: remove the user")
                    self.users[u] = len(self.users)
                ys.append(_leaf_y(y, text, path, u))
                owners.append(np.full(len(y), self.users.get(u, -1), dtype=np.int64))
                n += len(y)
        self.starts.append(n)
        self.targets = np.concatenate(ys) if ys else np.zeros(0, dtype=np.int64)
        self.owners = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.targets)

    def rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        out: np.ndarray | None = None
        for k, path in enumerate(self.files):
            lo, hi = self.starts[k], self.starts[k + 1]
            mine = np.flatnonzero((rows >= lo) & (rows < hi))
            if not mine.size and (out is not None or rows.size):
                continue
            parsed = _leaf_parse(path)
            x = [_leaf_x(xs, self.text, path, u) for u, xs, _ in parsed if xs]
            x = np.concatenate(x) if x else np.zeros((0, 0), dtype=np.float32)
            if len(x) != hi - lo:
                raise DatasetError(f"leaf: {path} changed while it was read: read it again")
            if out is None:
                out = np.empty((rows.size, *x.shape[1:]), dtype=np.float32)
            elif x.shape[1:] != out.shape[1:]:
                raise DatasetError(f"leaf: {path} has x rows of length {x.shape[1]}, {self.files[0]} of "
                                   f"{out.shape[1]}: give every x one length")
            out[mine] = x[rows[mine] - lo]
        out = np.zeros((0, 0), dtype=np.float32) if out is None else out
        side = math.isqrt(out.shape[1]) if out.ndim == 2 and out.shape[1] else 0
        if not self.text and side * side == out.shape[1] and side > 1:
            out = out.reshape(len(out), 1, side, side)   # FEMNIST: 784 values are a 1x28x28 image
        return out, self.targets[rows]

    def __getitem__(self, i: int):
        x, y = self.rows(np.array([i]))
        return x[0], int(y[0])


def load_leaf(data_dir: str | None) -> Dataset:
    """`--dataset leaf --data-dir DIR`: LEAF's DIR/train/*.json and DIR/test/*.json. FEMNIST (x: 784 floats, kept
    as they are, as 1x28x28; y: 0..61) and any numeric LEAF data (x: n numbers, a square number as 1xHxH, else
    features [n]); Shakespeare (x: strings of 80 characters, y: the next character) as float32 character indices
    into LEAF's 80-letter alphabet (labels 0..79). Each training user is one writer: --partition natural gives each
    user to one client, in the order the users appear. num_classes: 80 for text, else the largest label + 1."""
    if not data_dir:
        raise DatasetError("leaf: no directory given: pass --data-dir DIR holding LEAF's train/ and test/ "
                           "directories of JSON files")
    root = Path(data_dir)
    train_files, test_files = _leaf_files(root, "train"), _leaf_files(root, "test")
    train = LeafSplit(train_files, None)
    text = bool(train.text)
    test = LeafSplit(test_files, train.users, text)
    if not len(train):
        raise DatasetError(f"leaf: {root / 'train'} holds no samples: give LEAF's training JSON files")
    k = len(LEAF_LETTERS) if text else max(int(train.targets.max()), int(test.targets.max(initial=-1))) + 1
    bad = train.targets.min() < 0 or (len(test) and test.targets.min() < 0)
    if bad:
        raise DatasetError(f"leaf: {root} has negative labels: labels must be class indices 0..num_classes-1")
    return Dataset("leaf", train, test, num_classes=k)


def leaf_files(data_dir: str | None) -> list[Path]:
    if not data_dir:
        return []
    root = Path(data_dir)
    return _leaf_files(root, "train") + _leaf_files(root, "test")


DATASETS.register("leaf", load_leaf, files=leaf_files)
