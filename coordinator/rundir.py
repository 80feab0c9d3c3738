"""A run is a directory (ARCHITECTURE principle 7):

    config.json        resolved configuration (pass back with --config to rerun)
    metrics.jsonl      one JSON object per round (schema in docs/run-directory.md)
    participation.csv  who took part in each round and why the others did not (docs/traces.md)
    participation/     the same as compressed columns, for large N (--participation-format npz)
    reports.jsonl      what the clients measured (compute time, link rates, bytes) and the tasks set from it
    checkpoint.pt      last completed round: global model, strategy state, counters (for --resume)
    checkpoint.prev.pt the checkpoint before it, kept in case the last one is damaged
    state/, checkpoint.state/  --state-store disk: the per-client tables, and their copies for the checkpoints
    model.pt           final global model (state_dict)
    diverged.json      the round at which the global model stopped being finite, if it did (the run stops there)
    log.txt, log.jsonl the run's log, human and machine-readable
    tb/, mlruns/       --track's TensorBoard events and MLflow file store (coordinator/tracking.py)

A directory that holds a run is changed only with --resume (continue it) or --overwrite (replace it):
`check_out` decides, before anything is written. Checkpoints and rewritten files are written to a
temporary file and renamed, so a crash leaves the previous version whole.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from coordinator import statestore
from coordinator.availability import columnar
from coordinator.availability.columnar import ColumnarLog
from coordinator.availability.participation import ParticipationLog
from coordinator.errors import UserError
from coordinator.reports import ReportsLog

# Files whose presence means "this directory holds a run"; --overwrite removes exactly these (and field
# mode's), never anything else a user put there.
RUN_FILES = ("config.json", "metrics.jsonl", "participation.csv", "reports.jsonl", "checkpoint.pt",
             "checkpoint.prev.pt", "model.pt", "model.onnx", "field.json", "field.jsonl", "log.txt", "log.jsonl",
             "crash.log", "friends.jsonl", "telemetry.jsonl", "diverged.json", "flower.json")
CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"
DIVERGED = "diverged.json"   # {"round", "message"}: written by the round loop where the global model went non-finite
STATE_DIRS = (statestore.LIVE, statestore.SNAPSHOTS)  # --state-store disk: RUN/state/, RUN/checkpoint.state/


def holds_run(path: Path) -> bool:
    """True if `path` holds at least one completed round (a checkpoint or a metrics row). A directory where
    a run was set up but stopped before its first round (no broker, no agents) holds nothing to lose and
    may be reused as it is."""
    if not path.is_dir():
        return False
    if (path / CHECKPOINT).exists() or (path / PREVIOUS).exists() or (path / "model.pt").exists():
        return True
    m = path / "metrics.jsonl"
    return m.exists() and m.stat().st_size > 0


def _writable_dir(path: Path) -> str | None:
    """None if `path` is (or can be created as) a writable directory, else why not."""
    p = path
    while not p.exists():
        if p.parent == p:
            return "no existing parent directory"
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable"
    return None


def check_out(out: str | Path, resume: bool, overwrite: bool) -> Path:
    """Decide, before writing anything, whether a run may be written to `out`; raise UserError if not."""
    path = Path(out)
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other: continue the run or replace it, not both")
    problem = _writable_dir(path)
    if problem:
        raise UserError(f"--out {out}: cannot write a run directory there ({problem}); choose another --out")
    if resume:
        if not (path / CHECKPOINT).exists():
            prev = " (checkpoint.prev.pt is there: rename it to checkpoint.pt to resume from it)" \
                if (path / PREVIOUS).exists() else ""
            raise UserError(f"--resume: {path / CHECKPOINT} does not exist, so there is nothing to resume{prev}; "
                            f"leave out --resume to start a new run")
    elif holds_run(path) and not overwrite:
        raise UserError(f"--out {out} already holds a run; add --resume to continue it or --overwrite to replace "
                        f"it (or choose another --out)")
    return path


def load_checkpoint_file(path: Path) -> dict:
    """Read a checkpoint; a damaged one is a UserError naming the file and offering the previous one."""
    try:
        ck = torch.load(path, weights_only=False)
        if not isinstance(ck, dict) or not {"round", "w", "state", "counters"} <= set(ck):
            raise ValueError("not a dropfl checkpoint (keys round, w, state, counters)")
    except Exception as e:  # torch raises several types for a truncated or foreign file
        prev = path.with_name(PREVIOUS)
        offer = (f"; the previous checkpoint {prev} is there: move it over {path.name} to resume from it"
                 if path.name != PREVIOUS and prev.exists() else "")
        raise UserError(f"--resume: {path} is damaged ({type(e).__name__}: {str(e)[:120]}){offer}") from None
    return ck


class MetricsWriter:
    def __init__(self, path: Path, resume_from_round: int | None = None):
        self.path = path
        self.last_accuracy: float | None = None
        rows = []
        if resume_from_round is not None and path.exists():
            rows = [r for r in read_metrics(path, tolerate_torn_tail=True) if r["round"] < resume_from_round]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
                self.last_accuracy = r.get("accuracy", self.last_accuracy)
        os.replace(tmp, path)

    def write(self, row: dict) -> None:
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row.get("accuracy") is not None:
            self.last_accuracy = row["accuracy"]


def read_metrics(path: str | Path, tolerate_torn_tail: bool = False) -> list[dict]:
    """The rows of metrics.jsonl. A damaged line is a UserError naming the file and line, except (with
    `tolerate_torn_tail`) a last line cut off by a crash mid-write, which is dropped."""
    with open(path) as f:
        lines = f.readlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("round"), int):
                raise ValueError("no integer 'round'")
        except ValueError as e:
            if tolerate_torn_tail and i == len(lines) and not line.endswith("\n"):
                break  # the write of the last row was cut off; the checkpoint decides which rounds count
            raise UserError(f"{path}, line {i}: damaged metrics row ({str(e)[:80]}); "
                            f"restore the file or start a new run") from None
        rows.append(row)
    return rows


class RunDir:
    def __init__(self, path: str | Path, overwrite: bool = False):
        self.path = Path(path)
        if overwrite and self.path.is_dir():
            for name in RUN_FILES:
                (self.path / name).unlink(missing_ok=True)
            for d in ("report", "tb", "mlruns"):  # dropfl report's output; --track's default stores
                shutil.rmtree(self.path / d, ignore_errors=True)
            for name in (*STATE_DIRS, columnar.DIR):  # disk state store (statestore.py), columnar participation
                shutil.rmtree(self.path / name, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        # the last finished round's checkpoint when it was not due (--checkpoint-every): the round loop keeps it
        # here, and a run that stops early on purpose (field mode's broker outage) saves it before it exits
        self.unsaved_checkpoint: dict | None = None
        # the state-store snapshot directories checkpoint.pt refers to (None: not known, nothing is pruned)
        self.checkpoint_refs: set[str] | None = None
        self.participation_format = "csv"  # or "npz" (--participation-format; runsetup.setup_run sets it)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, obj) -> None:
        tmp = self.file(name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.file(name))

    def participation_log(self, resume_from_round: int | None = None) -> ParticipationLog | ColumnarLog:
        """participation.csv, or with `participation_format` "npz" the columnar log RUN/participation/."""
        if self.participation_format == "npz":
            return ColumnarLog(self.file(columnar.DIR), resume_from_round)
        return ParticipationLog(self.file("participation.csv"), resume_from_round)

    def reports_log(self, resume_from_round: int | None = None) -> ReportsLog:
        return ReportsLog(self.file("reports.jsonl"), resume_from_round)

    def metrics_writer(self, resume_from_round: int | None = None) -> MetricsWriter:
        return MetricsWriter(self.file("metrics.jsonl"), resume_from_round)

    def round_log(self, name: str, resume_from_round: int | None = None) -> MetricsWriter:
        """A strategy's per-round JSON lines (one object with "round" per line), kept like metrics.jsonl."""
        return MetricsWriter(self.file(name), resume_from_round)

    def save_checkpoint(self, ck: dict) -> None:
        """Atomic, keeping the previous one: write a temporary file, move the current checkpoint to
        checkpoint.prev.pt, then rename the new one into place."""
        self.unsaved_checkpoint = None
        prev_refs = self.checkpoint_refs  # the snapshots checkpoint.pt referred to: checkpoint.prev.pt's from here
        ck = statestore.snapshot(ck, self.path)  # disk tables: a complete copy under checkpoint.state/ first
        tmp = self.file(CHECKPOINT + ".tmp")
        torch.save(ck, tmp)
        if self.file(CHECKPOINT).exists():
            os.replace(self.file(CHECKPOINT), self.file(PREVIOUS))
        os.replace(tmp, self.file(CHECKPOINT))
        self.checkpoint_refs = statestore.referenced(ck)
        if prev_refs is not None:  # keep only the snapshots of checkpoint.pt and checkpoint.prev.pt
            statestore.prune(self.path, self.checkpoint_refs | prev_refs)

    def save_unsaved_checkpoint(self) -> None:
        """Save the last finished round's checkpoint if the round loop kept one that was not due yet."""
        if self.unsaved_checkpoint is not None:
            self.save_checkpoint(self.unsaved_checkpoint)

    def load_checkpoint(self) -> dict | None:
        p = self.file(CHECKPOINT)
        return load_checkpoint_file(p) if p.exists() else None

    def save_model(self, model: torch.nn.Module) -> None:
        tmp = self.file("model.pt.tmp")
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, self.file("model.pt"))
