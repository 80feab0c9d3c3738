"""Files that grow by appends, read incrementally (the dashboard's run data, coordinator/dashboard/rundata.py).

The run writes its files by appending lines (metrics.jsonl, participation.csv, reports.jsonl, field.jsonl,
log.jsonl, the agents' trace.csv) and rewrites them atomically only on --resume. `LineFile` therefore reads
only the bytes appended since the last poll, and starts over when the file was replaced or shrank. A last
line without its newline is still being written: it waits for the next poll. Any other line that does not
parse is reported in `problems` (file and line) and shown on the page: nothing is skipped silently.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from pathlib import Path


class LineFile:
    """The complete lines of a file that grows by appends, each parsed by `parse(text)` once."""

    def __init__(self, path: Path, parse: Callable[[str], object]):
        self.path, self.parse = path, parse
        self._reset(None)

    def _reset(self, key) -> None:
        self.rows: list = []
        self.problems: list[str] = []
        self._key, self._offset, self._lines = key, 0, 0

    def version(self) -> str:
        """Changes when the file was replaced or grew by a complete line."""
        return f"{self._key[1] if self._key else 0}:{self._offset}"

    def update(self) -> bool:
        """Read what was appended; True if rows changed."""
        try:
            st = os.stat(self.path)
        except OSError:  # not written yet (or removed)
            changed = bool(self.rows or self.problems)
            self._reset(None)
            return changed
        key = (st.st_dev, st.st_ino)
        if key != self._key or st.st_size < self._offset:  # replaced (a resume) or truncated: start over
            self._reset(key)
        if st.st_size == self._offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        end = data.rfind(b"\n") + 1  # the part after the last newline is still being written
        before = len(self.rows)
        for raw in data[:end].splitlines():
            self._lines += 1
            if not raw.strip():
                continue
            try:
                row = self.parse(raw.decode())
            except (ValueError, UnicodeDecodeError) as e:
                self.problems.append(f"{self.path.name}:{self._lines}: {str(e)[:120]}")
                continue
            if row is not None:
                self.rows.append(row)
        self._offset += end
        return len(self.rows) != before or end > 0


def json_object(text: str) -> dict:
    row = json.loads(text)
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    return row


class CsvFile(LineFile):
    """A CSV file whose first line is its header (participation.csv, an agent's trace.csv)."""

    def __init__(self, path: Path, need: tuple[str, ...]):
        self.need = need
        super().__init__(path, self._row)

    def _reset(self, key) -> None:
        super()._reset(key)
        self.header: list[str] | None = None
        self.bad_header = False

    def _row(self, text: str):
        values = next(csv.reader([text]))
        if self.bad_header:  # reported once, at line 1: the file is not read
            return None
        if self.header is None:
            if not set(self.need) <= set(values):
                self.bad_header = True
                raise ValueError(f"header lacks columns {sorted(set(self.need) - set(values))}; file not read")
            self.header = values
            return None
        if len(values) != len(self.header):
            raise ValueError(f"{len(values)} fields, the header has {len(self.header)}")
        return dict(zip(self.header, values))
