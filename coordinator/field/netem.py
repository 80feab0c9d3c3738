"""Link emulation for one-machine trials (`dropfl trial --links FILE`, docs/links.md). Slightly over ~300
lines: the link plan, its validation and the namespace life cycle belong together (cleanup must know
exactly what setup made).

Every agent runs in its own network namespace `dropfl-<pid>-<i>`, joined to the host by a veth pair
(host end `dfh<pid>x<i>`, agent end `dfn<pid>x<i>`) with the private /30 10.231.<i>.0: the host end
is 10.231.<i>.1 (the broker listens there), the agent end 10.231.<i>.2. These addresses exist only
inside the project's own namespaces. A `tc tbf` qdisc on each end limits the rate per direction:
the agent end's egress is the uplink, the host end's egress the downlink (the kernel here has no
netem, so there is no delay or loss emulation). A network trace changes rates and takes links
down and up at given times (`ip link set ... down`), so outages are real: the agent's TCP
connection stalls, its heartbeats stop, and the coordinator drops it as `offline` (or `deadline`).

Link files (agents 0..N−1 must all be covered):

    JSON profile: {"agents": [{"agent": 0, "up_Bps": 20000, "down_Bps": 200000}, ...]}
    CSV profile:  agent,up_Bps,down_Bps
    CSV trace:    the device-trace schema (docs/traces.md): device,t_s,online,...,uplink_Bps,downlink_Bps;
                  device `client-<i>` or `<i>` is agent i; a device's first row sets its link, later
                  rows change it at trace time t_s (t = 0 when the links' clock is started).

Needs root and `ip netns`. Teardown deletes the namespaces (which deletes the veth pairs and their
qdiscs); it runs on exit from the context, at interpreter exit (atexit), and namespaces left by a
dead process (its pid is in the name) are removed by the next setup or by `dropfl links cleanup`.
"""

from __future__ import annotations

import atexit
import csv
import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.errors import UserError

NS_PREFIX = "dropfl-"
SUBNET = "10.231"         # 10.231.<i>.0/30 per agent; only inside the project's namespaces
MAX_AGENTS = 254
TBF_LATENCY = "400ms"     # queueing a tbf allows before it drops (TCP backs off on local drops)


@dataclass
class LinkEvent:
    t_s: float
    agent: int
    online: bool | None = None
    up_Bps: float | None = None
    down_Bps: float | None = None


@dataclass
class LinkPlan:
    up_Bps: list[float]
    down_Bps: list[float]
    online: list[bool]
    events: list[LinkEvent] = field(default_factory=list)  # sorted by time

    def to_json(self) -> dict:
        return {"agents": [{"agent": i, "up_Bps": u, "down_Bps": d, "online": o}
                           for i, (u, d, o) in enumerate(zip(self.up_Bps, self.down_Bps, self.online))],
                "events": [vars(e) for e in self.events]}


def _rate(v, what: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UserError(f"--links: {what} {v!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise UserError(f"--links: {what} must be a finite rate > 0 bytes/s, got {v!r}")
    return x


def _agent_of(device: str, n: int) -> int | None:
    m = re.fullmatch(r"(?:client-)?(\d+)", device)
    return int(m.group(1)) if m and int(m.group(1)) < n else None


def load_links(path: str | Path, n_agents: int) -> LinkPlan:
    """A profile (JSON/CSV) or a device-trace CSV as a LinkPlan for agents 0..n_agents-1."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"--links: cannot read {path}: {e.strerror}") from None
    if p.suffix == ".json":
        try:
            rows = json.loads(text)["agents"]
            table = {int(r["agent"]): r for r in rows}
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"--links: {path} is not a link profile ({{\"agents\": [...]}}): {e!r}") from None
    else:
        reader = csv.DictReader(text.splitlines())
        cols = set(reader.fieldnames or [])
        if {"device", "t_s"} <= cols:
            return _plan_from_trace(path, n_agents)
        if not {"agent", "up_Bps", "down_Bps"} <= cols:
            raise UserError(f"--links: {path}: expected columns agent,up_Bps,down_Bps (profile) or the "
                            f"device-trace schema of docs/traces.md (trace)")
        try:
            table = {int(r["agent"]): r for r in reader}
        except ValueError as e:
            raise UserError(f"--links: {path}: {e}") from None
    missing = [i for i in range(n_agents) if i not in table]
    if missing:
        raise UserError(f"--links: {path} has no link for agents {missing[:5]} (needs 0..{n_agents - 1})")
    return LinkPlan([_rate(table[i]["up_Bps"], f"agent {i} up_Bps") for i in range(n_agents)],
                    [_rate(table[i]["down_Bps"], f"agent {i} down_Bps") for i in range(n_agents)],
                    [bool(table[i].get("online", True)) for i in range(n_agents)])


def _plan_from_trace(path: str | Path, n_agents: int) -> LinkPlan:
    from coordinator.availability.traces import read_device_trace

    series = read_device_trace(path)
    by_agent = {}
    for dev, s in series.items():
        i = _agent_of(dev, n_agents)
        if i is not None:
            by_agent[i] = s
    missing = [i for i in range(n_agents) if i not in by_agent]
    if missing:
        raise UserError(f"--links: trace {path} has no device for agents {missing[:5]} "
                        f"(devices client-<i> or <i>, i in 0..{n_agents - 1})")
    plan = LinkPlan([], [], [])
    for i in range(n_agents):
        s = by_agent[i]
        first = s.rows[0]
        if first["uplink_Bps"] is None or first["downlink_Bps"] is None:
            raise UserError(f"--links: trace {path}: the first row of agent {i} must give uplink_Bps and downlink_Bps")
        plan.up_Bps.append(_rate(first["uplink_Bps"], f"agent {i} uplink_Bps"))
        plan.down_Bps.append(_rate(first["downlink_Bps"], f"agent {i} downlink_Bps"))
        plan.online.append(first["online"] != 0)
        for t, row in zip(s.t[1:], s.rows[1:]):
            plan.events.append(LinkEvent(
                t, i, None if row["online"] is None else row["online"] != 0,
                None if row["uplink_Bps"] is None else _rate(row["uplink_Bps"], f"agent {i} uplink_Bps"),
                None if row["downlink_Bps"] is None else _rate(row["downlink_Bps"], f"agent {i} downlink_Bps")))
    plan.events.sort(key=lambda e: (e.t_s, e.agent))
    return plan


def check_support() -> None:
    """Clear error unless this process can create network namespaces."""
    if os.geteuid() != 0:
        raise UserError("--links: link emulation needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise UserError(f"--links: `{tool}` not found (install iproute2)")


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"link emulation: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(NS_PREFIX)]


def _owner(ns: str) -> int | None:
    m = re.fullmatch(rf"{NS_PREFIX}(\d+)-\d+", ns)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(include_live: bool = False) -> list[str]:
    """Delete dropfl namespaces whose owner process is gone (or all of them); returns their names."""
    gone = []
    for ns in namespaces():
        pid = _owner(ns)
        if include_live or pid is None or not _alive(pid):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            gone.append(ns)
    return gone


def _tbf(rate_Bps: float) -> list[str]:
    burst = max(3200, int(rate_Bps / 50))  # >= two 1500-byte packets; 20 ms of traffic at high rates
    return ["tbf", "rate", f"{int(rate_Bps * 8)}bit", "burst", str(burst), "latency", TBF_LATENCY]


class Links:
    """`with Links(plan) as links:` namespaces, veths and rate limits for len(plan.up_Bps) agents."""

    def __init__(self, plan: LinkPlan):
        self.plan, self.n = plan, len(plan.up_Bps)
        if not 1 <= self.n <= MAX_AGENTS:
            raise UserError(f"--links: 1..{MAX_AGENTS} agents, got {self.n}")
        self.tag = str(os.getpid())
        self.created: list[str] = []
        self.applied: list[tuple[float, LinkEvent]] = []  # (trace time, event) as applied
        self._t0: float | None = None    # monotonic time of trace time 0 (start_clock)
        self.clock_from_s = 0.0          # the trace time start_clock started at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def ns(self, i: int) -> str:
        return f"{NS_PREFIX}{self.tag}-{i}"

    def host_dev(self, i: int) -> str:
        return f"dfh{self.tag}x{i}"

    def agent_dev(self, i: int) -> str:
        return f"dfn{self.tag}x{i}"

    def host_address(self, i: int) -> str:
        return f"{SUBNET}.{i}.1"

    def agent_address(self, i: int) -> str:
        return f"{SUBNET}.{i}.2"

    @property
    def hosts(self) -> list[str]:
        return [self.host_address(i) for i in range(self.n)]

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it inside agent i's namespace."""
        return ["ip", "netns", "exec", self.ns(i)]

    def setup(self) -> None:
        check_support()
        cleanup()  # namespaces of dead processes
        others = [ns for ns in namespaces() if _owner(ns) != os.getpid()]
        if others:
            raise UserError(f"--links: another emulated trial is running (namespaces {others[:3]}); its "
                            f"10.231.x.0/30 addresses would clash. `dropfl links cleanup --all` removes them")
        atexit.register(self.teardown)
        for i in range(self.n):
            ns, h, a = self.ns(i), self.host_dev(i), self.agent_dev(i)
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            _run("ip", "link", "add", h, "type", "veth", "peer", "name", a, "netns", ns)
            _run("ip", "addr", "add", f"{self.host_address(i)}/30", "dev", h)
            _run("ip", "-n", ns, "addr", "add", f"{self.agent_address(i)}/30", "dev", a)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", a, "up")
            _run("ip", "link", "set", h, "up" if self.plan.online[i] else "down")
            self.set_rates(i, self.plan.up_Bps[i], self.plan.down_Bps[i])

    def set_rates(self, i: int, up_Bps: float | None = None, down_Bps: float | None = None) -> None:
        if up_Bps is not None:      # agent end's egress = uplink
            _run("tc", "-n", self.ns(i), "qdisc", "replace", "dev", self.agent_dev(i), "root", *_tbf(up_Bps))
        if down_Bps is not None:    # host end's egress = downlink
            _run("tc", "qdisc", "replace", "dev", self.host_dev(i), "root", *_tbf(down_Bps))

    def set_online(self, i: int, online: bool) -> None:
        """Take agent i's link down (an outage: nothing passes either way) or bring it back."""
        _run("ip", "link", "set", self.host_dev(i), "up" if online else "down")

    def apply(self, e: LinkEvent) -> None:
        self.set_rates(e.agent, e.up_Bps, e.down_Bps)
        if e.online is not None:
            self.set_online(e.agent, e.online)

    def start_clock(self, from_s: float = 0.0) -> None:
        """Apply the plan's events at their trace times from now on (a daemon thread), now being trace time
        `from_s` (a resumed trial goes on where the interrupted one stopped): events before it are applied
        at once, in order, so the links start in the state the trace gives them at `from_s`."""
        if self._thread is not None or self._t0 is not None:
            return
        t0 = self._t0 = time.monotonic() - from_s
        self.clock_from_s = from_s
        if not self.plan.events:
            return

        def run() -> None:
            for e in self.plan.events:
                if self._stop.wait(max(0.0, e.t_s - (time.monotonic() - t0))):
                    return
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.apply(e)
                    self.applied.append((time.monotonic() - t0, e))

        self._thread = threading.Thread(target=run, name="link-trace", daemon=True)
        self._thread.start()

    def trace_time(self) -> float | None:
        """Seconds of trace time reached (None before start_clock)."""
        return None if self._t0 is None else time.monotonic() - self._t0

    def teardown(self) -> None:
        self._stop.set()
        with self._lock:
            for i in range(len(self.created)):  # deleting one end deletes the pair at once; a namespace
                subprocess.run(["ip", "link", "del", self.host_dev(i)], capture_output=True)  # goes lazily
            for ns in self.created:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self.created = []
        atexit.unregister(self.teardown)

    def __enter__(self) -> Links:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()


