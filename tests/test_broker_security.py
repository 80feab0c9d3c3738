"""The provisioned broker, for real: mosquitto with the generated TLS config on a loopback port.

Who gets in (only holders of a current password, over TLS to a certificate from our CA) and what each
account may do (docs/protocol.md's ACL). Waits are on events; the only bounded waits are for
"this did not happen" checks, and those are flushed through a later message on the same path.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import ssl
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

from coordinator.cli import main as dropfl
from edge_client import wire

MOSQUITTO = shutil.which("mosquitto") or shutil.which("/usr/sbin/mosquitto")
pytestmark = [pytest.mark.mosquitto,
              pytest.mark.skipif(MOSQUITTO is None, reason="needs the mosquitto broker (apt-get install mosquitto)")]
WAIT = 10.0  # upper bound for things that must happen; never reached when the test passes
QUIET = 0.5  # bounded wait for "nothing more arrived", after a flush message proved the path is drained


@dataclass
class Broker:
    dir: Path
    port: int

    def creds(self, name: str) -> tuple[str, str]:
        if name == "coordinator":
            c = json.loads((self.dir / "coordinator.json").read_text())
            return c["username"], c["password"]
        a = json.loads((self.dir / "devices" / name / "agent.json").read_text())["agent"]
        return a["device_id"], a["password"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def brk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    root = tmp_path_factory.mktemp("broker") / "b"
    port = free_port()
    assert dropfl(["provision", "init", str(root), "--port", str(port)]) == 0
    for name in ("pi-a", "pi-b", "pi-c", "pi-d"):
        assert dropfl(["provision", "add-device", name, "--dir", str(root)]) == 0
    proc = subprocess.Popen([MOSQUITTO, "-c", str(root / "mosquitto.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    running = threading.Event()
    log: list[str] = []

    def read_log() -> None:
        for line in proc.stderr:
            log.append(line)
            if " running" in line:
                running.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        if not running.wait(WAIT):
            pytest.fail("mosquitto did not start:\n" + "".join(log))
        yield Broker(root, port)
    finally:
        proc.terminate()
        proc.wait(WAIT)


class Client:
    """A paho-mqtt 2 client (MQTT 5, so refusals come back as reason codes) that records events."""

    def __init__(self, brk: Broker, username: str | None, password: str | None = None,
                 ca: Path | None = None, client_id: str | None = None) -> None:
        client_id = username or "" if client_id is None else client_id  # the protocol: client id = username
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        self.c.reconnect_delay_set(60, 60)  # a refused client must not quietly retry during a test
        if username is not None:
            self.c.username_pw_set(username, password)
        self.c.tls_set(ca_certs=str(ca or brk.dir / "ca.crt"))
        self.port = brk.port
        self.connack: ReasonCode | None = None
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.subacks: dict[int, list[ReasonCode]] = {}
        self.subscribed = threading.Condition()
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda c, u, f, rc, p: self.disconnected.set()
        self.c.on_message = lambda c, u, m: self.messages.put(m)
        self.c.on_subscribe = self._on_subscribe

    def _on_connect(self, c, u, flags, rc: ReasonCode, props) -> None:
        self.connack = rc
        self.connected.set()

    def _on_subscribe(self, c, u, mid: int, rcs: list[ReasonCode], props) -> None:
        with self.subscribed:
            self.subacks[mid] = rcs
            self.subscribed.notify_all()

    def connect(self) -> ReasonCode:
        self.c.connect("127.0.0.1", self.port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(WAIT), "no CONNACK"
        assert self.connack is not None
        return self.connack

    def subscribe(self, topic: str, qos: int = 1) -> ReasonCode:
        _, mid = self.c.subscribe(topic, qos)
        with self.subscribed:
            assert self.subscribed.wait_for(lambda: mid in self.subacks, WAIT), "no SUBACK"
            return self.subacks[mid][0]

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self.c.publish(topic, payload, qos=qos).wait_for_publish(WAIT)

    def expect(self, topic: str) -> mqtt.MQTTMessage:
        """The next message; it must be on `topic`."""
        m = self.messages.get(timeout=WAIT)
        assert m.topic == topic, (m.topic, m.payload)
        return m

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture
def clients(brk: Broker) -> Iterator[list[Client]]:
    made: list[Client] = []
    yield made
    for c in made:
        c.close()


@pytest.fixture
def login(brk: Broker, clients: list[Client]):
    def login(name: str, **kw) -> Client:
        c = Client(brk, *brk.creds(name), **kw)
        clients.append(c)
        assert c.connect() == 0, f"{name} could not log in"
        return c
    return login


def test_anonymous_client_refused(brk: Broker, clients: list[Client]) -> None:
    c = Client(brk, None)
    clients.append(c)
    rc = c.connect()
    assert rc.is_failure and rc.getName() == "Not authorized"


def test_wrong_password_refused(brk: Broker, clients: list[Client]) -> None:
    user, password = brk.creds("pi-a")
    _, other = brk.creds("pi-b")
    for pw in ("not-the-password", other):  # another device's password does not open this account
        c = Client(brk, user, pw)
        clients.append(c)
        rc = c.connect()
        assert rc.is_failure and rc.getName() == "Not authorized"  # mosquitto 2.0 says no more than that


def test_untrusted_ca_refused(brk: Broker, tmp_path: Path) -> None:
    """A client that trusts a different CA (e.g. a look-alike broker's) refuses our server certificate."""
    other = tmp_path / "other"
    assert dropfl(["provision", "init", str(other)]) == 0
    c = Client(brk, *brk.creds("pi-a"), ca=other / "ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        c.c.connect("127.0.0.1", brk.port)


def test_plain_text_mqtt_refused(brk: Broker) -> None:
    """The only listener is TLS: an MQTT client without TLS gets no CONNACK, the broker hangs up."""
    user, password = brk.creds("pi-a")
    c = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    c.username_pw_set(user, password)
    acked = threading.Event()
    c.on_connect = lambda *a: acked.set()
    c.connect("127.0.0.1", brk.port)
    while c.loop(timeout=1.0) == mqtt.MQTT_ERR_SUCCESS:  # runs until the broker closes the socket
        pass
    assert not acked.is_set()


def test_device_may_use_its_own_topics(login) -> None:
    """The positive case, so the denials below mean something: the ACL of docs/protocol.md lets a
    device publish its status/heartbeat/update and read the model, its control topic and the coordinator."""
    coord, a = login("coordinator"), login("pi-a")
    assert not coord.subscribe("dropfl/v1/#").is_failure
    for t in ("dropfl/v1/model/#", "dropfl/v1/device/pi-a/control", "dropfl/v1/coordinator/status"):
        assert not a.subscribe(t).is_failure, t
    for t in ("dropfl/v1/device/pi-a/status", "dropfl/v1/device/pi-a/heartbeat", "dropfl/v1/device/pi-a/update/3"):
        a.publish(t, b"x")
        coord.expect(t)
    for t in ("dropfl/v1/model/3/0", "dropfl/v1/device/pi-a/control", "dropfl/v1/coordinator/status"):
        coord.publish(t, b"y")
        assert coord.expect(t).payload == b"y"  # the coordinator hears itself on dropfl/v1/#
        assert a.expect(t).payload == b"y"


def test_device_cannot_publish_as_another_device(login) -> None:
    coord, a = login("coordinator"), login("pi-a")
    assert not coord.subscribe("dropfl/v1/#").is_failure
    for t in ("dropfl/v1/device/pi-b/update/1", "dropfl/v1/device/pi-b/status", "dropfl/v1/model/1/0",
              "dropfl/v1/device/pi-b/control", "dropfl/v1/coordinator/status"):
        a.publish(t, b"forged")
    a.publish("dropfl/v1/device/pi-a/update/1", b"flush")  # same connection, so it arrives after any forgery
    assert coord.expect("dropfl/v1/device/pi-a/update/1").payload == b"flush"
    with pytest.raises(queue.Empty):
        m = coord.messages.get(timeout=QUIET)
        pytest.fail(f"forged message reached the coordinator on {m.topic}")


def test_device_cannot_subscribe_to_another_device(login) -> None:
    """mosquitto's acl_file grants a SUBACK for any filter (2.0.11 does) and checks `read` on every
    delivery, so the proof is that nothing of B's arrives: B's update and status stay invisible to A,
    while a flush on A's own control topic, queued after them, does arrive."""
    coord, a, b = login("coordinator"), login("pi-a"), login("pi-b")
    for t in ("dropfl/v1/device/pi-b/update/#", "dropfl/v1/device/pi-b/status", "dropfl/v1/device/+/update/#",
              "dropfl/v1/#", "#"):
        a.subscribe(t)
    assert not coord.subscribe("dropfl/v1/device/pi-b/#").is_failure
    b.publish("dropfl/v1/device/pi-b/update/1", b"secret")
    b.publish("dropfl/v1/device/pi-b/status", b"secret")
    coord.expect("dropfl/v1/device/pi-b/update/1")  # the broker has routed both before this returns
    coord.expect("dropfl/v1/device/pi-b/status")
    coord.publish("dropfl/v1/device/pi-a/control", b"flush")
    assert a.expect("dropfl/v1/device/pi-a/control").payload == b"flush"
    later = []  # MQTT 5 may deliver the flush once per matching filter; nothing else may come
    while True:
        try:
            later.append(a.messages.get(timeout=QUIET).topic)
        except queue.Empty:
            break
    assert set(later) <= {"dropfl/v1/device/pi-a/control"}, later


def test_client_id_is_the_username(login) -> None:
    """Connecting with another device's client id does not take over its session (it would kick it off)."""
    b = login("pi-b")
    login("pi-a", client_id="pi-b")
    b.publish("dropfl/v1/device/pi-b/heartbeat", b"alive")  # QoS 1 round trip: B is still connected
    assert not b.disconnected.is_set()


def test_revoked_device_refused(brk: Broker, login, clients: list[Client]) -> None:
    c = login("pi-c")
    user, password = brk.creds("pi-c")
    assert dropfl(["provision", "revoke-device", "pi-c", "--dir", str(brk.dir)]) == 0
    assert c.disconnected.wait(WAIT), "the broker reloaded but kept the revoked device connected"
    again = Client(brk, user, password)
    clients.append(again)
    rc = again.connect()
    assert rc.is_failure and rc.getName() == "Not authorized"
    assert not (brk.dir / "devices" / "pi-c.tar.gz").exists()
    assert "pi-c" not in (brk.dir / "acl").read_text()


def test_bundle_lets_dropfl_client_connect_over_tls(brk: Broker, login, tmp_path: Path) -> None:
    """The bundle as add-device wrote it (agent.json + ca.crt, ca_file relative), plus a trial's data
    and model sections, is enough for `dropfl client` to log in over TLS and announce itself."""
    with tarfile.open(brk.dir / "devices" / "pi-d.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    cfg = json.loads((tmp_path / "pi-d" / "agent.json").read_text())
    cfg["agent"] |= {"client": 0, "out": str(tmp_path / "out"), "heartbeat_s": 0.2}
    cfg |= {"data": {"dataset": "fmnist", "partition": "iid", "clients": 2}, "model": {"model": "logreg"}}
    config = tmp_path / "pi-d" / "agent.json"
    config.write_text(json.dumps(cfg))

    coord = login("coordinator")
    assert not coord.subscribe("dropfl/v1/device/pi-d/#").is_failure
    agent = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "client", "--config", str(config)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen: dict[str, dict] = {}
        while not {"status", "heartbeat"} <= set(seen):
            try:
                m = coord.messages.get(timeout=60)  # the agent loads torch and its shard first
            except queue.Empty:
                agent.kill()
                pytest.fail("no status/heartbeat from the agent:\n" + agent.communicate()[1][-2000:])
            header, _ = wire.decode_frame(m.payload)
            seen[m.topic.rsplit("/", 1)[1]] = header.meta
        assert seen["status"]["state"] == "online" and seen["status"]["device"] == "pi-d"
    finally:
        agent.terminate()
        agent.wait(WAIT)
