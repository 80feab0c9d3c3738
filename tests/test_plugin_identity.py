"""Plugins in the field (edge_client/federation.py): the data binding names the code behind the model, dataset and
partitioner by distribution, version and code digest; an agent whose plugin differs is refused at join, naming the
plugin and what to install, as a refusal (`rejected`), never as offline; and nothing the coordinator names is
imported on the device."""

import dataclasses
import json
import logging
import sys

import pytest

from coordinator.config import SimConfig
from coordinator.field.connection import FieldConfig
from coordinator.field.hub import FieldHub
from coordinator.field.registry import FieldAvailability
from coordinator.runsetup import binding_of
from edge_client import agent as ag
from edge_client import datasets, federation, wire
from tests import pluginkit
from tests.pluginkit import DIST, MODEL, PACKAGE

N = 4


@pytest.fixture
def labels():
    return datasets.load_labels("fmnist")


@pytest.fixture
def on_path(monkeypatch):
    """Put a plugin directory on sys.path (and forget the package's module) for the rest of the test."""
    def put(path):
        monkeypatch.syspath_prepend(str(path))
        pluginkit.forget()
    yield put
    pluginkit.forget()


def _agent_cfg(client: int, model: str) -> ag.AgentConfig:
    return ag.config_from_dict({"agent": {"client": client}, "model": {"model": model},
                                "data": {"dataset": "fmnist", "partition": "shards", "clients": N, "seed": 0}})


def _coordinator_binding(model: str, labels) -> federation.DataBinding:
    sim = SimConfig()
    sim.data.partition, sim.data.clients, sim.model.model = "shards", N, model
    return binding_of(sim, labels)


def _join(hub: FieldHub, c: int, binding: federation.DataBinding) -> None:
    meta = {"state": "online", "device": f"d{c}", "num_samples": 10} | binding.to_meta()
    meta = json.loads(json.dumps(meta))   # as it crosses the wire
    hub._dispatch(f"d{c}", "status", wire.encode("status", "", -1, c, meta=meta)[0], False)
    hub._dispatch(f"d{c}", "heartbeat", wire.encode("heartbeat", "", -1, c, meta={"available": True})[0], False)


def test_a_plugin_is_bound_by_distribution_version_and_code_digest(tmp_path, on_path, labels):
    on_path(pluginkit.make_plugin(tmp_path / "v1", "1.0"))
    b = ag.binding_of(_agent_cfg(0, MODEL), labels)
    model, dataset, part = b.plugins
    assert (model.kind, model.name, model.dist, model.version) == ("model", MODEL, DIST, "1.0")
    assert len(model.digest) == 16 and PACKAGE not in sys.modules   # identified without importing it
    # the digest is SHA-256 over the package's *.py files (relative path, bytes), computed here by hand
    import hashlib
    src = (tmp_path / "v1" / PACKAGE / "__init__.py").read_bytes()
    want = hashlib.sha256(f"{PACKAGE}/__init__.py".encode() + b"\0" + src + b"\0").hexdigest()[:16]
    assert model.digest == want
    # built-ins are identified by dropfl's own version, with no digest
    assert (dataset.dist, dataset.version, dataset.digest) == ("dropfl", federation.dropfl_version(), "")
    assert (part.kind, part.name, part.dist) == ("partitioner", "shards", "dropfl")
    assert federation.diff(b, json.loads(json.dumps(b.to_meta()))) == {}


def test_an_agent_with_another_version_of_the_plugin_is_refused_naming_it(tmp_path, on_path, labels, caplog):
    on_path(pluginkit.make_plugin(tmp_path / "v1", "1.0"))
    coord = _coordinator_binding(MODEL, labels)
    good = ag.binding_of(_agent_cfg(0, MODEL), labels)
    on_path(pluginkit.make_plugin(tmp_path / "v2", "2.0", hidden=32))   # the device has another version
    other = ag.binding_of(_agent_cfg(1, MODEL), labels)
    assert other.plugins[0].version == "2.0" and other.plugins[0].digest != good.plugins[0].digest
    hub = FieldHub(FieldConfig(run_id="run-p", heartbeat_timeout_s=60), N, coord, 7850, tmp_path)
    with caplog.at_level(logging.INFO, logger="dropfl"):
        _join(hub, 0, good)
        _join(hub, 1, other)
    ra = FieldAvailability(hub).round(0)
    assert ra.available.tolist()[:2] == [True, False] and ra.reasons[1] == "rejected"   # a refusal, not offline
    said = " ".join(r.getMessage() for r in caplog.records if "d1" in r.getMessage())
    assert (f"model plugin {MODEL!r} differs (on the agent: {DIST} 2.0 (code digest {other.plugins[0].digest}); "
            f"on the coordinator: {DIST} 1.0 (code digest {good.plugins[0].digest})): install {DIST} 1.0 on the "
            f"device") in said, said
    refused = [json.loads(line) for line in (tmp_path / "field.jsonl").read_text().splitlines()]
    assert [e["device"] for e in refused if "refused" in e] == ["d1"]   # recorded in the run's field.jsonl
    assert hub.registry.by_client[1].mismatch and not hub.registry.by_client[0].mismatch
    # refused from its announce on, before any heartbeat: `rejected`, never `offline`
    meta = json.loads(json.dumps({"state": "online", "device": "d2", "num_samples": 10} | other.to_meta()))
    hub._dispatch("d2", "status", wire.encode("status", "", -1, 2, meta=meta)[0], False)
    assert FieldAvailability(hub).round(0).reasons[2] == "rejected"


def test_same_version_other_code_and_a_missing_plugin_are_refused(tmp_path, on_path, labels):
    on_path(pluginkit.make_plugin(tmp_path / "v1", "1.0"))
    coord = _coordinator_binding(MODEL, labels)
    edited = dataclasses.replace(coord, plugins=(dataclasses.replace(coord.plugins[0], digest="0" * 16),
                                                 *coord.plugins[1:]))
    why = federation.refusal(coord, edited.to_meta())
    assert f"install {DIST} 1.0 on the device (same version, other code" in why, why
    # an agent without the plugin: its own binding says the name resolves to nothing
    pluginkit.forget()
    sys.path.remove(str(tmp_path / "v1"))
    missing = federation.plugin_id("model", MODEL)
    assert (missing.dist, missing.version, missing.digest) == ("", "", "")
    gone = dataclasses.replace(coord, plugins=(missing, *coord.plugins[1:]))
    assert f"model plugin {MODEL!r} differs (on the agent: not installed; on the coordinator: {DIST} 1.0" in \
        federation.refusal(coord, gone.to_meta())
    # an older agent announces no plugins: refused only where the coordinator runs a plugin
    old = {k: v for k, v in coord.to_meta().items() if k != "plugins"}
    assert "install tinyplug 1.0" in federation.refusal(coord, old)
    builtin = _coordinator_binding("logreg", labels)
    assert federation.refusal(builtin, {k: v for k, v in builtin.to_meta().items() if k != "plugins"}) is None


def test_a_module_attr_the_coordinator_names_is_never_imported_on_the_device(tmp_path, monkeypatch, labels):
    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "evilnet.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('x')\n"
                                     "def build(shape, n, dropout=None):\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(trap))
    coord = federation.DataBinding("fmnist", "shards", N, 2, 0.5, 0, "evilnet:build", None,
                                   plugins=federation.plugin_ids("evilnet:build", "fmnist", "shards"))
    assert coord.plugins[0].digest and "evilnet" not in sys.modules   # digested, not imported
    # the device's agent is configured with its own model; the coordinator's name reaches it in no message
    device = ag.binding_of(_agent_cfg(1, "logreg"), labels)
    hub = FieldHub(FieldConfig(run_id="run-t", heartbeat_timeout_s=60), N, coord, 7850, tmp_path)
    _join(hub, 1, device)
    assert "model (agent 'logreg', coordinator 'evilnet:build')" in hub.registry.by_client[1].mismatch
    assert "evilnet" not in sys.modules and not (trap / "RAN").exists()
    # a binding built on the device from a config naming evilnet:build digests the module without running it
    assert federation.plugin_ids("evilnet:build", "fmnist", "shards")[0].digest == coord.plugins[0].digest
    assert not (trap / "RAN").exists()
