"""`dropfl links`: housekeeping for the network namespaces of `dropfl trial --links` (coordinator/field/netem.py)."""

from __future__ import annotations

from coordinator.field.netem import _alive, _owner, check_support, cleanup, namespaces


def add_parser(sub) -> None:
    p = sub.add_parser("links", help="link emulation housekeeping (network namespaces of `dropfl trial --links`)",
                       description="List or remove the network namespaces `dropfl trial --links` creates "
                                   "(docs/links.md). Needs root.")
    p.add_argument("action", choices=["list", "cleanup"])
    p.add_argument("--all", action="store_true", help="cleanup: also namespaces of running processes")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    if args.action == "list":
        for ns in namespaces():
            pid = _owner(ns)
            print(f"{ns}  owner {pid} {'running' if pid and _alive(pid) else 'gone'}")
        return 0
    check_support()
    gone = cleanup(include_live=args.all)
    print(f"removed {len(gone)} namespace(s)" + (": " + ", ".join(gone) if gone else ""))
    return 0
