"""Field mode's run: `setup_run` (coordinator/runsetup.py), the MQTT hub and transport, the round loop.

Writes the same run directory as simulation, plus `field.jsonl` (per-round timings, drops, duplicates; agents'
evaluations and status changes), `telemetry.jsonl` (what each round cost each aggregated device),
`field.json` (run id, field options) and `model.onnx`. A broker outage longer
than --broker-outage-timeout (coordinator/field/outage.py), or an empty federation (nobody there to take part)
for longer than --empty-federation-timeout (coordinator/field/absence.py), ends the run with a RunFailure that
says how to resume, after the last finished round's checkpoint is saved.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from coordinator import config
from coordinator.errors import RunFailure, UserError
from coordinator.field.absence import EmptyFederation
from coordinator.field.connection import FieldConfig
from coordinator.field.hub import FieldHub
from coordinator.field.outage import BrokerOutage
from coordinator.field.registry import FieldAvailability
from coordinator.field.transport import MqttTransport, export_onnx
from coordinator.loop import run_rounds
from coordinator.rundir import CHECKPOINT, load_checkpoint_file
from coordinator.runsetup import setup_run
from coordinator.tracking import trackers
from edge_client.models import num_params

log = logging.getLogger("dropfl.coordinator")


def run_field(cfg: config.SimConfig, fc: FieldConfig, out: str, resume: bool = False,
              progress: bool = True, overwrite: bool = False) -> torch.Tensor:
    run = setup_run(cfg, out, mode="field", resume=resume, overwrite=overwrite)
    run.rundir.write_json("field.json", dataclasses.asdict(fc) | {"password": None})
    hub = FieldHub(fc, cfg.data.clients, run.binding, num_params(run.model), run.rundir.path)
    hub.start()
    finished = False
    try:
        want = fc.wait_agents or cfg.data.clients
        got = hub.registry.wait_for_agents(want, fc.wait_timeout_s)
        if hub.connection.connects == 0:
            raise UserError(f"could not connect to the broker {fc.broker} within {fc.wait_timeout_s:g} s")
        if got < want:
            raise UserError(f"only {got} of {want} agents came online within {fc.wait_timeout_s:g} s "
                            f"(broker {fc.broker}); start them with `dropfl client --config FILE`")
        log.info("run %s: %d agents online; %s", fc.run_id, got, "resuming" if resume else "starting")
        transport = MqttTransport(hub, run.model, run.input_shape, run.rundir.file("model.onnx"))
        try:
            with trackers(cfg, run.rundir.path, run.checkpoint) as observers:  # --track (coordinator/tracking.py)
                w = run_rounds(run.loop, run.strategy, FieldAvailability(hub), transport, run.evaluate,
                               run.rundir, run.w0(), resume=resume, progress=progress, checkpoint=run.checkpoint,
                               observers=observers, buffers=run.buffers)
        except (BrokerOutage, EmptyFederation) as e:
            run.rundir.save_unsaved_checkpoint()  # the last finished round, if --checkpoint-every had not saved it
            when = "the broker is back" if isinstance(e, BrokerOutage) else "agents are back"
            raise RunFailure(f"{e}; {how_to_resume(run.rundir.path, when)}") from None
        run.save_final(w)
        if transport.onnx_ok:   # the final model (a model that cannot be exported was said so once)
            run.rundir.file("model.onnx").write_bytes(export_onnx(run.eval_model, w, run.input_shape))
        finished = True
        return w
    finally:
        hub.stop(finished)


def how_to_resume(path: Path, when: str = "the broker is back") -> str:
    """After a broker outage or an empty federation: which rounds are saved in the run directory, and how to go
    on `when` the cause is gone."""
    ck = path / CHECKPOINT
    if not ck.exists():
        return (f"no round had finished: once {when}, start the run again (the same command; "
                f"{path} holds no finished round)")
    try:
        done = f"rounds 0..{load_checkpoint_file(ck)['round']} are checkpointed in {path}"
    except UserError:
        done = f"{ck} is damaged (the previous checkpoint may be whole)"
    return (f"{done}: once {when}, resume with the same command plus --resume "
            f"(`dropfl coordinator ... --out {path} --resume`; a trial: `dropfl trial --resume {path}`)")
