"""dropfl/flower: the ArrayRecord <-> flat vector conversion, the node map, and every wrapped dropfl strategy
against dropfl's own round loop (coordinator/loop.py `run_rounds`) on the same hand-made client updates: the same
selection, tasks, final model and state, bitwise. Flower's grid is a fake that answers in-process (no engine)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

flwr = pytest.importorskip("flwr", reason="Flower is not installed (pip install 'dropfl[flower]')")

import torch  # noqa: E402
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from coordinator.availability.models import RoundAvailability  # noqa: E402
from coordinator.availability.participation import LoggedRound  # noqa: E402
from coordinator.config import StrategyConfig  # noqa: E402
from coordinator.errors import UserError  # noqa: E402
from coordinator.loop import LoopConfig, run_rounds  # noqa: E402
from coordinator.rundir import RunDir  # noqa: E402
from coordinator.strategies import ClientUpdate  # noqa: E402
from dropfl.flower import nodes  # noqa: E402
from dropfl.flower.client import task_from_message  # noqa: E402
from dropfl.flower.nodes import NodeMap, NodeMapError, discover, from_reply, partition_reply  # noqa: E402
from dropfl.flower.strategy import (  # noqa: E402
    ARRAYS,
    MASK,
    META,
    METRICS,
    MODEL,
    STATE,
    DropflStrategy,
    build_dropfl_strategy,
    model_arrays,
    state_from_file,
    state_to_file,
    to_arrays,
    to_vector,
)
from edge_client.models import build_model, get_flat  # noqa: E402
from edge_client.report import ClientReport  # noqa: E402

N = 5
NODE_IDS = [90210, 17, 4242, 2 ** 63 + 5, 8]          # partition i is held by NODE_IDS[i]: not 0..N-1, not sorted
SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,)}        # a tiny "model": 15 parameters
MODEL_SHAPES = {"fc1.weight": (20, 30), "fc1.bias": (20,), "fc2.weight": (4, 20), "fc2.bias": (4,)}   # 704


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """What Flower's runtime sets before a ServerApp or ClientApp creates a Message (the run, this node, the task)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


# ---- the model as an ArrayRecord and as dropfl's vector ------------------------------------------------------------

@pytest.mark.parametrize("name,shape", [("logreg", (1, 28, 28)), ("mlp", (1, 28, 28)), ("mimic-cnn", (1, 28, 28)),
                                        ("fdms-cnn", (1, 28, 28))])
def test_model_arrays_are_dropfls_flat_vector_bitwise(name, shape):
    model = build_model(name, shape, 10, seed=3)
    arrays = model_arrays(model)
    assert list(arrays) == [n for n, _ in model.named_parameters()]
    w = to_vector(arrays)
    assert torch.equal(w.view(torch.int32), get_flat(model).view(torch.int32))   # the bits, not just the values
    back = to_arrays(w, arrays)
    assert list(back) == list(arrays)
    assert all(back[k].shape == arrays[k].shape and back[k].numpy().tobytes() == arrays[k].numpy().tobytes()
               for k in arrays)


def test_vector_round_trip_keeps_every_bit():
    """-0.0, a NaN with a payload, a subnormal, ±inf and the largest float32 survive vector → record → vector."""
    specials = [struct.unpack("<f", struct.pack("<I", b))[0] for b in (0x80000000, 0x7FC00123, 0x00000001)]
    w = torch.tensor(specials + [float("inf"), -float("inf"), 3.4028235e38] + [0.1 * k for k in range(9)],
                     dtype=torch.float32)
    like = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})
    back = to_vector(to_arrays(w, like))
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))
    assert back.view(torch.int32)[1].item() == 0x7FC00123


def test_conversion_refuses_what_is_not_dropfls_vector():
    like = ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})
    with pytest.raises(ValueError, match="a vector of 14 values for an ArrayRecord of 15"):
        to_arrays(torch.zeros(14), like)
    with pytest.raises(ValueError, match="array 'w' is float64; dropfl's models are float32"):
        to_vector(ArrayRecord({"w": Array(np.zeros(3))}))


# ---- node identity ---------------------------------------------------------------------------------------------------

def context(node_id: int, config: dict) -> Context:
    return Context(run_id=1, node_id=node_id, node_config=config, state=RecordDict(), run_config={})


def test_node_map_is_one_to_one_and_round_trips_through_a_config_record():
    m = NodeMap([(NODE_IDS[i], i) for i in range(N)])
    assert [m.partition(NODE_IDS[i]) for i in range(N)] == list(range(N))
    assert [m.node(i) for i in range(N)] == NODE_IDS
    m.learn(NODE_IDS[2], 2)   # the same pair again: nothing changes
    assert NodeMap.from_record(m.to_record()) == m and len(m) == N
    with pytest.raises(NodeMapError, match="partition 1 is held by nodes 17 and 99"):
        m.learn(99, 1)
    with pytest.raises(NodeMapError, match="node 17 answered partition 3, before 1"):
        m.learn(17, 3)
    m.check_complete(N)
    with pytest.raises(NodeMapError, match=r"expected partitions 0..5, 5 nodes answered; missing \[5\]"):
        m.check_complete(6)


def test_partition_reply_carries_the_node_config_partition_id():
    query = Message(RecordDict({nodes.QUERY_KEY: ConfigRecord({"ask": nodes.PARTITION_ID})}), dst_node_id=4242,
                    message_type=MessageType.QUERY)
    reply = partition_reply(query, context(4242, {"partition-id": 2, "num-partitions": 5}))
    assert from_reply(reply) == (4242, 2)
    with pytest.raises(NodeMapError, match="node 7 has no 'partition-id' in its node config"):
        partition_reply(query, context(7, {}))


class FakeGrid:
    """Flower's Grid, in-process: node NODE_IDS[i] holds partition i; `train(msg, ctx)` answers training messages.
    Replies come back in reverse order (Flower's order is the order of arrival); `lose` loses those partitions'
    replies (a timeout), `fail` makes theirs error replies."""

    def __init__(self, train=None, n: int = N, lose=(), fail=()):
        self.train, self.ids, self.lose, self.fail = train, NODE_IDS[:n], set(lose), set(fail)
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            pid = self.ids.index(msg.metadata.dst_node_id)
            ctx = context(msg.metadata.dst_node_id, {"partition-id": pid, "num-partitions": len(self.ids)})
            if msg.metadata.message_type == MessageType.QUERY:
                replies.append(partition_reply(msg, ctx))
            elif msg.metadata.message_type == MessageType.EVALUATE:
                acc = 0.5 + 0.1 * pid   # partition i: accuracy 0.5 + 0.1 i on 10 (i + 1) examples
                replies.append(Message(RecordDict({METRICS: MetricRecord({"num-examples": 10 * (pid + 1),
                                                                          "accuracy": acc})}), reply_to=msg))
            elif pid in self.fail:
                replies.append(Message(Error(code=0, reason="ClientApp raised"), reply_to=msg))
            elif pid not in self.lose:
                replies.append(self.train(msg, ctx))
        return replies[::-1]


def test_discover_learns_every_node_and_refuses_a_missing_partition():
    assert discover(FakeGrid()) == NodeMap([(NODE_IDS[i], i) for i in range(N)])
    with pytest.raises(NodeMapError, match=r"expected partitions 0..5, 5 nodes answered; missing \[5\]"):
        discover(FakeGrid(), 6, wait=0)


# ---- every wrapped strategy against dropfl's round loop --------------------------------------------------------------

def local_model(t: int, i: int, w: torch.Tensor) -> torch.Tensor:
    """What client i trained to in round t: w minus a fixed pseudo-random step (the same on both sides)."""
    g = torch.Generator().manual_seed(1000 * t + i)
    return w - 0.05 * torch.randn(w.numel(), generator=g)


def mask_of(t: int, i: int, m: int) -> torch.Tensor:
    return torch.arange(m) % (i + 2) != t % (i + 2)   # FedDD: a partial upload, different per client and round


def report_of(i: int) -> ClientReport:
    return ClientReport(compute_s=1.0 + i, up_Bps=1e5 * (i + 1), down_Bps=2e5, upload_bytes=60, download_bytes=60)


class Participation(list):
    """A plain participation (item t: the available partition ids) answering round(t) as a dropfl source."""

    def round(self, t):
        ids = self[t]
        available = np.array([i in ids for i in range(N)])
        return RoundAvailability(available, {i: "model_draw" for i in range(N) if i not in ids})


ROUNDS = Participation([set(range(N)), {0, 2, 3}, {1, 2, 4}, {0, 1, 2, 3}])


class LoopTransport:
    """dropfl's side: the round loop's transport, returning the same hand-made updates."""

    def __init__(self, masked: bool, lose=(), fail=()):
        self.masked, self.lose, self.fail = masked, set(lose), set(fail)
        self.tasks: list = []

    def run_round(self, t, w, tasks):
        updates, dropped = {}, {}
        for task in tasks:
            self.tasks.append(task)
            i = task.client
            if i in self.lose | self.fail:
                dropped[i] = "deadline" if i in self.lose else "rejected"
                continue
            delta = w - local_model(t, i, w)
            mask = mask_of(t, i, w.numel()) if self.masked else None
            if mask is not None:
                delta = torch.where(mask, delta, torch.zeros_like(delta))
            updates[i] = ClientUpdate(i, delta, num_samples=10 * (i + 1), steps=3, lr=task.lr, loss=0.5 + i,
                                      mask=mask, report=report_of(i) if self.masked else None)
        return updates, dropped


def flower_train(masked: bool, seen: list):
    """Flower's side: a ClientApp's train handler replying as Flower's quickstart does, with the same update."""
    def train(msg: Message, ctx: Context) -> Message:
        task = task_from_message(msg)
        seen.append(task)
        w = to_vector(msg.content.array_records[ARRAYS])
        t, i = task.round, task.client
        m = {"num-examples": 10 * (i + 1), "steps": 3, "lr": task.lr, "train_loss": 0.5 + i}
        content = {ARRAYS: to_arrays(local_model(t, i, w), msg.content.array_records[ARRAYS])}
        if masked:
            content[MASK] = ArrayRecord({MASK: Array(mask_of(t, i, w.numel()).numpy())})
            r = report_of(i)
            m |= {"compute-s": r.compute_s, "up-Bps": r.up_Bps, "down-Bps": r.down_Bps, "upload-bytes": 60,
                  "download-bytes": 60}
        return Message(RecordDict({**content, METRICS: MetricRecord(m)}), reply_to=msg)
    return train


def w0_arrays() -> ArrayRecord:
    g = torch.Generator().manual_seed(7)
    return ArrayRecord({k: Array(torch.randn(s, generator=g).numpy()) for k, s in MODEL_SHAPES.items()})


LOOP = LoopConfig(rounds=len(ROUNDS), n_clients=N, seed=11, lr=0.1, lr_decay=0.9, batch_size=4, epochs=1, steps=3)


def run_loop(algo, config, tmp_path, lose=(), fail=(), participation=ROUNDS):
    strategy = build_dropfl_strategy(algo, config, LOOP)
    transport = LoopTransport(algo == "feddd", lose, fail)
    w = run_rounds(LOOP, strategy, participation, transport, lambda w: (0.0, 0.0), RunDir(tmp_path / "loop"),
                   to_vector(w0_arrays()), progress=False)
    state = torch.load(tmp_path / "loop" / "checkpoint.pt", weights_only=False)["state"]
    return w, state, transport.tasks


def run_flower(algo, config, rounds, lose=(), fail=(), participation=ROUNDS, state=None, arrays=None, **kw):
    seen: list = []
    grid = FakeGrid(flower_train(algo == "feddd", seen), lose=lose, fail=fail)
    s = DropflStrategy(algo, LOOP, config=config, participation=participation, state=state, **kw)
    arrays = arrays if arrays is not None else w0_arrays()
    for r in range(1, rounds + 1):   # Flower numbers a run's rounds from 1, a resumed one too
        msgs = s.configure_train(r, arrays, ConfigRecord(), grid)
        arrays, _ = s.aggregate_train(r, grid.send_and_receive(msgs))
    return to_vector(arrays), s, seen


CASES = [("fedavg", {}), ("fedavg", {"weighting": "samples", "fedavg_k": 2}), ("full", {}), ("fedprox", {"mu": 0.1}),
         ("scaffold", {}), ("mimic", {}), ("mimic", {"units": "gradient"}), ("mimic-client", {}), ("mifa", {}),
         ("mifa", {"mifa_storage": "lr-normalised"}), ("mifa", {"mifa_wait_all": True}), ("fedlaavg", {"beta": 0.4}),
         ("fedlaavg", {"fedlaavg_storage": "lr-normalised"}), ("fdms", {}), ("fdms", {"fdms_cr": "case1"}),
         ("stale", {}), ("feddd", {}), ("fedcs", {})]


def assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = torch.as_tensor(a[k]), torch.as_tensor(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.nan_to_num(123.0), y.nan_to_num(123.0)), k


@pytest.mark.parametrize("algo,options", CASES, ids=[f"{a}-{'-'.join(map(str, o.values())) or 'default'}"
                                                      for a, o in CASES])
def test_wrapped_strategy_equals_dropfls_round_loop(algo, options, tmp_path):
    import dataclasses

    config = dataclasses.replace(StrategyConfig(), algo=algo, **options)
    w_loop, state_loop, tasks_loop = run_loop(algo, config, tmp_path)
    w_flower, s, tasks_flower = run_flower(algo, config, len(ROUNDS))
    assert torch.equal(w_flower, w_loop)                               # the final model, bitwise
    assert not torch.equal(w_flower, to_vector(w0_arrays()))           # ... which moved
    assert_same_state(s.state, state_loop)                             # every table, bitwise
    assert [(k.round, k.client, k.lr, k.prox_mu, k.dropout_rate) for k in tasks_flower] == \
        [(k.round, k.client, k.lr, k.prox_mu, k.dropout_rate) for k in tasks_loop]
    for a, b in zip(tasks_flower, tasks_loop, strict=True):           # SCAFFOLD's c − c_i travels exactly
        assert (a.grad_correction is None) == (b.grad_correction is None)
        assert a.grad_correction is None or torch.equal(a.grad_correction, b.grad_correction)
    assert [h["selected"] for h in s.history] == [len({k.client for k in tasks_loop if k.round == t})
                                                  for t in range(len(ROUNDS))]


def test_lost_and_failed_replies_are_recorded_as_what_happened(tmp_path):
    """A reply that never came is `deadline`, an error reply `rejected` (Flower's reason kept); neither is
    aggregated, exactly as dropfl's loop leaves out a transport's drops."""
    config = StrategyConfig(algo="mifa")
    w_loop, state_loop, _ = run_loop("mifa", config, tmp_path, lose={2}, fail={0})
    w_flower, s, _ = run_flower("mifa", config, len(ROUNDS), lose={2}, fail={0})
    assert torch.equal(w_flower, w_loop)
    assert_same_state(s.state, state_loop)
    assert s.history[0]["dropped"] == {0: "rejected", 2: "deadline"}
    assert s.history[0]["errors"] == {0: "flower error 0: ClientApp raised"}
    assert s.history[0]["participants"] == N - 2
    assert s.history[1]["reasons"] == {1: "model_draw", 4: "model_draw"}


class Replayed(list):
    """A replayed log: the recorded selection and after-selection drops (a declined one is not trained)."""

    def round(self, t):
        sel, drops = self[t]
        return LoggedRound(np.ones(N, dtype=bool), {}, selected=sel, drops=drops)


def test_a_replayed_logs_selection_and_drops_are_followed(tmp_path):
    replay = Replayed([([0, 1, 2, 3, 4], {}), ([0, 3], {3: "battery"}), ([1, 2, 4], {2: "deadline"}),
                       ([0, 4], {})])
    config = StrategyConfig(algo="mimic")
    w_loop, state_loop, tasks_loop = run_loop("mimic", config, tmp_path, participation=replay)
    w_flower, s, tasks_flower = run_flower("mimic", config, len(replay), participation=replay)
    assert torch.equal(w_flower, w_loop)
    assert_same_state(s.state, state_loop)
    assert [(k.round, k.client) for k in tasks_flower] == [(k.round, k.client) for k in tasks_loop]
    assert (1, 3) not in [(k.round, k.client) for k in tasks_flower]   # declined (battery): never sent
    assert s.history[1]["dropped"] == {3: "battery"} and s.history[2]["dropped"] == {2: "deadline"}


def test_a_list_of_sets_is_a_participation():
    config = StrategyConfig(algo="mifa")
    w_obj, _, _ = run_flower("mifa", config, len(ROUNDS))
    w_list, s, _ = run_flower("mifa", config, len(ROUNDS), participation=[set(r) for r in ROUNDS])
    assert torch.equal(w_obj, w_list)
    assert [h["available"] for h in s.history] == [len(r) for r in ROUNDS]


@pytest.mark.parametrize("algo", ["mifa", "mimic", "fedlaavg", "fdms", "scaffold"])
def test_state_kept_in_a_record_dict_resumes_exactly(algo, tmp_path):
    """What survives: the RecordDict given as `state` holds the tables, the model and the last round after every
    round; a new DropflStrategy on it (here after a trip through a file) goes on from there, bitwise as one run."""
    config = StrategyConfig(algo=algo)
    w_all, s_all, _ = run_flower(algo, config, 4)
    record = RecordDict()
    run_flower(algo, config, 2, state=record)
    assert sorted(record.keys()) == sorted([STATE, MODEL, META])
    assert record.config_records[META]["round"] == 1 and record.config_records[META]["algo"] == algo
    state_to_file(record, tmp_path / "state.bin")
    again = state_from_file(tmp_path / "state.bin")
    _, by_file, _ = run_flower(algo, config, 2, state_file=tmp_path / "each-round.bin")   # written every round
    assert_same_state(state_from_record_dict(state_from_file(tmp_path / "each-round.bin")), by_file.state)
    resumed = DropflStrategy(algo, LOOP, config=config, participation=ROUNDS, state=again)
    assert resumed.offset == 2
    w_two, s_two, _ = run_flower(algo, config, 2, state=again, arrays=resumed.resume_arrays())
    assert torch.equal(w_two, w_all)
    assert_same_state(s_two.state, s_all.state)
    assert [h["round"] for h in s_two.history] == [2, 3]


def state_from_record_dict(record: RecordDict) -> dict:
    from dropfl.flower.strategy import state_from_record

    return state_from_record(record.array_records[STATE])


def test_a_state_of_another_strategy_is_refused():
    record = RecordDict()
    run_flower("mifa", StrategyConfig(algo="mifa"), 1, state=record)
    with pytest.raises(UserError, match="the state in Context.state is of mifa with 5 clients, not mimic with 5"):
        DropflStrategy("mimic", LOOP, state=record)


def test_an_unknown_strategy_is_one_line():
    with pytest.raises(UserError, match="--algo: "):
        DropflStrategy("no-such-algo", LOOP)


PLUGIN = '''
"""A user's strategy plugin: FedAvg with server momentum, its state a model-sized vector."""
import torch

from coordinator.strategies.base import Strategy, mean_delta


class Momentum(Strategy):
    name = "momentum"

    def __init__(self, *, weighting="uniform"):
        self.weighting = weighting

    def init_state(self, n_clients, w0):
        return {"v": torch.zeros_like(w0)}

    def aggregate(self, state, t, w, updates):
        if not updates:
            return w, state
        v = 0.9 * state["v"] + mean_delta(updates, self.weighting)
        return w - v, {**state, "v": v}
'''


def test_a_strategy_plugin_is_wrapped_by_name_or_as_an_instance(tmp_path, monkeypatch):
    (tmp_path / "flower_plugin_momentum.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    algo = "flower_plugin_momentum:Momentum"
    config = StrategyConfig(algo=algo)
    w_loop, state_loop, _ = run_loop(algo, config, tmp_path)
    w_flower, s, _ = run_flower(algo, config, len(ROUNDS))
    assert s.name == "momentum" and torch.equal(w_flower, w_loop)
    assert_same_state(s.state, state_loop)
    instance = DropflStrategy(build_dropfl_strategy(algo, config, LOOP), LOOP, participation=ROUNDS)
    grid, arrays = FakeGrid(flower_train(False, [])), w0_arrays()
    for r in range(1, len(ROUNDS) + 1):
        arrays, _ = instance.aggregate_train(r, grid.send_and_receive(instance.configure_train(r, arrays,
                                                                                                ConfigRecord(), grid)))
    assert torch.equal(to_vector(arrays), w_loop)


def test_federated_evaluation_averages_by_examples_and_is_off_by_default():
    grid = FakeGrid()
    off = DropflStrategy("fedavg", LOOP)
    assert off.configure_evaluate(1, w0_arrays(), ConfigRecord(), grid) == []
    on = DropflStrategy("fedavg", LOOP, evaluate=True)
    msgs = list(on.configure_evaluate(1, w0_arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(NODE_IDS)
    metrics = on.aggregate_evaluate(1, grid.send_and_receive(msgs))
    want = sum(10 * (i + 1) * (0.5 + 0.1 * i) for i in range(N)) / sum(10 * (i + 1) for i in range(N))
    assert metrics["accuracy"] == pytest.approx(want, rel=1e-12)
    assert on.aggregate_evaluate(1, []) is None


class ViewGrid(FakeGrid):
    """A grid listing only some nodes (as dropfl/flower/availability.py's view of the round's available ones)."""

    def __init__(self, train, visible):
        super().__init__(train)
        self.visible = visible

    def get_node_ids(self):
        return [NODE_IDS[i] for i in self.visible]


def test_only_listed_nodes_are_selected_and_the_rest_is_not_connected():
    s = DropflStrategy("fedavg", LOOP, nodes=NodeMap([(NODE_IDS[i], i) for i in range(N)]))
    grid = ViewGrid(flower_train(False, []), [0, 3, 4])
    msgs = list(s.configure_train(1, w0_arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == sorted(NODE_IDS[i] for i in (0, 3, 4))
    s.aggregate_train(1, grid.send_and_receive(msgs))
    assert s.history[0]["reasons"] == {1: "not_connected", 2: "not_connected"}
    assert s.history[0]["participants"] == 3 and s.history[0]["dropped"] == {}


@pytest.mark.parametrize("algo", ["mimic", "mifa"])
def test_under_the_availability_wrapper_the_participation_comes_from_its_grid(algo, tmp_path):
    """DropflStrategy without a participation of its own, inside dropfl/flower/availability.py's WithDropouts:
    the wrapper's grid lists the round's available nodes and hands over its node map; the result is dropfl's loop."""
    from dropfl.flower.availability import WithDropouts

    config = StrategyConfig(algo=algo)
    w_loop, state_loop, _ = run_loop(algo, config, tmp_path)
    inner = DropflStrategy(algo, LOOP, config=config)
    outer = WithDropouts(inner, ROUNDS, clients=N)
    grid, arrays = FakeGrid(flower_train(False, [])), w0_arrays()
    for r in range(1, len(ROUNDS) + 1):
        arrays, _ = outer.aggregate_train(r, grid.send_and_receive(outer.configure_train(r, arrays, ConfigRecord(),
                                                                                         grid)))
    assert inner.nodes is outer.nodes                                  # one query, one map
    assert torch.equal(to_vector(arrays), w_loop)
    assert_same_state(inner.state, state_loop)
    assert [h["available"] for h in inner.history] == [len(r) for r in ROUNDS]


@pytest.mark.parametrize("algo", ["mifa", "fedavg"])
def test_a_round_with_nobody_available_is_still_a_round(algo, tmp_path):
    """No message is sent, and the strategy still aggregates the empty round as dropfl's loop does (MIFA moves the
    model by its stored updates, FedAvg keeps it)."""
    empty = Participation([set(range(N)), set(), {1, 3}, set()])
    config = StrategyConfig(algo=algo)
    w_loop, state_loop, _ = run_loop(algo, config, tmp_path, participation=empty)
    w_flower, s, seen = run_flower(algo, config, len(empty), participation=empty)
    assert torch.equal(w_flower, w_loop)
    assert_same_state(s.state, state_loop)
    assert sorted({k.round for k in seen}) == [0, 2] and [h["participants"] for h in s.history] == [N, 0, 2, 0]


def test_dropfls_client_app_trains_the_task_it_is_sent_with_local_train():
    """The ClientApp (dropfl/flower/client.py) on a FedProx + SCAFFOLD task: its reply is the model that dropfl's
    local_train makes of the same task on the same shard, bitwise, with the metrics DropflStrategy reads."""
    from coordinator.config import SimConfig
    from coordinator.runsetup import binding_of, client_data, load_dataset
    from dropfl.flower.client import client_app
    from dropfl.flower.strategy import task_record
    from edge_client.trainer import TrainTask, local_train

    cfg = SimConfig()
    cfg.data.clients, cfg.model.model = 4, "logreg"
    ds = load_dataset(cfg)
    model = build_model("logreg", (1, 28, 28), 10, seed=0)
    w = get_flat(model)
    corr = 0.01 * torch.randn(w.numel(), generator=torch.Generator().manual_seed(5))
    task = TrainTask(client=2, round=3, lr=0.05, batch_size=8, steps=4, prox_mu=0.1, grad_correction=corr, seed=9)
    msg = Message(task_record(model_arrays(model), task, 4), dst_node_id=NODE_IDS[2], message_type=MessageType.TRAIN)
    reply = client_app(cfg)(msg, context(NODE_IDS[2], {"partition-id": 2, "num-partitions": 4}))
    x, y = client_data(ds, binding_of(cfg, ds))[2]
    want = local_train(build_model("logreg", (1, 28, 28), 10, seed=0), w, x, y, task)
    got = w - to_vector(reply.content.array_records[ARRAYS])
    assert torch.equal(got, want.delta)
    m = reply.content.metric_records[METRICS]
    assert (m["num-examples"], m["steps"], m["lr"], m["train_loss"]) == (len(y), 4, 0.05, want.loss)
    wrong = Message(task_record(model_arrays(model), task, 4), dst_node_id=NODE_IDS[1], message_type=MessageType.TRAIN)
    with pytest.raises(ValueError, match="holds partition 1, the task is for 2"):
        client_app(cfg)(wrong, context(NODE_IDS[1], {"partition-id": 1, "num-partitions": 4}))


@pytest.mark.parametrize("algo", ["mifa", "fedlaavg"])
def test_empty_rounds_under_the_availability_wrapper_are_dropfls(algo, tmp_path):
    """Inside WithDropouts, a round with nobody available (round 1) and a round whose every reply is lost (round 2:
    clients 1 and 3, both lost) still reach the dropfl strategy, which aggregates them as dropfl's loop does
    (MIFA and FedLaAvg move the model by their stored updates): the final model and every table, bitwise."""
    from dropfl.flower.availability import WithDropouts

    empty = Participation([set(range(N)), set(), {1, 3}, {0, 2, 4}])
    config = StrategyConfig(algo=algo)
    w_loop, state_loop, _ = run_loop(algo, config, tmp_path, lose=(1, 3), participation=empty)
    inner = DropflStrategy(algo, LOOP, config=config)
    outer = WithDropouts(inner, empty, clients=N)
    grid, arrays = FakeGrid(flower_train(False, []), lose=(1, 3)), w0_arrays()
    models = [to_vector(arrays)]
    for r in range(1, len(empty) + 1):
        new, _ = outer.aggregate_train(r, grid.send_and_receive(outer.configure_train(r, arrays, ConfigRecord(),
                                                                                      grid)))
        arrays = new if new is not None else arrays
        models.append(to_vector(arrays))
    assert torch.equal(models[-1], w_loop)
    assert_same_state(inner.state, state_loop)
    import json

    logged = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [h["participants"] for h in inner.history] == [r["participants"] for r in logged]
    assert [h["participants"] for h in inner.history][1:3] == [0, 0] and inner.history[1]["selected"] == 0
    lost = inner.history[2]["dropped"]   # every one selected in round 2 was lost
    assert len(lost) == inner.history[2]["selected"] >= 1 and set(lost.values()) == {"deadline"}
    assert not torch.equal(models[2], models[1]) and not torch.equal(models[3], models[2])   # the empty rounds moved


def test_flowers_fedavg_under_the_wrapper_keeps_the_model_when_nobody_replies():
    """Flower's FedAvg (min 0 nodes: asked every round) under WithDropouts, run by Flower's Strategy.start: a round
    with nobody available and a round whose every reply is lost reach its aggregate_train with no replies; it
    returns no arrays, and the model stays round 1's (no crash, no invented model)."""
    from flwr.serverapp.strategy import FedAvg

    from dropfl.flower.availability import WithDropouts

    inner = FedAvg(fraction_evaluate=0.0, min_train_nodes=0, min_evaluate_nodes=0, min_available_nodes=0)
    calls: list[int] = []
    aggregate = inner.aggregate_train
    inner.aggregate_train = lambda r, replies: (lambda rs: calls.append(len(rs)) or aggregate(r, rs))(list(replies))
    outer = WithDropouts(inner, Participation([set(range(N)), set(), {1, 3}]), clients=N)
    def train(msg: Message, ctx: Context) -> Message:   # as Flower's quickstart replies
        i, w = int(ctx.node_config["partition-id"]), to_vector(msg.content.array_records[ARRAYS])
        return Message(RecordDict({ARRAYS: to_arrays(local_model(0, i, w), msg.content.array_records[ARRAYS]),
                                   METRICS: MetricRecord({"num-examples": 10 * (i + 1)})}), reply_to=msg)

    grid, w0 = FakeGrid(train, lose=(1, 3)), w0_arrays()
    result = outer.start(grid, w0, num_rounds=3, timeout=10)
    assert calls == [3, 0, 0]   # round 1: clients 0, 2, 4 (1 and 3 lost); rounds 2 and 3: no reply
    assert sorted(result.train_metrics_clientapp) == [1]
    one = [local_model(0, i, to_vector(w0)) for i in (0, 2, 4)]   # what the three trained to
    weights = [10.0, 30.0, 50.0]   # num-examples 10 (i + 1)
    assert torch.allclose(to_vector(result.arrays), sum(w * m for w, m in zip(weights, one)) / sum(weights))
    assert [(h.configured, sorted(h.participated), h.dropped) for h in outer.history] == \
        [(True, [0, 2, 4], {1: "deadline", 3: "deadline"}), (True, [], {}), (True, [], {1: "deadline", 3: "deadline"})]
