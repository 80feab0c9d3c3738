"""`dropfl coordinator`: the round loop over MQTT with real edge agents (`dropfl client`).

Same options as `dropfl sim` for data, model, training and strategy (the agents must be configured
with the same data binding; the coordinator refuses agents that are not), plus the field options.
Availability comes from the agents' own heartbeats. The run itself: coordinator/field/run.py.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import uuid
from pathlib import Path

from coordinator import config
from coordinator.dashboard import server as dashboard
from coordinator.errors import UserError
from coordinator.field.run import run_field
from edge_client.agent.config import AgentError, broker_urls
from edge_client.configfile import check_value

FIELD_OPTIONS = {  # flag: (FieldConfig field, type, help)
    "--broker": ("broker", str, "MQTT broker URL mqtt://HOST[:PORT], or a comma-separated list of URLs of one "
                                "cluster to fail over between (default: mqtt://127.0.0.1:1883)"),
    "--deadline": ("deadline_s", float, "per-round deadline in seconds (default: 60)"),
    "--heartbeat-timeout": ("heartbeat_timeout_s", float, "an agent silent for this long is offline (default: 10)"),
    "--upload-extension": ("upload_extension_s", float, "an upload still arriving at the deadline at a rate that "
                           "finishes within this many seconds past it keeps the round open (default: 60; 0: the "
                           "deadline is hard)"),
    "--wait-agents": ("wait_agents", int, "agents to wait for before round 0 (default: --clients)"),
    "--wait-timeout": ("wait_timeout_s", float, "give up waiting for agents after this long (default: 120)"),
    "--round-wait": ("round_wait_s", float, "at each round start, wait up to this long for absent agents (default: 0)"),
    "--broker-outage-timeout": ("broker_outage_timeout_s", float, "disconnected from the broker (or no answer "
                                "from it, its connection open, 3 s on) this long: stop (exit 1) with the finished "
                                "rounds checkpointed, to --resume later; meanwhile no round starts and the open "
                                "one's deadline is suspended (default: 300)"),
    "--empty-federation-timeout": ("empty_federation_timeout_s", float, "nobody there to take part this long: "
                                   "stop (exit 1) with the finished rounds checkpointed, to --resume later; "
                                   "meanwhile no round starts while no agent is available, and a round in which "
                                   "every agent is gone without an update is suspended, not recorded "
                                   "(default: 300)"),
    "--chunk-bytes": ("chunk_bytes", int, "send tensors above this size in chunks (default: 262144)"),
    "--run-id": ("run_id", str, "run id bound into every message (default: run directory name + random suffix)"),
}
# ranges of the numeric field options (edge_client/configfile.py check_value; floats must also be finite)
FIELD_LIMITS = {"deadline_s": {"gt": 0}, "heartbeat_timeout_s": {"gt": 0}, "upload_extension_s": {"minimum": 0},
                "wait_agents": {"minimum": 0}, "broker_outage_timeout_s": {"gt": 0},
                "empty_federation_timeout_s": {"gt": 0},
                "wait_timeout_s": {"minimum": 0}, "round_wait_s": {"minimum": 0}, "chunk_bytes": {"minimum": 1}}


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
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint.pt")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
    dashboard.add_option(p)
    p.set_defaults(func=run)


def field_config(args: argparse.Namespace, out: Path, resume: bool):
    from coordinator.field.connection import FieldConfig

    fc = FieldConfig()
    saved = out / "field.json"
    if resume and saved.exists():
        try:
            fc = FieldConfig(**json.loads(saved.read_text()))
        except (OSError, ValueError, TypeError) as e:  # TypeError: not an object, or keys FieldConfig lacks
            raise UserError(f"--resume: {saved} is damaged ({type(e).__name__}: {str(e)[:80]}); restore it, "
                            f"or delete it to resume with the field options given as flags") from None
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
        fc.run_id = f"{out.name}-{uuid.uuid4().hex[:8]}"
    for flag, (dest, typ, _) in FIELD_OPTIONS.items():  # each value against its range, wherever it came from
        v = getattr(fc, dest)
        if dest in FIELD_LIMITS and v is not None:
            where = f"from {flag}" if getattr(args, f"field.{dest}", None) is not None else f"in {saved}"
            setattr(fc, dest, check_value(f"field.{dest}", v, typ, FIELD_LIMITS[dest], where, UserError))
    try:
        fc.broker = ",".join(broker_urls(fc.broker))  # a bad URL now, before the run directory is written
    except AgentError as e:
        raise UserError(f"--broker: {e}") from None
    return fc


def check_field_mode(cfg: config.SimConfig) -> None:
    """What field mode refuses beyond `config.validate` (also dropfl.field)."""
    if cfg.availability.kind != "always":
        raise UserError("--availability: in field mode availability comes from the agents; leave it out")


def run(args) -> int:
    from coordinator.strategies import STRATEGIES

    cfg = config.resolve(args, list(STRATEGIES))
    check_field_mode(cfg)
    out = cfg.run.out or f"runs/field-{cfg.strategy.algo}-{cfg.data.dataset}-s{cfg.run.seed}"
    cfg.run.out = out
    fc = field_config(args, Path(out), args.resume)
    signal.signal(signal.SIGTERM, _interrupt)
    with dashboard.serving(args, out):
        run_field(cfg, fc, out, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite)
    print(f"run directory: {out}")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:  # python -m coordinator.cli.coordinator ...
    from coordinator.cli import main as cli_main
    return cli_main(["coordinator", *(sys.argv[1:] if argv is None else argv)])
