"""A sweep: many simulation runs (methods × seeds × settings) that share a dataset and a model.

`run_sweep(jobs, executor=...)` runs every job into its own run directory, each exactly as `dropfl sim` would
(`coordinator.sim.run.run_sim`), and returns the run directories in the order of `jobs`:

    lockstep  (default) runs that share a dataset, a model and the local work per task (batch size, epochs,
              steps) advance round by round together, and round t's local training of all of them is one
              call of one batched engine (coordinator/sim/lockstep.py); a job that cannot join a group
              (--engine loop, a clock profile, FedDD, a model whose batched path is not exact when merged,
              --track, CUDA) runs serially, and the log says why
    serial    one run after the other in this process (the reference)
    ray       every run a Ray task on a cluster (`address`), its run directory shipped back to its `out`
              (coordinator/scale/ray_sweep.py, docs/scale-out.md)

Every executor gives each run the very files the serial executor gives it (model.pt, metrics except the
timing fields `seconds` and `elapsed`: bitwise, tests/test_sweep.py). A job's `resume`/`overwrite` work as
with `dropfl sim`. A failing job does not stop the sweep (serial or lockstep): every other job runs to its end,
a line says which one failed and why, and then the first failing job's error is raised. (The ray executor
gathers every task's result first, too.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.config import SimConfig

EXECUTORS = ("lockstep", "serial", "ray")
LOCKSTEP_RUNS = 16  # runs per lockstep group at most: each run holds its dataset (~0.4 GB for FMNIST)


@dataclass
class Job:
    """One run of a sweep: its configuration, its run directory, and whether it continues a checkpoint."""

    cfg: SimConfig
    out: Path
    resume: bool = False
    overwrite: bool = False
    label: str = ""   # shown in progress lines (e.g. "MimiC τmax=20 trial 0")


def run_sweep(jobs: list[Job], executor: str = "lockstep", progress: bool = True,
              log: Callable[[str], None] | None = None, max_runs: int = LOCKSTEP_RUNS,
              address: str | None = None, diverged_ok: bool = False) -> list[Path]:
    """Run `jobs`; return their run directories in order. `max_runs`: lockstep group size at most.
    `address`: executor "ray"'s cluster (coordinator/scale/__init__.py `connected`). `diverged_ok`: a run whose
    global model went non-finite (FloatingPointError; its run directory has `diverged.json`) is a result, not
    an error (`dropfl reproduce`: the paper's settings can diverge): said, not raised."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown sweep executor {executor!r} (choose from {', '.join(EXECUTORS)})")
    if executor == "ray":   # each run a Ray task on the cluster, gathered back (coordinator/scale/ray_sweep.py)
        from coordinator.scale.ray_sweep import run_on_ray
        return run_on_ray(jobs, address, progress, log)
    say = log or (lambda _line: None)
    failed: list[Exception] = []   # a failing run does not stop the sweep: the others run, then the first error

    def attempt(what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - every run's failure is its own; KeyboardInterrupt still stops
            failed.append(e)
            say(f"{what}: failed ({str(e).splitlines()[0] if str(e) else type(e).__name__}); the sweep goes on")

    if executor == "serial":
        for k in range(len(jobs)):
            attempt(jobs[k].label or str(jobs[k].out), lambda k=k: _serial(jobs, k, progress, say))
    elif executor == "lockstep":
        from coordinator.sim import lockstep

        for unit, reason in plan(jobs, max_runs):
            if reason is not None:
                say(f"[{unit[0] + 1}/{len(jobs)}] {jobs[unit[0]].label or jobs[unit[0]].out}: not batched with "
                    f"other runs ({reason}); runs on its own")
                k = unit[0]
                attempt(jobs[k].label or str(jobs[k].out), lambda k=k: _serial(jobs, k, progress, say))
                continue
            say(f"lockstep: {len(unit)} runs together ({', '.join(jobs[i].label or str(jobs[i].out) for i in unit)})")
            attempt(f"lockstep group of {len(unit)}",
                    lambda unit=unit: lockstep.run_group([jobs[i] for i in unit], progress, say))
    failed = [e for e in failed if not (diverged_ok and isinstance(e, FloatingPointError))]
    if failed:
        raise failed[0]
    return [Path(job.out) for job in jobs]


def plan(jobs: list[Job], max_runs: int = LOCKSTEP_RUNS) -> list[tuple[list[int], str | None]]:
    """The lockstep executor's units, in the order of their first job: (job indices, None) for a group
    that advances together, ([k], reason) for a job that runs on its own. A group of more than `max_runs`
    jobs is cut into near-equal groups (memory: every run of a group holds its dataset)."""
    from coordinator.sim.lockstep import group_key, why_not

    groups: dict[tuple, list[int]] = {}
    units: list[tuple[list[int], str | None]] = []
    for k, job in enumerate(jobs):
        reason = why_not(job.cfg)
        if reason is not None:
            units.append(([k], reason))
            continue
        key = group_key(job.cfg)
        if key not in groups:
            groups[key] = []
            units.append((groups[key], None))
        groups[key].append(k)
    out = []
    for members, reason in units:
        n = -(-len(members) // max(1, max_runs))   # groups needed
        bounds = [len(members) * i // n for i in range(n + 1)]
        out += [(members[a:b], reason) for a, b in zip(bounds, bounds[1:])]
    return out


def _serial(jobs: list[Job], k: int, progress: bool, say: Callable[[str], None]) -> None:
    from coordinator.sim.run import run_sim

    job = jobs[k]
    say(f"[{k + 1}/{len(jobs)}] {job.label or job.out}: {'resuming' if job.resume else 'running'} "
        f"{job.cfg.run.rounds} rounds -> {job.out}")
    run_sim(job.cfg, str(job.out), resume=job.resume, progress=progress, overwrite=job.overwrite)
