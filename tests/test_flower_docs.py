"""docs/flower.md's commands, run as written (its ```bash blocks, in order, from a directory where `examples/` is
the repository's), with Flower's simulation engine on 127.0.0.1; then what the page says of their results."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is the optional extra dropfl[flower]")

from coordinator.availability.participation import read_rows  # noqa: E402
from coordinator.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "flower.md"
TRIAL = ROOT / "examples" / "dropfl-examples" / "traces" / "field-trial-a6"   # a recorded 6-agent field trial


def commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_every_command_is_a_dropfl_command():
    cmds = commands()
    assert len(cmds) == 5 and all(c.startswith("dropfl ") for c in cmds), cmds


def test_the_python_example_names_what_exists():
    """The page's Python block imports names that exist (the block itself needs a ServerApp's grid)."""
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    exec("\n".join(line for line in block.splitlines() if line.startswith(("from ", "import "))), {})


def test_the_pages_commands_run_and_say_what_it_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for cmd in commands():
        assert main(shlex.split(cmd)[1:]) == 0, cmd
    runs = tmp_path / "runs" / "flower"
    out = capsys.readouterr().out
    for name, algo in (("fedavg", "fedavg"), ("mimic", "mimic"), ("dropfl-mimic", "mimic")):
        assert re.search(rf"^\| {name} \| {algo} \| replay of field-trial-a6 \| 5 \| [0-9.]+ \| [0-9.]+ \| 5 \| 24 \|",
                         out, re.M), out
    assert (runs / "report" / "comparison.md").exists() and (runs / "report" / "accuracy_vs_uploads.png").exists()
    trial = [r for r in read_rows(TRIAL / "participation.csv") if int(r["round"]) < 5]
    away = {(r["round"], r["client"]): r["reason"] for r in trial if r["status"] in ("unavailable", "dropped")}
    assert set(away.values()) == {"battery", "charging"}, "the trial's first rounds have both causes"
    for run in ("fedavg", "mimic", "dropfl-mimic"):   # each under the trial's dropouts, with their reasons
        assert (runs / run / "model.pt").exists(), run
        rows = read_rows(runs / run / "participation.csv")
        assert {(r["round"], r["client"]): r["reason"] for r in rows if r["status"] == "unavailable"} == away, run
    # MimiC in Flower and MimiC in dropfl, on the same log: the same participation, row for row
    assert read_rows(runs / "mimic" / "participation.csv") == read_rows(runs / "dropfl-mimic" / "participation.csv")
    # "The replay's participation.csv is the Flower run's row for row"
    assert read_rows(runs / "fedavg-in-dropfl" / "participation.csv") == read_rows(runs / "fedavg" /
                                                                                  "participation.csv")
