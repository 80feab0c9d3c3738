"""The agent's tests under the Pythons and torches that boards ship (issue 21; docs/devices.md):

    py3.10        a Jetson's JetPack 6 system Python (pyenv's 3.10 here), torch 2.13.0, numpy 2.2, onnxruntime 1.23
    py3.13        the newest Python the device side supports, torch 2.13.0
    debian-torch  Debian bookworm's python3-torch 1.13 on its Python 3.11 with numpy 1.24: the oldest torch the
                  agent supports (what Debian and Raspberry Pi OS 12 ship for arm64)

Each target gets a venv with only the agent's dependencies (scripts/device-venv.sh, cached under
~/.cache/dropfl/device-venvs) and runs AGENT_TESTS there, from this checkout. A target whose Python or Debian
package is absent is skipped with the reason. Slow: the first build downloads torch (minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
AGENT_TESTS = ["test_trainer.py", "test_models.py", "test_datasets.py", "test_partition.py", "test_field_wire.py",
               "test_agent_lean.py", "test_feddd_client.py", "test_configfile.py", "test_field_agent.py",
               "test_wire_fuzz.py", "test_agent_device.py"]


def _agent_tests_import_only_what_the_agent_has() -> list[str]:
    """The modules the agent tests (and the test helpers they import) import that are not the agent's own
    dependencies: the device venvs have only those."""
    allowed = ("edge_client", "coordinator", "torch", "numpy", "pytest", "hypothesis", "paho", "psutil",
               "onnxruntime", "onnx")
    bad, todo, seen = [], list(AGENT_TESTS), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in (REPO / "tests" / name).read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("import", "from") and not line.startswith((" ", "\t")):
                top = words[1].split(".")[0]
                if (REPO / "tests" / f"{top}.py").is_file():
                    todo.append(f"{top}.py")  # a test helper or another test module: its imports count too
                elif top not in allowed and top not in sys.stdlib_module_names and top != "__future__":
                    bad.append(f"{name}: {line.strip()}")
    return bad


def test_agent_tests_need_only_the_agents_dependencies() -> None:
    assert _agent_tests_import_only_what_the_agent_has() == []


@pytest.mark.slow
@pytest.mark.parametrize("target", ["py3.10", "py3.13", "debian-torch"])
def test_agent_tests_pass_under(target: str) -> None:
    build = subprocess.run(["bash", str(REPO / "scripts" / "device-venv.sh"), target], capture_output=True, text=True,
                           timeout=1200, cwd=REPO)
    if build.returncode == 3:
        pytest.skip(build.stderr.strip().splitlines()[-1])
    assert build.returncode == 0, build.stderr[-3000:]
    python = build.stdout.strip().splitlines()[-1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[f"tests/{t}" for t in AGENT_TESTS]],
                         capture_output=True, text=True, timeout=1500, cwd=REPO, env=env)
    probe = "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)"
    versions = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120).stdout.strip()
    print(f"{target}: Python, torch, numpy = {versions}\n{run.stdout[-400:]}")
    assert run.returncode == 0, f"{target} ({versions}):\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout and " failed" not in run.stdout
