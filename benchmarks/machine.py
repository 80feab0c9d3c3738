"""What a benchmark's results name as its machine (run as `python benchmarks/<name>.py`: this directory is on
sys.path)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo (and lscpu) give it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
