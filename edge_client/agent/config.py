"""The agent's config file and the names its parts share.

Owns the config sections (`AgentSection`, `AgentData`, `AgentModel`, with `PolicyConfig` and
`BatteryConfig` from their own modules), reading them (`config_from_dict`, `load_config`), the broker
URL (`broker_address`), the topic root every MQTT topic hangs under (`TOPIC_ROOT`), the agent's one
exception (`AgentError`) and its logger (`log`, "dropfl.agent"; pass `extra=who(device_id)` so the
human line reads `[agent <device>] text`).

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
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from edge_client.battery import BatteryConfig
from edge_client.configfile import fill_sections, read_config_file
from edge_client.monitor import PolicyConfig

TOPIC_ROOT = "dropfl/v1"

log = logging.getLogger("dropfl.agent")


def who(device_id: str) -> dict:
    """`extra=` for `log`: the human line reads `[agent <device_id>] text`."""
    return {"who": f"agent {device_id}"}


class AgentError(Exception):
    """The agent cannot start; the message says what to fix."""


@dataclass
class AgentSection:
    client: int = 0                        # client index = data shard (0..clients-1)
    device_id: str | None = None           # broker username / topic id (default: client-<client>)
    broker: str = "mqtt://127.0.0.1:1883"     # mqtts://HOST:PORT = TLS, server checked against ca_file
    password: str | None = None                # broker password (username = device_id)
    ca_file: str | None = None                 # CA certificate for mqtts:// (relative to the config file)
    heartbeat_s: float = 1.0
    keepalive_s: int = 10
    out: str | None = None                 # directory for trace.csv (default: agents/<device_id>)
    threads: int = 1                       # torch threads for training
    slowdown_s_per_step: float = 0.0       # emulate a slower device: extra seconds per SGD step
    uplink_limit_Bps: float = 0.0          # emulate a slow uplink: pace the update's chunks to this rate (0: off)
    exit_when_done: bool = True            # exit when the coordinator announces the run finished
    chunk_bytes: int = 256 * 1024
    max_tensor_bytes: int = 256 * 1024 ** 2
    publish_timeout_s: float = 60.0


@dataclass
class AgentData:
    dataset: str = "fmnist"
    data_dir: str | None = None
    partition: str = "shards"
    clients: int = 30
    shards_per_client: int = 2
    dirichlet_alpha: float = 0.5
    seed: int = 0


@dataclass
class AgentModel:
    model: str = "mimic-cnn"
    dropout: float | None = None


@dataclass
class AgentConfig:
    agent: AgentSection = field(default_factory=AgentSection)
    data: AgentData = field(default_factory=AgentData)
    model: AgentModel = field(default_factory=AgentModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    battery: BatteryConfig = field(default_factory=BatteryConfig)

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
    if cfg.agent.heartbeat_s <= 0:
        raise AgentError("agent config: heartbeat_s must be > 0")
    return cfg


def load_config(path: str) -> AgentConfig:
    p = Path(path)
    cfg = config_from_dict(read_config_file(p, AgentError))
    if cfg.agent.ca_file and not Path(cfg.agent.ca_file).is_absolute():
        cfg.agent.ca_file = str(p.parent / cfg.agent.ca_file)
    return cfg


def broker_address(url: str) -> tuple[str, int]:
    u = urlparse(url if "://" in url else "mqtt://" + url)
    if u.scheme not in ("mqtt", "tcp", "mqtts") or not u.hostname:
        raise AgentError(f"broker {url!r}: expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
    return u.hostname, u.port or (8883 if u.scheme == "mqtts" else 1883)
