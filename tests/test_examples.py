"""examples/dropfl-examples, the plugin package written only against the public API: installed into the venv
(pip install -e, as a user would; entry points need an installed distribution), its own tests pass, and it
imports nothing of dropfl but `dropfl` itself."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
from examples_pkg import PACKAGE, ROOT, ensure_installed

INTERNAL = ("coordinator", "edge_client", "cvx", "provisioning")


def test_the_example_package_uses_only_the_public_api():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10   # the package's modules and its tests
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in INTERNAL, f"{path.relative_to(ROOT)} imports {name}"
        assert "monkeypatch" not in path.read_text(), f"{path.relative_to(ROOT)} monkeypatches"


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_the_example_package_installs_and_its_tests_pass(tmp_path):
    ensure_installed()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(PACKAGE),
                           "--basetemp", str(tmp_path / "t"), str(PACKAGE / "tests")],
                          cwd=PACKAGE, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 25 and "failed" not in done.stdout and "skipped" not in done.stdout
