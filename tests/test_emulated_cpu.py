"""The engine's CPU-dependent tests on an emulated AMD EPYC with AVX2 and no AVX-512 (scripts/emulated-cpu.sh).

qemu-user's EPYC-Rome CPU model: CPUID says AuthenticAMD, AVX2, no AVX-512, so torch, oneDNN and MKL pick the paths
such a machine takes from the CPU itself, and /proc/cpuinfo (in a private mount namespace) says the same to dropfl's
native kernels. The files run here are the ones a machine of that kind failed before the suite stopped assuming its
CPU (the native layers' bits where MKL's order is known, the kernels' variants, batch-invariant logits), and the
channels-last BatchNorm's (its kernel's variant for this CPU against torch's kernels on it, to float64).

Opt-in like the emulated Pi: only with DROPFL_TEST_DEVICE=1 (`make test` sets it), as root, with qemu-user-static on
an x86-64 machine; otherwise it skips and says which is missing. About 4 minutes on 2 cores (7x slower than
native); the whole engine tier: `make test-emulated-cpu`, ~16 min.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "emulated-cpu.sh"
FILES = ("tests/test_kernels.py", "tests/test_batched_fastpath.py", "tests/test_evaluator.py",
         "tests/test_channels_last.py")


def why_not() -> str | None:
    if os.environ.get("DROPFL_TEST_DEVICE") != "1":
        return "opt-in: set DROPFL_TEST_DEVICE=1 (make test sets it); it runs tests under qemu-user (minutes)"
    if platform.machine() != "x86_64":
        return f"emulates an x86-64 CPU on an x86-64 machine; this one is {platform.machine()}"
    if os.geteuid() != 0:
        return "needs root (a private mount namespace for /proc/cpuinfo)"
    if shutil.which("qemu-x86_64-static") is None:
        return "qemu-x86_64-static not found (apt-get install qemu-user-static)"
    return None


WHY_NOT = why_not()


def test_without_qemu_it_is_one_line_and_runs_nothing(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the script refuses a non-root user before it looks for qemu")
    bin_dir = tmp_path / "bin"   # a PATH with what the script needs but qemu
    bin_dir.mkdir()
    for exe in ("bash", "dirname", "id", "uname", "mktemp", "rm"):
        (bin_dir / exe).symlink_to(shutil.which(exe))
    run = subprocess.run([str(bin_dir / "bash"), str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(bin_dir)})
    assert run.returncode == 2
    assert run.stderr == "dropfl: error: qemu-x86_64-static not found: apt-get install qemu-user-static\n"
    assert run.stdout == ""


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_the_cpu_dependent_engine_tests_pass_on_an_emulated_avx2_amd_epyc(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), "-n", "2", "--dist", "loadfile", "-rs", "--basetemp",
                          str(tmp_path / "inner"), *FILES], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    out = run.stdout + run.stderr
    print(out[-6000:])
    # the emulation is what it says: torch's dispatch and the kernels' /proc/cpuinfo both see AVX2 and no AVX-512
    assert "CPU capability AVX2 ; /proc/cpuinfo: AMD EPYC-Rome Processor (qemu-user TCG, emulated" in out
    assert "this CPU runs only ['avx2', 'generic']" in out   # a kernels test's skip reason, read from /proc/cpuinfo
    assert run.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary
