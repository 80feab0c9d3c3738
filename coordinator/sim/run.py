"""A simulation run: `setup_run` (coordinator/runsetup.py), the in-process transport, the round loop."""

from __future__ import annotations

from coordinator.config import SimConfig
from coordinator.loop import run_rounds
from coordinator.rundir import RunDir
from coordinator.runsetup import setup_run
from coordinator.sim.clock import load_profile
from coordinator.sim.transport import SimTransport


def run_sim(cfg: SimConfig, out: str, resume: bool = False, progress: bool = True, overwrite: bool = False) -> RunDir:
    run = setup_run(cfg, out, mode="sim", resume=resume, overwrite=overwrite)
    profile = load_profile(cfg.clock.profile, cfg.data.clients) if cfg.clock.profile else None
    transport = SimTransport(run.model, run.client_data, cfg.train.engine, profile, run.ds.num_classes)
    w = run_rounds(run.loop, run.strategy, run.availability, transport, run.evaluate, run.rundir, run.w0(),
                   resume=resume, progress=progress)
    run.save_final(w)
    return run.rundir
