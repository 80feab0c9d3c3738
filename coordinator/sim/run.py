"""A simulation run: `setup_run` (coordinator/runsetup.py), the in-process transport, the round loop."""

from __future__ import annotations

import functools
import logging

import torch

from coordinator.config import SimConfig
from coordinator.errors import UserError
from coordinator.loop import run_rounds
from coordinator.rundir import RunDir
from coordinator.runsetup import setup_run
from coordinator.sim.clock import load_profile
from coordinator.sim.transport import SimTransport
from coordinator.tracking import trackers

log = logging.getLogger("dropfl.sim")


def run_sim(cfg: SimConfig, out: str, resume: bool = False, progress: bool = True, overwrite: bool = False,
            make_engine=None, wrap_evaluate=None) -> RunDir:
    """`make_engine`: SimTransport's batched engine factory (a lockstep sweep's, coordinator/sim/lockstep.py);
    `wrap_evaluate(evaluate)`: what the round loop calls instead (a lockstep sweep's: other runs take their turn
    while this one evaluates)."""
    # the profile is input too: checked before setup_run writes the run directory
    profile = load_profile(cfg.clock.profile, cfg.data.clients) if cfg.clock.profile else None
    engine = cfg.train.engine
    check_device(cfg.train.device)   # before the run directory is written
    if make_engine is None:   # --slices; --engine ray: the batched engine's slices on Ray actors (coordinator/scale)
        from coordinator.sim.batched import BatchedEngine
        make_engine = functools.partial(BatchedEngine, groups=cfg.train.slices, device=cfg.train.device)
        if engine == "ray":
            from coordinator.scale import check_cluster
            from coordinator.scale.ray_engine import RayEngine
            check_cluster(cfg.train.ray_address, "--engine ray")   # before the run directory is written
            make_engine = functools.partial(RayEngine, groups=cfg.train.slices, address=cfg.train.ray_address)
    run = setup_run(cfg, out, mode="sim", resume=resume, overwrite=overwrite)
    transport = SimTransport(run.model, run.client_data, "batched" if engine == "ray" else engine, profile,
                             run.ds.num_classes,
                             feddd=run.strategy.sets_dropout_rate, store=run.strategy.store,
                             make_engine=make_engine, device=cfg.train.device)
    try:
        evaluate, how = evaluator(run, engine)
        if wrap_evaluate is not None:
            evaluate = wrap_evaluate(evaluate)
        line, fields = transport.summary()
        if how != "reference":
            line += f"; evaluation through the fused kernels ({how})"
        log.info("%s", line, extra={"fields": fields | {"eval": how}})  # stderr `[sim] engine: ...`, log.txt, log.jsonl
        with trackers(cfg, run.rundir.path, run.checkpoint) as observers:  # --track (coordinator/tracking.py)
            w = run_rounds(run.loop, run.strategy, run.availability, transport, evaluate, run.rundir,
                           run.w0(), resume=resume, progress=progress, checkpoint=run.checkpoint,
                           observers=observers, buffers=run.buffers)
    finally:
        transport.close()
    run.save_final(w)
    return run.rundir


def check_device(device: str) -> None:
    """--sim-device cuda where torch sees no GPU: a UserError, before anything is written."""
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else \
            f"torch (CUDA {torch.version.cuda}) finds no usable GPU"
        raise UserError(f"--sim-device cuda: {why}; use --sim-device auto (the CPU for the LeNets, else a GPU where "
                        f"there is one) or cpu")


def evaluator(run, engine: str):
    """How the run evaluates the global model on the test set, and its name for the log (`eval`): with any
    engine but `loop`, the batched forward with the fused LeNet kernels where the model has them
    (`batched.Evaluator`, "batched+native(<variant>)": ~7x less CPU, equal to the reference to float
    rounding); else, and with `--engine loop`, "reference" (`edge_client.trainer.evaluate`, the model's own
    forward)."""
    if engine != "loop":
        from coordinator.sim.batched import Evaluator
        ev = Evaluator(run.eval_model, run.ds.test.x, run.ds.test.y)
        if ev.available():
            return ev, f"batched+native({ev.native})"
    return run.evaluate, "reference"
