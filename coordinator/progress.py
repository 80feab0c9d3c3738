"""Progress bars of the long commands that are not the round loop (dropfl report over many runs, dropfl trace
import-fedscale): tqdm on a terminal (done, rate, time left), nothing when stderr is not a terminal or with
--no-progress / --quiet (coordinator/cli/__init__.py sets `args.no_progress` for --quiet).

The round loop has its own (coordinator/loop.py): the same bar on a terminal, and elsewhere one line per
evaluation (round, accuracy, participants, time left), which a log file keeps; `dropfl trial` shows its
coordinator's. Errors and warnings are log records and never depend on these switches.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator


def bar(items: Iterable, *, total: int | None = None, desc: str, unit: str, enabled: bool = True) -> Iterator:
    """`items`, through a tqdm bar on a terminal when `enabled`; else `items` as they are."""
    if not enabled or not sys.stderr.isatty():
        return iter(items)
    from tqdm import tqdm
    return iter(tqdm(items, total=total, desc=desc, unit=unit, dynamic_ncols=True))
