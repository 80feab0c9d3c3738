"""`dropfl` command line. Each subcommand lives in its own module here with `add_parser(subparsers)`;
this file only wires them together and turns every failure into one line on stderr:

    dropfl: error: <what, where, what to do>     exit 2: bad input (UserError, or a flag argparse refused)
    dropfl: error: <what>                        exit 1: the run failed (RunFailure, a diverged model)
    dropfl: error: internal error ... crash.log  exit 1: a bug; the traceback is in the crash log

`--debug` shows tracebacks instead; `--log-level` sets what reaches stderr (the run directory's log.txt and
log.jsonl always get debug and up); `--quiet` turns off every progress bar and progress line (it sets
`args.no_progress`, which each long command reads) and lowers stderr to warnings and errors."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from coordinator import alloc

alloc.one_arena()  # before torch starts its first thread (coordinator/alloc.py)

from coordinator import errors  # noqa: E402
from coordinator.errors import RunFailure, UserError  # noqa: E402
from edge_client import logs  # noqa: E402

SUBCOMMANDS = ["coordinator.cli.sim", "coordinator.cli.trace", "coordinator.cli.provision", "coordinator.cli.client",
               "coordinator.cli.coordinator", "coordinator.cli.report", "coordinator.cli.trial",
               "coordinator.cli.reproduce", "coordinator.cli.links",
               "coordinator.cli.dashboard", "coordinator.cli.plugins", "coordinator.cli.flower"]


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `dropfl: error: <message> (see dropfl sim --help)`."""

    def error(self, message: str):
        print(f"dropfl: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    d = argparse.SUPPRESS
    if "--log-level" in parser._option_string_actions:  # `dropfl client` declares its own (edge_client)
        return
    parser.add_argument("--log-level", choices=logs.LEVELS, default=d if suppress else None,
                        help="what reaches stderr (default: info; with --quiet: warning); the run directory's logs "
                             "keep debug")
    parser.add_argument("--debug", action="store_true", default=d if suppress else False,
                        help="show tracebacks instead of one-line errors")
    parser.add_argument("--quiet", action="store_true", default=d if suppress else False,
                        help="no progress output (bars, per-round lines; implies --no-progress) and only warnings "
                             "and errors on stderr unless --log-level is given; results still go to stdout")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = Parser(
        prog="dropfl",
        description="Federated learning under client dropouts: simulate, run field trials, compare strategies.")
    _common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    for p in sub.choices.values():  # the same two options after the subcommand (`dropfl sim --debug`)
        _common(p, suppress=True)
    return parser


def _crash_log(command: str) -> Path:
    """Write the current exception's traceback to crash.log of the run directory (or a temp file)."""
    text = f"dropfl {command} crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n{traceback.format_exc()}"
    d = errors.current_run_dir
    if d is not None and d.is_dir():
        path = d / "crash.log"
        try:
            path.write_text(text)
            return path
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix="dropfl-crash-", suffix=".log")
    with open(fd, "w") as f:
        f.write(text)
    return Path(name)


def _one_line(e: BaseException) -> str:
    """The message on one line: an exception's text may hold newlines (a path, a parser's excerpt)."""
    return " ".join(str(e).splitlines())


# commands whose process evaluates or aggregates models: glibc keeps freed memory for reuse (coordinator/alloc.py)
KEEPS_FREED_MEMORY = ("sim", "reproduce", "coordinator")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = getattr(args, "quiet", False)
    if quiet:  # every command reads its progress switch from here (`--no-progress` where it has the flag)
        args.no_progress = True
    logs.setup(args.log_level or ("warning" if quiet else "info"))
    errors.current_run_dir = None
    if args.command in KEEPS_FREED_MEMORY:
        alloc.keep_freed_memory()
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        if args.debug:
            raise
        print(f"dropfl: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (RunFailure, FloatingPointError) as e:
        if args.debug:
            raise
        print(f"dropfl: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dropfl {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        path = _crash_log(args.command)
        print(f"dropfl: error: internal error in `dropfl {args.command}`: {type(e).__name__}: {_one_line(e)} "
              f"(a bug; the traceback is in {path}; rerun with --debug to see it)", file=sys.stderr)
        return 1
    finally:
        logs.detach_run_files()  # an in-process caller's next command must not log into this run's files


if __name__ == "__main__":
    sys.exit(main())
