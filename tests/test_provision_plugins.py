"""`dropfl provision add-device --plugin` bundles a plugin package (a wheel, or a project directory built with
`pip wheel --no-deps`), and provisioning/setup-device.sh installs it into the device's venv from the bundle,
offline (a temporary prefix without systemd, as tests/test_setup_device.py)."""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from coordinator.cli import main as dropfl
from tests import pluginkit
from tests.test_setup_device import listener, setup, wheel  # noqa: F401  (fixtures)

PYPROJECT = f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{pluginkit.DIST}"
version = "1.0"

[project.entry-points."dropfl.models"]
{pluginkit.MODEL} = "{pluginkit.PACKAGE}:build"

[tool.setuptools]
packages = ["{pluginkit.PACKAGE}"]
"""


def _project(root: Path) -> Path:
    """The tiny plugin as a source project (pyproject.toml and its package)."""
    pluginkit.make_plugin(root)
    for info in root.glob("*.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


@pytest.fixture
def bdir(tmp_path: Path, listener) -> Path:  # noqa: F811
    root = tmp_path / "b"
    assert dropfl(["provision", "init", str(root), "--port", str(listener.getsockname()[1])]) == 0
    return root


def test_a_plugin_project_is_bundled_and_installed_into_the_device_venv(tmp_path, bdir, wheel, capsys):  # noqa: F811
    project = _project(tmp_path / "proj")
    assert dropfl(["provision", "add-device", "pi-09", "--dir", str(bdir), "--plugin", str(project)]) == 0
    assert f"plugin {pluginkit.DIST}-1.0-py3-none-any.whl" in capsys.readouterr().out
    archive = bdir / "devices" / "pi-09.tar.gz"
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert names == ["pi-09/agent.json", "pi-09/ca.crt", f"pi-09/plugins/{pluginkit.DIST}-1.0-py3-none-any.whl"]

    prefix = tmp_path / "p"
    r = setup("--bundle", str(archive), "--prefix", str(prefix), "--no-systemd", "--skip-torch", "--agent", str(wheel),
              "--pip-args", "--no-index", power=tmp_path / "none")
    assert r.returncode == 0, r.stderr
    assert f"--no-index --no-deps --force-reinstall {prefix}/opt/dropfl/plugins/{pluginkit.DIST}-1.0" in r.stdout
    venv_py = prefix / "opt/dropfl/venv/bin/python"
    probe = ("import json; from importlib import metadata as m; "
             "print(json.dumps([m.version('tinyplug'), [e.value for e in m.entry_points(group='dropfl.models')]]))")
    got = json.loads(subprocess.run([str(venv_py), "-c", probe], capture_output=True, text=True, check=True,
                                    cwd=tmp_path).stdout)
    assert got == ["1.0", [f"{pluginkit.PACKAGE}:build"]]

    # a wheel file is bundled as it is; the second device's dry run names the wheel and writes nothing
    (whl,) = (prefix / "opt/dropfl/plugins").glob("*.whl")
    assert dropfl(["provision", "add-device", "pi-10", "--dir", str(bdir), "--plugin", str(whl)]) == 0
    r = setup("--bundle", str(bdir / "devices" / "pi-10.tar.gz"), "--prefix", str(tmp_path / "q"), "--no-systemd",
              "--dry-run", "--agent", str(wheel))
    assert r.returncode == 0 and f"{tmp_path}/q/opt/dropfl/plugins/{whl.name}" in r.stdout
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("what, message", [
    ("missing", "not a wheel file (.whl) or a project directory"),
    ("broken", "`pip wheel --no-deps` did not build one wheel"),
])
def test_a_bad_plugin_is_one_line_and_writes_nothing(tmp_path, bdir, capsys, what, message):
    path = tmp_path / what
    if what == "broken":
        path.mkdir()
        (path / "pyproject.toml").write_text("[project\n")
    assert dropfl(["provision", "add-device", "pi-11", "--dir", str(bdir), "--plugin", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dropfl: error: --plugin ") and message in err[0], err
    assert not (bdir / "devices" / "pi-11.tar.gz").exists() and not (bdir / "devices" / "pi-11").exists()
    assert "pi-11" not in (bdir / "passwd").read_text()


def test_setup_device_refuses_other_files_in_the_bundle(tmp_path):
    import io
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("x/agent.json", "x/ca.crt", "x/plugins/evil.sh"):
            info = tarfile.TarInfo(name)
            tar.addfile(info, io.BytesIO(b""))
    r = setup("--bundle", str(archive), "--prefix", str(tmp_path / "p"), "--no-systemd")
    assert r.returncode == 2 and "(and plugin wheels NAME/plugins/*.whl), found" in r.stderr
    assert not (tmp_path / "p").exists()

