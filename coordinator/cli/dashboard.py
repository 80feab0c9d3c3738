"""`dropfl dashboard RUN_DIR [RUN_DIR ...]`: the live web dashboard of one or more run directories
(coordinator/dashboard/, docs/dashboard.md), served until Ctrl-C."""

from __future__ import annotations


def add_parser(sub) -> None:
    from coordinator.dashboard.server import DEFAULT_HOST

    p = sub.add_parser(
        "dashboard", help="live web dashboard of run directories (accuracy, participation, devices, timing)",
        description="Serve a web page that shows run directories and redraws as their files grow: accuracy and "
                    "loss per round (the runs side by side), the participation raster (available, selected, "
                    "dropped and why), the devices of a field run, FedDD's dropout rates and round timing. "
                    "Works for a finished run and one still being written; read-only. Ctrl-C stops it. "
                    "See docs/dashboard.md.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (the --out of sim, coordinator, trial)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; 0.0.0.0: every "
                        f"interface, anyone who reaches it sees the runs)")
    p.add_argument("--port", type=int, default=0, help="TCP port (default: 0, a free one; the URL is printed)")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS",
                   help="how often the page checks the runs for new rows (default: 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    import math

    from coordinator.dashboard.rundata import check_run_dirs
    from coordinator.dashboard.server import DashboardServer
    from coordinator.errors import UserError

    if not (math.isfinite(args.poll) and 0.1 <= args.poll <= 3600):
        raise UserError(f"--poll {args.poll}: give seconds between 0.1 and 3600")
    dirs = check_run_dirs(args.runs)
    srv = DashboardServer(dirs, args.host, args.port, args.poll)
    print(f"dashboard: {srv.url} ({len(dirs)} run{'s' * (len(dirs) > 1)}; Ctrl-C stops it)", flush=True)
    srv.serve_forever()
    return 0
