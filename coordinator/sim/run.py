"""A simulation run: `setup_run` (coordinator/runsetup.py), the in-process transport, the round loop."""

from __future__ import annotations

import logging

from coordinator.config import SimConfig
from coordinator.loop import run_rounds
from coordinator.rundir import RunDir
from coordinator.runsetup import setup_run
from coordinator.sim.clock import load_profile
from coordinator.sim.transport import SimTransport

log = logging.getLogger("dropfl.sim")


def run_sim(cfg: SimConfig, out: str, resume: bool = False, progress: bool = True, overwrite: bool = False) -> RunDir:
    # the profile is input too: checked before setup_run writes the run directory
    profile = load_profile(cfg.clock.profile, cfg.data.clients) if cfg.clock.profile else None
    run = setup_run(cfg, out, mode="sim", resume=resume, overwrite=overwrite)
    transport = SimTransport(run.model, run.client_data, cfg.train.engine, profile, run.ds.num_classes,
                             feddd=run.strategy.sets_dropout_rate)
    try:
        line, fields = transport.summary()
        log.info("%s", line, extra={"fields": fields})  # stderr `[sim] engine: ...`, log.txt, log.jsonl
        w = run_rounds(run.loop, run.strategy, run.availability, transport, run.evaluate, run.rundir, run.w0(),
                       resume=resume, progress=progress, checkpoint=run.checkpoint)
    finally:
        transport.close()
    run.save_final(w)
    return run.rundir
