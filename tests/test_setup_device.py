"""provisioning/setup-device.sh in a temporary prefix (what CI can run: no systemd, no network).

To stay fast and offline the real install uses --skip-torch: the venv gets only the dropfl wheel
(built here from a copy of the source, pip --no-deps --no-index), not torch and the agent's other
dependencies. What it checks: the venv, the agent package inside it, the config written from the
bundle, idempotence, battery detection, the broker reachability check, and shellcheck.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from provisioning import broker

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "provisioning" / "setup-device.sh"
UNIT = REPO / "provisioning" / "dropfl-agent.service"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dropfl wheel, built from a copy of the source (so the shared tree gets no build/ dir)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    for pkg in ("coordinator", "edge_client", "cvx", "provisioning"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    (whl,) = (tmp / "dist").glob("dropfl-*.whl")
    return whl


@pytest.fixture(scope="module")
def listener() -> socket.socket:
    """A loopback TCP listener standing in for the broker in the reachability check."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s
    s.close()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, listener: socket.socket) -> Path:
    root = tmp_path_factory.mktemp("broker") / "b"
    broker.init(root, [], port=listener.getsockname()[1])
    archive, _ = broker.add_device(root, "pi-07")
    return archive


def setup(*args: str, power: Path | None = None, python: str = sys.executable,
          jetson: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
           "DROPFL_NV_TEGRA_RELEASE": str(jetson) if jetson else "/nonexistent/nv_tegra_release"}
    if power is not None:
        env["DROPFL_POWER_SUPPLY_DIR"] = str(power)
    return subprocess.run(["bash", str(SCRIPT), "--python", python, *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_dry_run_prints_every_action_and_creates_nothing(tmp_path: Path, bundle: Path, wheel: Path) -> None:
    prefix = tmp_path / "p"
    r = setup("--bundle", str(bundle), "--prefix", str(prefix), "--dry-run", "--agent", str(wheel),
              power=tmp_path / "no-supplies")
    assert r.returncode == 0, r.stderr
    assert not prefix.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    actions = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    expect = [
        f"+ mkdir -p {prefix}/opt/dropfl",
        f"+ {sys.executable} -m venv --system-site-packages {prefix}/opt/dropfl/venv",
        f"-q install -c {prefix}/opt/dropfl/constraints-system.txt numpy paho-mqtt psutil onnxruntime",
        f"install --no-deps --force-reinstall {wheel}",
        f"+ write {prefix}/etc/dropfl/ca.crt (mode 644)",
        f"+ write {prefix}/etc/dropfl/agent.json (mode 640)",
        f"+ write {prefix}/etc/systemd/system/dropfl-agent.service (mode 644)",
        "+ systemctl enable dropfl-agent.service",
        "+ systemctl restart dropfl-agent.service",
    ]
    for e in expect:
        assert any(e in a for a in actions), (e, actions)
    password = json.loads(_bundle_agent(bundle))["agent"]["password"]
    assert password not in r.stdout + r.stderr
    assert "battery source: model" in r.stdout
    # this venv's python has torch: auto uses it (the system source), keeping its numpy
    assert f"torch: system, {torch.__version__} from {sys.executable}" in r.stdout


def _python_without_torch() -> str | None:
    for exe in sorted(Path.home().glob(".pyenv/versions/3.1[0-3].*/bin/python")):
        if subprocess.run([str(exe), "-c", "import torch"], capture_output=True, timeout=60).returncode != 0:
            return str(exe)
    return None


def test_torch_source_is_chosen_per_board_and_said(tmp_path: Path, bundle: Path, wheel: Path) -> None:
    """auto: a Python without torch gets PyTorch's CPU index (never PyPI's CUDA build); a Jetson without a system
    torch is refused with what to install; every source is printed, also in a dry run."""
    bare = _python_without_torch()
    if bare is None:
        pytest.skip("no Python without torch under ~/.pyenv/versions")
    common = ("--bundle", str(bundle), "--prefix", str(tmp_path / "p"), "--dry-run", "--agent", str(wheel))
    r = setup(*common, python=bare, power=tmp_path / "none")
    assert r.returncode == 0, r.stderr
    assert "torch: cpu-index, torch==2.13.0 from https://download.pytorch.org/whl/cpu" in r.stdout
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in r.stdout
    assert "--system-site-packages" not in r.stdout

    r = setup(*common, "--torch-index", "http://mirror.local/cpu", python=bare, power=tmp_path / "none")
    assert "--index-url http://mirror.local/cpu torch==2.13.0" in r.stdout

    r = setup(*common, "--torch", "pypi", python=bare, power=tmp_path / "none")
    assert "CUDA 13 build" in r.stdout and f"-c {REPO}/constraints.txt torch==2.13.0 numpy" in r.stdout

    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 4.0\n")
    r = setup(*common, python=bare, power=tmp_path / "none", jetson=release)
    assert r.returncode == 2 and "board: NVIDIA Jetson" in r.stdout
    assert "--torch system" in r.stderr and "JetPack torch" in r.stderr and not (tmp_path / "p").exists()

    r = setup(*common, "--torch", "system", python=bare, power=tmp_path / "none")
    assert r.returncode == 2 and "no torch >= 1.13" in r.stderr

    r = setup(*common, "--torch", "cuda", python=bare, power=tmp_path / "none")
    assert r.returncode == 2 and "--torch must be" in r.stderr


def test_install_into_a_prefix_without_systemd(tmp_path: Path, bundle: Path, wheel: Path) -> None:
    prefix = tmp_path / "p"
    overlay = tmp_path / "trial.toml"
    overlay.write_text('[agent]\nclient = 3\ndevice_id = "forged"\n[data]\nclients = 10\n[model]\nmodel = "logreg"\n')
    args = ("--bundle", str(bundle), "--prefix", str(prefix), "--no-systemd", "--skip-torch", "--agent", str(wheel),
            "--pip-args", "--no-index", "--agent-config", str(overlay))
    r = setup(*args, power=tmp_path / "none")
    assert r.returncode == 0, r.stderr
    venv_py = prefix / "opt/dropfl/venv/bin/python"
    where = subprocess.run([str(venv_py), "-c", "import edge_client, provisioning; print(edge_client.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()
    assert where.startswith(str(prefix / "opt/dropfl/venv/lib/"))
    assert (Path(where).with_name("agent") / "__init__.py").is_file()

    config = prefix / "etc/dropfl/agent.json"
    assert config.stat().st_mode & 0o777 == 0o600
    cfg = json.loads(config.read_text())
    a = cfg["agent"]
    port = json.loads(_bundle_agent(bundle))["agent"]["broker"].rsplit(":", 1)[1]
    assert (a["device_id"], a["broker"], a["client"]) == ("pi-07", f"mqtts://127.0.0.1:{port}", 3)
    assert a["ca_file"] == str(prefix / "etc/dropfl/ca.crt") and a["out"] == str(prefix / "var/lib/dropfl")
    assert a["exit_when_done"] is False and cfg["battery"] == {"source": "model"}
    assert (cfg["data"], cfg["model"]) == ({"clients": 10}, {"model": "logreg"})
    assert (prefix / "etc/dropfl/ca.crt").read_text().startswith("-----BEGIN CERTIFICATE-----")
    assert f"broker 127.0.0.1:{port} reachable" in r.stdout

    # Idempotent: the second run changes nothing it wrote (config and CA identical, venv kept).
    before = config.read_bytes()
    again = setup(*args, power=tmp_path / "none")
    assert again.returncode == 0, again.stderr
    assert config.read_bytes() == before
    for what in (f"unchanged: venv {prefix}/opt/dropfl/venv exists", f"unchanged: {config}"):
        assert what in again.stdout


def test_battery_is_detected_like_psutil(tmp_path: Path, bundle: Path) -> None:
    power = tmp_path / "power_supply"
    (power / "usb").mkdir(parents=True)  # a charger port: not a battery
    (power / "usb" / "capacity").write_text("100\n")
    r = setup("--bundle", str(bundle), "--prefix", str(tmp_path / "p"), "--no-systemd", "--dry-run", power=power)
    assert "battery source: model" in r.stdout
    (power / "BAT0").mkdir()
    (power / "BAT0" / "capacity").write_text("87\n")
    r = setup("--bundle", str(bundle), "--prefix", str(tmp_path / "p"), "--no-systemd", "--dry-run", power=power)
    assert "battery source: psutil" in r.stdout
    r = setup("--bundle", str(bundle), "--prefix", str(tmp_path / "p"), "--no-systemd", "--dry-run",
              "--battery", "mains", power=power)
    assert "battery source: mains" in r.stdout


def test_unreachable_broker_is_reported(tmp_path: Path) -> None:
    root = tmp_path / "b"
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker.init(root, [], port=port)
    archive, _ = broker.add_device(root, "pi-08")
    r = setup("--bundle", str(archive), "--prefix", str(tmp_path / "p"), "--no-systemd", "--dry-run")
    assert r.returncode == 0 and f"cannot reach the broker at 127.0.0.1:{port}" in r.stderr


@pytest.mark.parametrize("members, message", [
    ({"x/agent.json": b"{}", "x/ca.crt": b""}, "lacks agent.device_id"),
    ({"x/agent.json": b"{}"}, "expected NAME/agent.json and NAME/ca.crt"),
    ({"x/agent.json": b"{}", "x/ca.crt": b"", "../evil": b""}, "expected NAME/agent.json and NAME/ca.crt"),
])
def test_bad_bundles_are_refused(tmp_path: Path, members: dict[str, bytes], message: str) -> None:
    import io
    import tarfile

    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    r = setup("--bundle", str(archive), "--prefix", str(tmp_path / "p"), "--no-systemd")
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "p").exists()


def test_bad_options(tmp_path: Path) -> None:
    r = setup("--bundle", str(tmp_path / "missing.tar.gz"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = setup("--frobnicate")
    assert r.returncode == 2 and "unknown option --frobnicate" in r.stderr


def test_pins_match_the_project() -> None:
    text = SCRIPT.read_text()
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert re.search(r"^MIN_PYTHON=(\S+)", text, re.M).group(1) == requires.removeprefix(">=")
    torch_pin = re.search(r"torch==(\S+)", (REPO / "scripts" / "bootstrap.sh").read_text()).group(1)
    assert re.search(r"^TORCH_VERSION=(\S+)", text, re.M).group(1) == torch_pin


def test_unit_template() -> None:
    unit = UNIT.read_text()
    assert "Restart=on-failure" in unit and "ExecStart=@VENV@/bin/python -m edge_client.agent --config @CONFIG@" in unit
    substituted = set(re.findall(r"s\|(@[A-Z]+@)\|", SCRIPT.read_text()))
    assert set(re.findall(r"@[A-Z]+@", unit)) == substituted == {"@USER@", "@STATE@", "@VENV@", "@CONFIG@"}


def test_shellcheck_clean() -> None:
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("needs shellcheck (scripts/bootstrap.sh installs it)")
    r = subprocess.run([tool, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def _bundle_agent(archive: Path) -> str:
    import tarfile

    with tarfile.open(archive) as tar:
        (name,) = [n for n in tar.getnames() if n.endswith("/agent.json")]
        return tar.extractfile(name).read().decode()
