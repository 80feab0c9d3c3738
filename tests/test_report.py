"""dropfl report: table numbers, participation codes and the PNGs, from hand-written run directories."""


import numpy as np
import pytest
from rundirs import N, P, make_run

from coordinator import cli
from coordinator.errors import UserError
from coordinator.report.compare import comparison_table, load_runs, raster_codes, summary

U, D = ("unavailable", "battery"), ("dropped", "deadline")


@pytest.fixture
def two_runs(tmp_path):
    a = make_run(tmp_path / "a", "mimic", [0.5, None, 0.7], [[P, P, P], [P, U, D], [P, N, P]])
    b = make_run(tmp_path / "b", "fedavg", [0.4, 0.6, 0.55], [[P, P, P], [P, P, U], [U, P, P]])
    return [str(a), str(b)]


def test_summary_and_table(two_runs):
    runs = load_runs(two_runs)
    s = summary(runs[0])
    # round 1 has no accuracy: final = 70.0, best = 70.0; uploads 3; client uploads 3+1+2 = 6; participants 2.0 [1, 3]
    assert (s["final_acc"], s["best_acc"], s["uploads"], s["client_uploads"]) == (70.0, 70.0, 3, 6)
    assert s["participants_mean"] == 2.0 and (s["participants_min"], s["participants_max"]) == (1, 3)
    assert summary(runs[1])["best_acc"] == pytest.approx(60.0) and summary(runs[1])["final_acc"] == pytest.approx(55.0)
    table = comparison_table(runs).splitlines()
    assert table[2] == "| a | mimic | bounded | 3 | 70.00 | 70.00 | 3 | 6 | 2.0 [1, 3] |"
    assert table[3] == "| b | fedavg | bounded | 3 | 55.00 | 60.00 | 3 | 7 | 2.3 [2, 3] |"


def test_raster_codes_keep_status_and_reason(two_runs):
    codes, labels = raster_codes(load_runs(two_runs)[0])
    assert labels == ["participated", "unavailable: battery", "dropped: deadline", "not_selected"]
    assert codes.tolist() == [[0, 0, 0], [0, 1, 3], [0, 2, 0]]  # clients × rounds


def test_report_cli_writes_pngs_and_markdown(two_runs, tmp_path, capsys):
    out = tmp_path / "rep"
    assert cli.main(["report", *two_runs, "--out", str(out)]) == 0
    for name in ("accuracy_vs_uploads.png", "participation-a.png", "participation-b.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "comparison.md").read_text()
    assert "| a | mimic |" in md and "participation-b.png" in md
    assert "| b | fedavg |" in capsys.readouterr().out


def test_report_rejects_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(UserError, match="not a run directory"):
        load_runs([str(tmp_path)])
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2


def test_same_base_names_are_disambiguated(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = make_run(tmp_path / "x" / "run", "mifa", [0.1], [[P]])
    b = make_run(tmp_path / "y" / "run", "mifa", [0.2], [[P]])
    assert [r.name for r in load_runs([str(a), str(b)])] == ["x/run", "y/run"]
    assert np.array_equal(raster_codes(load_runs([str(a)])[0])[0], [[0]])


def test_an_accuracy_plot_without_curves_says_so_without_a_warning(tmp_path):
    """`dropfl report` on runs that evaluated nothing yet: matplotlib's empty-legend warning was seen in CI's fuzz."""
    import warnings

    from coordinator.report.compare import accuracy_plot
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accuracy_plot({}, tmp_path / "a.png").exists()
