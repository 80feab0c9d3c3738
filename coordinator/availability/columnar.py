"""The participation log as compressed columns, for large federations (--participation-format npz).

participation.csv has a row per client per round: at N = 100,000 clients that is 100,000 lines (~2.5 MB)
per round, gigabytes over a run. The columnar log keeps the same information (the four statuses and the
reasons of docs/traces.md, for every client in every round) as two uint8 codes per client per round,
compressed with zlib (numpy's savez_compressed, no new dependency):

    RUN/participation/round-000050.npz            one round, written (temporary file + rename) when it ends
    RUN/participation/rounds-000000-000049.npz    CHUNK rounds merged into one file once all are there

    each file: round int64 [R]; status uint8 [R, N] (index into STATUSES); reason uint8 [R, N] (0 = none,
    k = REASONS[k − 1]); statuses, reasons: the vocabularies, so a file reads without this module's constants

A round is on disk when it ends (no data lost on a crash, as participation.csv); every CHUNK rounds the round
files are merged into one chunk (written first, then the round files removed; a round found in both is the
same round). `dropfl report` draws its raster from these columns and `--availability replay --trace
RUN/participation` replays them (coordinator/availability/participation.py), exactly as the CSV.

Cost per round: O(N) bytes of numpy work (two uint8 columns, compressed), no Python work per client except for
the availability model's reasons dict (one entry per absent client, coordinator/availability/models.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from coordinator.availability.models import REASONS, RoundAvailability
from coordinator.errors import UserError

STATUSES = ("participated", "unavailable", "not_selected", "dropped")  # = participation.STATUSES
PARTICIPATED, UNAVAILABLE, NOT_SELECTED, DROPPED = range(4)
REASON_CODE = {"": 0} | {r: k + 1 for k, r in enumerate(REASONS)}
CHUNK = 50
DIR = "participation"
_ROUND = re.compile(r"round-(\d+)\.npz$")
_CHUNK = re.compile(r"rounds-(\d+)-(\d+)\.npz$")


def _save(path: Path, rounds: np.ndarray, status: np.ndarray, reason: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, round=rounds.astype(np.int64), status=status, reason=reason,
                        statuses=np.array(STATUSES), reasons=np.array(("",) + REASONS))
    os.replace(tmp, path)


def _files(d: Path) -> tuple[dict[int, Path], list[tuple[int, int, Path]]]:
    singles, chunks = {}, []
    for p in d.iterdir() if d.is_dir() else []:
        if m := _ROUND.fullmatch(p.name):
            singles[int(m.group(1))] = p
        elif m := _CHUNK.fullmatch(p.name):
            chunks.append((int(m.group(1)), int(m.group(2)), p))
    return singles, sorted(chunks)


def _load(p: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        with np.load(p, allow_pickle=False) as z:
            rounds, status, reason = z["round"], z["status"], z["reason"]
            if tuple(z["statuses"]) != STATUSES or tuple(z["reasons"]) != ("",) + REASONS:
                raise ValueError("another status or reason vocabulary")
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"{p}: not a readable participation chunk ({e}); restore it or re-record the run") from None
    if status.shape != reason.shape or status.ndim != 2 or len(rounds) != status.shape[0]:
        raise UserError(f"{p}: round, status and reason do not fit together; restore it or re-record the run")
    if status.size and (status.max() >= len(STATUSES) or reason.max() > len(REASONS)):
        raise UserError(f"{p}: a status or reason code outside the vocabulary; restore it or re-record the run")
    return rounds, status, reason


def read_columnar(d: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rounds int64 [R] ascending, status uint8 [R, N], reason uint8 [R, N]) of a columnar log directory."""
    d = Path(d)
    singles, chunks = _files(d)
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _, _, p in chunks:
        rounds, status, reason = _load(p)
        for j, t in enumerate(rounds.tolist()):
            parts[t] = (status[j], reason[j])
    for p in singles.values():
        rounds, status, reason = _load(p)
        parts[int(rounds[0])] = (status[0], reason[0])
    if not parts:
        raise UserError(f"--trace: {d} holds no participation rounds")
    widths = {s.shape[0] for s, _ in parts.values()}
    if len(widths) > 1:
        raise UserError(f"{d}: rounds with different client counts {sorted(widths)}; re-record the run")
    order = sorted(parts)
    return (np.array(order, np.int64), np.stack([parts[t][0] for t in order]),
            np.stack([parts[t][1] for t in order]))


def round_codes(n: int, avail: RoundAvailability, selected: list[int], participated: set[int],
                dropped: dict[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """One round's status and reason columns, the same statuses and reasons as participation.csv's rows."""
    status = np.where(avail.available[:n], NOT_SELECTED, UNAVAILABLE).astype(np.uint8)
    reason = np.where(status == UNAVAILABLE, REASON_CODE["model_draw"], 0).astype(np.uint8)
    if avail.reasons:
        who = np.fromiter(avail.reasons.keys(), np.int64, len(avail.reasons))
        code = np.fromiter((REASON_CODE[r] for r in avail.reasons.values()), np.uint8, len(avail.reasons))
        absent = status[who] == UNAVAILABLE
        reason[who[absent]] = code[absent]
    sel = np.asarray(sorted(set(selected) - participated), np.int64)
    status[sel] = DROPPED
    reason[sel] = [REASON_CODE[dropped.get(int(i), "deadline")] for i in sel]
    part = np.asarray(sorted(participated), np.int64)
    status[part], reason[part] = PARTICIPATED, 0
    return status, reason


class ColumnarLog:
    """Writes RUN/participation/ round by round (same interface as participation.ParticipationLog)."""

    def __init__(self, d: Path, resume_from_round: int | None = None):
        self.dir = d
        d.mkdir(parents=True, exist_ok=True)
        singles, chunks = _files(d)
        keep = resume_from_round if resume_from_round is not None else 0
        for a, b, p in chunks:  # rounds from `keep` on are rewritten by this run
            if b >= keep:
                if a < keep:
                    rounds, status, reason = _load(p)
                    m = rounds < keep
                    _save(d / f"rounds-{a:06d}-{keep - 1:06d}.npz", rounds[m], status[m], reason[m])
                p.unlink()
        for t, p in singles.items():
            if t >= keep:
                p.unlink()
        for p in d.glob("*.tmp.npz"):
            p.unlink()

    def write_round(self, t: int, n: int, avail: RoundAvailability, selected: list[int],
                    participated: set[int], dropped: dict[int, str]) -> None:
        status, reason = round_codes(n, avail, selected, participated, dropped)
        _save(self.dir / f"round-{t:06d}.npz", np.array([t]), status[None], reason[None])
        singles, _ = _files(self.dir)
        if len(singles) >= CHUNK:  # merge: the chunk first, then the round files it holds
            order = sorted(singles)
            loaded = [_load(singles[r]) for r in order]
            _save(self.dir / f"rounds-{order[0]:06d}-{order[-1]:06d}.npz", np.array(order),
                  np.concatenate([s for _, s, _ in loaded]), np.concatenate([r for _, _, r in loaded]))
            for r in order:
                singles[r].unlink()


def to_rows(rounds: np.ndarray, status: np.ndarray, reason: np.ndarray) -> list[dict]:
    """participation.csv's rows (strings, as csv.DictReader gives them) from the columns: for small logs."""
    names = ("",) + REASONS
    return [{"round": str(t), "client": str(c), "status": STATUSES[status[j, c]], "reason": names[reason[j, c]]}
            for j, t in enumerate(rounds.tolist()) for c in range(status.shape[1])]
