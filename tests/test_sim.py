"""End-to-end simulation: replay exactness, resume, config file, and one-line user errors."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from coordinator.cli import main

TINY = ["--dataset", "fmnist", "--clients", "10", "--model", "logreg", "--steps", "3", "--batch-size", "8",
        "--lr", "0.05", "--rounds", "6", "--no-progress"]


def _final(run):
    return torch.load(run / "checkpoint.pt", weights_only=False)["w"]


def _participation(run):
    with open(run / "participation.csv") as f:
        return [(r["round"], r["client"], r["status"]) for r in csv.DictReader(f)]


def test_replay_reproduces_participation_and_model(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["sim", *TINY, "--availability", "static", "--p", "0.4", "--algo", "fedavg", "--out", str(a)]) == 0
    assert main(["sim", *TINY, "--availability", "replay", "--trace", str(a / "participation.csv"),
                 "--out", str(b)]) == 0
    assert _participation(a) == _participation(b)
    assert any(s == "unavailable" for _, _, s in _participation(a))
    assert torch.equal(_final(a), _final(b))
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(6))
    assert rows[-1]["uploads"] == 6 and rows[-1]["client_uploads"] == sum(r["participants"] for r in rows)
    assert (a / "model.pt").exists() and json.loads((a / "config.json").read_text())["run"]["rounds"] == 6


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_resume_gives_same_model(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*TINY, "--availability", "bounded", "--tau-max", "3"]
    main(["sim", *args, "--out", str(full)])
    main(["sim", *[a if a != "6" else "3" for a in args], "--out", str(part)])
    assert main(["sim", *args, "--out", str(part), "--resume"]) == 0
    assert torch.equal(_final(full), _final(part))
    assert _participation(full) == _participation(part)
    assert len((part / "metrics.jsonl").read_text().splitlines()) == 6



def test_resume_after_a_crash_between_checkpoints_recomputes_the_rounds_since(tmp_path, monkeypatch):
    """--checkpoint-every 3: a crash after round 4 (its metrics and participation rows written, its checkpoint
    not due) resumes from round 2's checkpoint, drops the rows of rounds 3-4 and recomputes them: the model,
    the participation and the metrics equal an uninterrupted run's (fedlaavg-fig8 checkpoints every 20)."""
    from coordinator import rundir
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*TINY, "--rounds", "8", "--availability", "static", "--p", "0.6", "--algo", "fedlaavg",
            "--checkpoint-every", "3"]
    assert main(["sim", *args, "--out", str(full)]) == 0
    write = rundir.MetricsWriter.write

    class Killed(BaseException):   # not an Exception, nor Ctrl-C (which the CLI handles): as a kill
        pass

    def crash_after_round_4(self, row):
        write(self, row)
        if row["round"] == 4:
            raise Killed
    monkeypatch.setattr(rundir.MetricsWriter, "write", crash_after_round_4)
    with pytest.raises(Killed):
        main(["sim", *args, "--out", str(part)])
    monkeypatch.setattr(rundir.MetricsWriter, "write", write)
    assert torch.load(part / "checkpoint.pt", weights_only=False)["round"] == 2
    assert len((part / "metrics.jsonl").read_text().splitlines()) == 5
    assert main(["sim", *args, "--out", str(part), "--resume"]) == 0
    assert torch.equal(_final(full), _final(part))
    assert _participation(full) == _participation(part)
    drop = ("seconds", "elapsed")
    rows = [[{k: v for k, v in json.loads(x).items() if k not in drop}
             for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (full, part)]
    assert rows[0] == rows[1] and [r["round"] for r in rows[1]] == list(range(8))

def test_config_file_equals_flags(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\nclients = 10\n[model]\nmodel = "logreg"\n[train]\nsteps = 3\nbatch_size = 8\n'
                   'lr = 0.05\n[availability]\nkind = "static"\np = 0.4\n[run]\nrounds = 6\n')
    main(["sim", *TINY, "--availability", "static", "--p", "0.4", "--out", str(tmp_path / "f")])
    main(["sim", "--config", str(cfg), "--no-progress", "--out", str(tmp_path / "c")])
    assert torch.equal(_final(tmp_path / "f"), _final(tmp_path / "c"))
    # the saved config reruns the same job
    main(["sim", "--config", str(tmp_path / "c" / "config.json"), "--no-progress", "--out", str(tmp_path / "again")])
    assert torch.equal(_final(tmp_path / "c"), _final(tmp_path / "again"))


@pytest.mark.parametrize("args,needle", [
    (["--algo", "nope"], "--algo"),
    (["--availability", "bounded", "--tau-max", "-1"], "--tau-max"),
    (["--availability", "static", "--p", "0"], "--p"),
    (["--availability", "static", "--p", "1.5"], "--p"),
    (["--dataset", "cifar10"], "--data-dir"),
    (["--dataset", "fmnist", "--data-dir", "/nonexistent"], "dataset-fashion-mnist"),
    (["--availability", "replay", "--trace", "/nonexistent.csv"], "--trace"),
    (["--availability", "replay"], "--trace"),
    (["--config", "/nonexistent.toml"], "--config"),
])
def test_bad_input_is_one_line_no_traceback(args, needle, tmp_path):
    p = subprocess.run([sys.executable, "-m", "coordinator.cli", "sim", *args, "--rounds", "1",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert p.returncode == 2
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in p.stderr, p.stderr


def test_unreadable_trace_is_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    p = subprocess.run([sys.executable, "-m", "coordinator.cli", "sim", "--availability", "replay", "--trace",
                        str(bad), "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--trace" in p.stderr


def test_trace_show(tmp_path, capsys):
    run = tmp_path / "r"
    main(["sim", *TINY, "--availability", "static", "--p", "0.3", "--out", str(run)])
    capsys.readouterr()
    assert main(["trace", "show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "rounds 6, clients 10" in out and "absent: model_draw" in out


@pytest.mark.parametrize("engine", [None, "loop"])
def test_the_engine_that_ran_is_said_and_recorded(tmp_path, capsys, engine):
    """The default is the batched engine; the CLI says which engine runs, every metrics row records it."""
    out = tmp_path / "run"
    flags = [] if engine is None else ["--engine", engine]
    assert main(["sim", *[a if a != "6" else "2" for a in TINY], *flags, "--out", str(out)]) == 0
    # logreg: no fused layers, so not batched+native; on a machine with a GPU the default runs there
    want = ("batched (cuda)" if torch.cuda.is_available() else "batched") if engine is None else "loop"
    assert f"[sim] engine: {want} — " in capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in rows] == [want, want]
    logged = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    said = [(r["engine"], r["requested"]) for r in logged if r["logger"] == "dropfl.sim"]
    assert said == [(want, engine or "batched")]
