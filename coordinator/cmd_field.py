"""`dropfl coordinator`: the round loop over MQTT with real edge agents (`dropfl client`).

Same options as `dropfl sim` for data, model, training and strategy (the agents must be configured
with the same dataset, partition, clients, seed and model; the coordinator refuses agents that are
not), plus the field options. Availability comes from the agents' own heartbeats. Writes the same
run directory as simulation, plus `field.jsonl` (per-round timings, drops, duplicates; agents'
evaluations and status changes), `field.json` (run id, field options) and `model.onnx`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import uuid
from pathlib import Path

import torch

from coordinator import config
from coordinator.errors import UserError
from coordinator.rundir import RunDir

FIELD_OPTIONS = {  # flag: (FieldConfig field, type, help)
    "--broker": ("broker", str, "MQTT broker URL mqtt://HOST[:PORT] (default: mqtt://127.0.0.1:1883)"),
    "--deadline": ("deadline_s", float, "per-round deadline in seconds (default: 60)"),
    "--heartbeat-timeout": ("heartbeat_timeout_s", float, "an agent silent for this long is offline (default: 10)"),
    "--wait-agents": ("wait_agents", int, "agents to wait for before round 0 (default: --clients)"),
    "--wait-timeout": ("wait_timeout_s", float, "give up waiting for agents after this long (default: 120)"),
    "--round-wait": ("round_wait_s", float, "at each round start, wait up to this long for absent agents (default: 0)"),
    "--chunk-bytes": ("chunk_bytes", int, "send tensors above this size in chunks (default: 262144)"),
    "--run-id": ("run_id", str, "run id bound into every message (default: run directory name + random suffix)"),
}


def add_parser(sub) -> None:
    from coordinator.strategies import STRATEGIES

    p = sub.add_parser(
        "coordinator", help="run federated training with edge agents over an MQTT broker (field mode)",
        description="Field mode: the same round loop as `dropfl sim`, with edge agents (`dropfl client`) over "
                    "MQTT (docs/protocol.md). Availability comes from the agents; a selected agent that goes "
                    "offline, declines or misses the deadline is dropped with its reason.")
    config.add_arguments(p, list(STRATEGIES))
    g = p.add_argument_group("field")
    for flag, (dest, typ, help_) in FIELD_OPTIONS.items():
        g.add_argument(flag, dest=f"field.{dest}", type=typ, default=None, help=help_,
                       metavar=flag.lstrip("-").upper().replace("-", "_"))
    g.add_argument("--broker-config", metavar="FILE",
                   help="coordinator.json of a provisioned broker (broker URL, username, password, ca_file); "
                        "see docs/provisioning.md")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's checkpoint.pt")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def field_config(args: argparse.Namespace, rundir: RunDir, resume: bool):
    from coordinator.transport_mqtt import FieldConfig

    fc = FieldConfig()
    saved = rundir.file("field.json")
    if resume and saved.exists():
        fc = FieldConfig(**json.loads(saved.read_text()))
    if getattr(args, "broker_config", None):
        try:
            creds = json.loads(Path(args.broker_config).read_text())
            fc.broker, fc.username, fc.password = creds["broker"], creds["username"], creds["password"]
            fc.ca_file = str(Path(args.broker_config).parent / creds["ca_file"]) if creds.get("ca_file") else None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--broker-config: {args.broker_config} is not a readable coordinator.json ({e})") from None
    for dest, _, _ in FIELD_OPTIONS.values():
        v = getattr(args, f"field.{dest}", None)
        if v is not None:
            setattr(fc, dest, v)
    if not fc.run_id:
        fc.run_id = f"{rundir.path.name}-{uuid.uuid4().hex[:8]}"
    if fc.deadline_s <= 0 or fc.heartbeat_timeout_s <= 0 or fc.chunk_bytes < 1:
        raise UserError("--deadline, --heartbeat-timeout and --chunk-bytes must be > 0")
    return fc


def run(args) -> int:
    from coordinator.strategies import STRATEGIES

    cfg = config.resolve(args, list(STRATEGIES))
    if cfg.availability.kind != "always":
        raise UserError("--availability: in field mode availability comes from the agents; leave it out")
    out = cfg.run.out or f"runs/field-{cfg.strategy.algo}-{cfg.data.dataset}-s{cfg.run.seed}"
    cfg.run.out = out
    rundir = RunDir(out)
    fc = field_config(args, rundir, args.resume)
    rundir.write_json("config.json", cfg.to_dict())
    rundir.write_json("field.json", dataclasses.asdict(fc) | {"password": None})
    signal.signal(signal.SIGTERM, _interrupt)
    run_field(cfg, fc, rundir, resume=args.resume, progress=not args.no_progress)
    print(f"run directory: {out}")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_field(cfg: config.SimConfig, fc, rundir: RunDir, resume: bool = False, progress: bool = True) -> torch.Tensor:
    from coordinator.loop import LoopConfig, run_rounds
    from coordinator.sim import build_strategy
    from coordinator.transport_mqtt import FieldAvailability, FieldHub, MqttTransport, export_onnx, log
    from edge_client import datasets
    from edge_client.models import build_model, get_flat, num_params, set_flat
    from edge_client.trainer import evaluate

    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    strategy = build_strategy(cfg)
    try:
        ds = datasets.load(cfg.data.dataset, cfg.data.data_dir)
    except datasets.DatasetError as e:
        raise UserError(str(e)) from None
    shape = tuple(ds.train.x.shape[1:])
    model = build_model(cfg.model.model, shape, ds.num_classes, cfg.run.seed, cfg.model.dropout)
    eval_model = build_model(cfg.model.model, shape, ds.num_classes, cfg.run.seed, cfg.model.dropout)
    binding = {"dataset": cfg.data.dataset, "partition": cfg.data.partition, "clients": cfg.data.clients,
               "seed": cfg.run.seed, "model": cfg.model.model}
    hub = FieldHub(fc, cfg.data.clients, binding, num_params(model), rundir.path)
    hub.start()
    finished = False
    try:
        want = fc.wait_agents or cfg.data.clients
        got = hub.wait_for_agents(want, fc.wait_timeout_s)
        if hub.connects == 0:
            raise UserError(f"could not connect to the broker {fc.broker} within {fc.wait_timeout_s:g} s")
        if got < want:
            raise UserError(f"only {got} of {want} agents came online within {fc.wait_timeout_s:g} s "
                            f"(broker {fc.broker}); start them with `dropfl client --config FILE`")
        log(f"run {fc.run_id}: {got} agents online; {'resuming' if resume else 'starting'}")
        t = cfg.train
        loop = LoopConfig(rounds=cfg.run.rounds, n_clients=cfg.data.clients, seed=cfg.run.seed, lr=t.lr,
                          lr_decay=t.lr_decay, lr_min=t.lr_min, batch_size=t.batch_size, epochs=t.epochs,
                          steps=t.steps, eval_every=cfg.run.eval_every, checkpoint_every=cfg.run.checkpoint_every)
        transport = MqttTransport(hub, model, shape, rundir.file("model.onnx"))
        w = run_rounds(loop, strategy, FieldAvailability(hub), transport,
                       lambda w: evaluate(eval_model, w, ds.test.x, ds.test.y), rundir, get_flat(model),
                       resume=resume, progress=progress)
        set_flat(eval_model, w)
        rundir.save_model(eval_model)
        rundir.file("model.onnx").write_bytes(export_onnx(eval_model, w, shape))  # the final model, too
        finished = True
        return w
    finally:
        hub.stop(finished)


def main(argv: list[str] | None = None) -> int:  # python -m coordinator.cmd_field ...
    from coordinator.cli import main as cli_main
    return cli_main(["coordinator", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

