"""The participation raster's data, from participation.csv or from the columnar log RUN/participation/
(--participation-format npz, coordinator/availability/columnar.py), whichever the run writes.

Both give, per round: a letter per client for the first `MAX_CLIENTS` clients (P participated, D dropped,
N not selected, U unavailable, - no row), the reasons of those clients' D and U, and the count of every
status over all clients (so the counts stay whole when the raster shows only the first clients). The columnar
log is read file by file and each file's rounds are kept until the file changes: a poll reads only the round
files written since the last one (and a chunk once, when the round files are merged into it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from coordinator.availability import columnar
from coordinator.availability.participation import FIELDS, STATUSES
from coordinator.dashboard.files import CsvFile
from coordinator.errors import UserError

MAX_CLIENTS = 1000   # raster and device rows sent; the page says "first 1000 of N" beyond that
STATUS_CODE = {s: s[0].upper() for s in STATUSES}  # P(articipated) U(navailable) N(ot_selected) D(ropped)


def _csv_rounds(rows: list[dict]) -> dict[int, tuple[str, dict[str, str], dict[str, int]]]:
    by_round: dict[int, list[str]] = {}
    reasons: dict[int, dict[str, str]] = {}
    counts: dict[int, dict[str, int]] = {}
    for r in rows:
        t, c, s = int(r["round"]), int(r["client"]), r["status"]
        per = counts.setdefault(t, dict.fromkeys(STATUSES, 0))
        per[s] = per.get(s, 0) + 1
        if c < MAX_CLIENTS:
            letters = by_round.setdefault(t, [])
            letters.extend("-" * (c + 1 - len(letters)))
            letters[c] = STATUS_CODE.get(s, "?")
            if r.get("reason"):
                reasons.setdefault(t, {})[str(c)] = r["reason"]
    return {t: ("".join(by_round.get(t, [])), reasons.get(t, {}), counts[t]) for t in counts}


def _columnar_rounds(rounds: np.ndarray, status: np.ndarray, reason: np.ndarray) -> dict:
    names = ("",) + columnar.REASONS
    letters = np.array([STATUS_CODE[s] for s in columnar.STATUSES])
    shown = min(status.shape[1], MAX_CLIENTS)
    out = {}
    for j, t in enumerate(rounds.tolist()):
        st, why = status[j, :shown], reason[j, :shown]
        n = np.bincount(status[j], minlength=len(columnar.STATUSES))
        out[int(t)] = ("".join(letters[st]), {str(c): names[why[c]] for c in np.flatnonzero(why).tolist()},
                       {s: int(n[k]) for k, s in enumerate(columnar.STATUSES)})
    return out


class ParticipationData:
    """`rounds()`: {round: (letters, reasons, counts)} of the run's participation log; `problems`."""

    def __init__(self, path: Path):
        self.csv = CsvFile(path / "participation.csv", FIELDS)
        self.dir = path / columnar.DIR
        self._files: dict[Path, tuple[tuple[int, int], dict]] = {}
        self.column_problems: dict[Path, str] = {}

    @property
    def problems(self) -> list[str]:
        return list(self.csv.problems) + list(self.column_problems.values())

    def column_problems_list(self) -> list[str]:
        return list(self.column_problems.values())

    def columnar_version(self) -> str:
        """Changes when a file of the columnar log was written, merged or removed ("" without one)."""
        if not self.dir.is_dir():
            return ""
        stats = []
        for p in sorted(self.dir.glob("*.npz")):
            try:
                st = p.stat()
            except OSError:  # merged away meanwhile
                continue
            stats.append(f"{p.name}:{st.st_mtime_ns}:{st.st_size}")
        return str(hash(tuple(stats)))

    def rounds(self) -> dict[int, tuple[str, dict[str, str], dict[str, int]]]:
        self.csv.update()
        if self.csv.rows or not self.dir.is_dir():
            return _csv_rounds(self.csv.rows)
        names = sorted(p for p in self.dir.glob("*.npz") if not p.name.endswith(".tmp.npz"))
        for p in set(self._files) - set(names):
            del self._files[p]
        out: dict = {}
        for p in names:
            try:
                st = os.stat(p)
                key = (st.st_mtime_ns, st.st_size)
                if p not in self._files or self._files[p][0] != key:
                    self._files[p] = (key, _columnar_rounds(*columnar._load(p)))
                self.column_problems.pop(p, None)
            except (OSError, UserError) as e:
                if p.exists():  # else merged into a chunk meanwhile: the chunk holds its rounds
                    self.column_problems[p] = f"{p.parent.name}/{p.name}: {str(e)[:160]}"
                continue
            out.update(self._files[p][1])  # a round in a chunk and in its round file is the same round
        return out
