"""reports.jsonl in simulation (docs/run-directory.md; docs/traces.md "Replay (exact)"): every run records
what its clients measured; a replay of the log's selection gives those measurements back, so a FedDD run
on the wall clock (compute times that differ from run to run) replays bit for bit; resume truncates the
file like the participation log; a damaged or incomplete file is refused before the run starts; a client
that declined its task is not trained in the replay. Tiny settings (logreg, 4 clients, 1 step)."""

import csv
import json

import pytest
import torch
from strategy_helpers import cache_dataset_loads

from coordinator.cli import main
from coordinator.reports import read_reports

N = 4
TINY = ["--clients", str(N), "--steps", "1", "--batch-size", "8", "--lr", "0.05", "--model", "logreg",
        "--threads", "1", "--no-progress"]


@pytest.fixture(autouse=True)
def _cached(monkeypatch):
    cache_dataset_loads(monkeypatch)


def sim(out, *args: str) -> torch.Tensor:
    assert main(["sim", *TINY, *args, "--out", str(out)]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=False)["w"]


def rounds_of(path) -> list[int]:
    return [json.loads(line)["round"] for line in path.read_text().splitlines()]


def test_feddd_on_the_wall_clock_replays_bit_for_bit(tmp_path):
    w_r = sim(tmp_path / "R", "--algo", "feddd", "--rounds", "3")
    rec = read_reports(tmp_path / "R" / "reports.jsonl", N)
    assert sorted(rec) == [0, 1, 2] and all(set(r.reports) == set(range(N)) for r in rec.values())
    assert all(r.compute_s > 0 and r.upload_bytes > 0 for r in rec[1].reports.values())  # wall-clock seconds
    assert {c: t["dropout_rate"] for c, t in rec[0].tasks.items()} == dict.fromkeys(range(N), 0.0)
    w_c = sim(tmp_path / "C", "--algo", "feddd", "--rounds", "3", "--availability", "replay",
              "--trace", str(tmp_path / "R" / "participation.csv"))
    assert torch.equal(w_c, w_r)
    assert read_reports(tmp_path / "C" / "reports.jsonl", N) == rec
    state_r = torch.load(tmp_path / "R" / "checkpoint.pt", weights_only=False)["state"]
    state_c = torch.load(tmp_path / "C" / "checkpoint.pt", weights_only=False)["state"]
    assert torch.equal(state_r["dropout"], state_c["dropout"])


def test_resume_truncates_reports_like_the_participation_log(tmp_path):
    out = tmp_path / "run"
    sim(out, "--algo", "fedavg", "--rounds", "2")
    with open(out / "reports.jsonl", "a") as f:  # a round written after the last checkpoint (a crash)
        f.write(json.dumps({"round": 2, "reports": {}, "tasks": {}}) + "\n")
    sim(out, "--algo", "fedavg", "--rounds", "3", "--resume")
    assert rounds_of(out / "reports.jsonl") == [0, 1, 2]
    assert json.loads((out / "reports.jsonl").read_text().splitlines()[2])["reports"] == dict.fromkeys(
        map(str, range(N)))  # FedAvg in simulation without a clock profile: updates carry no report


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
@pytest.mark.parametrize("damage", ["missing round", "damaged row"])
def test_an_incomplete_or_damaged_reports_file_is_refused(tmp_path, capsys, damage):
    sim(tmp_path / "R", "--algo", "fedcs", "--rounds", "3")
    path = tmp_path / "R" / "reports.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2] if damage == "missing round" else lines[0] + '{"round": 1, "reports": 3}\n'
                    + lines[2])
    trace = ["--availability", "replay", "--trace", str(tmp_path / "R" / "participation.csv")]
    out = tmp_path / "C"
    assert main(["sim", *TINY, "--algo", "fedcs", "--rounds", "3", *trace, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and ("lacks rounds 1" if damage == "missing round" else ":2: damaged row") in err, err
    assert not out.exists()  # refused before anything was written
    # another strategy compares on the recorded availability: its measurements are its own, the file unread
    sim(tmp_path / "X", "--algo", "fedavg", "--rounds", "3", *trace)


def test_a_client_that_declined_is_not_trained_in_the_replay(tmp_path):
    """Edits of one FedDD log: client 0 dropped in round 1 for `deadline` (it trained: its upload counts
    in the replay's bytes) or for `charging` or `thermal` (it declined: not trained, no bytes)."""
    sim(tmp_path / "R", "--algo", "feddd", "--rounds", "2")
    with open(tmp_path / "R" / "participation.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    up = {}
    for reason in ("deadline", "charging", "thermal"):
        d = tmp_path / reason
        d.mkdir()
        for r in rows:
            if (r["round"], r["client"]) == ("1", "0"):
                r["status"], r["reason"] = "dropped", reason
        with open(d / "participation.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["round", "client", "status", "reason"])
            w.writeheader()
            w.writerows(rows)
        sim(d / "run", "--algo", "feddd", "--rounds", "2", "--availability", "replay", "--trace",
            str(d / "participation.csv"))
        metrics = (d / "run" / "metrics.jsonl").read_text().splitlines()
        up[reason] = [json.loads(line)["upload_bytes"] for line in metrics]
        ck = torch.load(d / "run" / "checkpoint.pt", weights_only=False)
        assert (0 in ck["transport"]["clients"]["memory"] and
                ck["transport"]["clients"]["memory"][0]["round"] == (1 if reason == "deadline" else 0))
    assert up["deadline"][0] == up["charging"][0] and up["deadline"][1] > up["charging"][1]
    assert up["thermal"] == up["charging"]
