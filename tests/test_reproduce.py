"""dropfl reproduce mimic-table3 on a tiny setting: the whole pipeline, its JSON schema, resumption."""

import json
import os
import re
import warnings

import pytest
from strategy_helpers import cache_dataset_loads

from coordinator import cli
from coordinator.report.reproduce import METHODS, PAPER_TABLE3, busy_seconds, markdown, sessions

TINY = ["--trials", "1", "--taus", "3", "--rounds", "2", "--clients", "6", "--steps", "2", "--model", "logreg",
        "--no-progress", "--threads", "1", "--engine", "loop"]


@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    base = tmp_path_factory.mktemp("repro")
    args = ["reproduce", "mimic-table3", *TINY, "--out", str(base / "runs"), "--results", str(base / "res")]
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main(args) == 0
    return base, args


def test_results_json_schema_and_files(repro):
    base, _ = repro
    res = json.loads((base / "res" / "mimic_table3.json").read_text())
    assert res["paper"] == PAPER_TABLE3 and res["paper"]["MimiC"]["20"] == 75.89
    assert set(res["ours"]) == set(METHODS)
    for cells in res["ours"].values():
        cell = cells["3"]
        assert len(cell["trials"]) == 1 and cell["mean"] == cell["trials"][0] and cell["std"] == 0.0
        assert 0 <= cell["mean"] <= 100  # percent
    assert res["setup"]["rounds"] == 2 and res["setup"]["rounds_scaffold"] == 1 and res["setup"]["taus"] == [3]
    md = (base / "res" / "mimic_table3.md").read_text()
    assert "| MimiC |" in md and "τmax = 3" in md
    for cells in res["ours"].values():  # per run: spread of the last evaluations and wall time
        (run,) = cells["3"]["per_run"]
        assert run["last_min"] <= run["last_mean"] <= run["last_max"] and run["seconds"] > 0
        assert run["engine"] == "loop"
        (span,) = run["sessions"]   # one session: its start and end in wall-clock time
        assert 0 < span[1] - span[0] < 3600
    assert "## Evidence" in md and "## Wall time" in md and "The 5 distinct runs were computing for" in md
    assert (base / "res" / "mimic_table3_fig4.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_use_the_paper_setup_and_equal_uploads(repro):
    base, _ = repro
    cfg = json.loads((base / "runs" / "mimic-tau3-s0" / "config.json").read_text())
    assert cfg["train"]["lr"] == 0.01 and cfg["train"]["lr_decay"] == 0.95 and cfg["train"]["batch_size"] == 16
    a = cfg["availability"]
    assert (a["kind"], a["tau_max"], a["tau_dist"], a["min_active"], a["first_round_all"]) == (
        "bounded", 3, "uniform", 2, True)
    last = {}
    for m in ("scaffold", "mimic"):
        rows = (base / "runs" / f"{m}-tau3-s0" / "metrics.jsonl").read_text().splitlines()
        last[m] = json.loads(rows[-1])
    assert last["scaffold"]["round"] == 0 and last["mimic"]["round"] == 1  # SCAFFOLD: half the rounds ...
    assert last["scaffold"]["uploads"] == last["mimic"]["uploads"] == 2   # ... for the same uploads


def test_rerun_skips_finished_runs_and_resumes_interrupted_ones(repro, capsys):
    base, args = repro
    model = base / "runs" / "fedavg-tau3-s0" / "model.pt"
    stamp = model.stat().st_mtime_ns
    (base / "runs" / "mimic-tau3-s0" / "model.pt").unlink()  # as if stopped before the end
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("done already, skipped") == 4 and "MimiC τmax=3 trial 0: resuming" in out
    assert model.stat().st_mtime_ns == stamp
    assert (base / "runs" / "mimic-tau3-s0" / "model.pt").exists()


def test_report_only_runs_nothing_and_leaves_unfinished_trials_out(repro, capsys):
    base, args = repro
    res_dir = base / "res-partial"
    two = list(args)
    two[two.index("--trials") + 1] = "2"  # trial 1 was never run
    two[two.index(str(base / "res"))] = str(res_dir)
    capsys.readouterr()
    assert cli.main([*two, "--report-only"]) == 0
    out = capsys.readouterr().out
    assert out.count("not finished, left out of the table") == len(METHODS)
    assert not (base / "runs" / "mimic-tau3-s1").exists()  # nothing was run
    res = json.loads((res_dir / "mimic_table3.json").read_text())
    assert all(cells["3"]["seeds"] == [0] and len(cells["3"]["trials"]) == 1 for cells in res["ours"].values())


def test_unknown_engine_is_a_user_error(tmp_path):
    assert cli.main(["reproduce", "mimic-table3", *TINY, "--engine", "warp", "--out", str(tmp_path)]) == 2


def test_markdown_checks_order_and_distance_to_paper():
    ours = {m: {"20": {"mean": v, "std": 0.5}} for m, v in
            {"FedAvg": 69.0, "FedProx": 60.0, "SCAFFOLD": 73.0, "MIFA": 72.0, "MimiC": 76.0}.items()}
    md = markdown({"paper": PAPER_TABLE3, "ours": ours,
                   "setup": {"clients": 30, "rounds": 200, "rounds_scaffold": 100, "trials": 3, "engine": "loop"}},
                  list(METHODS), [20])
    assert "| MimiC | 76.00 ± 0.50 | 75.89 |" in md
    assert "MimiC ≥ MIFA ≥ FedAvg: yes" in md
    assert "more than 4 points from the paper: FedProx (-12.67)" in md


def test_a_run_directory_with_another_setup_is_not_reused(tmp_path):
    from coordinator.report.reproduce import Setup, same_setup, sim_config

    cfg = sim_config(Setup(rounds=2), "MimiC", 20, 0, tmp_path)
    assert same_setup(tmp_path, cfg)  # nothing there yet
    old = json.loads(json.dumps(cfg.to_dict()))
    old["run"]["threads"], old["train"]["engine"] = 7, "other"  # do not change the numbers
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert same_setup(tmp_path, cfg)
    old["availability"]["tau_max"] = 50
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert not same_setup(tmp_path, cfg)


def test_halfnormal_runs_get_their_own_files_and_uncapped_taus_reuse_one_run(tmp_path, capsys):
    """--tau-dist halfnormal (released code): τ_i = min(round(|N(0,9)|), τmax) stays far below 20, so the
    runs at τmax 20 and 50 would be the same run; the second is not run again, and says so."""
    args = ["reproduce", "mimic-table3", *TINY, "--methods", "MimiC", "--taus", "20,50", "--tau-dist", "halfnormal",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "MimiC τmax=50 trial 0: same τ_i as mimic-tau20-halfnormal-s0 (none reaches 50), reusing that run" in out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mimic-tau20-halfnormal-s0"]
    res = json.loads((tmp_path / "res" / "mimic_table3_halfnormal.json").read_text())
    cells = res["ours"]["MimiC"]
    assert cells["20"]["trials"] == cells["50"]["trials"] and cells["50"]["runs"] == cells["20"]["runs"]
    assert res["setup"]["tau_dist"] == "halfnormal" and "released code" in res["setup"]["availability"]
    cfg = json.loads((tmp_path / "runs" / "mimic-tau20-halfnormal-s0" / "config.json").read_text())
    assert cfg["availability"]["tau_dist"] == "halfnormal"
    md = (tmp_path / "res" / "mimic_table3_halfnormal.md").read_text()
    assert "τ_i halfnormal (released code)" in md
    assert "| MimiC | 20, 50 | 0 |" in md and "The 1 distinct runs were computing for" in md  # listed, timed once


# --- one command per seed paper: every --quick form end to end (docs/reproductions.md) ---

VERDICT = re.compile(r"^- verdict: .+: (holds|DOES NOT HOLD|not measured) \(.+\)$")
QUICK = {  # name → (results stem, the paper gives numbers: a _vs_paper figure)
    "mimic-table3": ("mimic_table3_quick", False),  # τmax 3: not in the paper, no bars
    "fdms-fig1": ("fdms_fig1_quick", False),
    "fedlaavg-fig8": ("fedlaavg_fig8_quick", False),
    "feddd-virtual-clock": ("feddd_virtual_clock_t2a_quick", True),
}


@pytest.mark.parametrize("name", list(QUICK))
def test_quick_form_writes_results_and_verdicts(name, tmp_path, capsys):
    stem, has_paper = QUICK[name]
    args = ["reproduce", name, "--quick", "--engine", "loop", "--no-progress", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main(args) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "res" / f"{stem}.json").read_text())
    verdicts = [line for line in out.splitlines() if line.startswith("- verdict:")]
    assert verdicts and all(VERDICT.match(v) for v in verdicts), verdicts
    assert len(res["verdicts"]) == len(set(verdicts)) >= 2
    assert {v["verdict"] for v in res["verdicts"]} <= {"holds", "DOES NOT HOLD", "not measured"}
    cells = [c for by in res["ours"].values() for c in by.values()]
    assert cells and all(len(c["trials"]) == 1 == len(c["runs"]) and c["std"] == 0.0 for c in cells)
    assert all(c["mean"] is not None for c in cells), "the quick form measures every cell"
    md = (tmp_path / "res" / f"{stem}.md").read_text()
    assert "## Verdicts (the orderings the paper claims)" in md
    assert all(v in md for v in verdicts)
    figs = [f"{stem}_fig4.png" if name == "mimic-table3" else f"{stem}.png"]
    figs += [f"{stem}_vs_paper.png"] if has_paper else []
    for f in figs:
        assert (tmp_path / "res" / f).read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "res" / f"{stem}_vs_paper.png").exists() or has_paper
    if has_paper:
        assert res["paper"]
    if name == "fdms-fig1":  # its FL-FDMS runs keep a friend log, and the verdict on it is measured
        assert (tmp_path / "runs" / "fdms-a0.5-s0" / "friends.jsonl").exists()
        assert any("friends are found" in v and "not measured" not in v for v in verdicts)


def test_feddd_quick_normalises_to_fedavg_of_the_same_trial(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main(["reproduce", "feddd-virtual-clock", "--quick", "--engine", "loop", "--no-progress",
                         "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]) == 0
    res = json.loads((tmp_path / "res" / "feddd_virtual_clock_t2a_quick.json").read_text())
    cells = res["ours"]["MNIST IID"]
    assert cells["FedAvg"]["mean"] == 1.0
    from coordinator.report.feddd_clock import time_to_target

    t = {m: time_to_target(tmp_path / "runs" / f"{m}-s0", 0.6) for m in ("fedavg", "feddd")}
    assert cells["FedDD"]["trials"] == [round(t["feddd"] / t["fedavg"], 3)]
    assert (tmp_path / "runs" / "profile-s0.json").exists()


@pytest.mark.parametrize("extra", [["--taus", "3"], ["--alphas", "0.5"], ["--settings", "2:1"], ["--target", "0.5"]])
def test_an_option_of_another_experiment_is_a_user_error(extra, tmp_path, capsys):
    name = "fedlaavg-fig8" if extra[0] != "--settings" else "fdms-fig1"
    assert cli.main(["reproduce", name, "--quick", *extra, "--out", str(tmp_path / "r")]) == 2
    assert "belongs to" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.parametrize("name", ["mimic-table3", "fedlaavg-fig8"])
def test_runs_go_through_the_sweep_with_the_chosen_executor(name, tmp_path):
    from coordinator.sim import sweep

    seen = []
    real = sweep.run_sweep

    def spy(jobs, executor, **kw):
        seen.append((executor, [type(j).__name__ for j in jobs], [j.out.name for j in jobs]))
        return real(jobs, executor=executor, **kw)

    args = ["reproduce", name, "--quick", "--engine", "loop", "--no-progress", "--executor", "serial",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        mp.setattr(sweep, "run_sweep", spy)
        assert cli.main(args) == 0
        assert cli.main(args) == 0  # everything finished: nothing left to run, the sweep is not called again
    ((executor, kinds, outs),) = seen
    assert executor == "serial" and set(kinds) == {"Job"} and len(outs) == 5
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == sorted(outs)


def test_wall_time_is_the_union_of_the_runs_sessions(tmp_path):
    """Runs of a lockstep group overlap in time: the table's wall time is the union of their sessions' spans,
    not the sum of their rounds' seconds; a resumed run has one span per session, a session that wrote no
    round (resumed with nothing left to do) none."""
    assert busy_seconds([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_seconds([]) == 0
    run = tmp_path / "run"
    run.mkdir()

    def log(*times):
        (run / "log.jsonl").write_text("".join(json.dumps({"time": t, "logger": "dropfl.run",
                                                            "message": f"run {run}: fedavg on fmnist"}) + "\n"
                                               for t in times))

    rows = [{"round": t, "seconds": 10.0, "elapsed": 10.0 * (t + 1)} for t in range(3)]   # session 1: 30 s
    rows += [{"round": t, "seconds": 10.0, "elapsed": 10.0 * (t - 2)} for t in range(3, 5)]  # session 2: 20 s
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.utime(run / "metrics.jsonl", (5020.0, 5020.0))   # when the last round's row was written
    log(1000.0, 5000.0)
    assert sessions(run) == [(1000.0, 1030.0), (5000.0, 5020.0)]
    log(1000.0, 5000.0, 9000.0)   # resumed at 9000 with nothing left to do: no rows, no span
    assert sessions(run) == [(1000.0, 1030.0), (5000.0, 5020.0)]
    log(1000.0)
    assert sessions(run) is None   # two sessions of rounds, one start: they do not pair up
    (run / "log.jsonl").write_text('not json\n{"logger": "dropfl.run", "message": "run x"}\n[1]\n'
                                   '{"logger": "dropfl.run", "message": "run x", "time": "soon"}\n')
    assert sessions(run) is None   # damaged lines are no session starts, and never an exception
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "elapsed": "x"}) + "\n")
    log(1000.0)
    assert sessions(run) is None


@pytest.mark.parametrize("name", ["fdms-fig1", "fedlaavg-fig8"])
def test_report_only_before_any_run_draws_empty_panels_without_warnings(name, tmp_path, capsys):
    """--report-only on an empty run directory: a figure whose panels say there is nothing yet, and no
    matplotlib warning about a legend without curves."""
    args = ["reproduce", name, "--quick", "--report-only", "--no-progress", "--out", str(tmp_path / "runs"),
            "--results", str(tmp_path / "res")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main(args) == 0
    stem = QUICK[name][0]
    assert (tmp_path / "res" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"


def test_jobs_run_trial_by_trial(tmp_path):
    """The lockstep executor groups the jobs in their order: one trial's runs together share their data and
    their round 0 (identical tasks train once), so the jobs go trial by trial, then τmax, then method."""
    from coordinator.report.reproduce import Setup, plan_grid

    setup = Setup(rounds=2, clients=6, steps=2, model="logreg", engine="loop", threads=1)
    methods = list(METHODS)[:2]
    _, jobs = plan_grid(setup, methods, [3, 5], 2, tmp_path, lambda _: None, False)
    names = [j.out.name for j in jobs]
    assert len(names) == 8 and [n.rsplit("-s", 1)[1] for n in names] == ["0"] * 4 + ["1"] * 4
    assert [n.split("-tau")[1].split("-")[0] for n in names[:4]] == ["3", "3", "5", "5"]


class _Stop(BaseException):
    """Raised by the sweep spy to end the command once the jobs are seen; not an Exception, so cli.main (which turns
    those into error lines) lets it through."""


@pytest.mark.parametrize("name", ["mimic-table3", "fdms-fig1", "fedlaavg-fig8", "feddd-virtual-clock"])
def test_sim_device_reaches_every_run_and_the_command(name, tmp_path):
    """`--sim-device` is every run's `train.device` (auto by default) and, where not auto, part of the command the
    results files record."""
    from coordinator.cli import reproduce
    from coordinator.sim import sweep

    seen: list[set[str]] = []

    def spy(jobs, executor, **kw):
        seen.append({j.cfg.train.device for j in jobs})
        raise _Stop

    for device in ("auto", "cpu"):
        args = ["reproduce", name, "--quick", "--engine", "loop", "--no-progress", "--executor", "serial",
                "--out", str(tmp_path / device), "--results", str(tmp_path / "res")]
        args += [] if device == "auto" else ["--sim-device", device]
        with pytest.MonkeyPatch.context() as mp:
            cache_dataset_loads(mp)
            mp.setattr(sweep, "run_sweep", spy)
            with pytest.raises(_Stop):
                cli.main(args)
    assert seen == [{"auto"}, {"cpu"}]
    parsed = cli.build_parser().parse_args(["reproduce", name, "--sim-device", "cpu"])
    assert "--sim-device cpu" in reproduce._command(parsed)
    assert "--sim-device" not in reproduce._command(cli.build_parser().parse_args(["reproduce", name]))


def test_sim_device_cuda_without_a_gpu_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "runs"
    assert cli.main(["reproduce", "mimic-table3", "--quick", "--sim-device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dropfl: error: --sim-device cuda:") and len(err.strip().splitlines()) == 1
    assert cli.main(["reproduce", "mimic-table3", "--quick", "--sim-device", "cuda", "--engine", "loop",
                     "--out", str(out)]) == 2
    assert "--engine loop trains on the CPU" in capsys.readouterr().err
    assert not out.exists()
