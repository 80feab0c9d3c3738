"""A run is a directory (ARCHITECTURE principle 7):

    config.json        resolved configuration (pass back with --config to rerun)
    metrics.jsonl      one JSON object per round (schema in docs/run-directory.md)
    participation.csv  who took part in each round and why the others did not (docs/traces.md)
    checkpoint.pt      last completed round: global model, strategy state, counters (for --resume)
    model.pt           final global model (state_dict)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from coordinator.availability.participation import ParticipationLog


class MetricsWriter:
    def __init__(self, path: Path, resume_from_round: int | None = None):
        self.path = path
        self.last_accuracy: float | None = None
        rows = []
        if resume_from_round is not None and path.exists():
            rows = [r for r in read_metrics(path) if r["round"] < resume_from_round]
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
                self.last_accuracy = r.get("accuracy", self.last_accuracy)

    def write(self, row: dict) -> None:
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row.get("accuracy") is not None:
            self.last_accuracy = row["accuracy"]


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, obj) -> None:
        tmp = self.file(name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.file(name))

    def participation_log(self, resume_from_round: int | None = None) -> ParticipationLog:
        return ParticipationLog(self.file("participation.csv"), resume_from_round)

    def metrics_writer(self, resume_from_round: int | None = None) -> MetricsWriter:
        return MetricsWriter(self.file("metrics.jsonl"), resume_from_round)

    def save_checkpoint(self, ck: dict) -> None:
        """Atomic: write to a temporary file, then rename over the old checkpoint."""
        tmp = self.file("checkpoint.pt.tmp")
        torch.save(ck, tmp)
        os.replace(tmp, self.file("checkpoint.pt"))

    def load_checkpoint(self) -> dict | None:
        p = self.file("checkpoint.pt")
        return torch.load(p, weights_only=False) if p.exists() else None

    def save_model(self, model: torch.nn.Module) -> None:
        torch.save(model.state_dict(), self.file("model.pt"))
