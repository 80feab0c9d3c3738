"""`dropfl provision`: a TLS mosquitto broker directory with a CA, passwords and the protocol's ACL,
and one credential bundle per device (docs/provisioning.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from coordinator.errors import UserError

DEFAULT_DIR = "broker"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "provision", help="create a TLS broker directory and per-device credential bundles",
        description="Set up the MQTT broker for field trials: a CA, a server certificate, mosquitto.conf "
                    "(TLS only, no anonymous access), a password file and the ACL of docs/protocol.md; "
                    "then add or revoke devices. See docs/provisioning.md.")
    psub = p.add_subparsers(dest="provision_command", metavar="ACTION", required=True)

    q = psub.add_parser("init", help="create a broker directory (CA, certificate, config, coordinator account)")
    q.add_argument("dir", help="directory to create (must not exist or be empty)")
    q.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="IP address or DNS name devices dial (repeatable; the first is written into bundles; "
                        "127.0.0.1 and localhost are always in the certificate)")
    q.add_argument("--port", type=int, default=8883, help="TLS listener port (default 8883)")
    q.add_argument("--bind", default=None,
                   help="address the listener binds (default: 127.0.0.1 if every host is loopback, else 0.0.0.0)")
    q.add_argument("--broker-user", default=None,
                   help="user mosquitto runs as (written as `user` in mosquitto.conf; when run as root the files "
                        "the broker reads are given to this user; default: the current user)")
    q.set_defaults(func=run_init)

    q = psub.add_parser("add-device", help="create credentials and a bundle for a device")
    q.add_argument("name", help="device name = MQTT username = client id (letters, digits, '-', '_')")
    q.add_argument("--dir", default=DEFAULT_DIR, help=f"broker directory (default ./{DEFAULT_DIR})")
    q.add_argument("--host", default=None, help="host written into the bundle (default: the first --host of init)")
    q.add_argument("--plugin", action="append", default=[], metavar="WHEEL|DIR",
                   help="a plugin package for the device (repeatable): a wheel file, or a project directory built "
                        "into one with `pip wheel --no-deps`; put into the bundle, installed by setup-device.sh")
    q.set_defaults(func=run_add_device)

    q = psub.add_parser("revoke-device", help="remove a device's credentials and reload the broker")
    q.add_argument("name", help="device name")
    q.add_argument("--dir", default=DEFAULT_DIR, help=f"broker directory (default ./{DEFAULT_DIR})")
    q.set_defaults(func=run_revoke_device)


def run_init(args: argparse.Namespace) -> int:
    from provisioning import broker

    root = Path(args.dir)
    try:
        s = broker.init(root, args.host, port=args.port, bind=args.bind, broker_user=args.broker_user)
    except broker.ProvisionError as e:
        raise UserError(str(e)) from e
    print(f"broker directory: {root}")
    print(f"  listener: TLS on {s.bind}:{s.port}; certificate valid for {', '.join(s.hosts)}")
    print(f"  coordinator credentials: {root / 'coordinator.json'}")
    print(f"  start the broker: mosquitto -c {(root / 'mosquitto.conf').resolve()}")
    print(f"  add a device: dropfl provision add-device NAME --dir {root}")
    return 0


def plugin_wheel(path: str, work: Path) -> Path:
    """The wheel of a --plugin: the file itself, or the project directory built by `pip wheel --no-deps` into
    `work` (UserError, one line, if it is neither or does not build)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".whl":
        return p
    if not p.is_dir() or not any((p / f).is_file() for f in ("pyproject.toml", "setup.py")):
        raise UserError(f"--plugin {path}: not a wheel file (.whl) or a project directory (with pyproject.toml "
                        f"or setup.py): give the plugin package's wheel or its source directory")
    out = work / str(len(list(work.iterdir())))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(p)], capture_output=True, text=True)
    wheels = sorted(out.glob("*.whl")) if out.is_dir() else []
    if r.returncode != 0 or len(wheels) != 1:
        last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise UserError(f"--plugin {path}: `pip wheel --no-deps` did not build one wheel ({last}): fix the project "
                        f"or give its wheel")
    return wheels[0]


def run_add_device(args: argparse.Namespace) -> int:
    from provisioning import broker

    with tempfile.TemporaryDirectory(prefix="dropfl-plugins-") as work:
        wheels = tuple(plugin_wheel(p, Path(work)) for p in args.plugin)   # before anything is written
        names = [w.name for w in wheels]
        if len(set(names)) != len(names):
            raise UserError(f"--plugin: two plugins give the same wheel ({', '.join(names)}): give each once")
        try:
            archive, reloaded = broker.add_device(Path(args.dir), args.name, host=args.host, plugins=wheels)
        except broker.ProvisionError as e:
            raise UserError(str(e)) from e
    print(f"device {args.name}: bundle {archive} (contains the password; copy it to the device and delete it)")
    for n in names:
        print(f"  plugin {n}: installed into the device's venv by setup-device.sh")
    print("  broker reloaded" if reloaded else "  broker not running; it reads the new password when it starts")
    return 0


def run_revoke_device(args: argparse.Namespace) -> int:
    from provisioning import broker

    try:
        was_active, reloaded = broker.revoke_device(Path(args.dir), args.name)
    except broker.ProvisionError as e:
        raise UserError(str(e)) from e
    if not was_active:
        print(f"device {args.name}: already revoked")
        return 0
    print(f"device {args.name}: revoked")
    print("  broker reloaded" if reloaded else "  broker not running; it reads the new password file when it starts")
    return 0
