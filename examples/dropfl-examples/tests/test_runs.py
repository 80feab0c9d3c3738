"""The plugins run through dropfl by their installed names: a simulation on Markov availability, a resumed run
equal to the same run straight through, a replay of its participation with another plugin strategy, and their
options set from Python and from the command line, recorded in config.json, and refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dropfl
import pytest
import torch


def config(algo: str, rounds: int) -> dropfl.SimConfig:
    cfg = dropfl.SimConfig()
    cfg.data.clients = 6
    cfg.model.model = "logreg"
    cfg.train.steps, cfg.train.engine = 2, "loop"
    cfg.availability.kind = "markov"
    cfg.strategy.algo = algo
    cfg.run.rounds, cfg.run.threads = rounds, 1
    return cfg


@pytest.mark.parametrize("name, group", [("fedavgm", dropfl.STRATEGIES), ("fedau", dropfl.STRATEGIES),
                                         ("fedvarp", dropfl.STRATEGIES), ("markov", dropfl.AVAILABILITY)])
def test_installed_names(name, group):
    assert group.entry(name).origin.startswith("entry point dropfl-examples==")


@pytest.mark.parametrize("algo", ["fedau", "fedvarp"])   # FedAU: int and float64 state; FedVARP: a table
def test_resume_equals_straight_run(tmp_path, algo):
    straight = dropfl.simulate(config(algo, 5), out=tmp_path / "straight")
    dropfl.simulate(config(algo, 2), out=tmp_path / "resumed")
    resumed = dropfl.simulate(config(algo, 5), out=tmp_path / "resumed", resume=True)
    a, b = straight.model_state(), resumed.model_state()
    assert all(torch.equal(a[k], b[k]) for k in a)              # bitwise: the strategy's state was checkpointed
    assert straight.config_dict()["strategy"]["algo"] == algo
    assert straight.config_dict()["availability"]["kind"] == "markov"
    rows = straight.participation()
    assert {r["reason"] for r in rows if r["status"] == "unavailable"} == {"model_draw"}   # Markov left some out


def test_fedvarp_table_on_disk_gives_the_same_model(tmp_path):
    # FedVARP's per-client table y in RAM or in a file of the run directory (--state-store): the same bits
    runs = {}
    for store in ("memory", "disk"):
        cfg = config("fedvarp", 4)
        cfg.run.state_store = store
        runs[store] = dropfl.simulate(cfg, out=tmp_path / store).model_state()
    assert (tmp_path / "disk" / "state" / "fedvarp.y.bin").is_file() and not (tmp_path / "memory" / "state").exists()
    assert all(torch.equal(runs["memory"][k], runs["disk"][k]) for k in runs["memory"])


def test_replay_with_another_plugin(tmp_path):
    recorded = dropfl.simulate(config("fedavgm", 4), out=tmp_path / "fedavgm")
    again = dropfl.replay(recorded.path, out=tmp_path / "fedau", algo="fedau")
    available = [(r["round"], r["client"]) for r in recorded.participation() if r["status"] != "unavailable"]
    assert [(r["round"], r["client"]) for r in again.participation() if r["status"] != "unavailable"] == available
    assert again.config_dict()["strategy"]["algo"] == "fedau" and again.final["round"] == 3


def test_options_from_python_are_used_and_recorded(tmp_path):
    cfg = config("fedau", 3)
    cfg.strategy.options = {"cutoff": 2}
    cfg.availability.options = {"p_drop": 0.5, "p_return": 0.25}
    run = dropfl.simulate(cfg, out=tmp_path / "run")
    saved = run.config_dict()
    assert saved["strategy"]["options"] == {"cutoff": 2, "server_lr": 1.0}         # the defaults filled in
    assert saved["availability"]["options"] == {"p_drop": 0.5, "p_return": 0.25}
    # the Markov chain with these options, asked directly, gives the availability the run logged
    chain = dropfl.AVAILABILITY["markov"](6, 0, options=dropfl.AVAILABILITY["markov"].Options(0.5, 0.25))
    logged = [(r["round"], r["client"]) for r in run.participation() if r["status"] == "unavailable"]
    assert logged == [(t, i) for t in range(3) for i in range(6) if not chain.round(t).available[i]]

    cfg.strategy.options = {"cutoff": 0}
    with pytest.raises(dropfl.UserError, match="cutoff must be an integer ≥ 1"):
        dropfl.simulate(cfg, out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_options_from_the_command_line(tmp_path):
    dropfl_cmd = str(Path(sys.executable).with_name("dropfl"))
    base = [dropfl_cmd, "sim", "--algo", "fedavgm", "--clients", "4", "--rounds", "2", "--model", "logreg",
            "--steps", "1", "--engine", "loop", "--availability", "markov", "--quiet"]
    ok = subprocess.run(base + ["--strategy-option", "momentum=0.5", "--strategy-option", "weighting=samples",
                                "--availability-option", "p_return=1", "--out", str(tmp_path / "ok")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    saved = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert saved["strategy"]["options"] == {"momentum": 0.5, "server_lr": 1.0, "weighting": "samples"}
    assert saved["availability"]["options"] == {"p_drop": 0.2, "p_return": 1.0}
    bad = subprocess.run(base + ["--strategy-option", "momentum=1.5", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and not (tmp_path / "bad").exists()
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dropfl: error: ") and "momentum must be in [0, 1]" in lines[0]
