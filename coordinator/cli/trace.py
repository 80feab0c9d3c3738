"""`dropfl trace`: import and summarise availability traces (schemas in docs/traces.md)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from coordinator.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="import and summarise availability traces",
                       description="Availability traces: import FedScale's client_behave_trace into the "
                                   "device-trace schema, or summarise a participation log. Schemas: docs/traces.md.")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    imp = tsub.add_parser("import-fedscale", help="convert a FedScale client_behave_trace pickle to a device trace CSV")
    imp.add_argument("pickle", help="FedScale client_behave_trace file (pickled dict)")
    imp.add_argument("out", help="device trace CSV to write")
    imp.add_argument("--horizon", type=float, default=None,
                     help="unroll the periodic pattern up to this many seconds (default: one period)")
    imp.add_argument("--max-devices", type=int, default=None, help="keep only the first N devices")
    imp.add_argument("--max-rows", type=int, default=None,
                     help="refuse an unrolling longer than this many rows (default 50,000,000, ~1.3 GB)")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    imp.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")
    imp.set_defaults(func=run_import)
    show = tsub.add_parser("show", help="summarise a participation log (a run directory, participation.csv or "
                                        "participation/)")
    show.add_argument("path", help="run directory, participation.csv or the columnar participation/")
    show.set_defaults(func=run_show)


def run_import(args) -> int:
    from coordinator.availability.traces import import_fedscale
    from edge_client.configfile import check_value

    if args.horizon is not None:  # inf or nan would never end the unrolling; 0 or less would silently mean one period
        check_value("--horizon", args.horizon, float, {"gt": 0}, "", UserError)
    if args.max_devices is not None:  # 0 meant all devices, -1 all but the last
        check_value("--max-devices", args.max_devices, int, {"minimum": 1}, "", UserError)
    if args.max_rows is not None:
        check_value("--max-rows", args.max_rows, int, {"minimum": 1}, "", UserError)
    from coordinator.availability.traces import MAX_IMPORT_ROWS
    n = import_fedscale(args.pickle, args.out, args.horizon, args.max_devices,
                        progress=not getattr(args, "no_progress", False), overwrite=args.overwrite,
                        max_rows=args.max_rows or MAX_IMPORT_ROWS)
    print(f"wrote {n} devices to {args.out}")
    return 0


def summarise(path: str | Path) -> dict:
    from coordinator.availability.participation import read_rows

    p = Path(path)
    if p.is_dir() and (p / "participation").is_dir():
        p = p / "participation"
    if p.is_dir() and p.name == "participation":  # the columnar log (coordinator/availability/columnar.py)
        return summarise_columnar(p)
    if p.is_dir():
        p = p / "participation.csv"
    if not p.exists():
        raise UserError(f"trace show: {p} does not exist")
    rows = read_rows(p)
    rounds = {int(r["round"]) for r in rows}
    clients = {int(r["client"]) for r in rows}
    status = Counter(r["status"] for r in rows)
    reasons = Counter(r["reason"] for r in rows if r["status"] in ("unavailable", "dropped"))
    return {"rounds": len(rounds), "clients": len(clients), "status": dict(status), "reasons": dict(reasons),
            "participants_per_round": status["participated"] / max(len(rounds), 1)}


def summarise_columnar(p: Path) -> dict:
    import numpy as np

    from coordinator.availability import columnar
    from coordinator.availability.models import REASONS

    rounds, status, reason = columnar.read_columnar(p)
    counts = np.bincount(status.ravel(), minlength=len(columnar.STATUSES))
    absent = (status == columnar.UNAVAILABLE) | (status == columnar.DROPPED)
    why = np.bincount(reason[absent], minlength=len(REASONS) + 1)
    names = ("",) + REASONS
    return {"rounds": len(rounds), "clients": status.shape[1],
            "status": {s: int(c) for s, c in zip(columnar.STATUSES, counts) if c},
            "reasons": {names[k]: int(c) for k, c in enumerate(why) if c},
            "participants_per_round": int(counts[columnar.PARTICIPATED]) / max(len(rounds), 1)}


def run_show(args) -> int:
    s = summarise(args.path)
    print(f"rounds {s['rounds']}, clients {s['clients']}, participants per round {s['participants_per_round']:.2f}")
    for k, v in sorted(s["status"].items()):
        print(f"  {k:13s} {v}")
    for k, v in sorted(s["reasons"].items(), key=lambda kv: -kv[1]):
        print(f"  absent: {k or '(none)':10s} {v}")
    return 0
