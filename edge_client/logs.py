"""Logging for the coordinator and the agent, through the standard `logging` module.

Loggers are named `dropfl.<part>` (`dropfl.run`, `dropfl.field`, `dropfl.agent`, `dropfl.trial`, …).
`setup(level)` sends human lines to stderr; `attach_run_files(dir)` adds the run directory's two logs:

    log.txt     the same human lines, with a timestamp
    log.jsonl   one JSON object per record: {"time", "level", "logger", "message", ...extra fields}

Extra structured fields go in `extra={"fields": {...}}` and appear as keys of the JSON line.
Lives on the device side because the agent, which may not import `coordinator`, logs the same way.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")
ROOT = "dropfl"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        row = {"time": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        row |= getattr(record, "fields", None) or {}
        if record.exc_info:
            row["exception"] = self.formatException(record.exc_info)
        return json.dumps(row, default=str)


class _Human(logging.Formatter):
    """`[coordinator] text` / `[agent client-3] text`, as the earlier print-based lines read."""

    def format(self, record: logging.LogRecord) -> str:
        who = getattr(record, "who", None) or record.name.removeprefix(ROOT + ".")
        return f"[{who}] {record.getMessage()}"


def setup(level: str = "info") -> logging.Logger:
    """Configure the `dropfl` logger: stderr at `level`. Idempotent (re-running replaces the handler)."""
    root = logging.getLogger(ROOT)
    root.setLevel(logging.DEBUG)
    for h in [h for h in root.handlers if getattr(h, "_dropfl", None) == "stderr"]:
        root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(level.upper())
    h.setFormatter(_Human())
    h._dropfl = "stderr"
    root.addHandler(h)
    return root


def attach_run_files(directory: str | Path, level: str = "debug") -> None:
    """Add `log.txt` and `log.jsonl` in `directory` (appending: a resumed run keeps its earlier lines).
    Handlers of an earlier run directory in the same process are closed first."""
    root = logging.getLogger(ROOT)
    if not any(getattr(h, "_dropfl", None) == "stderr" for h in root.handlers):
        setup()
    detach_run_files()
    d = Path(directory)
    for name, fmt in (("log.txt", logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")),
                      ("log.jsonl", JsonLines())):
        h = logging.FileHandler(d / name, encoding="utf-8")
        h.setLevel(level.upper())
        h.setFormatter(fmt)
        h._dropfl = "run"
        root.addHandler(h)


def detach_run_files() -> None:
    root = logging.getLogger(ROOT)
    for h in [h for h in root.handlers if getattr(h, "_dropfl", None) == "run"]:
        root.removeHandler(h)
        h.close()
