"""The public API (dropfl/, docs/api.md): importable from anywhere, the CLI's checks and messages, the
`__main__` guard with the batched engine's spawned workers, the documented example, and the round loop's
interfaces (coordinator/protocols.py)."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dropfl
from coordinator import protocols
from dropfl import _guard

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600   # one subprocess, with a slow, shared machine in mind
TINY = {"data": {"clients": 4}, "model": {"model": "logreg"}, "train": {"steps": 1, "slices": 2, "engine": "batched"},
        "run": {"rounds": 2, "threads": 1}}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DROPFL_KERNEL")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)


def test_import_from_a_fresh_process_outside_the_repository(tmp_path):
    code = ("import dropfl, json; missing = [n for n in dropfl.__all__ if not hasattr(dropfl, n)]; "
            "print(json.dumps({'file': dropfl.__file__, 'missing': missing, 'version': dropfl.__version__}))")
    p = _python(["-c", code], tmp_path)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert Path(got["file"]).resolve() == ROOT / "dropfl" / "__init__.py"
    assert got["missing"] == []
    assert got["version"] != "0+unknown"   # installed (pyproject's packages include dropfl)


def test_public_names_are_the_documented_ones():
    doc = (ROOT / "docs" / "api.md").read_text()
    for name in dropfl.__all__:
        if name != "__version__":
            assert f"`{name}" in doc, f"{name} is exported but not documented in docs/api.md"
    assert dropfl.SimConfig is __import__("coordinator.config").config.SimConfig
    assert issubclass(dropfl.MainGuardError, dropfl.UserError)


# --- the CLI's checks and messages -------------------------------------------------------------------------------

def _cli_error(argv: list[str], capsys) -> tuple[int, str]:
    from coordinator.cli import main
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return rc, err[0]


BAD_FILES = {
    "range": "[data]\nclients = 0\n",
    "unknown key": "[data]\nclient = 4\n",
    "unknown algorithm": '[strategy]\nalgo = "nope"\n',
    "replay without trace": '[availability]\nkind = "replay"\n',
    "cross-field": '[strategy]\nalgo = "mifa"\nmifa_storage = "lr-normalised"\nunits = "gradient"\n',
    "unknown section": "[nope]\nx = 1\n",
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_simulate_refuses_a_bad_config_file_as_the_cli(tmp_path, capsys, case):
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_FILES[case])
    out = tmp_path / "out"
    rc, line = _cli_error(["sim", "--config", str(bad), "--out", str(out), "--no-progress"], capsys)
    assert rc == 2 and line.startswith("dropfl: error: ")
    with pytest.raises(dropfl.UserError) as e:
        dropfl.simulate(bad, out=out)
    assert f"dropfl: error: {e.value}" == line
    assert not out.exists()


@pytest.mark.parametrize("flags,field", [
    (["--availability", "replay"], ("availability", "kind", "replay")),
    (["--availability", "device-trace"], ("availability", "kind", "device-trace")),
    (["--engine", "loop", "--sim-device", "cuda"], None),
])
def test_simulate_refuses_a_bad_simconfig_as_the_cli_refuses_its_flags(tmp_path, capsys, flags, field):
    out = tmp_path / "out"
    rc, line = _cli_error(["sim", *flags, "--out", str(out), "--no-progress"], capsys)
    cfg = dropfl.SimConfig()
    if field:
        setattr(getattr(cfg, field[0]), field[1], field[2])
    else:
        cfg.train.engine, cfg.train.device = "loop", "cuda"
    before = json.dumps(cfg.to_dict())
    with pytest.raises(dropfl.UserError) as e:
        dropfl.simulate(cfg, out=out)
    assert rc == 2 and f"dropfl: error: {e.value}" == line
    assert json.dumps(cfg.to_dict()) == before   # the caller's config is not changed
    assert not out.exists()


def test_simulate_leaves_a_directory_that_holds_a_run_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 0, "accuracy": 0.5}\n')
    (out / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    good = tmp_path / "good.toml"
    good.write_text('[data]\nclients = 4\n[model]\nmodel = "logreg"\n')
    rc, line = _cli_error(["sim", "--config", str(good), "--out", str(out), "--no-progress"], capsys)
    with pytest.raises(dropfl.UserError) as e:
        dropfl.simulate(good, out=out)
    assert rc == 2 and f"dropfl: error: {e.value}" == line and "already holds a run" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_simulate_takes_a_mapping_and_checks_it(tmp_path):
    with pytest.raises(dropfl.UserError, match=r"^data\.clients must be an integer ≥ 1 \(got 0 in config\)$"):
        dropfl.simulate({"data": {"clients": 0}}, out=tmp_path / "x")
    cfg = dropfl.load_config(TINY)
    assert (cfg.data.clients, cfg.model.model, cfg.train.slices, cfg.run.rounds) == (4, "logreg", 2, 2)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags,config,field_config", [
    (["--availability", "bounded"], {"availability": {"kind": "bounded"}}, {}),
    (["--deadline", "-1"], None, {"deadline_s": -1.0}),
    (["--broker", "http://x"], None, {"broker": "http://x"}),
])
def test_field_refuses_as_the_coordinator_command(tmp_path, capsys, flags, config, field_config):
    out = tmp_path / "out"
    rc, line = _cli_error(["coordinator", *flags, "--out", str(out), "--no-progress"], capsys)
    with pytest.raises(dropfl.UserError) as e:
        dropfl.field(config, out, dropfl.FieldConfig(**field_config))
    assert rc == 2 and f"dropfl: error: {e.value}" == line
    assert not out.exists()


def test_run_directory_refuses_a_directory_without_a_run(tmp_path):
    with pytest.raises(dropfl.UserError, match="holds no run"):
        dropfl.RunDirectory(tmp_path)


# --- the __main__ guard ------------------------------------------------------------------------------------------

SCRIPT = """\
import json
import dropfl

with open("marker.txt", "a") as f:   # every run of the script's top level: the parent's and its workers'
    f.write(__name__ + "\\n")
CONFIG = {config}

def main():
    run = dropfl.simulate(CONFIG, out="out")
    print(json.dumps({{"final": run.final, "engines": [r["engine"] for r in run.metrics()],
                      "participation": len(run.participation())}}))

{call}
"""
CALLS = {
    "unguarded": "main()",
    "unguarded-direct": 'dropfl.simulate(CONFIG, out="out")',
    "unguarded-in-else": 'if __name__ != "__main__":\n    pass\nelse:\n    pass\nmain()',
    "guarded": 'if __name__ == "__main__":\n    main()',
}


def _script(tmp_path: Path, call: str) -> subprocess.CompletedProcess:
    (tmp_path / "run.py").write_text(SCRIPT.format(config=repr(TINY), call=CALLS[call]))
    return _python(["run.py"], tmp_path)


@pytest.mark.parametrize("call", ["unguarded", "unguarded-direct", "unguarded-in-else"])
def test_a_script_without_the_guard_gets_one_line_and_nothing_is_written(tmp_path, call):
    p = _script(tmp_path, call)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("dropfl: error: simulate() is called at the top level of ")
    assert 'put the call under if __name__ == "__main__":' in lines[0]
    assert "BrokenProcessPool" not in p.stderr and "Traceback" not in p.stderr
    assert (tmp_path / "marker.txt").read_text().splitlines() == ["__main__"]   # no worker reran the script
    assert not (tmp_path / "out").exists()


@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_a_script_with_the_guard_runs_on_worker_processes(tmp_path):
    p = _script(tmp_path, "guarded")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["final"]["round"] == 1 and 0 <= got["final"]["accuracy"] <= 1
    assert got["engines"] and all(e.startswith("batched") for e in got["engines"])
    assert got["participation"] == 2 * 4   # a row per client per round
    names = (tmp_path / "marker.txt").read_text().splitlines()
    assert names.count("__main__") == 1
    assert names.count("__mp_main__") >= 1   # the workers did import the script, and stopped at the guard
    assert json.loads((tmp_path / "out" / "config.json").read_text())["data"]["clients"] == 4


def test_a_worker_that_reaches_simulate_refuses_it(tmp_path, monkeypatch):
    """The worker-side check: a call while this process imports its parent's script (multiprocessing's flag)."""
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(dropfl.MainGuardError) as e:
        dropfl.simulate(TINY, out=tmp_path / "out")
    assert isinstance(e.value, SystemExit) and isinstance(e.value, dropfl.UserError)
    assert e.value.code == f"dropfl: error: {e.value}" and "if __name__ == " in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source,line,ok", [
    ('import x\nx.f()\n', 2, False),
    ('import x\nif __name__ == "__main__":\n    x.f(\n        1)\n', 4, True),
    ("import x\nif '__main__' == __name__:\n    x.f()\n", 3, True),
    ('import x\nif __name__ != "__main__":\n    x.f()\nelse:\n    x.g()\n', 3, False),
    ('import x\nif __name__ != "__main__":\n    x.f()\nelse:\n    x.g()\n', 5, True),
    ('import x\nif __name__ == "__main__":\n    pass\nx.f()\n', 4, False),
    ('import x\nif x.main:\n    x.f()\n', 3, False),
])
def test_guarded_reads_the_main_test(source, line, ok):
    assert _guard.guarded(ast.parse(source), line) is ok


# --- the documented example --------------------------------------------------------------------------------------

@pytest.mark.slow   # the edit loop's heaviest (make test-fast); make test runs it
def test_the_example_of_docs_api_md_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert blocks, "docs/api.md has no python example"
    (tmp_path / "example.py").write_text(textwrap.dedent(blocks[0]))
    p = _python(["example.py"], tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"^fedavg: 2 [0-9.]+ \{", out, re.M)
    assert re.search(r"^mifa on the same availability: [0-9.]+$", out, re.M)
    assert "refused: data.clients must be an integer ≥ 1 (got 0 in config)" in out
    assert not (tmp_path / "runs" / "never-written").exists()
    fedavg = dropfl.RunDirectory(tmp_path / "runs" / "api-example")
    mifa = dropfl.RunDirectory(tmp_path / "runs" / "api-example-mifa")
    assert fedavg.finished and mifa.finished and mifa.config().strategy.algo == "mifa"
    assert mifa.config().availability.kind == "replay"
    # the same availability: every client unavailable in one run is unavailable in the other, round by round
    absent = [{(r["round"], r["client"]) for r in run.participation() if r["status"] == "unavailable"}
              for run in (fedavg, mifa)]
    assert absent[0] == absent[1]


# --- the round loop's interfaces ---------------------------------------------------------------------------------

def test_the_built_in_parts_have_the_declared_features():
    from coordinator.availability.models import Bounded, RoundAvailability
    from coordinator.availability.participation import LoggedRound
    from coordinator.field.transport import MqttTransport
    from coordinator.sim.transport import SimTransport
    from coordinator.strategies import FDMS, MIFA, STRATEGIES, FedAvg

    sim, mqtt = object.__new__(SimTransport), object.__new__(MqttTransport)
    for proto in (protocols.Transport, protocols.StreamingTransport, protocols.StatefulTransport,
                  protocols.RoundStats, protocols.RoundInfo, protocols.Closable):
        assert isinstance(sim, proto), proto
    assert isinstance(mqtt, protocols.Transport) and isinstance(mqtt, protocols.RoundStats)
    assert not isinstance(mqtt, protocols.StatefulTransport) and not protocols.streams(mqtt)
    assert protocols.streams(sim)
    for cls in STRATEGIES.values():
        assert isinstance(object.__new__(cls), protocols.Strategy), cls
    fdms, fedavg, mifa = object.__new__(FDMS), object.__new__(FedAvg), object.__new__(MIFA)
    assert protocols.round_log_file(fdms) == "friends.jsonl" and protocols.round_log_file(fedavg) is None
    assert mifa.absorbs and isinstance(mifa, protocols.Absorbing)
    assert isinstance(fedavg, protocols.FromConfig)
    assert isinstance(Bounded(4, 0), protocols.AvailabilitySource)
    plain, logged = RoundAvailability(np.ones(2, bool)), LoggedRound(np.ones(2, bool))
    assert isinstance(logged, protocols.RecordedRound) and not isinstance(plain, protocols.RecordedRound)
    assert protocols.recorded_selection(plain) is None and protocols.recorded_selection(logged) == []


def test_every_feature_the_loop_probes_for_is_declared():
    """Each hasattr/getattr site of the round loop names an attribute of a declared protocol."""
    tree = ast.parse((ROOT / "coordinator" / "loop.py").read_text())
    probed = {node.args[1].value for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)}
    undeclared = probed - set(protocols.PROBED)
    assert not undeclared, f"coordinator/loop.py probes for {undeclared}: declare them in coordinator/protocols.py"
    for name, proto in protocols.PROBED.items():
        assert name in dir(proto) or name in getattr(proto, "__annotations__", {}), (name, proto)
