"""dropfl's availability inside Flower, and a Flower app written as a dropfl run directory (docs/flower.md).

1. `WithDropouts` (dropfl/flower/availability.py) around Flower's own FedAvg, driven through Flower's
   `Strategy.start` with a Grid that hands each message to a ClientApp in this process (no Ray): a replayed
   field-trial-like participation log comes back row for row (selection among the available clients, declined
   clients never asked, other drops trained and left out, the reasons); dropfl's bounded model decides the
   selection round by round exactly as dropfl's own source; what Flower itself loses (no reply, an error reply)
   is recorded as such; a strategy that needs more nodes than are available trains nobody instead of waiting.
2. The quickstart app (examples/flower_quickstart) in Flower's simulation engine (Ray on 127.0.0.1) through
   `dropfl flower run`: its run directory and a dropfl run of the same federation side by side in one
   `dropfl report`, and its participation replayed by `dropfl sim --availability replay`.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is the optional extra dropfl[flower]")

from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from coordinator.availability.participation import read_rows  # noqa: E402
from coordinator.cli import main  # noqa: E402
from coordinator.runsetup import build_availability  # noqa: E402
from dropfl.flower.availability import WithDropouts, from_config, replay  # noqa: E402
from dropfl.flower.nodes import partition_reply  # noqa: E402
from dropfl.flower.rundir import RunRecorder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "flower_quickstart"


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Flower's Message needs the process's task identity (the simulation runtime sets it)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)


def adder_app(fail: int | None = None) -> ClientApp:
    """A ClientApp whose training adds partition id + 1 to every array (train_loss = partition id); partition
    `fail` raises."""
    app = ClientApp()
    app.query()(partition_reply)

    @app.train()
    def train(msg: Message, context: Context):
        p = int(context.node_config["partition-id"])
        if p == fail:
            raise RuntimeError("out of memory")
        arrays = {k: Array(a.numpy() + np.float32(p + 1)) for k, a in msg.content["arrays"].items()}
        return Message(RecordDict({"arrays": ArrayRecord(arrays),
                                   "metrics": MetricRecord({"num-examples": 1, "train_loss": float(p)})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context):
        p = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "eval_acc": float(p)})}), reply_to=msg)

    return app


class LocalGrid(Grid):
    """Delivers each message to `app` in this process: node 1000 + 17·i holds partition i. `lose`: partitions
    whose replies never come back; `gone`: partitions answered with Flower's NODE_UNAVAILABLE error."""

    def __init__(self, app: ClientApp, n: int, lose=(), gone=()):
        self.app, self.n, self.lose, self.gone = app, n, set(lose), set(gone)
        self.ids = {1000 + 17 * i: i for i in range(n)}
        self.trained: list[list[int]] = []     # partitions sent a training task, per round
        self.evaluated: list[list[int]] = []   # partitions sent an evaluation, per round

    def set_run(self, run) -> None:
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError

    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        messages, replies = list(messages), []
        for kind, seen in ((MessageType.TRAIN, self.trained), (MessageType.EVALUATE, self.evaluated)):
            if messages and messages[0].metadata.message_type == kind:
                seen.append(sorted(self.ids[m.metadata.dst_node_id] for m in messages))
        for m in messages:
            p = self.ids[m.metadata.dst_node_id]
            if m.metadata.message_type == MessageType.TRAIN and p in self.lose:
                continue
            if m.metadata.message_type == MessageType.TRAIN and p in self.gone:
                replies.append(Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="heartbeat lost"), reply_to=m))
                continue
            ctx = Context(run_id=1, node_id=m.metadata.dst_node_id, state=RecordDict(), run_config={},
                          node_config={"partition-id": p, "num-partitions": self.n})
            try:
                replies.append(self.app(m, ctx))
            except Exception as e:   # as Flower's runtime answers a ClientApp that raised
                replies.append(Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(e)), reply_to=m))
        return replies


def fedavg(**kw) -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, **({"min_train_nodes": 1, "min_available_nodes": 1} | kw))


def write_log(path: Path, rows: list[list[tuple[str, str]]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "client", "status", "reason"])
        for t, row in enumerate(rows):
            for c, (status, reason) in enumerate(row):
                w.writerow([t, c, status, reason])
    return path


P = ("participated", "")
# a field trial's log as the coordinator records it: a battery and an offline device, a deadline drop, a charger
# device that declined, an update that failed validation
TRIAL = [[P, P, P, P],
         [P, ("unavailable", "battery"), ("dropped", "deadline"), ("dropped", "charging")],
         [("unavailable", "offline"), P, P, ("dropped", "rejected")]]


def logreg_arrays(cfg: dict) -> ArrayRecord:
    from dropfl.flower.federation import federation

    return ArrayRecord(federation(cfg).model().state_dict())


def test_a_field_trials_log_replays_in_flower_row_for_row(tmp_path):
    """Flower's FedAvg under a replayed field-trial log: the unavailable are never offered, the declined
    (charging) never asked, the deadline and rejected drops trained but left out; the run directory's
    participation.csv is the log row for row, its metrics count the same, and the model is the average of the
    participants' updates round by round (to float32 rounding: 1e-6)."""
    trace = write_log(tmp_path / "participation.csv", TRIAL)
    cfg = {"data": {"clients": 4}, "model": {"model": "logreg"}, "strategy": {"weighting": "samples"},
           "run": {"rounds": 3}}
    grid = LocalGrid(adder_app(), 4)
    out = tmp_path / "flower-run"
    inner = fedavg()
    strategy = WithDropouts(inner, replay(trace, 4), recorder=RunRecorder(out, cfg, strategy=inner))
    w0 = logreg_arrays(cfg)
    result = strategy.start(grid, w0, num_rounds=3, timeout=10)

    assert grid.trained == [[0, 1, 2, 3], [0, 2], [1, 2, 3]]   # after the discovery query: the rounds
    assert [sorted(r.participated) for r in strategy.history] == [[0, 1, 2, 3], [0], [1, 2]]
    assert [r.dropped for r in strategy.history] == [{}, {2: "deadline", 3: "charging"}, {3: "rejected"}]
    # round 0 adds mean(1..4) = 2.5, round 1 client 0's 1, round 2 mean(2, 3) = 2.5
    for got, start in zip(result.arrays.to_numpy_ndarrays(), w0.to_numpy_ndarrays()):
        np.testing.assert_allclose(got, start + 6.0, rtol=0, atol=1e-6)
    assert read_rows(out / "participation.csv") == read_rows(trace)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["available"], m["selected"], m["participants"], m["client_uploads"]) for m in metrics] == \
        [(4, 4, 4, 4), (3, 3, 1, 5), (3, 3, 2, 7)]
    assert [m["train_loss"] for m in metrics] == [1.5, 0.0, 1.5]
    assert json.loads((out / "config.json").read_text())["data"]["clients"] == 4
    assert [json.loads(line)["reports"] for line in (out / "reports.jsonl").read_text().splitlines()] == \
        [{"0": None, "1": None, "2": None, "3": None}, {"0": None}, {"1": None, "2": None}]
    flower_json = json.loads((out / "flower.json").read_text())
    assert flower_json["strategy"] == "flwr.serverapp.strategy.fedavg.FedAvg"
    assert flower_json["nodes"] == {str(i): 1000 + 17 * i for i in range(4)}
    assert (out / "model.pt").exists()
    from coordinator.dashboard.rundata import RunData  # what `dropfl dashboard` serves of it

    board = RunData(out)
    assert board.summary()["rounds_done"] == 3 and board.summary()["problems"] == []
    assert board.raster()["status"] == ["PPPP", "PUDD", "UPPD"]


def test_bounded_availability_decides_flowers_selection(tmp_path):
    """MimiC's bounded model from a dropfl config: each round FedAvg(fraction_train=1) trains exactly the clients
    dropfl's own source makes available, the others unavailable with reason model_draw; with fraction_train=0.5
    Flower samples half of them, never an unavailable one."""
    cfg = {"data": {"clients": 6}, "availability": {"kind": "bounded", "tau_max": 3}, "run": {"seed": 1}}
    import dropfl

    own = build_availability(dropfl.load_config(cfg))
    rounds = 6
    wanted = [own.round(t).active for t in range(rounds)]
    assert len({tuple(a) for a in wanted}) > 1, "the bounded draw should vary over the rounds"
    grid = LocalGrid(adder_app(), 6)
    strategy = WithDropouts(fedavg(), from_config(cfg))
    strategy.start(grid, ArrayRecord([np.zeros(3, np.float32)]), num_rounds=rounds, timeout=10)
    assert grid.trained == wanted
    for t, r in enumerate(strategy.history):
        assert r.avail.reasons == {i: "model_draw" for i in range(6) if i not in wanted[t]}

    half = LocalGrid(adder_app(), 6)
    WithDropouts(fedavg(fraction_train=0.5), from_config(cfg)).start(half, ArrayRecord([np.zeros(3, np.float32)]),
                                                                     num_rounds=rounds, timeout=10)
    for t, sent in enumerate(half.trained):
        assert set(sent) <= set(wanted[t]) and len(sent) == max(len(wanted[t]) // 2, 1)


def test_what_flower_loses_is_recorded_as_what_happened(tmp_path, caplog):
    """A reply that never came (deadline), a node Flower reports gone (offline) and a ClientApp that raised
    (rejected, Flower's error code in the log) are drops of the round; the others' updates are aggregated."""
    grid = LocalGrid(adder_app(fail=2), 4, lose={3}, gone={1})
    strategy = WithDropouts(fedavg(), from_config({"data": {"clients": 4}}))
    with caplog.at_level(logging.WARNING, logger="dropfl.flower"):
        result = strategy.start(grid, ArrayRecord([np.zeros(2, np.float32)]), num_rounds=1, timeout=10)
    r = strategy.history[0]
    assert r.participated == {0} and r.dropped == {1: "offline", 2: "rejected", 3: "deadline"}
    np.testing.assert_array_equal(result.arrays.to_numpy_ndarrays()[0], np.ones(2, np.float32))
    said = {rec.fields["client"]: rec.fields for rec in caplog.records if hasattr(rec, "fields")}
    assert said[2]["flower_error"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and said[2]["reason"] == "rejected"
    assert said[1]["flower_error"] == ErrorCode.NODE_UNAVAILABLE and said[1]["reason"] == "offline"


def test_too_few_available_nodes_trains_nobody_instead_of_waiting(tmp_path, caplog):
    """Flower's FedAvg defaults wait for 2 nodes (sample_nodes would sleep for ever with one visible): a round
    with one available client trains nobody, says so once, and records the client not_selected."""
    trace = write_log(tmp_path / "participation.csv",
                      [[P, P], [P, ("unavailable", "battery")], [("unavailable", "offline"), P]])
    grid = LocalGrid(adder_app(), 2)
    with caplog.at_level(logging.WARNING, logger="dropfl.flower"):
        strategy = WithDropouts(FedAvg(fraction_evaluate=0.0), replay(trace, 2, selection="strategy"))
        strategy.start(grid, ArrayRecord([np.zeros(2, np.float32)]), num_rounds=3, timeout=10)
    assert grid.trained == [[0, 1]]
    assert [(r.selected, r.configured) for r in strategy.history] == [([0, 1], True), ([], False), ([], False)]
    said = [rec.getMessage() for rec in caplog.records if "trains nobody" in rec.getMessage()]
    assert len(said) == 1 and said[0].startswith("round 1: 1 clients available, FedAvg needs 2")


def test_a_dropfl_strategy_under_the_wrapper_shares_its_node_map(tmp_path):
    """DropflStrategy (MimiC) inside WithDropouts: one discovery query for both, MimiC selects among the
    available clients only, and a replayed drop's update is left out of MimiC's aggregate."""
    from coordinator.loop import LoopConfig
    from dropfl.flower.strategy import DropflStrategy

    trace = write_log(tmp_path / "participation.csv", TRIAL)
    grid = LocalGrid(adder_app(), 4)
    inner = DropflStrategy("mimic", LoopConfig(rounds=3, n_clients=4, seed=0, lr=0.1))
    strategy = WithDropouts(inner, replay(trace, 4))
    strategy.start(grid, ArrayRecord([np.zeros(2, np.float32)]), num_rounds=3, timeout=10)
    assert inner.nodes is strategy.nodes
    assert grid.trained == [[0, 1, 2, 3], [0, 2], [1, 2, 3]]
    assert [r["participants"] for r in inner.history] == [4, 1, 2]
    assert [r["dropped"] for r in inner.history] == [{}, {2: "deadline", 3: "charging"}, {3: "rejected"}]
    assert [sorted(r.participated) for r in strategy.history] == [[0, 1, 2, 3], [0], [1, 2]]


def test_flower_run_refuses_bad_input_in_one_line(tmp_path, capsys):
    """Not a Flower app, an app that does not declare dropfl's keys, a replay without a trace, a directory that
    holds a run: one line each, exit 2, nothing written."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "pyproject.toml").write_text('[tool.flwr.app.components]\nserverapp = "a:app"\nclientapp = "b:app"\n')
    out = tmp_path / "out"
    cases = [(["flower", "run", str(tmp_path / "none"), "--out", str(out)], "cannot read pyproject.toml"),
             (["flower", "run", str(bare), "--out", str(out)], "lacks dropfl-config, dropfl-out, dropfl-overwrite"),
             (["flower", "run", str(APP), "--availability", "replay", "--out", str(out)], "--trace is required")]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("dropfl: error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    (out / "metrics.jsonl").parent.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 0}\n')
    assert main(["flower", "run", str(APP), "--out", str(out)]) == 2
    assert "already holds a run; add --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_quickstart_app_beside_dropfl_in_one_report_and_replayed(tmp_path, monkeypatch, capsys):
    """The quickstart app in Flower's simulation engine under bounded availability (`dropfl flower run`), and
    `dropfl sim` with the Flower run's own config.json: `dropfl report` reads both and names both; the Flower
    run's participation replays in dropfl to the same log row for row."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    config = APP / "federation.toml"
    pythonpath = os.environ.get("PYTHONPATH")
    assert main(["flower", "run", str(APP), "--config", str(config), "--rounds", "2", "--num-cpus", "1",
                 "--out", "flower"]) == 0
    # Flower's Ray backend sets PYTHONPATH to this process's sys.path: put back, later subprocesses never see it
    assert os.environ.get("PYTHONPATH") == pythonpath
    flower_run = tmp_path / "flower"
    assert {"config.json", "metrics.jsonl", "participation.csv", "reports.jsonl", "model.pt"} <= \
        {p.name for p in flower_run.iterdir()}
    metrics = [json.loads(line) for line in (flower_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1] and all(0 < m["accuracy"] <= 1 for m in metrics)
    assert main(["sim", "--config", str(flower_run / "config.json"), "--out", "dropfl", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["report", "flower", "dropfl", "--out", "report", "--no-progress"]) == 0
    table = capsys.readouterr().out
    for name in ("flower", "dropfl"):
        assert f"| {name} | fedavg | bounded (τmax 3) | 2 |" in table, table
    md = (tmp_path / "report" / "comparison.md").read_text()
    assert "participation-flower.png" in md and "participation-dropfl.png" in md
    # the same bounded draw in both: the same participation
    assert read_rows(flower_run / "participation.csv") == read_rows(tmp_path / "dropfl" / "participation.csv")
    assert main(["sim", "--config", str(flower_run / "config.json"), "--availability", "replay", "--trace",
                 str(flower_run / "participation.csv"), "--out", "replay", "--no-progress"]) == 0
    assert read_rows(tmp_path / "replay" / "participation.csv") == read_rows(flower_run / "participation.csv")


def test_evaluation_goes_to_the_available_clients_that_did_not_drop(tmp_path):
    """Flower's federated evaluation (fraction_evaluate=1) under the replayed trial: each round only the available
    clients that did not drop are asked."""
    trace = write_log(tmp_path / "participation.csv", TRIAL)
    grid = LocalGrid(adder_app(), 4)
    strategy = WithDropouts(FedAvg(min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1), replay(trace, 4))
    strategy.start(grid, ArrayRecord([np.zeros(2, np.float32)]), num_rounds=3, timeout=10)
    assert grid.evaluated == [[0, 1, 2, 3], [0], [1, 2]]


def test_under_dropfl_wraps_as_the_run_config_says(tmp_path, caplog):
    """Without dropfl-config the ServerApp's strategy is returned as it is; with it, wrapped under the config's
    availability (no run directory without dropfl-out); Flower's FedAvg under a config that is not
    fedavg/samples is said once."""
    from dropfl.flower.rundir import under_dropfl

    plain = fedavg()
    assert under_dropfl(plain, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                       run_config={"dropfl-config": "", "dropfl-out": ""})) is plain
    cfg = {"data": {"clients": 3}, "availability": {"kind": "static", "p": 0.5}}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                  run_config={"dropfl-config": json.dumps(cfg), "dropfl-out": ""})
    with caplog.at_level(logging.WARNING, logger="dropfl.flower"):
        wrapped = under_dropfl(plain, ctx)
    assert isinstance(wrapped, WithDropouts) and wrapped.strategy is plain and wrapped.recorder is None
    assert wrapped.clients == 3 and type(wrapped.availability).__name__ == "Static"
    said = [r.getMessage() for r in caplog.records if "Flower's FedAvg" in r.getMessage()]
    assert len(said) == 1 and "--algo fedavg --weighting uniform" in said[0]


def test_overwrite_removes_a_flower_runs_flower_json(tmp_path):
    """flower.json is one of a run's files (coordinator/rundir.py RUN_FILES): `--overwrite` of a directory that
    held a Flower run leaves no stale one; a file the user put there stays."""
    from coordinator.rundir import RunDir

    recorder = RunRecorder(tmp_path / "run", {"data": {"clients": 2}, "model": {"model": "logreg"}}, strategy=fedavg())
    recorder.close()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert json.loads((tmp_path / "run" / "flower.json").read_text())["strategy"] == \
        "flwr.serverapp.strategy.fedavg.FedAvg"
    RunDir(tmp_path / "run", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
