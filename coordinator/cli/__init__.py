"""`dropfl` command line. Each subcommand lives in its own module with `add_parser(subparsers)`;
this file only wires them together and turns user errors into one-line messages (exit code 2)."""

from __future__ import annotations

import argparse
import sys

from coordinator.errors import UserError

SUBCOMMANDS = ["coordinator.cli.sim", "coordinator.cli.trace", "coordinator.cli.provision", "coordinator.cli.client",
               "coordinator.cli.coordinator", "coordinator.cli.report", "coordinator.cli.trial",
               "coordinator.cli.reproduce", "coordinator.cli.links"]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="dropfl",
        description="Federated learning under client dropouts: simulate, run field trials, compare strategies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"dropfl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dropfl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
