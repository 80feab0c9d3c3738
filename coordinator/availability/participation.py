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

The statuses keep three things apart: availability (unavailable vs the rest), the strategy's selection
(participated + dropped), and what happened after selection (dropped vs participated). `Replay` gives all
three back to the round loop (`LoggedRound`), so a replay reproduces the recorded run exactly. When the
recorded run's `reports.jsonl` is beside the log (coordinator/reports.py), a replay of the log's selection
also gives back what the clients measured (`LoggedRound.reports`) and the tasks the strategy set from it
(`LoggedRound.tasks`, FedDD's dropout rates).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.availability.models import REASONS, RoundAvailability
from coordinator.errors import UserError
from coordinator.reports import read_reports
from edge_client.report import ClientReport

log = logging.getLogger("dropfl.replay")

FIELDS = ("round", "client", "status", "reason")
STATUSES = ("participated", "unavailable", "not_selected", "dropped")


@dataclass
class LoggedRound(RoundAvailability):
    """A recorded round: who was available (`available`, `reasons`), whom the strategy selected
    (`selected`: participated + dropped, ascending) and which of them dropped after selection, with the
    recorded reason (`drops`). The round loop uses the recorded selection instead of the strategy's and
    leaves the dropped clients' updates out of the aggregate (coordinator/loop.py; docs/traces.md).
    With the recorded run's reports.jsonl: `reports`, what each aggregated client measured (its updates in
    the replay carry these instead of the simulation's), and `tasks`, the task parameters the strategy
    set from them ({client: {dropout_rate, sparse_download}}, FedDD); None without reports.jsonl."""

    selected: list[int] = field(default_factory=list)
    drops: dict[int, str] = field(default_factory=dict)
    reports: dict[int, ClientReport | None] | None = None
    tasks: dict[int, dict] | None = None


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
        """mode "w" rewrites the file atomically (temporary file, then rename): a crash during a resume's
        rewrite leaves the old log whole; mode "a" appends a round."""
        target = self.path.with_name(self.path.name + ".tmp") if mode == "w" else self.path
        with open(target, mode, newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if mode == "w":
                w.writeheader()
            w.writerows(rows)
        if mode == "w":
            os.replace(target, self.path)

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
    return [r for _, r in numbered_rows(path)]


def numbered_rows(path: Path) -> list[tuple[int, dict]]:
    """The log's rows, each with the line of the file it ends on (for error messages)."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or not set(FIELDS) <= set(reader.fieldnames):
                raise UserError(f"--trace: {path} is not a participation log (need columns {', '.join(FIELDS)})")
            return [(reader.line_num, r) for r in reader]
    except OSError as e:
        raise UserError(f"--trace: cannot read {path}: {e.strerror}") from None
    except (csv.Error, UnicodeDecodeError) as e:
        raise UserError(f"--trace: {path} is not a readable CSV ({e})") from None


def _spans(xs, most: int = 8) -> str:
    """[1, 2, 3, 7, 9, 10] -> '1..3, 7, 9..10' (at most `most` spans, then '...')."""
    spans: list[list[int]] = []
    for x in sorted(xs):
        if spans and x == spans[-1][1] + 1:
            spans[-1][1] = x
        else:
            spans.append([x, x])
    return _fmt_spans(spans, most)


def _fmt_spans(spans, most: int = 8) -> str:
    text = [str(a) if a == b else f"{a}..{b}" for a, b in spans[:most]]
    return ", ".join(text + (["..."] if len(spans) > most else []))


def _gaps(present) -> list[tuple[int, int]]:
    """The runs of integers in 0..max(present) that are not in `present`, as (first, last) pairs."""
    gaps, prev = [], -1
    for t in sorted(present):
        if t > prev + 1:
            gaps.append((prev + 1, t - 1))
        prev = t
    return gaps


class Replay:
    """Replays a recorded participation log exactly (docs/traces.md): `round(t)` is a `LoggedRound`.
    Available: the clients that participated, were not selected or dropped (a dropped client was
    selected, so it was available); unavailable clients are absent with their reason. Selected: the
    participated and dropped clients. Drops: the dropped clients with their reason (empty: deadline)."""

    name = "replay"

    def __init__(self, path: str | Path, n_clients: int, selection: str = "log"):
        """Reads and checks the whole log up front (so a bad log fails before a run starts): integer
        round >= 0 and client in 0..n_clients-1, a known status and reason, one row per (round,
        client), and every client in every round 0..last. With selection "log", the recorded run's
        reports.jsonl beside the log (if there) too: a row for every round of the log."""
        if selection not in ("log", "strategy"):
            raise ValueError(f"selection {selection!r}")
        self.n, self.selection = n_clients, selection
        self.table: dict[int, RoundAvailability] = {}
        if Path(path).is_dir():  # RUN/participation/, the columnar log (coordinator/availability/columnar.py)
            self._read_columnar(Path(path), n_clients)
        else:
            self._read_csv(path, n_clients)
        if not self.table:
            raise UserError(f"--trace: {path} holds no rounds")
        for ra in self.table.values():
            ra.selected.sort()
        self.rounds = max(self.table) + 1
        gaps = _gaps(self.table)
        if gaps:
            several = len(gaps) > 1 or gaps[0][0] != gaps[0][1]
            raise UserError(f"--trace: {path} lacks round{'s' if several else ''} {_fmt_spans(gaps)} "
                            f"(it has rounds up to {self.rounds - 1}); a replayed log needs every round from 0 "
                            f"on: re-record it, or cut it before the first missing round")
        self.reports_path: Path | None = None
        reports = Path(path).with_name("reports.jsonl")
        if selection == "log" and reports.is_file():
            self._attach_reports(reports, n_clients)

    def _read_csv(self, path, n_clients: int) -> None:
        """participation.csv's rows into `self.table`, each checked (see __init__)."""
        seen: dict[tuple[int, int], int] = {}
        fix = "fix or re-record the log (schema: docs/traces.md)"
        for line, r in numbered_rows(Path(path)):
            where = f"--trace: {path}:{line}"
            if None in r or any(r[k] is None for k in FIELDS):
                header = sum(k is not None for k in r)
                got = header - sum(v is None for k, v in r.items() if k is not None) + len(r.get(None) or [])
                raise UserError(f"{where}: the row has {got} fields, the header {header}; {fix}")
            t, c = (self._int(where, r, k, fix) for k in ("round", "client"))
            status, reason = r["status"], r["reason"]
            if not (0 <= c < n_clients):
                raise UserError(f"{where}: column 'client': client {c} is outside 0..{n_clients - 1} "
                                f"(--clients {n_clients}); replay with the --clients of the recorded run")
            if status not in STATUSES:
                raise UserError(f"{where}: column 'status': unknown status {status!r} (one of {', '.join(STATUSES)}); "
                                f"{fix}")
            if reason and reason not in REASONS:
                raise UserError(f"{where}: column 'reason': unknown reason {reason!r} (empty or one of "
                                f"{', '.join(REASONS)}); {fix}")
            if (t, c) in seen:
                raise UserError(f"{where}: round {t}, client {c} again (first on line {seen[t, c]}); "
                                f"keep one row per client per round")
            seen[t, c] = line
            ra = self.table.setdefault(t, LoggedRound(np.zeros(n_clients, bool)))
            if status == "unavailable":
                ra.reasons[c] = reason or "trace"
            else:
                ra.available[c] = True
            if status in ("participated", "dropped"):
                ra.selected.append(c)
            if status == "dropped":
                ra.drops[c] = reason or "deadline"
        for t in sorted(self.table):  # a round that is there at all has every client (absent rounds: __init__)
            missing = [c for c in range(n_clients) if (t, c) not in seen]
            if missing:
                raise UserError(f"--trace: {path}: round {t} has no row for client{'s' if len(missing) > 1 else ''} "
                                f"{_spans(missing)} (--clients {n_clients}); replay with the --clients of the "
                                f"recorded run (the log has a row for every client in every round)")

    def _read_columnar(self, path: Path, n_clients: int) -> None:
        """A columnar log's rounds into `self.table`: the same LoggedRounds as its rows in a CSV would give."""
        from coordinator.availability import columnar

        rounds, status, reason = columnar.read_columnar(path)
        if status.shape[1] != n_clients:
            raise UserError(f"--trace: {path} has {status.shape[1]} clients per round, --clients is {n_clients}; "
                            f"replay with the --clients of the recorded run")
        names = ("",) + REASONS
        for t, st, rs in zip(rounds.tolist(), status, reason):
            ra = LoggedRound(st != columnar.UNAVAILABLE)
            absent = np.flatnonzero(st == columnar.UNAVAILABLE)
            ra.reasons = {int(i): names[rs[i]] or "trace" for i in absent}
            ra.selected = [int(i) for i in np.flatnonzero((st == columnar.PARTICIPATED) | (st == columnar.DROPPED))]
            ra.drops = {int(i): names[rs[i]] or "deadline" for i in np.flatnonzero(st == columnar.DROPPED)}
            self.table[t] = ra

    def _attach_reports(self, path: Path, n_clients: int) -> None:
        """The recorded measurements and tasks, round by round, onto the logged rounds."""
        recorded = read_reports(path, n_clients)
        lacking = _gaps(set(recorded) & set(range(self.rounds)) | {self.rounds})
        if lacking:
            raise UserError(f"--trace: {path} lacks rounds {_fmt_spans(lacking)} of the log beside it; restore "
                            f"it, or move it away to replay with the simulation's own measurements")
        for t, ra in self.table.items():
            ra.reports, ra.tasks = recorded[t].reports, recorded[t].tasks
        self.reports_path = path
        log.info("replay: the clients' measurements (compute time, link rates, bytes) and the tasks set from "
                 "them come from %s", path)

    @staticmethod
    def _int(where: str, r: dict, col: str, fix: str) -> int:
        try:
            v = int(r[col])
        except ValueError:
            raise UserError(f"{where}: column {col!r}: {r[col]!r} is not an integer; {fix}") from None
        if v < 0:
            raise UserError(f"{where}: column {col!r}: {v} is negative; {fix}")
        return v

    def round(self, t: int) -> LoggedRound:
        if t not in self.table:
            raise UserError(f"--trace: the log has no round {t} (it covers rounds 0..{self.rounds - 1})")
        ra = self.table[t]
        for i in np.flatnonzero(~ra.available):
            ra.reasons.setdefault(int(i), "trace")
        if self.selection == "strategy":  # availability only: who dropped in the log could not take part
            avail = ra.available.copy()
            avail[list(ra.drops)] = False
            return RoundAvailability(avail, {**ra.reasons, **ra.drops})
        return ra


def recorded_engine(trace: str | Path) -> tuple[str | None, str]:
    """The engine that reproduces the run that wrote `trace` bit for bit, and why; (None, why) where the default
    does as well or the run is unknown. A field run (`field.json` beside the log) trained on its agents with the
    per-client loop (edge_client/trainer.py `local_train`), whatever its `config.json` says (the coordinator's
    config records the simulation's default engine, which it never used): `loop`. A simulation recorded with
    `--engine loop`: `loop`. The batched and Ray engines give batched's bits, the default's."""
    run = Path(trace).parent
    if (run / "field.json").exists():
        return "loop", f"{run} is a field run: its agents trained with the per-client loop"
    try:
        engine = json.loads((run / "config.json").read_text())["train"]["engine"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"no run's config.json beside {trace}"
    if engine == "loop":
        return "loop", f"{run} was simulated with --engine loop"
    return None, f"{run} was simulated with --engine {engine}"
