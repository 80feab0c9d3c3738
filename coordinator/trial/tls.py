"""`dropfl trial --broker-dir DIR`: a one-machine trial on a provisioned broker (docs/provisioning.md).

Instead of the private anonymous mosquitto, the trial runs mosquitto with DIR's own `mosquitto.conf`
(TLS only, passwords, ACL, client id = username) on its port; the coordinator logs in with DIR's
`coordinator.json`, and agent i with the bundle of device `client-<i>` from `DIR/devices/`, made with
`add-device` if it does not exist yet. Everyone dials 127.0.0.1 (the server certificate always
names it), whatever host the bundles were made for.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from coordinator.errors import UserError
from coordinator.trial.broker import MOSQUITTO, Mosquitto
from provisioning import broker as prov


def device_name(i: int) -> str:
    return f"client-{i}"


class ProvisionedBroker(Mosquitto):
    """mosquitto with a broker directory's own configuration; the same life cycle as `Mosquitto`
    (start waits until it runs; stop, restart, close; its own process group)."""

    def __init__(self, broker_dir: str | Path, timeout_s: float = 10.0):
        self.root = Path(broker_dir).resolve()
        try:
            self.settings = prov.load_settings(prov.BrokerDir(self.root))
        except prov.ProvisionError as e:
            raise UserError(f"--broker-dir: {e}") from None
        exe = shutil.which("mosquitto") or (MOSQUITTO if os.path.exists(MOSQUITTO) else None)
        if exe is None:
            raise UserError("mosquitto not found: install the Debian package (apt-get install mosquitto)")
        self.exe, self.timeout_s, self._tmp, self.proc = exe, timeout_s, None, None
        self.dir, self.conf, self.port = self.root, self.root / "mosquitto.conf", self.settings.port
        self.start()

    @property
    def url(self) -> str:
        return prov.broker_url("127.0.0.1", self.port)

    @property
    def coordinator_json(self) -> Path:
        return self.root / "coordinator.json"


def device_agent_keys(broker_dir: str | Path, n: int) -> list[dict]:
    """The `[agent]` keys (device_id, broker, password, ca_file) of devices client-0 .. client-<n-1>,
    from their bundles; a device without one is added first (`dropfl provision add-device`). The broker
    URL is rewritten to 127.0.0.1 and ca_file made absolute."""
    root = Path(broker_dir).resolve()
    d = prov.BrokerDir(root)
    out = []
    try:
        s = prov.load_settings(d)
        for i in range(n):
            name = device_name(i)
            bundle = d.devices / name / "agent.json"
            if not bundle.exists():
                prov.add_device(root, name, "127.0.0.1" if "127.0.0.1" in s.hosts else None)
            keys = json.loads(bundle.read_text())["agent"]
            out.append(keys | {"broker": prov.broker_url("127.0.0.1", s.port),
                               "ca_file": str((bundle.parent / keys["ca_file"]).resolve())})
    except prov.ProvisionError as e:
        raise UserError(f"--broker-dir: {e}") from None
    return out


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (an agent config holding a device password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
