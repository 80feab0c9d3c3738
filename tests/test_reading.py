"""What the researcher reads (issue 37 item 10): the report's legends name the algorithm and the run, accuracy is
in %, rounds are numbered from 1 wherever a person reads them (metrics.jsonl and participation.csv keep their
0-based `round`), integer axes have integer ticks, and the availability column says what a replay replays and
why a field run's clients were missing. The dashboard's part is in tests/test_dashboard.py."""

import json
from types import SimpleNamespace

import pytest
from rundirs import N, P, make_run

from coordinator import cli
from coordinator.report.compare import comparison_table, load_runs, write_report

B, O, D = ("unavailable", "battery"), ("unavailable", "offline"), ("dropped", "deadline")


@pytest.fixture
def figures(monkeypatch):
    """Every figure the report saves, by file name (the Figure objects, after the report closed them)."""
    from matplotlib.figure import Figure

    saved = {}
    real = Figure.savefig

    def savefig(self, fname, *a, **kw):
        saved[getattr(fname, "name", str(fname)).rsplit("/", 1)[-1]] = self
        return real(self, fname, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _integer_ticks(axis) -> list[float]:
    lo, hi = sorted(axis.get_view_interval())
    ticks = [t for t in axis.get_majorticklocs() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    return ticks


def test_legends_name_the_algorithm_and_the_run_and_integer_axes_tick_integers(tmp_path, figures):
    a = make_run(tmp_path / "x" / "run", "mimic", [0.5, 0.6, 0.7], [[P, P, B]] * 3)
    b = make_run(tmp_path / "y" / "run", "mimic", [0.4, 0.5, 0.55], [[P, N, P]] * 3)
    c = make_run(tmp_path / "fedavg", "fedavg", [0.3, 0.4, 0.45], [[P, P, P]] * 3)
    runs = load_runs([str(a), str(b), str(c)])
    assert [r.label for r in runs] == ["mimic (x/run)", "mimic (y/run)", "fedavg"]  # same algorithm: unique
    write_report(runs, tmp_path / "rep")
    ax = figures["accuracy_vs_uploads.png"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mimic (x/run)", "mimic (y/run)", "fedavg"]
    assert ax.get_ylabel() == "test accuracy (%)" and list(ax.lines[0].get_ydata()) == [50.0, 60.0, 70.0]
    _integer_ticks(ax.xaxis)   # uploads 1..3: not 1.0, 1.25, ...
    raster = figures["participation-x_run.png"].axes[0]
    assert raster.get_title() == "participation: mimic (x/run)"
    assert raster.get_xlim() == (0.5, 3.5)   # rounds 1..3: the 0-based log's rounds 0..2, numbered as printed
    assert _integer_ticks(raster.xaxis) == [1, 2, 3] and _integer_ticks(raster.yaxis)
    md = (tmp_path / "rep" / "comparison.md").read_text()
    assert "## Participation: mimic (x/run)" in md and "| final acc. (%) |" in md


def test_the_availability_column_names_the_model_what_a_replay_replays_and_a_field_runs_causes(tmp_path):
    bounded = make_run(tmp_path / "bounded", "fedavg", [0.5], [[P, B]],
                       {"kind": "bounded", "tau_max": 20, "tau_dist": "uniform", "p": 0.1})
    static = make_run(tmp_path / "static", "fedavg", [0.5], [[P, B]], {"kind": "static", "p": 0.25})
    # a trial: 12 client-rounds, battery 3 (25 %), offline 1 (8 %), dropped at the deadline 2 (17 %)
    trial = make_run(tmp_path / "trial", "fedavg", [0.5, 0.6, 0.7], [[P, B, B, N], [P, O, D, P], [B, P, D, P]],
                     {"kind": "always"}, files=("trial.json",))
    replay = make_run(tmp_path / "replay", "mimic", [0.5], [[P, B]],
                      {"kind": "replay", "trace": str(bounded / "participation.csv")})
    replay_field = make_run(tmp_path / "replay-field", "mimic", [0.5], [[P, B]],
                            {"kind": "replay", "trace": str(trial / "participation.csv")})
    lost = make_run(tmp_path / "lost", "mimic", [0.5], [[P, B]],
                    {"kind": "replay", "trace": str(tmp_path / "gone" / "participation.csv")})
    field = make_run(tmp_path / "field", "fedavg", [0.5], [[P, N]], {"kind": "always"}, files=("field.json",))
    runs = load_runs([str(p) for p in (bounded, static, trial, replay, replay_field, lost, field)])
    assert [r.availability for r in runs] == [
        "bounded (τmax 20)", "static (p 0.25)", "field: battery 25 %, deadline 17 %, offline 8 %",
        "replay of bounded (τmax 20)", "replay of field: battery 25 %, deadline 17 %, offline 8 %",
        "replay of participation.csv", "field: none lost"]
    row = comparison_table(runs).splitlines()[4]
    assert row.startswith("| trial | fedavg | field: battery 25 %, deadline 17 %, offline 8 % | 3 | 70.00 |")


def test_the_final_line_numbers_rounds_as_the_progress_lines_do(tmp_path, monkeypatch, capsys):
    """`final: round 5/5` after the fifth of five rounds (metrics.jsonl's round 4), accuracy in %."""
    import coordinator.sim.run as sim_run

    def fake_run_sim(cfg, out, **kw):
        make_run(tmp_path / "out", "fedavg", [0.1, None, 0.3, 0.4, 0.7125], [[P, P]] * 5)
        return SimpleNamespace(file=lambda name: tmp_path / "out" / name)

    monkeypatch.setattr(sim_run, "run_sim", fake_run_sim)
    assert cli.main(["sim", "--rounds", "5", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        "final: round 5/5, accuracy 71.25%, uploads 5, client uploads 10"
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 4 and rows[-1]["accuracy"] == 0.7125   # the data keep 0-based rounds, fractions


def test_energy_and_friend_plots_number_rounds_from_one(tmp_path, figures):
    from coordinator.report.energy import energy_report
    from coordinator.report.friends import friend_panel

    run = make_run(tmp_path / "trial", "fdms", [0.5, 0.6, 0.7], [[P, P], [P, B], [P, P]], files=("trial.json",))
    with open(run / "telemetry.jsonl", "w") as f:
        for t in range(3):
            f.write(json.dumps({"round": t, "client": 0, "energy_j": 1.5}) + "\n")
    with open(run / "friends.jsonl", "w") as f:
        for t in range(3):
            f.write(json.dumps({"round": t, "friend": [-1, 0 if t == 1 else -1]}) + "\n")
    runs = load_runs([str(run)])
    files, table = energy_report(runs, tmp_path)
    ax = figures["energy_per_round.png"].axes[0]
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3] and _integer_ticks(ax.xaxis)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fdms (trial)"]
    assert "| trial | 3 | – | 4.5 | 1.5 | 3 |" in table   # the target (the run's best, 70 %) reached in round 3
    friend_panel(run, runs[0].label, tmp_path / "friends.png")
    fig = figures["friends.png"]
    assert fig._suptitle.get_text() == "FL-FDMS friends: fdms (trial)"
    (per_round,) = [a for a in fig.axes if a.get_ylabel() == "substituted clients"]
    assert list(per_round.lines[0].get_xdata()) == [1, 2, 3] and list(per_round.lines[0].get_ydata()) == [0, 1, 0]
    assert _integer_ticks(per_round.xaxis) and _integer_ticks(per_round.yaxis)
