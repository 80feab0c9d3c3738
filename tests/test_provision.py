"""`dropfl provision` without a running broker: files, password hashes, errors, idempotence."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from coordinator.cli import main as dropfl
from provisioning import broker


@pytest.fixture
def bdir(tmp_path: Path) -> Path:
    root = tmp_path / "b"
    assert dropfl(["provision", "init", str(root), "--host", "10.0.0.5", "--host", "coord.lan"]) == 0
    return root


def test_hash_matches_mosquitto_passwd(tmp_path: Path) -> None:
    """Our $7$ hash, recomputed with the salt mosquitto_passwd chose, is byte for byte what it wrote."""
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("needs mosquitto_passwd")
    pw = tmp_path / "pw"
    subprocess.run([tool, "-c", "-b", str(pw), "alice", "s3cret"], check=True)
    user, theirs = pw.read_text().strip().split(":", 1)
    salt = base64.b64decode(theirs.split("$")[3])
    assert user == "alice" and broker.hash_password("s3cret", salt) == theirs


def test_init_writes_a_tls_only_config(bdir: Path) -> None:
    conf = (bdir / "mosquitto.conf").read_text()
    assert "allow_anonymous false" in conf and "use_username_as_clientid true" in conf
    assert conf.count("listener ") == 1 and "listener 8883 0.0.0.0" in conf  # a LAN host was given
    assert f"certfile {(bdir / 'server.crt').resolve()}" in conf
    san = subprocess.run(["openssl", "x509", "-in", str(bdir / "server.crt"), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.0.0.5" in san and "DNS:coord.lan" in san and "IP Address:127.0.0.1" in san
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(bdir / "ca.crt"), str(bdir / "server.crt")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    assert (bdir / "ca.key").stat().st_mode & 0o077 == 0
    assert list(broker.read_passwd(bdir / "passwd")) == ["coordinator"]
    coord = json.loads((bdir / "coordinator.json").read_text())
    assert (coord["username"], coord["broker"]) == ("coordinator", "mqtts://10.0.0.5:8883")
    assert coord["ca_file"] == str((bdir / "ca.crt").resolve())


def test_loopback_only_binds_loopback(tmp_path: Path) -> None:
    s = broker.init(tmp_path / "b", [])
    assert s.bind == "127.0.0.1" and s.hosts == ["127.0.0.1", "localhost"]


def test_add_device_bundle(bdir: Path, tmp_path: Path) -> None:
    assert dropfl(["provision", "add-device", "pi-01", "--dir", str(bdir), "--host", "coord.lan"]) == 0
    with tarfile.open(bdir / "devices" / "pi-01.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["pi-01", "pi-01/agent.json", "pi-01/ca.crt"]
        tar.extractall(tmp_path / "x", filter="data")
    agent = json.loads((tmp_path / "x/pi-01/agent.json").read_text())
    a = agent["agent"]
    assert list(agent) == ["agent"] and sorted(a) == ["broker", "ca_file", "device_id", "password"]
    assert (a["device_id"], a["broker"], a["ca_file"]) == ("pi-01", "mqtts://coord.lan:8883", "ca.crt")
    assert (tmp_path / "x/pi-01/ca.crt").read_bytes() == (bdir / "ca.crt").read_bytes()
    stored = broker.read_passwd(bdir / "passwd")["pi-01"]
    salt = base64.b64decode(stored.split("$")[3])
    assert broker.hash_password(a["password"], salt) == stored
    acl = (bdir / "acl").read_text()
    assert "user pi-01\ntopic read dropfl/v1/model/#\n" in acl


@pytest.mark.parametrize("argv, message", [
    (["add-device", "a/b"], "bad device name 'a/b'"),
    (["add-device", "pi+1"], "bad device name"),
    (["add-device", "coordinator"], "reserved for the coordinator"),
    (["add-device", "pi-02", "--host", "evil.example"], "not in the server certificate"),
    (["revoke-device", "ghost"], "unknown device 'ghost'"),
])
def test_one_line_errors(bdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert dropfl(["provision", *argv, "--dir", str(bdir)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_init_refuses_existing_dir(bdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (bdir / "ca.crt").read_bytes()
    assert dropfl(["provision", "init", str(bdir)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (bdir / "ca.crt").read_bytes() == before


def test_not_a_broker_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dropfl(["provision", "add-device", "pi-01", "--dir", str(tmp_path)]) == 2
    assert "not a broker directory" in capsys.readouterr().err


def test_add_twice_refused_revoke_twice_is_a_no_op(bdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dropfl(["provision", "add-device", "pi-01", "--dir", str(bdir)]) == 0
    assert dropfl(["provision", "add-device", "pi-01", "--dir", str(bdir)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert dropfl(["provision", "revoke-device", "pi-01", "--dir", str(bdir)]) == 0
    assert "pi-01" not in broker.read_passwd(bdir / "passwd")
    assert "pi-01" not in (bdir / "acl").read_text()
    assert not (bdir / "devices" / "pi-01").exists()
    assert dropfl(["provision", "revoke-device", "pi-01", "--dir", str(bdir)]) == 0
    assert "already revoked" in capsys.readouterr().out
    # a revoked name can be provisioned again, with a new password
    assert dropfl(["provision", "add-device", "pi-01", "--dir", str(bdir)]) == 0
    assert "pi-01" in broker.read_passwd(bdir / "passwd")


def test_stale_pid_file_is_not_a_running_broker(bdir: Path) -> None:
    (bdir / "run" / "mosquitto.pid").write_text("999999999\n")
    _, reloaded = broker.add_device(bdir, "pi-01")
    assert reloaded is False
