"""The data binding (edge_client/federation.py): declared once, covering every config field that defines
the federation, and a misbound agent is refused with the differing fields named."""

import dataclasses
import logging

from coordinator.config import SimConfig
from coordinator.field.connection import FieldConfig
from coordinator.field.hub import FieldHub
from coordinator.field.registry import FieldAvailability
from coordinator.runsetup import NOT_BOUND, NOT_BOUND_SECTIONS, binding_of
from edge_client import agent as ag
from edge_client import datasets, federation, wire
from edge_client.federation import BINDING_SOURCE, DataBinding


def test_every_config_field_is_bound_or_excluded_with_a_reason():
    bound = set(BINDING_SOURCE.values())
    missing = []
    for section in dataclasses.fields(SimConfig):
        for f in dataclasses.fields(section.default_factory()):
            key = (section.name, f.name)
            if key in bound:
                assert key not in NOT_BOUND, f"{key} is both bound and excluded"
            elif key not in NOT_BOUND and section.name not in NOT_BOUND_SECTIONS:
                missing.append(".".join(key))
    assert not missing, (f"config fields neither in the data binding (edge_client/federation.py BINDING_SOURCE) "
                         f"nor excluded with a reason (coordinator/runsetup.py NOT_BOUND): {missing}")
    assert all(reason.strip() for reason in [*NOT_BOUND.values(), *NOT_BOUND_SECTIONS.values()])


def test_the_agent_config_carries_every_binding_key():
    cfg = ag.AgentConfig()
    keys = {f.name for f in dataclasses.fields(DataBinding)} - {"data_digest", "plugins"}  # computed
    have = {f.name for f in dataclasses.fields(cfg.data)} | {f.name for f in dataclasses.fields(cfg.model)}
    assert keys <= have, keys - have


def _agent_cfg(**data) -> ag.AgentConfig:
    return ag.config_from_dict({"agent": {"client": 1}, "model": {"model": "logreg"},
                                "data": {"dataset": "fmnist", "partition": "shards", "clients": 6, "seed": 0} | data})


def test_coordinator_and_agent_build_the_same_binding():
    sim = SimConfig()
    sim.data.partition, sim.data.clients, sim.model.model = "shards", 6, "logreg"
    ds = datasets.load("fmnist")
    coord = binding_of(sim, ds)
    agent = ag.binding_of(_agent_cfg(), ds)
    assert coord == agent and len(coord.data_digest) == 16
    assert federation.diff(coord, agent.to_meta()) == {}


def test_an_agent_with_another_shards_per_client_is_refused_naming_the_field(tmp_path, caplog):
    sim = SimConfig()
    sim.data.partition, sim.data.clients, sim.model.model = "shards", 6, "logreg"
    ds = datasets.load("fmnist")
    hub = FieldHub(FieldConfig(run_id="run-x", heartbeat_timeout_s=60), 6, binding_of(sim, ds), 7850, tmp_path)
    good, bad = ag.binding_of(_agent_cfg(), ds), ag.binding_of(_agent_cfg(shards_per_client=3), ds)
    with caplog.at_level(logging.INFO, logger="dropfl"):
        for c, b in ((0, good), (1, bad)):
            meta = {"state": "online", "device": f"d{c}", "num_samples": 10} | b.to_meta()
            hub._dispatch(f"d{c}", "status", wire.encode("status", "", -1, c, meta=meta)[0], False)
            hub._dispatch(f"d{c}", "heartbeat", wire.encode("heartbeat", "", -1, c, meta={"available": True})[0],
                          False)
    ra = FieldAvailability(hub).round(0)
    assert ra.available.tolist()[:2] == [True, False] and ra.reasons[1] == "rejected"
    refused = [r.getMessage() for r in caplog.records if "d1" in r.getMessage()]
    assert any("shards_per_client (agent 3, coordinator 2)" in m for m in refused), refused
    assert not any("d0" in r.getMessage() and "binding" in r.getMessage() for r in caplog.records)


def test_the_data_digest_binds_the_data_not_its_path():
    ds = datasets.load("fmnist")
    b = ag.binding_of(_agent_cfg(), ds)
    other = dataclasses.replace(b, data_digest="0" * 16)
    assert federation.diff(b, other.to_meta()) == {"data_digest": ("0" * 16, b.data_digest)}
    assert federation.diff(b, dataclasses.replace(b, data_digest="").to_meta()) == {}  # one side did not compute it
