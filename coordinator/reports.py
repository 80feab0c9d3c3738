"""What the strategy consumed of the clients' measurements, per round: `reports.jsonl` of a run directory,
and its replay (docs/run-directory.md, docs/traces.md "Replay (exact)").

One JSON object per round:

    {"round": 3,
     "reports": {"0": {"compute_s": 0.012, "up_Bps": 2.1e6, "down_Bps": 8.4e6, "upload_bytes": 31400,
                       "download_bytes": 31400, "label_score": 2.0}, "2": null, ...},
     "tasks": {"0": {"dropout_rate": 0.4, "sparse_download": false}, ...}}

`reports`: every aggregated update's `ClientReport` (edge_client/report.py; null: the update carried
none, e.g. FedAvg in simulation without a clock profile; a field null: not measured). `tasks`: the
task parameters a strategy set for each selected client that it derives from those reports (FedDD's
`dropout_rate` and `sparse_download`); empty for the other strategies. Floats are written with
`repr` precision, so a replay reads back the very numbers the recorded run's strategy saw.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.errors import UserError
from edge_client.report import ClientReport

if TYPE_CHECKING:
    from coordinator.strategies.base import ClientUpdate
    from edge_client.trainer import TrainTask

REPORT_FIELDS = tuple(f.name for f in fields(ClientReport))
TASK_FIELDS = ("dropout_rate", "sparse_download")


def _value(v):
    """A report field as JSON: None stays, numpy scalars become Python numbers, NaN (not measured) None."""
    if v is None:
        return None
    v = v.item() if hasattr(v, "item") else v
    return None if isinstance(v, float) and math.isnan(v) else v


def report_row(r: ClientReport | None) -> dict | None:
    return None if r is None else {k: _value(getattr(r, k)) for k in REPORT_FIELDS}


def task_row(task: TrainTask) -> dict | None:
    """The task parameters a strategy derived from the clients' reports (FedDD), None for a plain task."""
    if task.dropout_rate is None:
        return None
    return {"dropout_rate": float(task.dropout_rate), "sparse_download": bool(task.sparse_download)}


class ReportsLog:
    """Appends one row per round to reports.jsonl. On resume, the rows of rounds after the checkpoint are
    dropped (rewritten atomically, as participation.csv and metrics.jsonl)."""

    def __init__(self, path: Path, resume_from_round: int | None = None):
        self.path = path
        rows = []
        if resume_from_round is not None and path.exists():
            rows = [line for line in path.read_text().splitlines(keepends=True)
                    if line.endswith("\n") and _round_of(line) is not None and _round_of(line) < resume_from_round]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(rows)
        os.replace(tmp, path)

    def write_round(self, t: int, updates: dict[int, ClientUpdate], tasks: list[TrainTask]) -> None:
        row = {"round": t, "reports": {str(i): report_row(u.report) for i, u in sorted(updates.items())},
               "tasks": {str(task.client): task_row(task) for task in tasks if task_row(task) is not None}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _round_of(line: str) -> int | None:
    try:
        t = json.loads(line).get("round")
    except (ValueError, AttributeError):
        return None
    return t if isinstance(t, int) else None


@dataclass
class RecordedRound:
    reports: dict[int, ClientReport | None]
    tasks: dict[int, dict]


def _number(v, where: str, what: str):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{where}: {what} is {v!r}, not a number or null; restore the file, or move it away to "
                        f"replay with the simulation's own measurements")
    return v


def read_reports(path: Path, n_clients: int) -> dict[int, RecordedRound]:
    """The recorded rounds of a reports.jsonl, checked (a row cut off by a crash mid-write is dropped)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--trace: cannot read {path}: {e}") from None
    out: dict[int, RecordedRound] = {}
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--trace: {path}:{line_no}"
        try:
            row = json.loads(line)
            t = row["round"]
            reports, tasks = row["reports"], row.get("tasks", {})
            if not isinstance(t, int) or t < 0 or not isinstance(reports, dict) or not isinstance(tasks, dict):
                raise ValueError("round, reports or tasks of the wrong type")
        except (ValueError, KeyError, TypeError) as e:
            if line_no == len(lines) and not line.endswith("\n"):
                break  # the write of the last row was cut off
            raise UserError(f"{where}: damaged row ({str(e)[:80]}); restore the file, or move it away to replay "
                            f"with the simulation's own measurements") from None
        rec = RecordedRound({}, {})
        for key, table, target in (("reports", reports, rec.reports), ("tasks", tasks, rec.tasks)):
            for c, v in table.items():
                if not c.isdigit() or not 0 <= int(c) < n_clients:
                    raise UserError(f"{where}: {key}: client {c!r} is outside 0..{n_clients - 1}")
                if v is not None and not isinstance(v, dict):
                    raise UserError(f"{where}: {key} of client {c}: {v!r} is not an object or null")
                if key == "reports":
                    target[int(c)] = None if v is None else ClientReport(
                        **{k: _number(v.get(k), where, f"{k} of client {c}") for k in REPORT_FIELDS})
                elif v is not None:
                    target[int(c)] = {"dropout_rate": _number(v.get("dropout_rate"), where, f"dropout_rate of "
                                                                                              f"client {c}"),
                                      "sparse_download": bool(v.get("sparse_download", False))}
        out[t] = rec
    return out
