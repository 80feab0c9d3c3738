"""A field run replays bit for bit with the README's command, no --engine (docs/traces.md, docs/field-mode.md):
its agents train with the per-client loop (edge_client/trainer.py), so the replay picks `--engine loop` and
records it in its own config.json and metrics. An explicit --engine is honoured, with a one-line notice when
it cannot be exact. One field run (three agent processes on a private mosquitto, MimiC, 3 rounds) serves
every replay of the module."""

from __future__ import annotations

import json
import logging
import signal

import pytest
import torch
from fieldkit import (
    SETTINGS,
    agent_config,
    coordinator_cmd,
    kill_group,
    needs_mosquitto,
    start_agent,
    start_coordinator,
)
from strategy_helpers import cache_dataset_loads

from coordinator.availability.participation import recorded_engine
from coordinator.cli import main
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto

N, ROUNDS = 3, 3


@pytest.fixture(scope="module")
def field_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("field-engine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SETTINGS, "clients", N)
        broker = Mosquitto(workdir=d / "broker")
        agents = [start_agent(agent_config(i, broker.url, d / "agents"), d / "agents" / f"client-{i}.log")
                  for i in range(N)]
        try:
            coord = start_coordinator(coordinator_cmd(broker.url, d / "run", ROUNDS), d / "coordinator.log")
            assert coord.wait(timeout=300) == 0, (d / "coordinator.log").read_text()[-3000:]
        finally:
            for p in agents:
                kill_group(p, signal.SIGTERM)
            broker.close()
        cache_dataset_loads(mp)
        yield d / "run"


def flags(run) -> list[str]:
    """The field run's own options, as flags (fieldkit.coordinator_cmd's)."""
    return ["--clients", str(N), "--model", SETTINGS["model"], "--partition", SETTINGS["partition"], "--seed",
            str(SETTINGS["seed"]), "--steps", "2", "--lr", "0.05", "--threads", "1", "--rounds", str(ROUNDS),
            "--algo", "mimic", "--no-progress"]


def same(run, replay) -> bool:
    a, b = torch.load(run / "model.pt"), torch.load(replay / "model.pt")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def engine_of(replay) -> tuple[str, set[str]]:
    """The engine in the replay's config.json, and the engines its metrics say ran."""
    config = json.loads((replay / "config.json").read_text())["train"]["engine"]
    return config, {m["engine"] for m in read_metrics(replay / "metrics.jsonl")}


@needs_mosquitto
@pytest.mark.parametrize("form", ["config", "flags"])
def test_readme_replay_of_a_field_run_is_bit_for_bit(field_run, tmp_path, form, caplog):
    """`dropfl sim --config RUN/config.json --availability replay --trace RUN/participation.csv` (the README's
    command), and the same with the run's options as flags: the field model, torch.equal; the replay ran and
    recorded --engine loop (the field run's config.json says batched, which its agents never ran)."""
    assert json.loads((field_run / "config.json").read_text())["train"]["engine"] == "batched"
    source = ["--config", str(field_run / "config.json")] if form == "config" else flags(field_run)
    with caplog.at_level(logging.INFO, logger="dropfl.replay"):
        assert main(["sim", *source, "--availability", "replay", "--trace", str(field_run / "participation.csv"),
                     "--out", str(tmp_path / "replay")]) == 0
    assert same(field_run, tmp_path / "replay")
    assert engine_of(tmp_path / "replay") == ("loop", {"loop"})
    said = [r.getMessage() for r in caplog.records if r.name == "dropfl.replay"]
    assert any("--engine loop, which reproduces the recorded run bit for bit" in m for m in said), said


@needs_mosquitto
def test_an_explicit_engine_is_honoured_and_said_not_exact(field_run, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dropfl.replay"):
        assert main(["sim", *flags(field_run), "--engine", "batched", "--availability", "replay", "--trace",
                     str(field_run / "participation.csv"), "--out", str(tmp_path / "replay")]) == 0
    assert engine_of(tmp_path / "replay") == ("batched", {"batched"})
    said = [r for r in caplog.records if r.name == "dropfl.replay" and "--engine" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "float rounding, not bit for bit" in said[0].getMessage()
    assert "--engine loop replays it exactly" in said[0].getMessage()


def test_recorded_engine_of_a_simulation(tmp_path):
    """A simulated run replays with its own engine where the default would not be exact (loop); batched,
    ray and an unknown run keep the default."""
    trace = tmp_path / "participation.csv"
    assert recorded_engine(trace)[0] is None
    for engine, want in [("loop", "loop"), ("batched", None), ("ray", None)]:
        (tmp_path / "config.json").write_text(json.dumps({"train": {"engine": engine}}))
        assert recorded_engine(trace)[0] == want
    (tmp_path / "field.json").write_text("{}")
    assert recorded_engine(trace)[0] == "loop"


@needs_mosquitto
def test_a_resumed_replay_goes_on_with_its_own_engine(field_run, tmp_path):
    """A replay stopped after 2 rounds and resumed without --engine: the engine it started with (loop), the
    field model bit for bit; not a refusal for a changed engine."""
    replay, trace = tmp_path / "replay", str(field_run / "participation.csv")
    argv = ["sim", *flags(field_run), "--availability", "replay", "--trace", trace, "--out", str(replay)]
    assert main([*argv[:-4], "--rounds", "2", *argv[-4:]]) == 0
    assert main([*argv, "--resume"]) == 0
    assert same(field_run, replay)
    assert engine_of(replay) == ("loop", {"loop"})
