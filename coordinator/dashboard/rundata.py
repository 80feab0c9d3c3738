"""A run directory read while it grows, for the dashboard's JSON endpoints (coordinator/dashboard/app.py).

Each file is read incrementally (coordinator/dashboard/files.py: only what was appended since the last poll;
a half-written last line waits; a damaged line is reported in `problems`, shown on the page). The
participation log is participation.csv or the columnar RUN/participation/ (coordinator/dashboard/participation.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from coordinator.availability import columnar
from coordinator.availability.participation import STATUSES
from coordinator.dashboard.devices import device_rows
from coordinator.dashboard.files import CsvFile, LineFile, json_object
from coordinator.dashboard.participation import MAX_CLIENTS, ParticipationData
from coordinator.errors import UserError
from coordinator.reports import TASK_FIELDS

TRACE_NEED = ("device", "t_s")  # of an agent's trace.csv; other columns (edge_client/agent/heartbeat.py) if there
LOG_RECORDS = 200    # the last records of log.jsonl sent (info and up)
PANELS = ("accuracy", "loss", "participation", "devices", "dropout", "timing", "log")  # index.html's panels
RUN_MARKERS = ("config.json", "metrics.jsonl", "participation.csv", columnar.DIR, "checkpoint.pt")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)


def check_run_dirs(paths: list[str]) -> list[Path]:
    """`dropfl dashboard RUN_DIR ...`: each must be a run directory (checked before serving)."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_dir():
            raise UserError(f"dashboard: {p} is not a directory; give run directories (the --out of a run)")
        if not is_run_dir(path):
            raise UserError(f"dashboard: {p} holds no run (none of {', '.join(RUN_MARKERS)}); give the --out "
                            f"directory of a `dropfl sim`, `coordinator` or `trial` run")
        out.append(path)
    return out


def progress_text(last_round: int | None, planned: int | None) -> str:
    """`round 5/5` after metrics.jsonl's round 4 of 5: rounds numbered from 1 wherever a person reads them."""
    if last_round is None:
        return f"no round yet (of {planned})" if planned else "no round yet"
    return f"round {last_round + 1}/{planned if planned else '?'}"


def panels(algo: str | None) -> list[str]:
    """The page's panels that apply to a run of `algo`: FedDD's allocated dropout rates only to FedDD (and to a
    run whose algorithm is unknown yet: no config.json)."""
    return [p for p in PANELS if p != "dropout" or algo in (None, "feddd")]


class RunData:
    """One run directory's data for the page. Every method re-reads what was appended (under a lock:
    uvicorn answers requests from a thread pool)."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.metrics = LineFile(path / "metrics.jsonl", json_object)
        self.participation = ParticipationData(path)
        self.reports = LineFile(path / "reports.jsonl", json_object)
        self.field = LineFile(path / "field.jsonl", json_object)
        self.telemetry = LineFile(path / "telemetry.jsonl", json_object)
        self.log = LineFile(path / "log.jsonl", json_object)
        self.traces: dict[Path, CsvFile] = {}

    def _files(self) -> list[LineFile]:
        for p in sorted(self.path.glob("agents/*/trace.csv")):
            self.traces.setdefault(p, CsvFile(p, TRACE_NEED))
        return [self.metrics, self.participation.csv, self.reports, self.field, self.telemetry, self.log,
                *self.traces.values()]

    def config(self) -> dict:
        try:
            return json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return {}

    def kind(self) -> str:
        return "trial" if (self.path / "trial.json").exists() else \
            "field" if (self.path / "field.json").exists() else "sim"

    def finished(self) -> bool:
        return (self.path / "model.pt").exists()

    def summary(self) -> dict:
        """Name, kind and progress of the run, and `version`: it changes whenever a file grew (the page
        fetches the panels only then). What the page prints: `label` (the algorithm, then the run, as the
        report's legends name it), `progress` (`round 5/5`: rounds numbered from 1, as the round loop's
        progress lines and `dropfl sim`'s final line number them; metrics.jsonl's `round` is 0-based), and
        `panels`, those that apply to the run (FedDD's dropout rates only to a FedDD run)."""
        with self.lock:
            files = self._files()
            for f in files:
                f.update()
            cfg = self.config()
            rounds = [r.get("round") for r in self.metrics.rows]
            version = [f.version() for f in files] + [self.participation.columnar_version()]
            algo, planned = cfg.get("strategy", {}).get("algo"), cfg.get("run", {}).get("rounds")
            last = rounds[-1] if rounds else None
            name = self.path.name
            return {"name": name, "path": str(self.path.resolve()), "kind": self.kind(),
                    "algo": algo, "label": name if algo in (None, name) else f"{algo} ({name})",
                    "progress": progress_text(last, planned), "panels": panels(algo),
                    "clients": self._clients(cfg, {}),
                    "rounds_planned": planned, "rounds_done": len(rounds),
                    "last_round": last, "finished": self.finished(),
                    "version": version, "problems": [p for f in files for p in f.problems]
                    + self.participation.column_problems_list()}

    def _clients(self, cfg: dict, rounds: dict) -> int:
        seen = max((sum(counts.values()) for _, _, counts in rounds.values()), default=0)
        return max(int(cfg.get("data", {}).get("clients") or 0), seen)

    def metrics_rows(self) -> dict:
        with self.lock:
            self.metrics.update()
            return {"rows": list(self.metrics.rows), "problems": list(self.metrics.problems)}

    def raster(self) -> dict:
        """Per round, one letter per client (P participated, D dropped, N not selected, U unavailable, - no
        row) for the first MAX_CLIENTS clients, their reasons of D and U, and the counts per status of all."""
        with self.lock:
            per_round = self.participation.rounds()
            n = self._clients(self.config(), per_round)
            shown = min(n, MAX_CLIENTS)
            rounds = sorted(per_round)
            return {"clients": n, "shown": shown, "rounds": rounds,
                    "status": [per_round[t][0].ljust(shown, "-") for t in rounds],
                    "reasons": [per_round[t][1] for t in rounds],
                    "counts": {s: [per_round[t][2].get(s, 0) for t in rounds] for s in STATUSES},
                    "problems": self.participation.problems}

    def dropout(self) -> dict:
        """FedDD's allocated dropout rates (reports.jsonl `tasks`): per round min, mean, max over the
        selected clients, and each client's latest rate."""
        with self.lock:
            self.reports.update()
            rounds, lo, mean, hi, latest = [], [], [], [], {}
            for row in self.reports.rows:
                rates = {c: t["dropout_rate"] for c, t in (row.get("tasks") or {}).items()
                         if isinstance(t, dict) and t.get("dropout_rate") is not None}
                if not rates:
                    continue
                v = list(rates.values())
                rounds.append(row.get("round"))
                lo.append(min(v)), mean.append(sum(v) / len(v)), hi.append(max(v))
                latest.update(rates)
            return {"fields": list(TASK_FIELDS), "rounds": rounds, "min": lo, "mean": mean, "max": hi,
                    "latest": latest, "problems": list(self.reports.problems)}

    def timing(self) -> dict:
        """Seconds per round (metrics.jsonl) and, in field mode, the round's wall time, its slowest
        participant and the coordinator's overhead (field.jsonl round events)."""
        with self.lock:
            self.metrics.update(), self.field.update()
            m = [r for r in self.metrics.rows if "round" in r]
            f = [r for r in self.field.rows if r.get("event") == "round"]
            return {"rounds": [r["round"] for r in m], "seconds": [r.get("seconds") for r in m],
                    "elapsed": [r.get("elapsed") for r in m],
                    "field": {"rounds": [r.get("round") for r in f], "wall_s": [r.get("wall_s") for r in f],
                              "slowest_participant_s": [r.get("slowest_participant_s") for r in f],
                              "overhead_s": [r.get("overhead_s") for r in f]}}

    def log_records(self) -> dict:
        with self.lock:
            self.log.update()
            keep = ("time", "level", "logger", "message")
            shown = [r for r in self.log.rows if r.get("level") != "debug"]  # log.txt has the debug records
            return {"records": [{k: r.get(k) for k in keep} for r in shown[-LOG_RECORDS:]],
                    "total": len(shown), "debug": len(self.log.rows) - len(shown),
                    "problems": list(self.log.problems)}

    def devices(self) -> dict:
        with self.lock:
            for f in self._files():
                f.update()
            per_round = self.participation.rounds()
            n = self._clients(self.config(), per_round)
            out = device_rows(self, per_round, n, min(n, MAX_CLIENTS))
            if self.kind() != "sim" and self.finished():  # the run ended: its agents' last heartbeat is history
                for r in out["rows"]:
                    if r["connection"] == "online":
                        r["connection"] = "gone"
            return out | {"now": time.time()}
