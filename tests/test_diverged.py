"""A run whose global model goes non-finite: recorded in its run directory (diverged.json), a sweep goes on
with its other runs, and a reproduction counts it as diverged (left out of mean ± std, named in the table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator import config
from coordinator.cli import main
from coordinator.report import papers
from coordinator.report.reproduce import cell_text, diverged_at
from coordinator.sim.sweep import Job, run_sweep

TINY = ["--model", "logreg", "--clients", "3", "--rounds", "2", "--steps", "2", "--batch-size", "8",
        "--threads", "1", "--no-progress", "--quiet"]


def _cfg(out: Path, lr: float, seed: int = 0) -> config.SimConfig:
    cfg = config.SimConfig()
    cfg.model.model, cfg.data.clients = "logreg", 3
    cfg.train.lr, cfg.train.steps, cfg.train.batch_size = lr, 2, 8
    cfg.run.rounds, cfg.run.seed, cfg.run.threads, cfg.run.out = 2, seed, 1, str(out)
    return cfg


def test_a_diverged_run_records_its_round_and_says_so(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["sim", *TINY, "--lr", "1e38", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "dropfl: error: round 0: the global model is no longer finite (lr too high?)"
    assert json.loads((out / "diverged.json").read_text())["round"] == 0
    assert diverged_at(out) == 0 and not (out / "model.pt").exists()
    # --overwrite replaces the run, diverged.json included
    assert main(["sim", *TINY, "--out", str(out), "--overwrite"]) == 0
    assert diverged_at(out) is None and (out / "model.pt").exists()


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
@pytest.mark.parametrize("executor", ["serial", "lockstep"])
def test_a_failing_run_does_not_stop_the_sweep(tmp_path, executor) -> None:
    """The run after a diverging one still runs; the error comes at the end, or not at all for a divergence
    when the caller counts it as a result (`diverged_ok`, what `dropfl reproduce` does)."""
    jobs = [Job(_cfg(tmp_path / "bad", 1e38), tmp_path / "bad"), Job(_cfg(tmp_path / "good", 0.05), tmp_path / "good")]
    said: list[str] = []
    with pytest.raises(FloatingPointError, match="no longer finite"):
        run_sweep(jobs, executor=executor, progress=False, log=said.append)
    assert (tmp_path / "good" / "model.pt").exists() and diverged_at(tmp_path / "bad") == 0
    assert any("failed (round 0: the global model is no longer finite" in line for line in said)
    for j in jobs:
        j.overwrite = True
    run_sweep(jobs, executor=executor, progress=False, diverged_ok=True)   # no raise


def test_other_failures_are_still_raised_with_diverged_ok(tmp_path) -> None:
    cfg = _cfg(tmp_path / "x", 0.05)
    cfg.data.dataset = "cifar10"   # no --data-dir: a UserError when the run sets up
    with pytest.raises(Exception, match="cifar10|data"):
        run_sweep([Job(cfg, tmp_path / "x")], executor="serial", progress=False, diverged_ok=True)


@pytest.mark.slow
def test_a_reproduction_counts_a_diverged_trial_and_does_not_rerun_it(tmp_path) -> None:
    """Trial 1 of one arm diverges: its cell's mean is over the other trials, the table says so, and a second
    invocation skips the diverged run instead of running it again."""
    def build(lr_of_trial):
        return lambda trial, out: _cfg(out, lr_of_trial(trial), seed=trial)

    preset = papers.Preset(
        name="toy", stem="toy", title="toy", setup={}, metric="final accuracy (%)",
        arms=[papers.Arm("A", "s", "a", build(lambda t: 1e38 if t == 1 else 0.05)),
              papers.Arm("B", "s", "b", build(lambda t: 0.05))],
        claims=[papers.Claim("A > B", lambda o: papers.greater(o, "s", "A", "B"))])
    said: list[str] = []
    res = papers.run_preset(preset, 2, tmp_path / "runs", tmp_path / "res", log=said.append)
    cell = res["ours"]["s"]["A"]
    assert cell["trials"][1] is None and cell["diverged"] == {"1": 0}
    assert cell["mean"] == cell["trials"][0]
    assert "(n=1, 1 diverged)" in (tmp_path / "res" / "toy.md").read_text()
    assert "diverged" not in res["ours"]["s"]["B"]
    said.clear()
    papers.run_preset(preset, 2, tmp_path / "runs", tmp_path / "res", log=said.append)
    assert any("A s trial 1: diverged at round 0" in line and "not run again" in line for line in said)
    assert res["runs_run"] == 4


def test_the_table3_cell_names_diverged_trials() -> None:
    assert cell_text({"mean": 70.0, "std": 1.0, "diverged": {"2": 85}}) == "70.00 ± 1.00 (1 diverged)"
    assert cell_text({"mean": None, "std": None, "diverged": {"0": 3, "1": 4}}) == "all 2 diverged"
    assert cell_text({"mean": 70.0, "std": 1.0}) == "70.00 ± 1.00"
    assert cell_text(None) == "–"
    # the paper presets' tables (papers.markdown) show how many trials count
    assert cell_text({"mean": 70.0, "std": 1.0, "trials": [70.5, None, 69.5], "diverged": {"1": 40}},
                     show_n=True) == "70.00 ± 1.00 (n=2, 1 diverged)"
    assert cell_text({"mean": 70.0, "std": 1.0, "trials": [70.5, 69.5]}, show_n=True) == "70.00 ± 1.00 (n=2)"
    assert cell_text({"mean": 70.0, "std": 0.0, "trials": [70.0]}, show_n=True) == "70.00 (n=1)"   # no ± 0.00
    assert cell_text({"mean": 70.0, "std": 0.0, "trials": [70.0, None], "diverged": {"1": 9}}) == "70.00 (1 diverged)"
