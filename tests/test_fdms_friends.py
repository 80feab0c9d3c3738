"""FL-FDMS's friend log (friends.jsonl) and the friend panel of `dropfl report`."""

import json

import pytest
import torch
from strategy_helpers import cache_dataset_loads

from coordinator import cli
from coordinator.report.friends import cluster_share, friend_counts, read_friends
from coordinator.strategies.fdms import FDMS

SIM = ["sim", "--algo", "fdms", "--dataset", "mnist", "--partition", "fdms-clustered-80-20", "--clients", "10",
       "--availability", "cluster-dropout", "--alpha", "0.5", "--model", "logreg", "--steps", "2", "--rounds", "5",
       "--engine", "loop", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def fdms_run(tmp_path_factory):
    """A 5-round FL-FDMS run, recording what the strategy used each round (friend, and R after the round)."""
    out = tmp_path_factory.mktemp("fdms") / "run"
    used = []
    real = FDMS.aggregate

    def spy(self, state, t, w, updates):
        w, state = real(self, state, t, w, updates)
        used.append((t, sorted(updates), state["friend"].clone(), state["sim"].clone()))
        return w, state

    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        mp.setattr(FDMS, "aggregate", spy)
        assert cli.main([*SIM, "--out", str(out)]) == 0
    return out, used


def test_friend_log_holds_what_the_strategy_used(fdms_run):
    out, used = fdms_run
    rows = read_friends(out)
    assert [r["round"] for r in rows] == [t for t, *_ in used] == list(range(5))
    for row, (_t, active, friend, sim) in zip(rows, used):
        assert row["active"] == active
        assert row["friend"] == friend.tolist()
        assert torch.equal(torch.tensor(row["similarity"], dtype=torch.float32), sim)  # exact float32 values
        dropped = [k for k in range(10) if k not in active]
        assert all(row["friend"][k] in active for k in dropped) and all(row["friend"][k] == -1 for k in active)
        for k in dropped:  # φ(k) maximises R^{k·} over the active clients, first index on ties
            scores = [row["similarity"][k][i] for i in active]
            assert row["friend"][k] == active[scores.index(max(scores))]
    assert rows[0]["active"] == list(range(10))  # round 0: everyone (first round all), nobody substituted
    assert sum(j >= 0 for r in rows for j in r["friend"]) == 5 * 4  # 5 of 10 dropped in rounds 1..4


def test_cluster_share_and_friend_counts():
    rows = [{"round": 0, "friend": [-1, -1, -1, -1]}, {"round": 1, "friend": [1, -1, 1, -1]},
            {"round": 2, "friend": [-1, 0, -1, 0]}]
    # 4 clients, 2 clusters {0, 1}, {2, 3}
    assert cluster_share(rows, 4, n_clusters=2) == [None, 0.5, 0.5]
    counts = friend_counts(rows, 4)
    assert counts[0, 1] == 1 and counts[2, 1] == 1 and counts[1, 0] == 1 and counts[3, 0] == 1 and counts.sum() == 4


def test_report_draws_the_friend_panel(fdms_run, tmp_path, capsys):
    out, _ = fdms_run
    assert cli.main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    png = tmp_path / "rep" / f"friends-{out.name}.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "rep" / "comparison.md").read_text()
    assert f"## FL-FDMS friends: fdms ({out.name})" in md and "in their own cluster" in md  # algorithm (run)
    assert "friends-" in capsys.readouterr().out


def test_resume_keeps_the_friend_log_rounds_once(tmp_path):
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        assert cli.main([*SIM, "--rounds", "3", "--out", str(out)]) == 0
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["run"]["rounds"] == 3
        assert cli.main([*SIM, "--out", str(out), "--resume"]) == 0
    assert [r["round"] for r in read_friends(out)] == list(range(5))
