"""The per-round participation log (schema in docs/traces.md) and its replay as an availability model.

`participation.csv` has one row per client per round:

    round,client,status,reason
    3,7,participated,
    3,8,unavailable,battery
    3,9,not_selected,
    3,10,dropped,deadline

status: participated (update aggregated) | unavailable (could not take part; reason says why) |
not_selected (available, the strategy chose others) | dropped (selected, but its update did not
arrive or was rejected; reason says why).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from coordinator.availability.models import RoundAvailability
from coordinator.errors import UserError

FIELDS = ("round", "client", "status", "reason")
STATUSES = ("participated", "unavailable", "not_selected", "dropped")


class ParticipationLog:
    """Appends rows to participation.csv, flushing after every round (no data lost on a crash)."""

    def __init__(self, path: Path, resume_from_round: int | None = None):
        self.path = path
        if resume_from_round is not None and path.exists():
            rows = [r for r in read_rows(path) if int(r["round"]) < resume_from_round]
            self._write(rows, "w")
        else:
            self._write([], "w")

    def _write(self, rows, mode):
        with open(self.path, mode, newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if mode == "w":
                w.writeheader()
            w.writerows(rows)

    def write_round(self, t: int, n: int, avail: RoundAvailability, selected: list[int],
                    participated: set[int], dropped: dict[int, str]) -> None:
        sel = set(selected)
        rows = []
        for i in range(n):
            if i in participated:
                rows.append({"round": t, "client": i, "status": "participated", "reason": ""})
            elif i in sel:
                rows.append({"round": t, "client": i, "status": "dropped", "reason": dropped.get(i, "deadline")})
            elif avail.available[i]:
                rows.append({"round": t, "client": i, "status": "not_selected", "reason": ""})
            else:
                rows.append({"round": t, "client": i, "status": "unavailable",
                             "reason": avail.reasons.get(i, "model_draw")})
        self._write(rows, "a")


def read_rows(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                raise UserError(f"--trace: {path} is not a participation log (need columns {', '.join(FIELDS)})")
            return list(reader)
    except OSError as e:
        raise UserError(f"--trace: cannot read {path}: {e.strerror}") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise UserError(f"--trace: {path} is not a readable CSV ({e})") from None


class Replay:
    """Availability model that replays a recorded participation log: clients that participated or
    were not selected are available; unavailable and dropped clients are absent with their reason."""

    name = "replay"

    def __init__(self, path: str | Path, n_clients: int):
        rows = read_rows(Path(path))
        self.n = n_clients
        self.table: dict[int, RoundAvailability] = {}
        for r in rows:
            try:
                t, c, status = int(r["round"]), int(r["client"]), r["status"]
            except (TypeError, ValueError):
                raise UserError(f"--trace: {path}: bad row {r}") from None
            if status not in STATUSES:
                raise UserError(f"--trace: {path}: unknown status {status!r} in round {t}")
            if not (0 <= c < n_clients):
                raise UserError(f"--trace: {path}: client {c} outside 0..{n_clients - 1} (--clients {n_clients})")
            ra = self.table.setdefault(t, RoundAvailability(np.zeros(n_clients, bool)))
            if status in ("participated", "not_selected"):
                ra.available[c] = True
            else:
                ra.reasons[c] = r["reason"] or ("deadline" if status == "dropped" else "trace")
        if not self.table:
            raise UserError(f"--trace: {path} holds no rounds")
        self.rounds = max(self.table) + 1

    def round(self, t: int) -> RoundAvailability:
        if t not in self.table:
            raise UserError(f"--trace: the log has no round {t} (it covers rounds 0..{self.rounds - 1})")
        ra = self.table[t]
        for i in np.flatnonzero(~ra.available):
            ra.reasons.setdefault(int(i), "trace")
        return ra
