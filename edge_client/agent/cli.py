"""The agent's command line: `dropfl client --config FILE` (`add_parser`, wired in by
coordinator/cli/client.py) and `python -m edge_client.agent --config FILE` (`main`, used by the
systemd unit provisioning/dropfl-agent.service). Both take `--log-level` and `--device auto|cpu|cuda`
(edge_client/agent/device.py)."""

from __future__ import annotations

import argparse
import sys

from edge_client.agent.config import DEVICES, AgentError, load_config
from edge_client.logs import LEVELS


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="agent config file (TOML or JSON)")
    p.add_argument("--log-level", choices=LEVELS, default="info", help="stderr log level (default: info)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where to train: cpu, cuda (an error without CUDA) or auto (cuda where available, else "
                        "cpu); CUDA runs deterministic (default: the config's [agent] device, itself cpu by default)")


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="run an edge agent (one federated client) against an MQTT broker",
                       description="Run an edge agent: announce, heartbeat, train on request, upload, evaluate "
                                   "the global model with onnxruntime. See edge_client/agent/config.py for the "
                                   "config.")
    _arguments(p)
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    from edge_client.agent import run_agent  # the package imports this module first

    try:
        cfg = load_config(args.config)
        if getattr(args, "device", None):
            cfg.agent.device = args.device  # the option overrides the config file
        return run_agent(cfg, getattr(args, "log_level", "info"))
    except AgentError as e:
        print(f"dropfl: error: {e}", file=sys.stderr)  # the same one-line style as `dropfl`
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dropfl-client")
    _arguments(parser)
    return _cli(parser.parse_args(argv))
