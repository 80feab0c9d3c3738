"""The agent's config file and the names its parts share.

Owns the config sections (`AgentSection`, `AgentData`, `AgentModel`, with `PolicyConfig`,
`BatteryConfig` and `TelemetryConfig` from their own modules), reading them (`config_from_dict`,
`load_config`), the broker URLs (`broker_address` for one, `broker_urls` for a list, `Brokers` for a
client's failover over them), the topic root every MQTT topic hangs under (`TOPIC_ROOT`), the agent's
one exception (`AgentError`) and its logger (`log`, "dropfl.agent"; pass `extra=who(device_id)` so the human line reads
`[agent <device>] text`).

Config file (TOML or JSON), sections and keys as the dataclasses below, e.g.

    [agent]
    client = 3
    broker = "mqtt://127.0.0.1:1883"
    [data]
    dataset = "fmnist"
    partition = "shards"
    clients = 10
    seed = 0
    [model]
    model = "logreg"
    [policy]
    min_battery_pct = 20
    [battery]
    source = "model"
    start_pct = 60
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from edge_client.battery import BatteryConfig
from edge_client.configfile import fill_sections, read_config_file
from edge_client.monitor import PolicyConfig
from edge_client.telemetry import TelemetryConfig

TOPIC_ROOT = "dropfl/v1"
DEVICES = ("auto", "cpu", "cuda")  # [agent] device / --device (edge_client/agent/device.py)
DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # as provisioning/broker.py NAME_RE

log = logging.getLogger("dropfl.agent")


def who(device_id: str) -> dict:
    """`extra=` for `log`: the human line reads `[agent <device_id>] text`."""
    return {"who": f"agent {device_id}"}


class AgentError(Exception):
    """The agent cannot start; the message says what to fix."""


def _f(default, **limits):
    """A field with a range (`minimum`/`maximum` inclusive, `gt`/`lt` exclusive), checked by `fill_sections`."""
    return field(default=default, metadata=limits)


@dataclass
class AgentSection:
    client: int = _f(0, minimum=0)         # client index = data shard (0..clients-1)
    device_id: str | None = None           # broker username / topic id (default: client-<client>)
    # one URL, a list, or "URL,URL,...": connect to the first, fail over to the next (mqtts:// = TLS, every
    # server checked against ca_file; all URLs mqtt:// or all mqtts://)
    broker: str | list[str] = "mqtt://127.0.0.1:1883"
    password: str | None = None                # broker password (username = device_id)
    ca_file: str | None = None                 # CA certificate for mqtts:// (relative to the config file)
    heartbeat_s: float = _f(1.0, gt=0)
    # MQTT keep-alive (16 bits). Generous for slow devices and links: heartbeats (heartbeat_s) are the liveness
    # signal the coordinator uses (its --heartbeat-timeout); keep-alive only makes the broker publish the last will
    keepalive_s: int = _f(60, minimum=0, maximum=65535)
    out: str | None = None                 # directory for trace.csv (default: agents/<device_id>)
    threads: int = _f(1, minimum=1)        # torch threads for training
    # where to train: cpu (default: bitwise equal to the simulation), cuda (refused without CUDA), auto (cuda
    # where torch.cuda.is_available(), else cpu); CUDA runs deterministic (edge_client/agent/device.py)
    device: str = field(default="cpu", metadata={"choices": DEVICES})
    slowdown_s_per_step: float = _f(0.0, minimum=0)  # emulate a slower device: extra seconds per SGD step
    uplink_limit_Bps: float = _f(0.0, minimum=0)     # emulate a slow uplink: pace the update's chunks (0: off)
    exit_when_done: bool = True            # exit when the coordinator announces the run finished
    chunk_bytes: int = _f(256 * 1024, minimum=1)
    # an update's chunks while the uplink rate is not measured yet (the first upload): small, so heartbeats pass
    # between them on a slow link; later uploads size chunks from the measured rate (work.py _upload_limits)
    first_chunk_bytes: int = _f(8 * 1024, minimum=1)
    max_tensor_bytes: int = _f(256 * 1024 ** 2, minimum=1)
    publish_timeout_s: float = _f(60.0, gt=0)
    eval_every: int = _f(1, minimum=0)     # evaluate the global model every k-th round (0: never); see work.py
    eval_batch: int = _f(100, minimum=1)   # test samples per evaluation step (a task waits at most one step)
    upload_window: int = _f(2, minimum=1)  # update chunks in flight at once (a heartbeat waits behind at most these)


@dataclass
class AgentData:
    dataset: str = "fmnist"
    data_dir: str | None = None
    partition: str = "shards"
    clients: int = _f(30, minimum=1)
    shards_per_client: int = _f(2, minimum=1)
    dirichlet_alpha: float = _f(0.5, gt=0)
    seed: int = _f(0, minimum=0, maximum=2 ** 64 - 1)


@dataclass
class AgentModel:
    model: str = "mimic-cnn"
    dropout: float | None = _f(None, minimum=0, lt=1)


@dataclass
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    data: AgentData = field(default_factory=AgentData)
    model: AgentModel = field(default_factory=AgentModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    battery: BatteryConfig = field(default_factory=BatteryConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # sensors: edge_client/telemetry.py

    @property
    def device_id(self) -> str:
        return self.agent.device_id or f"client-{self.agent.client}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(d: dict) -> AgentConfig:
    sections = {f.name: f.default_factory for f in dataclasses.fields(AgentConfig)}
    parts = fill_sections(sections, d, AgentError, "agent config")
    cfg = AgentConfig(**parts)
    if not (0 <= cfg.agent.client < cfg.data.clients):
        raise AgentError(f"agent config: client {cfg.agent.client} outside 0..{cfg.data.clients - 1}")
    if cfg.agent.device_id is not None and not DEVICE_ID_RE.match(cfg.agent.device_id):
        raise AgentError(f"agent config: agent.device_id {cfg.agent.device_id!r} must be 1-64 letters, digits, "
                         f"'-' or '_', starting with a letter or digit (it is the MQTT username, a topic level "
                         f"and a directory name); use the name given to `dropfl provision add-device`")
    cfg.agent.broker = ",".join(broker_urls(cfg.agent.broker, "agent.broker"))  # a bad URL now, not when connecting
    return cfg


def load_config(path: str) -> AgentConfig:
    p = Path(path)
    cfg = config_from_dict(read_config_file(p, AgentError))
    if cfg.agent.ca_file and not Path(cfg.agent.ca_file).is_absolute():
        cfg.agent.ca_file = str(p.parent / cfg.agent.ca_file)
    return cfg


def broker_address(url: str) -> tuple[str, int]:
    expected = f"broker {url!r}: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]"
    try:
        u = urlparse(url if "://" in url else "mqtt://" + url)
        host, port = u.hostname, u.port  # .port raises ValueError for a port that is not 0..65535
    except ValueError:
        raise AgentError(f"{expected}, with PORT in 1..65535") from None
    if u.scheme not in ("mqtt", "tcp", "mqtts") or not host:
        raise AgentError(expected)
    return host, port or (8883 if u.scheme == "mqtts" else 1883)


def broker_urls(value: str | list[str], what: str = "broker") -> list[str]:
    """The broker URLs of `value` (one URL, "URL,URL,...", or a list of URLs), each checked with
    `broker_address`; all `mqtt://` or all `mqtts://` (one client has one TLS setting for all)."""
    if isinstance(value, str):
        urls = [u.strip() for u in value.split(",")]
    elif isinstance(value, list) and all(isinstance(u, str) for u in value):
        urls = [u.strip() for u in value]
    else:
        raise AgentError(f"{what} must be a URL, a comma-separated string of URLs or a list of URLs")
    if not urls or any(not u for u in urls):
        raise AgentError(f"{what} {value!r}: expected mqtt[s]://HOST[:PORT][,mqtt[s]://HOST[:PORT]...] "
                         f"without empty entries")
    for u in urls:
        broker_address(u)
    if len({is_tls(u) for u in urls}) > 1:
        raise AgentError(f"{what} {value!r}: mixes mqtt:// and mqtts:// (all URLs must be TLS, or none)")
    return urls


def is_tls(url: str) -> bool:
    return url.startswith("mqtts://")


class Brokers:
    """A client's broker URLs and the one it uses now. paho connects to one host: `rotate(client)`,
    called from on_disconnect and on_connect_fail, points the client at the next URL, and paho's own
    reconnect (with its backoff, reconnect_delay_set) then connects there."""

    def __init__(self, value: str | list[str], what: str = "broker"):
        self.urls = broker_urls(value, what)
        self.addresses = [broker_address(u) for u in self.urls]
        self.tls = is_tls(self.urls[0])
        self.i = 0

    @property
    def url(self) -> str:
        return self.urls[self.i]

    @property
    def address(self) -> tuple[str, int]:
        return self.addresses[self.i]

    def rotate(self, client) -> str:
        """Point `client` (paho, disconnected) at the next URL; returns it. paho's `host`/`port` setters
        refuse while its state is "connection lost" (the state on_disconnect and the reconnect loop run
        in), so this sets the attributes that its `reconnect()` reads."""
        if len(self.urls) > 1:
            self.i = (self.i + 1) % len(self.urls)
            client._host, client._port = self.address
        return self.url
