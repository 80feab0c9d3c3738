"""glibc malloc settings for the processes that evaluate and aggregate models: keep freed memory for reuse.

Measured (benchmarks/results/malloc.md): evaluating the MimiC CNN on the 10,000 FMNIST test images in
batches of 2,000 allocates buffers of 28-115 MB (activations, oneDNN's im2col) and frees them again.
With glibc's defaults each one is a fresh mmap (or a trimmed heap) and its pages are faulted in again:
~160,000 page faults and a third of the evaluation's CPU time in the kernel, each time. In a sweep the
coordinator's process evaluates 15 runs a round, each in its own thread (coordinator/sim/lockstep.py),
and that time is spent while the training workers wait.

Two calls, both once per process:
- `one_arena()` (when `coordinator.cli` is imported, before torch starts its first thread): M_ARENA_MAX 1,
  one heap for all threads. A thread's own arena is a chain of 64 MB heaps that cannot hold a larger
  buffer (oneDNN's 115 MB im2col is always a fresh mmap there), and a buffer one run's thread frees is
  then not reused by the next run's. Set after a second thread has allocated, it no longer helps.
- `keep_freed_memory()` (`dropfl sim`, `reproduce`, `coordinator`): M_MMAP_THRESHOLD 256 MB, so
  allocations below it come from the heap, not from fresh mmaps; M_TRIM_THRESHOLD 512 MB, so up to that
  much freed memory stays in the process for the next allocation.

The engines' training workers make the same two calls with their own thresholds (1 GiB each,
`coordinator.sim.batched._keep_freed_memory`): their steps allocate and free activations of a few MB.

Numbers are unchanged (where memory comes from does not change any arithmetic; tests/test_alloc.py runs a
simulation both ways). The cost is resident memory that is not returned at once: at most 512 MB of freed
heap. Only glibc has these knobs (elsewhere this is a no-op); `DROPFL_MALLOC=default` keeps glibc's own
settings. The edge agent does not call it: its footprint is budgeted (docs/devices.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys

log = logging.getLogger("dropfl.alloc")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8   # glibc <malloc.h>
ARENAS = ((M_ARENA_MAX, 1),)
_applied: dict[tuple, bool] = {}


def _mallopt(settings: tuple) -> bool:
    """Apply `settings` with glibc's mallopt, once per process; False where not glibc or DROPFL_MALLOC=default."""
    if settings in _applied:
        return _applied[settings]
    ok = False
    if os.environ.get("DROPFL_MALLOC", "").strip().lower() not in ("default", "off", "0") \
            and sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = all(libc.mallopt(option, value) == 1 for option, value in settings)
        except (OSError, AttributeError):
            ok = False
    _applied[settings] = ok
    return ok


def one_arena() -> bool:
    """One malloc arena for every thread (see above); call before a second thread allocates."""
    return _mallopt(ARENAS)


def keep_freed_memory(mmap_below: int = 256 << 20, keep: int = 512 << 20) -> bool:
    """Serve allocations below `mmap_below` bytes from the heap and keep up to `keep` bytes of freed memory for
    reuse (the coordinator's process: 256 and 512 MB; the engines' training workers: 1 GiB each,
    `batched._keep_freed_memory`)."""
    ok = _mallopt(((M_MMAP_THRESHOLD, mmap_below), (M_TRIM_THRESHOLD, keep)))
    log.debug("malloc: %s", "freed memory kept for reuse (coordinator/alloc.py)" if ok else "glibc's defaults")
    return ok
