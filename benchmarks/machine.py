"""What a benchmark's results name as its machine (run as `python benchmarks/<name>.py`: this directory is on
sys.path)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, as /proc/cpuinfo (and lscpu) give it; where a virtual machine names it only by its line
    ("AMD EPYC", no model number), with the CPUID family and model that tell its generation apart ("AMD EPYC
    (family 25, model 17)": Zen 4; family 26: Zen 5). `cpuinfo`: the file's text (default: this machine's)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown"
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break   # the first CPU's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or "unknown"
    if not any(ch.isdigit() for ch in name) and "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def git_commit(code: Path) -> str:
    """The short commit of the dropfl checkout at `code` whose code a benchmark ran ("" outside git)."""
    return subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
