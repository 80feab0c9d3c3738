"""docs/extending.md's tutorial runs as written: every `sh` block of its "Tutorial" section, in order, as one bash
script (set -euo pipefail), in a scratch directory that sees the repository's examples/ (a link), with this venv's
`dropfl` and `pip` first on PATH. Then what the tutorial says it makes is there: a report comparing the three
example plugins with MimiC and MIFA on the recorded field trial's participation, and a ResNet-8 run on Markov
availability trained by the generic engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from examples_pkg import PIP_ENV, ROOT, ensure_installed

DOC = ROOT / "docs" / "extending.md"
ALGOS = ("fedavgm", "fedau", "fedvarp", "mimic", "mifa")
RUNS = ALGOS + ("fedau-k5",)


def tutorial_script() -> str:
    text = DOC.read_text()
    section = re.search(r"^## Tutorial\b.*?(?=^## )", text, re.S | re.M)
    assert section, "docs/extending.md has no '## Tutorial' section"
    blocks = re.findall(r"^```sh\n(.*?)^```", section.group(0), re.S | re.M)
    assert len(blocks) >= 5
    return "set -euo pipefail\n" + "\n".join(blocks)


@pytest.mark.slow   # about 80 s of CPU: seven runs and a report (CI runs it; make test-fast does not)
def test_the_tutorial_runs_end_to_end(tmp_path):
    script = tutorial_script()
    assert "pip install -e examples/dropfl-examples" in script and "dropfl report" in script
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, **PIP_ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                              env=env)
    finally:
        ensure_installed()   # the tutorial installed the package through the scratch link: record the real path
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout

    # 1. the plugins are installed and listed with where they come from
    for name in ("fedavgm", "fedau", "fedvarp"):
        assert re.search(rf"{name}\s+entry point dropfl-examples==", out), name
    # 3. the recorded trial: 6 clients, 20 rounds, absences for battery and charging
    assert "rounds 20, clients 6" in out and "battery" in out and "charging" in out

    # 4. each algorithm replayed the same recorded availability, by itself
    runs = tmp_path / "runs" / "tutorial"
    trace = ROOT / "examples/dropfl-examples/traces/field-trial-a6/participation.csv"
    recorded_unavailable = _unavailable(trace.read_text())
    for run in RUNS:
        algo = run.removesuffix("-k5")
        cfg = json.loads((runs / run / "config.json").read_text())
        assert cfg["strategy"]["algo"] == algo and cfg["availability"]["kind"] == "replay"
        assert cfg["train"]["engine"] == "loop"   # the field run's engine, chosen by the replay
        rows = [json.loads(line) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == list(range(20))
        # every client the trial had unavailable is unavailable in the replay (which adds the trial's drops)
        assert recorded_unavailable <= _unavailable((runs / run / "participation.csv").read_text())
    # the option set on the command line: used, recorded with the defaults filled in, printed as the doc says
    k5 = json.loads((runs / "fedau-k5" / "config.json").read_text())["strategy"]
    assert k5["algo"] == "fedau" and k5["options"] == {"cutoff": 5, "server_lr": 1.0}
    assert "{'cutoff': 5, 'server_lr': 1.0}" in out
    assert re.search(r"--strategy-option cutoff=INT\s+\(default 50\)", out)   # dropfl plugins strategy fedau

    # 5. the report: one row per run, the availability named after the trial
    table = (runs / "report" / "comparison.md").read_text()
    for run in RUNS:
        algo = run.removesuffix("-k5")
        assert re.search(rf"^\| {run} \| {algo} \| replay of field-trial-a6 \| 20 \|", table, re.M), run
    assert (runs / "report" / "accuracy_vs_uploads.png").stat().st_size > 0

    # 6. ResNet-8 trained on the generic engine (per client: its FLOPs per sample are above the line where vmap
    # pays), Markov absences logged as model draws
    rows = [json.loads(line) for line in (runs / "resnet8-markov" / "metrics.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["batched (per client, channels-last)"] * 2 or all(
        r["engine"] == "batched (per client)" for r in rows)   # NCHW where the native kernels do not build
    assert json.loads((runs / "resnet8-markov" / "config.json").read_text())["availability"]["options"] == \
        {"p_drop": 0.5, "p_return": 0.5}
    reasons = {line.split(",")[3] for line in (runs / "resnet8-markov" / "participation.csv").read_text().split()[1:]
               if line.split(",")[2] == "unavailable"}
    assert reasons <= {"model_draw"}


def _unavailable(csv_text: str) -> set[tuple[str, str]]:
    rows = [line.split(",") for line in csv_text.split()[1:]]
    return {(r[0], r[1]) for r in rows if r[2] == "unavailable"}
