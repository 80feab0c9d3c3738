"""Local objectives (edge_client/objectives.py, docs/objectives.md): the registry and its built-ins, FedProx's and
SCAFFOLD's arithmetic kept bit for bit, the task message's `objectives`, and a user's algorithm with a client side
as one module: FedDyn (Acar et al., ICLR 2021), its client term a plugin objective named as module:attr, its
server rule a plugin strategy, trained alike by the loop, the generic engine (torch.func) and the batched engine,
declined by an agent that does not have it and trained bit for bit by one that has it installed (entry point)."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

import feddyn_source
import pytest
import torch
from feddyn_source import PLUGIN
from torch import nn

from coordinator.strategies import FedProx, Scaffold
from edge_client import agent as ag
from edge_client import objectives, wire
from edge_client.federation import dropfl_version
from edge_client.models import build_model, get_flat, set_flat
from edge_client.objectives import OBJECTIVES, Correction, PluginError, Proximal
from edge_client.trainer import TrainTask, batch_plan, client_generator, local_train

MOD = "dropfl_feddyn_plugin"   # the user's module (FedDyn)
TRAP = "dropfl_objective_trap"   # a module that a task message names as module:attr: must never be imported



@pytest.fixture
def plugin(tmp_path, monkeypatch):
    yield from feddyn_source.user_module(tmp_path, monkeypatch, MOD, TRAP)


def install_entry_point(src) -> None:
    feddyn_source.install_entry_point(src, MOD, "dropfl-feddyn-plugin")


# --- the registry and the built-ins --------------------------------------------------------------------------------

def test_the_registry_holds_the_builtins_and_resolves_a_plugin_as_module_attr(plugin):
    assert (OBJECTIVES.kind, OBJECTIVES.group) == ("local objective", "dropfl.objectives")
    assert OBJECTIVES.registered()[:2] == ["proximal", "correction"]
    assert OBJECTIVES.entry("proximal").obj is Proximal and OBJECTIVES.entry("correction").origin == "built-in"
    e = OBJECTIVES.entry(f"{MOD}:FedDynTerm")
    assert e.obj.name == "feddyn-term" and e.origin.startswith(f"module {MOD} (")
    with pytest.raises(PluginError, match="not a local objective"):
        OBJECTIVES.entry(f"{MOD}:FedDyn")   # a strategy is not an objective
    with pytest.raises(PluginError, match="no such local objective: choose one of proximal, correction"):
        OBJECTIVES.entry("feddyn-term")     # not installed: module:attr, or an entry point


def test_fedprox_and_scaffold_attach_their_objectives():
    task = TrainTask(client=1, round=3, lr=0.1, batch_size=4)
    assert FedProx(mu=0.25).configure({}, 3, task).objectives == (Proximal(0.25),) and task.objectives == ()
    s = Scaffold()
    state = s.init_state(3, torch.zeros(5))
    state["c"] += 1.0
    state["c_clients"][1] = torch.arange(5.0)
    (o,) = s.configure(state, 3, task).objectives
    assert type(o) is Correction and torch.equal(o.c, 1.0 - torch.arange(5.0))
    # the shorthands set the same objectives, proximal before correction whatever the order they are given in
    both = TrainTask(client=1, round=3, lr=0.1, batch_size=4, grad_correction=o.c, prox_mu=0.5)
    assert [type(x) for x in both.objectives] == [Proximal, Correction] and both.prox_mu == 0.5
    assert dataclasses.replace(both, objectives=()).prox_mu == 0.0
    assert dataclasses.replace(both, objectives=()).grad_correction is None


def _old_loop(model: nn.Module, w: torch.Tensor, x, y, task: TrainTask, mu: float, corr) -> torch.Tensor:
    """The loop's arithmetic before local objectives (TrainTask.prox_mu, .grad_correction), as it was written."""
    gen = client_generator(task.seed, task.round, task.client)
    plan = batch_plan(len(y), task, gen)
    set_flat(model, w)
    params = list(model.parameters())
    anchor = [p.detach().clone() for p in params] if mu else None
    split = None if corr is None else list(torch.split(corr, [p.numel() for p in params]))
    for idx in plan:
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        with torch.no_grad():
            for j, p in enumerate(params):
                g = p.grad
                if anchor is not None:
                    g = g + mu * (p - anchor[j])
                if split is not None:
                    g = g + split[j].view_as(p)
                p.add_(g, alpha=-task.lr)
    return w - get_flat(model)


@pytest.mark.parametrize("mu,corrected", [(0.3, False), (0.0, True), (0.05, True)])
def test_the_builtins_keep_the_loops_bits(mu, corrected):
    model = build_model("mlp", (1, 6, 6), 10, seed=1)
    w = get_flat(model) + 0.01
    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(23, 1, 6, 6, generator=g), torch.randint(0, 10, (23,), generator=g)
    corr = torch.randn(w.shape, generator=g) * 0.1 if corrected else None
    task = TrainTask(client=2, round=1, lr=0.07, batch_size=8, epochs=2, seed=3)
    attached = FedProx(mu=mu).configure({}, 1, task) if mu else task
    if corrected:
        attached = dataclasses.replace(attached, objectives=attached.objectives + (Correction(corr),))
    got = local_train(model, w, x, y, attached).delta
    assert torch.equal(got, _old_loop(model, w, x, y, task, mu, corr))


# --- the task message ---------------------------------------------------------------------------------------------

def test_the_task_message_carries_the_objectives_by_name():
    c = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    objs = (Proximal(0.01), Correction(c))
    meta, tensor = objectives.encode(objs)
    builtin = {"dist": "dropfl", "version": dropfl_version(), "digest": ""}   # the code behind each, by identity
    assert meta == [{"name": "proximal", "params": {"mu": 0.01}, "plugin": builtin},
                    {"name": "correction", "params": {}, "tensors": {"c": 1000}, "plugin": builtin}]
    assert torch.equal(tensor, c)   # SCAFFOLD's correction is the message's tensor, as before objectives
    frames = wire.encode("task", "run", 2, 1, tensor, {"lr": 0.1, "objectives": meta}, wire.Limits(chunk_bytes=512))
    assert len(frames) == 8   # chunked, reassembled by the wire
    msg = wire.decode(frames, run="run", round=2, client=1, kinds=("task",))
    back = objectives.decode(json.loads(json.dumps(msg.meta["objectives"])), msg.tensor)
    assert back[0] == Proximal(0.01) and type(back[1]) is Correction and torch.equal(back[1].c, c)
    assert objectives.decode([], None) == ()
    old = objectives.legacy(0.5, c)   # a task message without `objectives`: prox_mu and a bare correction
    assert old[0] == Proximal(0.5) and type(old[1]) is Correction and torch.equal(old[1].c, c)
    assert objectives.legacy(0.0, None) == ()
    with pytest.raises(TypeError, match="must be float32"):
        objectives.decode(meta, c.double())
    for bad, match in [([{"name": "correction", "tensors": {"c": 999}}], "has 1000 values, its objectives name 999"),
                       ([{"name": "correction", "tensors": {"c": 1001}}], "does not fit"),
                       ([{"name": "proximal", "params": {"mu": -1}}], "mu must be a finite number >= 0"),
                       ([{"name": "proximal", "params": {"mu": 0.1, "nu": 2}}], "unknown parameter"),
                       ([{"name": "proximal", "params": {"mu": [1]}}], "parameter mu is a list")]:
        with pytest.raises((ValueError, TypeError), match=match):
            objectives.decode(bad, c if "tensors" in bad[0] else None)


# --- a user's algorithm with a client side, as one module -----------------------------------------------------------

def _rounds(strategy, train, w: torch.Tensor, n: int, rounds: int = 3) -> torch.Tensor:
    """`rounds` rounds of `strategy` over clients 0..n-1, training each round's tasks with `train(w, tasks)`."""
    from coordinator.strategies import ClientUpdate
    state = strategy.init_state(n, w)
    for t in range(1, rounds + 1):
        tasks = [strategy.configure(state, t, TrainTask(client=i, round=t, lr=0.05, batch_size=8, steps=3 + i,
                                                        seed=7)) for i in range(n)]
        results = train(w, tasks)
        updates = {task.client: ClientUpdate(task.client, r.delta, r.num_samples, r.steps, task.lr, r.loss)
                   for task, r in zip(tasks, results)}
        w, state = strategy.aggregate(state, t, w, updates)
    return w


@pytest.mark.parametrize("model_name", ["tiny", "mlp"])
def test_a_plugin_objective_trains_alike_on_the_loop_and_the_engines(plugin, model_name):
    """float64: the generic engine (and the batched engine, for a model it has a forward for) = the loop to 1e-10
    (docs/engine.md), over three rounds of FedDyn; and the objective changes what is trained."""
    from coordinator.sim.batched import BatchedEngine
    from coordinator.sim.functional import FunctionalEngine
    from coordinator.strategies import STRATEGIES, FedAvg
    dyn = OBJECTIVES[f"{MOD}:FedDynTerm"]   # resolved as module:attr, as is the strategy that attaches it
    strategy = STRATEGIES[f"{MOD}:FedDyn"](alpha=0.1)
    shape = (1, 6, 6)
    torch.manual_seed(0)
    model = (sys.modules[MOD].tiny_net(shape) if model_name == "tiny" else build_model("mlp", shape)).double()
    w = get_flat(model)
    g = torch.Generator().manual_seed(2)
    data = [(torch.rand(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
            for n in (17, 9, 30)]

    def loop(w, tasks):
        return [local_train(model, w, *data[t.client], t) for t in tasks]

    first = strategy.configure(strategy.init_state(3, w), 1, TrainTask(client=0, round=1, lr=0.05, batch_size=8))
    assert [type(o) for o in first.objectives] == [dyn]
    ref = _rounds(strategy, loop, w, 3)
    assert not torch.allclose(_rounds(FedAvg(), loop, w, 3), ref, atol=1e-4)   # the objective changes the training
    engines = {"generic": FunctionalEngine(model, data, device="cpu")}
    if model_name == "mlp":   # a hand-written batched forward: the batched engine's torch-ops path, hooked
        engines["batched"] = BatchedEngine(model, data, workers=0, device="cpu")
    for name, engine in engines.items():
        got = _rounds(strategy, engine.run, w, 3)
        engine.close()
        assert torch.allclose(got, ref, atol=1e-10, rtol=0), (name, float((got - ref).abs().max()))


def test_gradient_hooks_on_the_engines_in_any_order(plugin):
    """A round whose tasks hold a plugin's term beside SCAFFOLD's correction, and the built-ins in the other order
    (correction, then proximal: not the stacked form), trains through the hooks on both engines: = loop to 1e-10
    (float64), the batched engine's transposed linear weights included."""
    from coordinator.sim.batched import BatchedEngine
    from coordinator.sim.functional import FunctionalEngine
    dyn = OBJECTIVES[f"{MOD}:FedDynTerm"]
    shape = (1, 6, 6)
    model = build_model("mlp", shape, seed=3).double()
    w = get_flat(model)
    g = torch.Generator().manual_seed(5)
    data = [(torch.rand(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
            for n in (12, 20, 7)]
    c = [torch.randn(w.numel(), generator=g, dtype=torch.float64) * 0.05 for _ in range(3)]
    objs = [(dyn(0.2, c[0] * 0.1), Correction(c[0])), (Correction(c[1]), Proximal(0.3)), ()]
    tasks = [TrainTask(client=i, round=2, lr=0.05, batch_size=8, epochs=2, seed=1, objectives=objs[i])
             for i in range(3)]
    ref = [local_train(model, w, *data[i], t) for i, t in enumerate(tasks)]
    for engine in (FunctionalEngine(model, data, device="cpu"), BatchedEngine(model, data, workers=0, device="cpu")):
        got = engine.run(w, tasks)
        engine.close()
        for r, e in zip(got, ref):
            assert r.steps == e.steps and torch.allclose(r.delta, e.delta, atol=1e-10, rtol=0)
            assert r.loss == pytest.approx(e.loss, abs=1e-12)


def test_a_plugin_algorithm_runs_from_the_cli_on_the_loop_and_the_generic_engine(plugin, tmp_path):
    """`dropfl sim --algo MOD:FedDyn --model MOD:tiny_net`: the loop and the generic engine (float32) agree to
    the generic engine's float32 tolerance (docs/engine.md: 1e-5) after three rounds."""
    from coordinator import cli
    runs = {}
    for engine in ("loop", "batched"):
        out = tmp_path / engine
        assert cli.main(["sim", "--out", str(out), "--clients", "4", "--rounds", "3", "--steps", "2",
                         "--batch-size", "8", "--algo", f"{MOD}:FedDyn", "--model", f"{MOD}:tiny_net",
                         "--engine", engine, "--sim-device", "cpu", "--threads", "1", "--no-progress"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[engine] = (torch.load(out / "model.pt", weights_only=True), {r.get("engine") for r in rows})
    (a, engines_a), (b, engines_b) = runs["loop"], runs["batched"]
    assert engines_a == {"loop"} and engines_b == {"batched (torch.func)"}
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=0), (k, float((a[k] - b[k]).abs().max()))


# --- the agent ----------------------------------------------------------------------------------------------------

class _Published:
    def wait_for_publish(self, timeout=None):
        pass

    def is_published(self):
        return True


def _agent(tmp_path, monkeypatch):
    """Client 1 of 4 (iid, logreg) with no broker: what it publishes goes to the returned list."""
    cfg = ag.config_from_dict({"agent": {"client": 1, "out": str(tmp_path / "agent")},
                               "battery": {"source": "mains"},
                               "data": {"clients": 4, "partition": "iid", "seed": 2}, "model": {"model": "logreg"}})
    a = ag.Agent(cfg)
    sent: list[tuple[str, bytes]] = []
    monkeypatch.setattr(a.link.mqtt, "publish", lambda topic, payload, qos=0, retain=False:
                        sent.append((topic, payload)) or _Published())
    a.connected.set()
    return a, sent


def _deliver(a, topic, frames):
    for f in frames:
        a._handle(topic, f, False, 0.0)
    a.work.step()


def _task_frames(task: TrainTask, name: str | None = None):
    """The coordinator's task message for `task` (coordinator/field/transport.py), the objective renamed if given."""
    meta, tensor = objectives.encode(task.objectives)
    if name is not None:
        meta[0]["name"] = name
    m = {"lr": task.lr, "batch_size": task.batch_size, "epochs": task.epochs, "steps": task.steps,
         "seed": task.seed, "objectives": meta}
    return wire.encode("task", "run", task.round, task.client, tensor, m)


def test_an_agent_declines_an_objective_it_does_not_have_and_never_imports_a_module_a_message_names(
        plugin, tmp_path, monkeypatch):
    a, sent = _agent(tmp_path, monkeypatch)
    n = sum(p.numel() for p in a.work.model.parameters())
    dyn = OBJECTIVES[f"{MOD}:FedDynTerm"]
    task = TrainTask(client=1, round=4, lr=0.1, batch_size=8, steps=2, seed=2,
                     objectives=(dyn(0.1, torch.full((n,), 0.01)),))
    for name in ("feddyn-term", f"{TRAP}:FedDynTerm"):
        sent.clear()
        _deliver(a, "dropfl/v1/device/client-1/control", _task_frames(task, name))
        (topic, payload), = sent
        m = wire.decode([payload])
        assert topic.endswith("/update/decline") and m.meta["reason"] == "declined" and a.work.task is None
        assert f"local objective {name!r}: not installed on this device" in m.meta["detail"]
    assert TRAP not in sys.modules


def test_an_agent_declines_an_objective_whose_code_differs_from_the_coordinators(tmp_path, monkeypatch):
    a, sent = _agent(tmp_path, monkeypatch)
    task = TrainTask(client=1, round=4, lr=0.1, batch_size=8, steps=2, seed=2, objectives=(Proximal(0.1),))
    meta, tensor = objectives.encode(task.objectives)
    assert meta[0]["plugin"] == objectives.identity("proximal")
    meta[0]["plugin"] = {"dist": "dropfl", "version": "0.0.1", "digest": ""}   # the coordinator runs another version
    m = {"lr": task.lr, "batch_size": task.batch_size, "steps": task.steps, "seed": task.seed, "objectives": meta}
    _deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 4, 1, tensor, m))
    (topic, payload), = sent
    d = wire.decode([payload])
    assert topic.endswith("/update/decline") and d.meta["reason"] == "declined" and a.work.task is None
    assert d.meta["detail"] == (f"local objective 'proximal': differs from the coordinator's (on this device: dropfl "
                                f"{dropfl_version()}; on the coordinator: dropfl 0.0.1): install dropfl 0.0.1 on the "
                                f"device")
    meta[0]["plugin"] = {"dist": "dropfl"}   # malformed: refused as a malformed task, never trained
    sent.clear()
    _deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 4, 1, tensor, m))
    assert sent == [] and a.work.task is None
    del meta[0]["plugin"]   # an older coordinator's task names no identity: trained as before
    _deliver(a, "dropfl/v1/device/client-1/control", wire.encode("task", "run", 4, 1, tensor, m))
    assert a.work.task is not None and a.work.task[1].objectives == (Proximal(0.1),)


def test_an_agent_with_the_plugin_installed_trains_it_as_the_simulation(plugin, tmp_path, monkeypatch):
    from coordinator.field.transport import export_onnx
    install_entry_point(plugin)
    assert OBJECTIVES.entry("feddyn-term").origin.startswith("entry point dropfl-feddyn-plugin==1.0")
    a, sent = _agent(tmp_path, monkeypatch)
    model = build_model("logreg", (1, 28, 28), 10, 2)
    w = get_flat(model) + 0.01
    dyn = OBJECTIVES["feddyn-term"]
    term = dyn(0.5, torch.randn(w.numel(), generator=torch.Generator().manual_seed(3)) * 0.01)
    task = TrainTask(client=1, round=5, lr=0.1, batch_size=8, steps=3, seed=2, objectives=(Proximal(0.2), term))
    _deliver(a, "dropfl/v1/device/client-1/control", _task_frames(task))
    _deliver(a, "dropfl/v1/model/weights", wire.encode("model", "run", 5, -1, w))
    _deliver(a, "dropfl/v1/model/onnx", wire.encode("onnx", "run", 5, -1, torch.frombuffer(
        bytearray(export_onnx(model, w, (1, 28, 28))), dtype=torch.uint8)))
    k = [t.rsplit("/", 1)[1] for t, _ in sent].count("delta")
    up = wire.decode([p for _, p in sent[:k]], run="run", round=5, client=1, kinds=("update",))
    ref = local_train(build_model("logreg", (1, 28, 28), 10, 0), w, a.work.x, a.work.y, task)
    plain = local_train(build_model("logreg", (1, 28, 28), 10, 0), w, a.work.x, a.work.y,
                        dataclasses.replace(task, objectives=()))
    assert torch.equal(up.tensor, ref.delta) and not torch.equal(ref.delta, plain.delta)


def test_plugin_module_source_is_what_the_docs_show():
    """docs/objectives.md's example objective is this file's (the same lines), so the page shows tested code."""
    from pathlib import Path
    doc = (Path(__file__).parents[1] / "docs" / "objectives.md").read_text()
    start = PLUGIN.index("@dataclasses.dataclass(frozen=True, eq=False)")
    end = PLUGIN.index("class FedDyn(Strategy)")
    assert textwrap.dedent(PLUGIN[start:end]).strip() in doc


def test_a_lockstep_sweep_trains_a_plugin_objectives_tasks_alone(plugin):
    """coordinator/sim/lockstep.py merges runs' clients only where its arithmetic is theirs: not with a plugin's
    objective (trained alone, through its hooks), still with FedProx's."""
    from coordinator.sim.lockstep import _key
    dyn = OBJECTIVES[f"{MOD}:FedDynTerm"]
    plain = [TrainTask(client=i, round=1, lr=0.1, batch_size=8, prox_mu=0.01) for i in range(2)]
    assert _key(plain, merges=True) == ((0.1, 8, 0.01, False), 1)
    hooked = [dataclasses.replace(t, objectives=t.objectives + (dyn(0.1, torch.zeros(3)),)) for t in plain]
    assert _key(hooked, merges=True) is None
