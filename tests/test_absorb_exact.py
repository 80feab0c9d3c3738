"""MIFA absorbs the round's updates slice by slice as the batched engine hands them over (Strategy.absorb,
coordinator/loop.py `_absorber`), so a round in which all N clients upload does not hold N deltas at once
(docs/scale-out.md, "Memory and large N"). The run is the same run, bit for bit, as with every delta held
until `aggregate`: model, metrics, participation and reports logs, on both state stores and in a replay
with recorded drops (whose updates are neither absorbed nor aggregated)."""

import json

import pytest
from strategy_helpers import cache_dataset_loads
from test_replay_exact import edit

from coordinator.cli import main
from coordinator.strategies.mifa import MIFA

N = 8
TINY = ["--algo", "mifa", "--clients", str(N), "--rounds", "4", "--steps", "1", "--batch-size", "8", "--lr", "0.05",
        "--model", "logreg", "--threads", "1", "--no-progress", "--engine", "batched", "--availability", "bounded",
        "--tau-max", "3", "--min-active", "2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        cache_dataset_loads(mp)
        yield tmp_path_factory.mktemp("absorb")


def run(out, absorbs: bool, *args: str) -> dict:
    """One run with MIFA absorbing (the default) or not (every delta held until aggregate, as before); its
    files, with the wall-clock columns of metrics.jsonl left out; and how many updates were absorbed."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MIFA, "absorbs", absorbs)
        real = MIFA.absorb
        mp.setattr(MIFA, "absorb", lambda self, state, t, u: (calls.append(u.client), real(self, state, t, u)))
        assert main(["sim", *TINY, *args, "--out", str(out)]) == 0
    metrics = [{k: v for k, v in json.loads(x).items() if k not in ("seconds", "elapsed")}
               for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"model": (out / "model.pt").read_bytes(), "metrics": metrics, "absorbed": len(calls),
            "participation": (out / "participation.csv").read_text(), "reports": (out / "reports.jsonl").read_text()}


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
@pytest.mark.parametrize("store, storage", [("memory", "raw"), ("disk", "raw"), ("memory", "lr-normalised")])
def test_absorbing_mifa_updates_gives_the_same_run(base, store, storage):
    args = ("--state-store", store, "--mifa-storage", storage)
    on = run(base / f"on-{store}-{storage}", True, *args)
    off = run(base / f"off-{store}-{storage}", False, *args)
    assert on["absorbed"] == sum(m["participants"] for m in on["metrics"]) > N  # every update, round 0 all N
    assert off["absorbed"] == 0
    assert {k: v for k, v in on.items() if k != "absorbed"} == {k: v for k, v in off.items() if k != "absorbed"}


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_a_replay_with_recorded_drops_absorbs_only_what_it_aggregates(base):
    rec = base / "recorded"
    run(rec, True)
    edits = edit(rec / "participation.csv", base / "edited.csv")
    assert edits
    replay = ["--availability", "replay", "--trace", str(base / "edited.csv")]
    on = run(base / "replay-on", True, *replay)
    off = run(base / "replay-off", False, *replay)
    assert on["absorbed"] == sum(m["participants"] for m in on["metrics"])  # the dropped ones are not absorbed
    assert {k: v for k, v in on.items() if k != "absorbed"} == {k: v for k, v in off.items() if k != "absorbed"}
