"""The example plugin package (examples/dropfl-examples) installed into this venv, editable, as a user would.

Its plugins are found by their entry points, which need an installed distribution: `ensure_installed` runs
`pip install -e examples/dropfl-examples` unless that very directory is already installed (a second call is a
no-op). Offline-safe: no build isolation (setuptools is the venv's own) and no dependencies fetched (dropfl,
torch and numpy are the venv's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples" / "dropfl-examples"
DIST = "dropfl-examples"

# pip reads PIP_<OPTION>; for the --no-build-isolation switch it reads the value inverted ("0": no isolation)
PIP_ENV = {"PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def installed_from() -> Path | None:
    """The directory the installed dropfl-examples was installed from (editable), as pip recorded it, or None.
    (Not resolved: an install through a link, as tests/test_tutorial.py makes, is done again from the real path.)"""
    try:
        text = metadata.distribution(DIST).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    url = json.loads(text or "{}").get("url", "")
    return Path(url.removeprefix("file://")) if url.startswith("file://") else None   # as recorded: not resolved


def ensure_installed() -> None:
    if installed_from() == PACKAGE and metadata.distribution(DIST).version == package_version():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(PACKAGE)],
                   check=True, timeout=300, env={**os.environ, **PIP_ENV})


def package_version() -> str:
    for line in (PACKAGE / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("examples/dropfl-examples/pyproject.toml has no version")
