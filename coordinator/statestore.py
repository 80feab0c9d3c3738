"""Per-client state tables (one row per client: MIFA's latest updates, MimiC's corrections, FedLaAvg's table,
SCAFFOLD's control variates, FedDD's device memory) in RAM or in files of the run directory.

    --state-store memory   torch tensors [N, M] in RAM (the default for small runs; checkpoint.pt holds them)
    --state-store disk     one flat file per table under RUN/state/, rows read and written with pread/pwrite
    --state-store auto     disk when a table would hold more than AUTO_DISK_ELEMENTS numbers (N × M), else memory

Why a flat file read by row, and not zarr or LMDB: it adds no dependency, a row is one pread/pwrite at
offset i·M·itemsize (O(1), no index, no compression to undo), and the operating system's page cache keeps
the hot rows, which does not count in the coordinator's resident memory. Why pread/pwrite and not
numpy.memmap / torch.from_file: pages of a mapping that a round touched stay in the process's RSS until the
kernel evicts them, so a run that touches every row (MIFA averages all N every round) would end up with the
whole table resident again; reads into a small buffer do not.

A `DiskTable` answers the indexing the strategies use on their tensors (`t[i]`, `t[i] = row`, `t[idx]`,
`t[idx] = rows`, `t[a:b]`, `.shape`), so a strategy's arithmetic is the same code on both stores and gives
the same bits (tests/test_state_store.py). Reductions over all N rows go through `row_sum`, which sums in
fixed blocks on both stores (so the float rounding order does not depend on the store).

Checkpoints (coordinator/rundir.py): `snapshot` copies every live table file into RUN/checkpoint.state/r<round>/
(a temporary directory renamed into place) before checkpoint.pt is written and renamed, and checkpoint.pt
names that directory; `restore` copies a snapshot back into RUN/state/ on --resume. A crash at any point
leaves checkpoint.pt (and checkpoint.prev.pt) beside a complete snapshot of the same round. Each snapshot is
a copy of the rows written so far (in the kernel, `copy_table`; rows never written are holes of a sparse file
and stay holes): at most N·M numbers per checkpoint, the bytes the memory store's torch.save writes into
checkpoint.pt, but not through the coordinator's memory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

STORES = ("auto", "memory", "disk")
AUTO_DISK_ELEMENTS = 2 ** 26   # auto: a table of more than 64 Mi numbers (256 MiB float32) goes to disk
SUM_BLOCK_BYTES = 2 ** 26      # row_sum: rows are summed in blocks of at most 64 MiB (at least one row)
LIVE, SNAPSHOTS = "state", "checkpoint.state"
REF = "__disk_table__"         # a checkpoint's reference to a snapshot file


class DiskTable:
    """A [n, m] table of `dtype` in one file, row-major, read and written by row (pread/pwrite)."""

    def __init__(self, path: str | Path, n: int, m: int, dtype: torch.dtype = torch.float32, fresh: bool = True):
        self.path, self.shape, self.dtype = Path(path), (n, m), dtype
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self.row_bytes = m * self.np_dtype.itemsize
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if fresh else 0), 0o644)
        size = n * self.row_bytes
        if fresh:
            os.ftruncate(self.fd, size)  # a sparse file: all zeros, nothing written yet
        elif os.fstat(self.fd).st_size != size:
            raise ValueError(f"{self.path}: {os.fstat(self.fd).st_size} bytes, expected {size} ([{n}, {m}] {dtype})")

    def __len__(self) -> int:
        return self.shape[0]

    def _read(self, first: int, count: int) -> torch.Tensor:
        out = np.empty((count, self.shape[1]), self.np_dtype)
        view, pos, end = memoryview(out).cast("B"), 0, count * self.row_bytes
        while pos < end:
            got = os.preadv(self.fd, [view[pos:]], first * self.row_bytes + pos)
            if got <= 0:
                raise OSError(f"{self.path}: short read at row {first}")
            pos += got
        return torch.from_numpy(out)

    def _write(self, first: int, rows: torch.Tensor) -> None:
        data = np.ascontiguousarray(rows.detach().to(self.dtype).reshape(-1, self.shape[1]).numpy())
        view, pos = memoryview(data).cast("B"), 0
        while pos < len(view):
            pos += os.pwrite(self.fd, view[pos:], first * self.row_bytes + pos)

    def _index(self, key) -> list[int]:
        idx = key.tolist() if isinstance(key, (torch.Tensor, np.ndarray)) else list(key)
        n = self.shape[0]
        for i in idx:
            if not -n <= i < n:
                raise IndexError(f"row {i} of a table of {n}")
        return [i % n for i in idx]

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, (int, np.integer)):
            return self._read(self._index([int(key)])[0], 1)[0]
        if isinstance(key, slice):
            a, b, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("DiskTable: slices with a step are not supported")
            return self._read(a, max(0, b - a))
        return torch.stack([self._read(i, 1)[0] for i in self._index(key)]) if len(key) else \
            torch.empty((0, self.shape[1]), dtype=self.dtype)

    def __setitem__(self, key, value) -> None:
        value = torch.as_tensor(value)
        if isinstance(key, (int, np.integer)):
            self._write(self._index([int(key)])[0], value.expand(self.shape[1]))
            return
        if isinstance(key, slice):
            a, b, _ = key.indices(self.shape[0])
            self._write(a, value.expand(b - a, self.shape[1]))
            return
        idx = self._index(key)
        rows = value.expand(len(idx), self.shape[1])
        for j, i in enumerate(idx):  # in order: a repeated index ends with its last row, as torch's index_put
            self._write(i, rows[j])

    def fill(self, row: torch.Tensor) -> None:
        """Every row = `row`, written in blocks (Stale-like initial tables)."""
        block = max(1, SUM_BLOCK_BYTES // max(self.row_bytes, 1))
        for a in range(0, self.shape[0], block):
            b = min(a + block, self.shape[0])
            self._write(a, row.expand(b - a, self.shape[1]))

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()

    def __reduce__(self):
        raise TypeError(f"a DiskTable ({self.path}) is not pickled: checkpoints reference a snapshot "
                        f"(coordinator/statestore.py snapshot)")


Table = torch.Tensor | DiskTable


def copy_table(src: Path, dst: Path) -> None:
    """Copy a table file in the kernel (copy_file_range), its data only: the holes of a sparse file (rows never
    written, all zeros) stay holes, so a snapshot of an [N, M] table costs the rows written so far, not N·M."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        fd, gd, size = f.fileno(), g.fileno(), os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole up to the end
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            while start < end:
                try:
                    done = os.copy_file_range(fd, gd, end - start, start, start)
                except OSError:  # a file system or kernel without it: through a 16 MiB buffer
                    done = os.pwrite(gd, os.pread(fd, min(end - start, 2 ** 24), start), start)
                if done <= 0:
                    raise OSError(f"{src}: copy stopped at byte {start}")
                start += done
            pos = end
        os.ftruncate(gd, size)


def row_sum(table: Table) -> torch.Tensor:
    """Σ_i table[i] over all N rows, summed in blocks of B = max(1, SUM_BLOCK_BYTES // row bytes) rows, in
    order: s = Σ_b (table[bB:(b+1)B].sum(0)). The same on both stores, bitwise. For N ≤ B (every run of the
    papers: N ≤ 1 000 with a model under 16 000 parameters, N ≤ 377 for mimic-cnn) it is exactly table.sum(0),
    as before the store existed; above, the float rounding order is that of the blocks. On the disk store
    this reads all N rows (O(N) per call, from the page cache or the disk): MIFA's rule averages all N, and
    a running sum updated in O(K) would not give the same bits."""
    n, m = table.shape
    block = max(1, SUM_BLOCK_BYTES // max(1, m * 4))
    total = table[0:block].sum(0)
    for a in range(block, n, block):
        total += table[a:a + block].sum(0)
    return total


class StateStore:
    """Where a run's per-client tables live: kind "memory" (torch tensors) or "disk" (files under `root`)."""

    def __init__(self, kind: str = "memory", root: str | Path | None = None):
        if kind not in ("memory", "disk"):
            raise ValueError(f"state store {kind!r}: memory or disk")
        if kind == "disk" and root is None:
            raise ValueError("the disk state store needs the run directory")
        self.kind, self.root = kind, Path(root) if root is not None else None

    def zeros(self, name: str, n: int, m: int, dtype: torch.dtype = torch.float32) -> Table:
        """A new table of zeros, [n, m]."""
        if self.kind == "memory":
            return torch.zeros(n, m, dtype=dtype)
        return DiskTable(self.root / LIVE / f"{name}.bin", n, m, dtype)

    def adopt(self, name: str, value) -> Table:
        """`value` (a tensor, a DiskTable, or a checkpoint's snapshot reference) as a table of this store."""
        if isinstance(value, dict) and REF in value:
            if self.root is None:
                raise ValueError("a checkpoint with disk tables is resumed in its run directory")
            src, (n, m), dtype = self.root / value[REF], value["shape"], getattr(torch, value["dtype"])
            if self.kind == "memory":
                snap = DiskTable(src, n, m, dtype, fresh=False)
                try:
                    return snap[0:n]
                finally:
                    snap.close()
            live = self.root / LIVE / f"{name}.bin"
            live.parent.mkdir(parents=True, exist_ok=True)
            copy_table(src, live)  # the live table is written from here on; the snapshot stays as it was
            return DiskTable(live, n, m, dtype, fresh=False)
        if self.kind == "memory":
            return value[0:len(value)] if isinstance(value, DiskTable) else value
        if isinstance(value, DiskTable):
            return value
        table = self.zeros(name, *value.shape, dtype=value.dtype)
        table[0:len(value)] = value
        return table


def auto_kind(kind: str, n_clients: int, n_params: int) -> str:
    """--state-store auto: disk when an [N, M] table would hold more than AUTO_DISK_ELEMENTS numbers."""
    if kind != "auto":
        return kind
    return "disk" if n_clients * n_params > AUTO_DISK_ELEMENTS else "memory"


def _walk(obj, fn):
    """`obj` (nested dicts and lists) with every DiskTable / snapshot reference replaced by fn(path, value)."""
    def go(path, v):
        if isinstance(v, DiskTable) or (isinstance(v, dict) and REF in v):
            return fn(path, v)
        if isinstance(v, dict):
            return {k: go(f"{path}.{k}" if path else str(k), x) for k, x in v.items()}
        if isinstance(v, list):
            return [go(f"{path}.{j}", x) for j, x in enumerate(v)]
        return v
    return go("", obj)


def snapshot(ck: dict, run: Path) -> dict:
    """`ck` with every DiskTable replaced by a reference to a copy in RUN/checkpoint.state/r<round>/ (written
    to a temporary directory, then renamed: the directory exists only when complete)."""
    tables: dict[str, DiskTable] = {}

    def collect(path, v):
        if isinstance(v, DiskTable):
            tables[path] = v
        return v
    _walk(ck, collect)
    if not tables:
        return ck
    name = f"r{ck['round']}"
    final, tmp = run / SNAPSHOTS / name, run / SNAPSHOTS / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path, t in tables.items():
        copy_table(t.path, tmp / f"{path}.bin")  # in the kernel, not via RAM; holes stay holes
    shutil.rmtree(final, ignore_errors=True)  # a stale snapshot of this round from a run resumed before it
    os.replace(tmp, final)
    return _walk(ck, lambda path, t: {REF: f"{SNAPSHOTS}/{name}/{path}.bin", "shape": list(t.shape),
                                      "dtype": str(t.dtype).removeprefix("torch.")})


def check_snapshots(ck: dict, run: Path) -> str | None:
    """None if every table a checkpoint refers to is there with its size, else what is wrong (for --resume,
    checked before anything is written)."""
    problems: list[str] = []

    def check(path, ref):
        if isinstance(ref, dict):
            f = run / ref[REF]
            n, m = ref["shape"]
            size = n * m * torch.empty(0, dtype=getattr(torch, ref["dtype"])).element_size()
            if not f.is_file():
                problems.append(f"{f} is missing")
            elif f.stat().st_size != size:
                problems.append(f"{f} has {f.stat().st_size} bytes, not {size}")
        return ref
    _walk(ck, check)
    return "; ".join(problems) or None


def referenced(ck: dict | None) -> set[str]:
    """The snapshot directories a checkpoint refers to."""
    out: set[str] = set()
    if ck is not None:
        _walk(ck, lambda path, v: out.add(Path(v[REF]).parent.name) or v)
    return out


def prune(run: Path, keep: set[str]) -> None:
    """Remove snapshot directories no checkpoint refers to (after checkpoint.pt was renamed into place)."""
    root = run / SNAPSHOTS
    if root.is_dir():
        for d in root.iterdir():
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
