"""A sweep: many simulation runs (methods × seeds × settings) that share a dataset and a model.

`run_sweep(jobs, executor=...)` runs every job into its own run directory, each exactly as `dropfl sim` would
(`coordinator.sim.run.run_sim`), and returns the run directories in the order of `jobs`:

    serial    one run after the other in this process (the reference)

Every executor gives each run the very files the serial executor gives it (bitwise: tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.config import SimConfig

EXECUTORS = ("serial",)


@dataclass
class Job:
    """One run of a sweep: its configuration, its run directory, and whether it continues a checkpoint."""

    cfg: SimConfig
    out: Path
    resume: bool = False
    overwrite: bool = False
    label: str = ""   # shown in progress lines (e.g. "MimiC τmax=20 trial 0")


def run_sweep(jobs: list[Job], executor: str = "serial", progress: bool = True,
              log: Callable[[str], None] | None = None) -> list[Path]:
    """Run `jobs`; return their run directories in order."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown sweep executor {executor!r} (choose from {', '.join(EXECUTORS)})")
    from coordinator.sim.run import run_sim

    out = []
    for k, job in enumerate(jobs, 1):
        if log is not None:
            log(f"[{k}/{len(jobs)}] {job.label or job.out}: {'resuming' if job.resume else 'running'} "
                f"{job.cfg.run.rounds} rounds -> {job.out}")
        run_sim(job.cfg, str(job.out), resume=job.resume, progress=progress, overwrite=job.overwrite)
        out.append(Path(job.out))
    return out
