"""Serving the dashboard: uvicorn on a socket this module binds first, so that a port in use or a bad host is
one UserError before anything runs, and port 0 gives a free port whose URL can be printed at once.

`DashboardServer.start()` serves from a background thread (the run commands' `--dashboard`, while the run
goes on in the main thread); `serve_forever()` serves from the calling thread until Ctrl-C
(`dropfl dashboard`). uvicorn gets no logging configuration of its own (`log_config=None`): its records go
through the `dropfl` logging set up by the CLI, and the access log is off.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from coordinator.errors import RunFailure, UserError

DEFAULT_HOST = "127.0.0.1"
START_TIMEOUT_S = 20.0


def bind(host: str, port: int, flag: str = "--port", host_flag: str = "--host") -> socket.socket:
    """A listening TCP socket on host:port (0: a free port), or a one-line UserError."""
    if not 0 <= port <= 65535:
        raise UserError(f"{flag} {port}: a TCP port is 0..65535 (0 picks a free one)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, ValueError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise UserError(f"{host_flag} {host!r}: not an address of this machine ({why}); give an IP address "
                        f"such as 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT only, not one in use
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UserError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); choose another port, "
                        f"or 0 for a free one") from None
    sock.set_inheritable(True)
    return sock


class DashboardServer:
    """The dashboard over `run_dirs` on host:port, bound at construction."""

    def __init__(self, run_dirs: list[Path], host: str = DEFAULT_HOST, port: int = 0, poll_s: float = 1.0,
                 flag: str = "--port", host_flag: str = "--host"):
        try:
            import uvicorn

            from coordinator.dashboard.app import create_app
        except ImportError as e:
            raise UserError(f"the dashboard needs FastAPI and uvicorn ({e}); install them with "
                            f"`pip install 'dropfl[dashboard]'`") from None

        self.sock = bind(host, port, flag, host_flag)
        self.port = self.sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/"
        config = uvicorn.Config(create_app(run_dirs, poll_s), log_config=None, access_log=False,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    def start(self) -> DashboardServer:
        """Serve from a daemon thread; return once it answers (RunFailure if it did not start)."""
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dropfl-dashboard", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RunFailure(f"the dashboard did not start on {self.url} (see the log)")
            time.sleep(0.02)
        return self

    def serve_forever(self) -> None:
        """Serve from this thread until Ctrl-C (uvicorn handles SIGINT and SIGTERM in the main thread)."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.sock.close()


def add_option(parser: argparse.ArgumentParser) -> None:
    """`--dashboard [PORT]` and `--dashboard-host` of the run commands (sim, trial, coordinator)."""
    g = parser.add_argument_group("dashboard")
    g.add_argument("--dashboard", nargs="?", const=0, type=int, default=None, metavar="PORT",
                   help="serve the live dashboard of this run while it goes on (docs/dashboard.md); PORT, or a "
                        "free port when left out; the URL is printed")
    g.add_argument("--dashboard-host", default=DEFAULT_HOST, metavar="HOST",
                   help=f"address the dashboard listens on (default: {DEFAULT_HOST}, this machine only)")


@contextlib.contextmanager
def serving(args: argparse.Namespace, out: str | Path) -> Iterator[DashboardServer | None]:
    """With `--dashboard`: the run directory `out` served while the body runs (it may not exist yet: the
    page shows it as it is written); stopped after it. Without: nothing."""
    port = getattr(args, "dashboard", None)
    if port is None:
        yield None
        return
    srv = DashboardServer([Path(out)], getattr(args, "dashboard_host", DEFAULT_HOST), port,
                          flag="--dashboard", host_flag="--dashboard-host").start()
    print(f"dashboard: {srv.url} (while the run goes on; afterwards: dropfl dashboard {out})",
          file=sys.stderr, flush=True)
    try:
        yield srv
    finally:
        srv.stop()
