"""A RabbitMQ cluster with the MQTT plugin on 127.0.0.1, for tests (Debian's `rabbitmq-server`).

`RabbitCluster(workdir, nodes=2)` starts `rabbit1@localhost`, `rabbit2@localhost`, ... (2 or 3 nodes) each
with its own AMQP, distribution and MQTT ports, joins them into one cluster and waits until every node's
MQTT listener accepts connections; `stop_node(i)` stops one node as an operator would, `kill_node(i)`
kills it with SIGKILL (its whole process group: beam.smp and its helpers), `start_node(i)` starts a
stopped or killed node again (it rejoins the cluster from its own data directory); `close()` stops
every node and the private epmd. Everything is private: an epmd on a free port (`ERL_EPMD_PORT`, bound to 127.0.0.1), a
HOME of its own holding one Erlang cookie for all nodes, per-node config, data and log directories,
listeners on 127.0.0.1 only. A client that sends a username needs an account (`add_user`).
Measured facts it is built on (Debian bookworm, RabbitMQ 3.10.8): two nodes start in 18-50 s on 2
cores; use /usr/lib/rabbitmq/bin/rabbitmqctl, not the /usr/sbin wrapper that switches to the rabbitmq
user and its cookie; three nodes start in ~42 s and a node restarts after SIGKILL in 28-55 s.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

from coordinator.trial.broker import free_port

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
SERVER, CTL = RABBIT_BIN / "rabbitmq-server", RABBIT_BIN / "rabbitmqctl"
EPMD = "/usr/bin/epmd"


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if not SERVER.exists() or not CTL.exists():
        return "rabbitmq-server is not installed (apt-get install --no-install-recommends rabbitmq-server)"
    return None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class RabbitCluster:
    def __init__(self, workdir: str | Path, nodes: int = 2, timeout_s: float = 150.0):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        cookie = home / ".erlang.cookie"  # one cookie for every node and rabbitmqctl
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        self.epmd_port = free_port()
        self.env = os.environ | {"HOME": str(home), "ERL_EPMD_PORT": str(self.epmd_port),
                                 "ERL_EPMD_ADDRESS": "127.0.0.1",
                                 "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf")}
        (self.dir / "rabbitmq-env.conf").write_text("")
        self.names = [f"rabbit{i + 1}@localhost" for i in range(nodes)]
        self.mqtt_ports = [free_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen | None] = [None] * nodes
        self.stopped: set[int] = set()
        self.timings: dict[str, float] = {}
        t0 = time.monotonic()
        try:
            for i in range(nodes):
                self._start(i)
            for i in range(nodes):
                self._wait(i)
            for i in range(1, nodes):
                for cmd in (["stop_app"], ["reset"], ["join_cluster", self.names[0]], ["start_app"]):
                    self.ctl(i, *cmd)
            for i in range(nodes):
                self._wait_mqtt(i)
            status = self.ctl(0, "cluster_status")
            if any(n not in status for n in self.names):
                raise RuntimeError(f"the nodes did not form one cluster:\n{status}")
        except BaseException:
            self.close()
            raise
        self.timings["start_s"] = time.monotonic() - t0

    # --- one node ---
    def _node_env(self, i: int) -> dict[str, str]:
        d = self.dir / f"node{i + 1}"
        for sub in ("mnesia", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{free_port()}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.mqtt_ports[i]}\n"
            "loopback_users = none\n"
            "mqtt.allow_anonymous = true\n")
        return self.env | {
            "RABBITMQ_NODENAME": self.names[i], "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(free_port()), "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"), "RABBITMQ_MNESIA_DIR": str(d / "mnesia" / self.names[i]),
            "RABBITMQ_LOG_BASE": str(d / "log"), "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}"}

    def _start(self, i: int) -> None:
        env = self._node_env(i)
        with open(self.dir / f"node{i + 1}" / "server.out", "ab") as out:
            self.procs[i] = subprocess.Popen([str(SERVER)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait(self, i: int, retries: int = 2) -> None:
        """Wait until node i runs. A node that exits at start because one of its ports was taken meanwhile (the
        ports are picked free, then bound by the node: another process may take one first on a busy machine)
        is started again on fresh ports (its MQTT port too, unless it has run before), `retries` times."""
        pid_file = self.dir / f"node{i + 1}" / "rabbit.pid"
        out = self.dir / f"node{i + 1}" / "server.out"
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.procs[i].poll() is not None:
                if retries > 0 and "eaddrinuse" in (out.read_text(errors="replace") if out.exists() else ""):
                    out.write_text("")
                    pid_file.unlink(missing_ok=True)
                    if i not in self.stopped:
                        self.mqtt_ports[i] = free_port()
                    self._start(i)
                    return self._wait(i, retries - 1)
                raise RuntimeError(f"{self.names[i]} exited at start:\n{self.log_tail(i)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.names[i]} did not start in {self.timeout_s:g} s:\n{self.log_tail(i)}")
            if pid_file.exists():  # the server writes it early; `wait` needs it
                try:
                    self.ctl(i, "wait", "--timeout", "10", str(pid_file), timeout=30)
                    return
                except (RuntimeError, subprocess.TimeoutExpired):
                    continue  # not up yet, or it exited: the loop looks again
            time.sleep(0.2)

    def _wait_mqtt(self, i: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not _port_open(self.mqtt_ports[i]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.names[i]}: MQTT port {self.mqtt_ports[i]} not open:\n{self.log_tail(i)}")
            time.sleep(0.2)

    def ctl(self, i: int, *args: str, timeout: float = 150.0) -> str:
        p = subprocess.run([str(CTL), "-n", self.names[i], *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"rabbitmqctl -n {self.names[i]} {' '.join(args)}: exit {p.returncode}\n"
                               f"{p.stdout[-2000:]}{p.stderr[-2000:]}")
        return p.stdout

    def log_files(self, i: int) -> list[Path]:
        """Node i's log files (RabbitMQ's own, not its console output)."""
        return sorted((self.dir / f"node{i + 1}").rglob("*.log"))

    def log_tail(self, i: int, n: int = 3000) -> str:
        parts = []
        for f in self.log_files(i) + [self.dir / f"node{i + 1}" / "server.out"]:
            if f.exists():
                parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-n:])
        return "\n".join(parts)

    def log_text(self, i: int) -> str:
        """Node i's whole log (what the broker itself recorded)."""
        return "\n".join(f.read_text(errors="replace") for f in self.log_files(i))

    def add_user(self, name: str, password: str) -> None:
        """An account for MQTT clients that send a username (RabbitMQ authenticates every username;
        only a client without one is the anonymous `guest`), with all rights on the default vhost."""
        self.ctl(0, "add_user", name, password)
        self.ctl(0, "set_permissions", "-p", "/", name, ".*", ".*", ".*")

    def url(self, i: int) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_ports[i]}"

    def stop_node(self, i: int) -> float:
        """Stop node i (gracefully, as an operator would); returns the seconds it took."""
        t0 = time.monotonic()
        self.stopped.add(i)
        try:
            self.ctl(i, "stop", timeout=120)
        finally:
            self._reap(i)
        return time.monotonic() - t0

    def kill_node(self, i: int) -> None:
        """SIGKILL node i's process group (no shutdown: its connections just vanish, as in a crash)."""
        p = self.procs[i]
        assert p is not None, f"{self.names[i]} is not running"
        self.stopped.add(i)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        self.procs[i] = None

    def start_node(self, i: int) -> float:
        """Start a stopped or killed node again; returns the seconds until its MQTT listener accepts."""
        t0 = time.monotonic()
        (self.dir / f"node{i + 1}" / "rabbit.pid").unlink(missing_ok=True)
        self._start(i)
        self._wait(i)
        self._wait_mqtt(i)
        self.stopped.discard(i)
        return time.monotonic() - t0

    def _reap(self, i: int) -> None:
        p = self.procs[i]
        if p is None:
            return
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        self.procs[i] = None

    def close(self) -> None:
        """Stop every node still running (rabbitmqctl stop, SIGKILL of its process group if that fails),
        then the private epmd."""
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            if p.poll() is None:
                try:
                    self.ctl(i, "stop", timeout=60)
                except (RuntimeError, subprocess.TimeoutExpired):
                    pass
            self._reap(i)
        subprocess.run([EPMD, "-kill"], env=self.env, capture_output=True, timeout=30)
