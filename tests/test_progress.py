"""Progress output (coordinator/loop.py, coordinator/progress.py) and --quiet (coordinator/cli/__init__.py):
a line per evaluation when stderr is a file, a bar on a terminal, nothing with --quiet, and warnings and
errors always."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from coordinator.cli import main

TINY = ["--dataset", "fmnist", "--clients", "6", "--model", "logreg", "--steps", "2", "--batch-size", "8",
        "--rounds", "3", "--engine", "loop"]


def _dropfl(*args):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          timeout=300)


def _on_terminal(*args) -> str:
    """dropfl's stdout and stderr on a pseudo-terminal of 120 columns."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        os.execv(sys.executable, [sys.executable, "-m", "coordinator.cli", *args])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # tqdm draws nothing at 0 columns
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_a_line_per_evaluation_and_none_with_quiet(tmp_path):
    loud = _dropfl("sim", *TINY, "--out", str(tmp_path / "loud"))
    assert loud.returncode == 0, loud.stderr
    lines = [x for x in loud.stderr.splitlines() if x.startswith("round ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"] and all(" eta " in x for x in lines)
    assert "[sim] engine:" in loud.stderr  # an info line
    quiet = _dropfl("sim", *TINY, "--quiet", "--out", str(tmp_path / "quiet"))
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert "run directory:" in quiet.stdout  # the result still goes to stdout
    # --quiet before the command, and --log-level still says what reaches stderr
    again = _dropfl("--quiet", "sim", *TINY, "--log-level", "info", "--out", str(tmp_path / "again"))
    assert again.returncode == 0 and "[sim] engine:" in again.stderr and "round 1/3" not in again.stderr


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_quiet_keeps_warnings_and_errors(tmp_path):
    warned = _dropfl("sim", *TINY, "--quiet", "--availability", "diurnal", "--period", "2",
                     "--out", str(tmp_path / "w"))
    assert warned.returncode == 0
    assert "deprecated" in warned.stderr and "round " not in warned.stderr
    failed = _dropfl("sim", *TINY, "--quiet", "--clients", "0", "--out", str(tmp_path / "e"))
    assert failed.returncode == 2 and failed.stderr.startswith("dropfl: error: data.clients")


@pytest.mark.slow
def test_a_bar_on_a_terminal_and_none_with_quiet(tmp_path):
    shown = _on_terminal("sim", *TINY, "--out", str(tmp_path / "bar"))
    assert "rounds: 100%" in shown and "3/3" in shown
    hidden = _on_terminal("sim", *TINY, "--quiet", "--out", str(tmp_path / "quiet"))
    assert "rounds:" not in hidden and "run directory:" in hidden


@pytest.mark.slow
def test_report_and_trace_import_bars(tmp_path):
    import pickle

    runs = []
    for name in ("a", "b"):
        assert main(["sim", *TINY, "--rounds", "1", "--quiet", "--out", str(tmp_path / name)]) == 0
        runs.append(str(tmp_path / name))
    shown = _on_terminal("report", *runs, "--out", str(tmp_path / "report"))
    assert "rasters: 100%" in shown
    assert "rasters:" not in _on_terminal("report", *runs, "--quiet", "--out", str(tmp_path / "report2"))
    pkl = tmp_path / "trace.pkl"
    pkl.write_bytes(pickle.dumps({i: {"active": [0], "inactive": [10], "finish_time": 100} for i in range(50)}))
    shown = _on_terminal("trace", "import-fedscale", str(pkl), str(tmp_path / "t.csv"))
    assert "import: 100%" in shown and "50/50" in shown
    assert "import:" not in _on_terminal("trace", "import-fedscale", str(pkl), str(tmp_path / "t2.csv"),
                                         "--no-progress")
