"""A run directory changes only with --resume or --overwrite, everything is checked before the first write,
resume refuses what it cannot continue exactly, and every failure is one line (docs/errors.md)."""

import hashlib

import pytest
import torch

from coordinator.cli import main

TINY = ["--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "1", "--partition", "iid",
        "--no-progress", "--engine", "loop"]


def snapshot(d) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """A finished 2-round run to point bad commands at."""
    out = tmp_path_factory.mktemp("runs") / "r"
    assert main(["sim", *TINY, "--rounds", "2", "--out", str(out)]) == 0
    return out


def fail(capsys, argv, code=2) -> str:
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    # one error line, last; before it at most the progress lines of a run that had started ("[sim] engine: ...")
    assert err[-1].startswith("dropfl: error: ") and all(e.startswith("[") for e in err[:-1]), err
    return err[-1]


def test_a_directory_holding_a_run_is_never_touched_without_resume_or_overwrite(run2, capsys):
    before = snapshot(run2)
    msg = fail(capsys, ["sim", *TINY, "--rounds", "3", "--out", str(run2)])
    assert "already holds a run" in msg and "--resume" in msg and "--overwrite" in msg
    msg = fail(capsys, ["sim", *TINY, "--rounds", "3", "--lr", "inf", "--out", str(run2), "--resume"])
    assert "train.lr" in msg
    assert snapshot(run2) == before


def test_out_that_cannot_hold_a_run_is_refused_before_anything(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert "is a file" in fail(capsys, ["sim", *TINY, "--rounds", "1", "--out", str(f / "run")])
    assert "--resume and --overwrite" in fail(capsys, ["sim", *TINY, "--out", str(tmp_path / "n"), "--resume",
                                                       "--overwrite"])
    assert not (tmp_path / "n").exists() and f.read_text() == "x"


def test_resume_without_a_checkpoint_is_an_error_not_a_restart(tmp_path, capsys):
    msg = fail(capsys, ["sim", *TINY, "--rounds", "2", "--out", str(tmp_path / "none"), "--resume"])
    assert "checkpoint.pt does not exist" in msg and "leave out --resume" in msg
    assert not (tmp_path / "none").exists()


def test_every_checkpoint_keeps_the_previous_one(run2):
    cur = torch.load(run2 / "checkpoint.pt", weights_only=False)
    prev = torch.load(run2 / "checkpoint.prev.pt", weights_only=False)
    assert (prev["round"], cur["round"]) == (0, 1)


def test_a_damaged_checkpoint_names_the_file_and_offers_the_previous_one(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["sim", *TINY, "--rounds", "2", "--out", str(out)]) == 0
    (out / "checkpoint.pt").write_bytes((out / "checkpoint.pt").read_bytes()[:100])  # torn
    before = snapshot(out)
    msg = fail(capsys, ["sim", *TINY, "--rounds", "4", "--out", str(out), "--resume"])
    assert "checkpoint.pt is damaged" in msg and "checkpoint.prev.pt" in msg
    assert snapshot(out) == before  # config.json not rewritten
    (out / "checkpoint.prev.pt").replace(out / "checkpoint.pt")  # what the message says to do
    assert main(["sim", *TINY, "--rounds", "4", "--out", str(out), "--resume"]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 3


def test_resume_refuses_another_model_or_setting_naming_it(run2, capsys):
    before = snapshot(run2)
    msg = fail(capsys, ["sim", *[a if a != "logreg" else "mlp" for a in TINY], "--rounds", "3", "--out", str(run2),
                        "--resume"])
    assert "parameters" in msg and "--model mlp" in msg
    msg = fail(capsys, ["sim", *TINY, "--rounds", "3", "--seed", "5", "--out", str(run2), "--resume"])
    assert "run.seed (0 → 5)" in msg
    assert snapshot(run2) == before


def test_a_damaged_metrics_row_is_named_a_torn_last_row_is_dropped(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["sim", *TINY, "--rounds", "2", "--out", str(out)]) == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(rows[0] + "\n" + rows[1][:20])  # a crash while writing round 1's row ...
    (out / "checkpoint.prev.pt").replace(out / "checkpoint.pt")          # ... before its checkpoint
    assert main(["sim", *TINY, "--rounds", "3", "--out", str(out), "--resume"]) == 0
    assert [r.count('"round"') for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 1, 1]
    (out / "metrics.jsonl").write_text("{not json}\n" + (out / "metrics.jsonl").read_text())
    msg = fail(capsys, ["sim", *TINY, "--rounds", "4", "--out", str(out), "--resume"])
    assert "metrics.jsonl, line 1: damaged" in msg


def test_overwrite_replaces_only_the_run_files(tmp_path):
    out = tmp_path / "r"
    assert main(["sim", *TINY, "--rounds", "2", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(["sim", *TINY, "--rounds", "1", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and not (out / "checkpoint.prev.pt").exists()
    assert torch.load(out / "checkpoint.pt", weights_only=False)["round"] == 0


def test_an_unexpected_exception_is_one_line_and_a_crash_log(tmp_path, capsys, monkeypatch):
    from coordinator.strategies.fedavg import FedAvg

    def boom(*a, **k):
        raise RuntimeError("kaboom")
    monkeypatch.setattr(FedAvg, "aggregate", boom)
    out = tmp_path / "r"
    msg = fail(capsys, ["sim", *TINY, "--rounds", "1", "--out", str(out)], code=1)
    assert "internal error" in msg and "RuntimeError: kaboom" in msg and str(out / "crash.log") in msg
    assert "Traceback" in (out / "crash.log").read_text()
    with pytest.raises(RuntimeError):
        main(["sim", *TINY, "--rounds", "1", "--out", str(tmp_path / "d"), "--debug"])
