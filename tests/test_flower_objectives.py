"""A plugin local objective (edge_client/objectives.py, docs/objectives.md) through Flower: DropflStrategy sends the
task's objectives as `objectives.encode` writes them (ConfigRecord "objectives", ArrayRecord "objectives"), dropfl's
ClientApp decodes them with its own registry. FedDyn (Acar et al., ICLR 2021) as a user's module (its client term a
plugin objective installed through an entry point, its server rule named as module:attr) gives the model of dropfl's
round loop (`dropfl.simulate`, --engine loop), bitwise, with every message going through Flower's protobuf form. A
client without the objective fails the reply with the objective named and is recorded `declined`; a message that
names a module never makes the client import it. Flower's grid is in-process (no Ray)."""

from __future__ import annotations

import json
import sys

import pytest

flwr = pytest.importorskip("flwr", reason="Flower is the optional extra dropfl[flower]")

import feddyn_source  # noqa: E402
import torch  # noqa: E402
from flwr.app import Context, Error, Message, MessageType, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.common.serde import message_from_proto, message_to_proto  # noqa: E402

import dropfl  # noqa: E402
from coordinator.config import SimConfig  # noqa: E402
from coordinator.runsetup import build_availability, load_dataset, loop_config  # noqa: E402
from dropfl.flower.client import TaskDeclined, client_app, task_from_message  # noqa: E402
from dropfl.flower.strategy import CONFIG, OBJECTIVES, DropflStrategy, model_arrays, task_record, to_vector  # noqa
from edge_client.models import build_model  # noqa: E402
from edge_client.objectives import OBJECTIVES as REGISTRY  # noqa: E402
from edge_client.objectives import Proximal  # noqa: E402
from edge_client.trainer import TrainTask  # noqa: E402

MOD = "dropfl_flower_feddyn"          # the user's module
TRAP = "dropfl_flower_objective_trap"  # a module a task message names as module:attr: must never be imported
N = 4



@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """What Flower's runtime sets before a ServerApp or ClientApp creates a Message."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    yield from feddyn_source.user_module(tmp_path, monkeypatch, MOD, TRAP)


def install_entry_point(src) -> None:
    feddyn_source.install_entry_point(src, MOD, "dropfl-flower-feddyn")


def config() -> SimConfig:
    cfg = SimConfig()
    cfg.data.clients, cfg.model.model = N, "logreg"
    cfg.train.lr, cfg.train.batch_size, cfg.train.steps, cfg.train.engine = 0.05, 8, 3, "loop"
    cfg.availability.kind, cfg.availability.p = "static", 0.7
    cfg.strategy.algo = f"{MOD}:FedDyn"
    cfg.run.rounds, cfg.run.seed, cfg.run.eval_every, cfg.run.threads = 3, 0, 3, 1
    return cfg


class SerdeGrid:
    """Flower's Grid in this process: node 100 + i holds partition i and runs `app`; every message and reply goes
    through Flower's protobuf form (flwr.common.serde), as it would between processes. A ClientApp that raises is
    answered as Flower's runtime answers it (CLIENT_APP_RAISED_EXCEPTION, "<class ...>:<'message'>")."""

    def __init__(self, app):
        self.app = app

    def get_node_ids(self):
        return [100 + i for i in range(N)]

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            msg = message_from_proto(message_to_proto(_with_id(msg)))
            i = msg.metadata.dst_node_id - 100
            ctx = Context(run_id=1, node_id=msg.metadata.dst_node_id, state=RecordDict(), run_config={},
                          node_config={"partition-id": i, "num-partitions": N})
            try:
                reply = self.app(msg, ctx)
            except Exception as ex:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                      reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=msg)
            replies.append(message_from_proto(message_to_proto(_with_id(reply))))
        return replies


def _with_id(msg: Message) -> Message:
    if not msg.metadata.message_id:
        msg.metadata.__dict__["_message_id"] = msg.object_id   # as Flower's runtime assigns one
    return msg


def flower_run(cfg: SimConfig, rounds: int):
    ds = load_dataset(cfg)
    model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed,
                        cfg.model.dropout)
    strategy = DropflStrategy(cfg.strategy.algo, loop_config(cfg), config=cfg.strategy,
                              participation=build_availability(cfg))
    threads = torch.get_num_threads()
    try:
        result = strategy.start(SerdeGrid(client_app(cfg)), model_arrays(model), num_rounds=rounds, timeout=10)
    finally:
        torch.set_num_threads(threads)
    return result, strategy


def test_a_plugin_objective_through_flower_equals_dropfls_loop(plugin, tmp_path):
    install_entry_point(plugin)
    cfg = config()
    result, strategy = flower_run(cfg, cfg.run.rounds)
    threads = torch.get_num_threads()
    try:
        run = dropfl.simulate(config(), out=tmp_path / "dropfl", progress=False)
    finally:
        torch.set_num_threads(threads)
    w = torch.load(run.path / "checkpoint.pt", weights_only=False)["w"]
    assert torch.equal(to_vector(result.arrays), w)                          # bitwise
    logged = [sum(1 for r in run.participation() if r["round"] == t and r["status"] == "participated")
              for t in range(cfg.run.rounds)]
    assert [h["participants"] for h in strategy.history] == logged and sum(logged) > 0
    assert all(h["dropped"] == {} for h in strategy.history)
    # the term changes what is trained: client 0's next task with its FedDyn term and without it
    from coordinator.runsetup import binding_of, client_data
    from edge_client.trainer import local_train

    ds = load_dataset(cfg)
    x, y = client_data(ds, binding_of(cfg, ds))[0]
    task = strategy.strategy.configure(strategy.state, 3, TrainTask(client=0, round=3, lr=0.05, batch_size=8,
                                                                    steps=3, seed=0))
    model = build_model("logreg", tuple(ds.train.x.shape[1:]), ds.num_classes, 0)
    assert [o.name for o in task.objectives] == ["feddyn-term"] and task.objectives[0].g.abs().sum() > 0
    with_term = local_train(model, w, x, y, task).delta
    assert not torch.equal(with_term, local_train(model, w, x, y, TrainTask(client=0, round=3, lr=0.05,
                                                                            batch_size=8, steps=3, seed=0)).delta)


def test_a_client_without_the_objective_declines_and_never_imports_a_named_module(plugin):
    """Not installed on the client (only module:attr resolves on the server): every reply is an error naming the
    objective, recorded `declined`; the model stays. A message naming module:attr is refused, never imported."""
    cfg = config()
    result, strategy = flower_run(cfg, 1)
    (row,) = strategy.history
    assert row["selected"] >= 1 and row["participants"] == 0
    assert set(row["dropped"].values()) == {"declined"} and len(row["dropped"]) == row["selected"]
    for why in row["errors"].values():
        assert "local objective 'feddyn-term': not installed on this device" in why
    ds = load_dataset(cfg)
    model = build_model("logreg", tuple(ds.train.x.shape[1:]), ds.num_classes, 0)
    dyn = REGISTRY[f"{MOD}:FedDynTerm"]
    n = sum(p.numel() for p in model.parameters())
    task = TrainTask(client=1, round=0, lr=0.05, batch_size=8, steps=1, seed=0,
                     objectives=(Proximal(0.1), dyn(0.1, torch.full((n,), 0.01))))
    content = task_record(model_arrays(model), task, 1)
    meta = json.loads(content.config_records[CONFIG][OBJECTIVES])
    assert [m["name"] for m in meta] == ["proximal", "feddyn-term"] and meta[1]["tensors"] == {"g": n}
    assert content.array_records[OBJECTIVES][OBJECTIVES].numpy().shape == (n,)
    meta[1]["name"] = f"{TRAP}:FedDynTerm"
    content.config_records[CONFIG][OBJECTIVES] = json.dumps(meta)
    msg = Message(content, dst_node_id=101, message_type=MessageType.TRAIN)
    with pytest.raises(TaskDeclined, match=f"local objective '{TRAP}:FedDynTerm': not installed on this device"):
        task_from_message(msg)
    assert TRAP not in sys.modules


def test_the_builtins_travel_as_objectives():
    """FedProx's and SCAFFOLD's objectives come back from the message as they were sent, in their order."""
    c = torch.randn(15, generator=torch.Generator().manual_seed(0))
    task = TrainTask(client=2, round=3, lr=0.1, batch_size=4, steps=2, seed=1, prox_mu=0.25, grad_correction=c)
    model = torch.nn.Linear(4, 3)
    back = task_from_message(Message(task_record(model_arrays(model), task, 4), dst_node_id=1,
                                     message_type=MessageType.TRAIN))
    assert [type(o) for o in back.objectives] == [type(o) for o in task.objectives]
    assert back.prox_mu == 0.25 and torch.equal(back.grad_correction, c)
    plain = task_from_message(Message(task_record(model_arrays(model), TrainTask(client=0, round=0, lr=0.1,
                                                                                 batch_size=4), 1),
                                      dst_node_id=1, message_type=MessageType.TRAIN))
    assert plain.objectives == () and OBJECTIVES not in task_record(model_arrays(model), plain, 1).array_records


def test_under_the_availability_wrapper_the_decline_is_recorded_too(plugin):
    """WithDropouts (which writes a Flower run's participation) records the same reason: `declined`."""
    from dropfl.flower.availability import WithDropouts

    cfg = config()
    ds = load_dataset(cfg)
    model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed)
    inner = DropflStrategy(cfg.strategy.algo, loop_config(cfg), config=cfg.strategy)
    outer = WithDropouts(inner, build_availability(cfg), clients=N)
    threads = torch.get_num_threads()
    try:
        outer.start(SerdeGrid(client_app(cfg)), model_arrays(model), num_rounds=1, timeout=10)
    finally:
        torch.set_num_threads(threads)
    (rnd,) = outer.history
    assert rnd.selected and not rnd.participated and rnd.dropped == {i: "declined" for i in rnd.selected}
    assert inner.history[0]["dropped"] == rnd.dropped
