"""A replayed participation log reproduces the recorded run exactly, for every strategy (docs/traces.md):
availability, the strategy's selection (FedLaAvg's K oldest, FedCS's budget, ...) and the drops after
selection (a `dropped` client is selected, trained, and not aggregated, with the recorded reason).

Per strategy, with tiny settings (logreg, 6 clients, 1 step, 4 rounds):
  R  a simulation under a dropout model;
  C  R's log replayed: the same log row for row and the same model bit for bit;
  E  R's log edited as a field trial's would read: some participants turned into `dropped` (deadline,
     rejected, offline);
  A  E replayed: A's own log is E row for row, the dropped clients' updates are not in A's model;
  B  A's log replayed: A's model bit for bit (so a replay of a replay is the same run).
"""

import csv
import json
import logging

import pytest
import torch
from strategy_helpers import cache_dataset_loads

from coordinator.cli import main
from coordinator.sim.clock import table4_profile
from coordinator.strategies import STRATEGIES

N, ROUNDS = 6, 4
TINY = ["--clients", str(N), "--rounds", str(ROUNDS), "--steps", "1", "--batch-size", "8", "--lr", "0.05",
        "--model", "logreg", "--threads", "1", "--no-progress"]
DROPOUTS = ["--availability", "bounded", "--tau-max", "3", "--min-active", "2"]
SUBSET = {"fedlaavg", "fedcs"}  # strategies that select a strict subset of the available clients here


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    (d / "profile.json").write_text(json.dumps(table4_profile(N, seed=0, batch_size=8).to_json()))
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        yield d


def options(algo: str, base) -> list[str]:
    """The strategy's flags: FedLaAvg K = 3 of 6; FedDD and FedCS on a virtual clock (measured times that
    do not depend on the wall clock, so that two runs are the same run)."""
    extra = ["--algo", algo]
    if algo == "fedlaavg":
        extra += ["--beta", "0.5"]
    if algo in ("feddd", "fedcs"):
        extra += ["--clock-profile", str(base / "profile.json")]
    return extra


def sim(out, *args: str):
    assert main(["sim", *TINY, *args, "--out", str(out)]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=False)["w"]


def rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def edit(src, dst) -> dict[tuple[int, int], str]:
    """R's log as a field trial with dropouts: in rounds 1.., the lowest participant of a round with at
    least two is dropped (reasons in turn); returns {(round, client): reason}."""
    table = rows(src)
    reasons = iter(["deadline", "rejected", "offline", "deadline"])
    edits = {}
    for t in range(1, ROUNDS):
        part = [r for r in table if int(r["round"]) == t and r["status"] == "participated"]
        if len(part) >= 2:
            part[0]["status"], part[0]["reason"] = "dropped", next(reasons)
            edits[int(part[0]["round"]), int(part[0]["client"])] = part[0]["reason"]
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, ["round", "client", "status", "reason"])
        w.writeheader()
        w.writerows(table)
    return edits


def metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# the edit loop (make test-fast) keeps three shapes of strategy: plain averaging, a per-client table, two uploads
EDIT_LOOP = ("fedavg", "mimic", "scaffold")


@pytest.mark.parametrize("algo", [a if a in EDIT_LOOP else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(STRATEGIES.registered())])
def test_replay_is_exact_for_every_strategy(base, algo, caplog):
    d, opts = base / algo, options(algo, base)
    w_r = sim(d / "R", *opts, *DROPOUTS)
    log_r = rows(d / "R" / "participation.csv")
    statuses = {r["status"] for r in log_r}
    assert ("unavailable" in statuses) == (algo != "full")  # the oracle takes everyone, available or not
    if algo in SUBSET:  # the case replay used to get wrong: the strategy chose among the available
        assert "not_selected" in statuses

    # C: the run replayed is the run; the strategy, asked as in R, selects what the log says
    with caplog.at_level(logging.WARNING, logger="dropfl.replay"):
        w_c = sim(d / "C", *opts, "--availability", "replay", "--trace", str(d / "R" / "participation.csv"))
    assert not [r for r in caplog.records if r.name == "dropfl.replay"]
    assert rows(d / "C" / "participation.csv") == log_r
    assert torch.equal(w_c, w_r)
    assert [m["participants"] for m in metrics(d / "C")] == [m["participants"] for m in metrics(d / "R")]

    # A: a log with after-selection drops replays them: same rows (reasons included), updates not aggregated
    edits = edit(d / "R" / "participation.csv", d / "E.csv")
    assert edits
    w_a = sim(d / "A", *opts, "--availability", "replay", "--trace", str(d / "E.csv"))
    assert rows(d / "A" / "participation.csv") == rows(d / "E.csv")
    m_a = metrics(d / "A")
    for t in range(ROUNDS):
        logged = [r for r in rows(d / "E.csv") if int(r["round"]) == t]
        assert m_a[t]["participants"] == sum(r["status"] == "participated" for r in logged)
        assert m_a[t]["selected"] == sum(r["status"] in ("participated", "dropped") for r in logged)
        assert m_a[t]["available"] == sum(r["status"] != "unavailable" for r in logged)
    assert not torch.equal(w_a, w_r)  # the dropped updates really are left out

    # B: A's log replayed is A, bit for bit
    w_b = sim(d / "B", *opts, "--availability", "replay", "--trace", str(d / "A" / "participation.csv"))
    assert rows(d / "B" / "participation.csv") == rows(d / "A" / "participation.csv")
    assert torch.equal(w_b, w_a)


def test_another_strategy_replays_the_logged_selection_and_says_so(base, caplog):
    """FedAvg replaying FedLaAvg's log: FedAvg would take every available client; the log's K are replayed,
    with a warning naming the first round where they differ."""
    d = base / "cross"
    sim(d / "R", *options("fedlaavg", base), *DROPOUTS)
    with caplog.at_level(logging.WARNING, logger="dropfl.replay"):
        sim(d / "X", "--algo", "fedavg", "--availability", "replay", "--trace", str(d / "R" / "participation.csv"),
            "--replay-selection", "log")
    assert rows(d / "X" / "participation.csv") == rows(d / "R" / "participation.csv")
    first = [r for r in caplog.records if r.name == "dropfl.replay"]
    assert first and first[0].getMessage().startswith("replay: round 0: fedavg selects clients [0, 1, 2, 3, 4, 5], "
                                                      "the log selected [0, 1, 2]")


def test_another_strategy_by_default_selects_among_the_recorded_available_clients(base, caplog):
    """Comparing algorithms on recorded availability (--replay-selection auto, the trace's run used another
    --algo): FedAvg takes every client the log had available, a client that dropped in the log counts as
    unavailable with its reason, and nothing is forced."""
    d = base / "compare"
    sim(d / "R", *options("fedlaavg", base), *DROPOUTS)
    with caplog.at_level(logging.WARNING, logger="dropfl.replay"):
        sim(d / "X", "--algo", "fedavg", "--availability", "replay", "--trace", str(d / "R" / "participation.csv"))
    assert not [r for r in caplog.records if r.name == "dropfl.replay"]
    rec, rep = rows(d / "R" / "participation.csv"), rows(d / "X" / "participation.csv")
    assert len(rec) == len(rep)
    assert any(a["status"] == "not_selected" for a in rec)  # FedLaAvg left available clients out
    for a, b in zip(rec, rep):
        assert (a["round"], a["client"]) == (b["round"], b["client"])
        if a["status"] in ("participated", "not_selected"):  # available in the log: FedAvg takes it
            assert b["status"] == "participated", (a, b)
        else:                                                # unavailable (or dropped) in the log
            assert b["status"] == "unavailable" and b["reason"] == (a["reason"] or "deadline"), (a, b)
