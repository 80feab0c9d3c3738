"""`dropfl trial`'s command line (issue 36 item 2).

1. Every field option of `dropfl coordinator` (coordinator/cli/coordinator.py FIELD_OPTIONS, read here at
   collection time, so an option added there is tested too) parses in `dropfl trial` and lands in the
   configuration of the trial's coordinator: the command line the trial starts it with, parsed by the real
   `dropfl coordinator` parser and `field_config`; and, with mosquitto, in a real trial's RUN/field.json.
2. Bad input is refused before anything starts or is written: one line `dropfl: error: ...`, exit 2, no
   process started (every process start of the trial and its broker is intercepted and recorded), and the
   test's directory byte for byte as it was (no trial.json, no agents/, no run directory).
3. `dropfl trial --help` shows only what a trial uses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import subprocess
from pathlib import Path

import pytest
from fieldkit import CLI, ROOT, SETTINGS, needs_mosquitto

import coordinator.cli.trial as trial_cli
import coordinator.trial.run as trial_run
from coordinator import cli
from coordinator.cli import coordinator as coord_cli
from coordinator.cli.coordinator import FIELD_LIMITS, FIELD_OPTIONS
from coordinator.trial.broker import Mosquitto
from edge_client import datasets, logs

BASE = ["trial", "--agents", "3", "--model", "logreg", "--rounds", "2", "--steps", "1", "--no-progress"]
PASSED_ON = [flag for flag in FIELD_OPTIONS if flag not in trial_cli.TRIAL_SETS]


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            code = e.code if isinstance(e.code, int) else 2
        finally:
            logs.detach_run_files()
    return code, out.getvalue(), err.getvalue()


def listing(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_dir(), p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.fixture()
def no_start(monkeypatch, tmp_path):
    """Every process start of a trial (agents, coordinator: trial/run.py's subprocess.Popen) and its broker
    (Mosquitto) recorded and refused; FMNIST read once; cwd and the temp dir in the test's directory."""
    started = []

    def popen(cmd, *a, **kw):
        started.append(cmd)
        raise AssertionError(f"a process was started: {cmd}")

    def broker(self, *a, **kw):
        started.append("mosquitto")
        raise AssertionError("the broker was started")

    monkeypatch.setattr(trial_run.subprocess, "Popen", popen)
    monkeypatch.setattr(Mosquitto, "__init__", broker)
    monkeypatch.setattr(trial_run, "mosquitto_exe", lambda: "/usr/sbin/mosquitto")  # installed or not
    monkeypatch.setattr(datasets, "load", _cached_load)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return started


_cached_load = functools.lru_cache(maxsize=2)(datasets.load)


# --- 1. every coordinator field option reaches the trial's coordinator ---

def _value(dest: str, typ: type):
    """A valid value of a field option, not its default."""
    if typ is str:
        return "trial-cli-run"
    low = FIELD_LIMITS.get(dest, {})
    v = typ(2) if typ is int else 7.25
    return max(v, typ(low.get("minimum", v)))


@pytest.mark.parametrize("flag", PASSED_ON)
def test_every_coordinator_field_option_reaches_the_trials_coordinator(flag, no_start, monkeypatch, tmp_path):
    dest, typ, _ = FIELD_OPTIONS[flag]
    value = _value(dest, typ)
    seen = {}
    monkeypatch.setattr(trial_cli, "run_trial", lambda *a, **kw: seen.update(args=a, kw=kw) or "stub")
    code, _, err = call([*BASE, "--out", "run", f"{flag}={value}"])
    assert code == 0, err
    cfg, out, profiles, deadline_s, heartbeat_s = seen["args"][:5]
    kw = seen["kw"]
    options = kw.get("coordinator", {})
    assert kw["checked"] is True and options.get(dest, value) == value

    cmd = trial_run.coordinator_command(out, "mqtt://127.0.0.1:1883", deadline_s, heartbeat_s,
                                        kw.get("broker_outage_timeout_s", 300.0), options)
    assert cmd[:4] == [*CLI[:3], "coordinator"]
    args = cli.build_parser().parse_args(cmd[3:])  # the trial's coordinator parses its command line ...
    fc = coord_cli.field_config(args, Path(out), resume=False)  # ... into its field configuration
    assert getattr(fc, dest) == value
    assert type(getattr(fc, dest)) is typ
    assert fc.broker == "mqtt://127.0.0.1:1883"  # the trial's own broker, always


def test_trial_defaults_reach_the_coordinator(no_start, monkeypatch):
    """Left out: the trial's deadline (30 s) and a heartbeat timeout of 10 heartbeats (at least 5 s)."""
    seen = {}
    monkeypatch.setattr(trial_cli, "run_trial", lambda *a, **kw: seen.update(args=a, kw=kw) or "stub")
    assert call([*BASE, "--out", "run", "--heartbeat", "0.8"])[0] == 0
    _, out, _, deadline_s, heartbeat_s = seen["args"][:5]
    assert (deadline_s, heartbeat_s, seen["kw"]["coordinator"]) == (30.0, 0.8, {})
    cmd = trial_run.coordinator_command(out, "mqtt://127.0.0.1:1", deadline_s, heartbeat_s, 300.0, {})
    fc = coord_cli.field_config(cli.build_parser().parse_args(cmd[3:]), Path(out), resume=False)
    assert (fc.deadline_s, fc.heartbeat_timeout_s, fc.broker_outage_timeout_s) == (30.0, 8.0, 300.0)
    assert fc.upload_extension_s == 60.0 and fc.round_wait_s == 0.0  # the coordinator's own defaults


def test_trial_options_keep_the_coordinators_options(tmp_path):
    """trial.json holds them for --resume; a trial.json from before (no "coordinator") still loads."""
    trial_run.TrialOptions(2, ["mains"], coordinator={"upload_extension_s": 1.5, "run_id": "x"}).save(tmp_path)
    assert trial_run.TrialOptions.load(tmp_path).coordinator == {"upload_extension_s": 1.5, "run_id": "x"}
    old = {"agents": 2, "profiles": ["mains"], "deadline_s": 20.0, "heartbeat_s": 0.5, "max_slowdown": 0.0,
           "links": None, "broker_dir": None, "broker_outage_timeout_s": 300.0}
    (tmp_path / "trial.json").write_text(json.dumps(old))
    assert trial_run.TrialOptions.load(tmp_path).coordinator == {}
    (tmp_path / "trial.json").write_text(json.dumps(old | {"coordinator": {"no_such_option": 1}}))
    with pytest.raises(Exception, match="trial.json is damaged"):
        trial_run.TrialOptions.load(tmp_path)


def test_a_value_starting_with_a_dash_reaches_the_coordinator(tmp_path):
    cmd = trial_run.coordinator_command(tmp_path, "mqtt://127.0.0.1:1", 30.0, 0.5, 300.0, {"run_id": "-odd"})
    fc = coord_cli.field_config(cli.build_parser().parse_args(cmd[3:]), tmp_path, resume=False)
    assert fc.run_id == "-odd"


# --- 2. bad input: one line, exit 2, nothing started, nothing written ---

def _write(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return name


BAD = {  # id: (extra argv, files to make first {name: text}, what the one line says)
    "availability-bounded": (["--availability", "bounded"], {}, "--availability bounded: a field trial's availability"),
    "availability-replay": (["--availability", "replay", "--trace", "t.csv"], {"t.csv": "round,client\n"},
                            "--availability replay"),
    "availability-option": (["--min-active", "2"], {}, "--min-active 2: a field trial's availability"),
    "availability-old-name": (["--period", "3"], {}, "--period 3: a field trial's availability"),
    "availability-in-config": (["--config", "c.toml"], {"c.toml": '[availability]\nkind = "bounded"\n'},
                               "--availability bounded"),
    "clock-profile": (["--clock-profile", "p.json"], {"p.json": "{}"}, "--clock-profile: not used by a trial"),
    "clock-in-config": (["--config", "c.toml"], {"c.toml": '[clock]\nprofile = "p.json"\n'},
                        "[clock] profile in c.toml"),
    "engine": (["--engine", "loop"], {}, "--engine: not used by a trial"),
    "sim-device": (["--sim-device", "cpu"], {}, "--sim-device: not used by a trial"),
    "broker": (["--broker", "mqtt://127.0.0.1:1"], {}, "--broker: a trial runs its own broker"),
    "broker-config": (["--broker-config", "c.json"], {"c.json": "{}"}, "--broker-config: a trial's coordinator"),
    "clients": (["--clients", "5"], {}, "--clients 5: a trial has one client per agent"),
    "agents-0": (["--agents", "0"], {}, "--agents must be >= 1"),
    "agents-x": (["--agents", "x"], {}, "argument --agents: invalid int value"),
    "unknown-flag": (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    "heartbeat": (["--heartbeat", "0"], {}, "trial.heartbeat must be a finite number > 0"),
    "max-slowdown": (["--max-slowdown", "-1"], {}, "trial.max_slowdown must be a finite number ≥ 0"),
    "deadline": (["--deadline", "nan"], {}, "field.deadline_s must be a finite number > 0 (got nan from --deadline)"),
    "upload-extension": (["--upload-extension", "-1"], {}, "field.upload_extension_s must be a finite number ≥ 0"),
    "round-wait": (["--round-wait", "inf"], {}, "field.round_wait_s must be a finite number"),
    "chunk-bytes": (["--chunk-bytes", "0"], {}, "field.chunk_bytes must be an integer ≥ 1"),
    "heartbeat-timeout": (["--heartbeat-timeout", "0.5"], {}, "--heartbeat-timeout 0.5 (the coordinator's) is not "
                                                              "longer than the agents' heartbeat period"),
    "wait-agents": (["--wait-agents", "4"], {}, "--wait-agents 4: the trial has 3 agents"),
    "run-id": (["--run-id", "r" * 70000], {}, "--run-id: header of"),
    "profiles": (["--profiles", "steady,nope"], {}, "--profiles 'steady,nope': unknown profile(s) ['nope']"),
    "config-missing": (["--config", "nope.toml"], {}, "nope.toml"),
    "config-garbage": (["--config", "c.toml"], {"c.toml": "= = ="}, "c.toml"),
    "config-bad-value": (["--config", "c.toml"], {"c.toml": "[train]\nlr = -1\n"}, "train.lr must be"),
    "links-missing": (["--links", "nope.json"], {}, "--links nope.json: no such file"),
    "links-garbage": (["--links", "l.json"], {"l.json": "not json"}, "--links: l.json is not a link profile"),
    "broker-dir-missing": (["--broker-dir", "nodir"], {}, "--broker-dir nodir: no such directory"),
    "broker-dir-not-one": (["--broker-dir", "."], {}, "is not a broker directory (no broker.json)"),
    "broker-dir-and-links": (["--broker-dir", ".", "--links", "l.json"], {"l.json": "{}"},
                             "--broker-dir cannot be combined with --links"),
    "out-a-file": (["--out", "f.txt"], {"f.txt": "x"}, "--out f.txt: cannot write a run directory there"),
    "out-below-a-file": (["--out", "f.txt/run"], {"f.txt": "x"}, "cannot write a run directory there"),
    "dataset": (["--dataset", "cifar10"], {}, "cifar10 is not available offline"),
    "model-too-deep": (["--model", "vgg11", "--dataset", "mnist"], {},
                       "--model vgg11: it does not take mnist's inputs of shape (1, 28, 28)"),
    "algo": (["--algo", "nope"], {}, "strategy.algo must be one of"),
    "track": (["--track", "nope"], {}, "run.track must be a comma-separated list"),
    "seed": (["--seed", "-1"], {}, "run.seed must be"),
}


def _refused(argv: list[str], tmp_path: Path, started: list, says: str) -> None:
    before = listing(tmp_path)
    code, out, err = call(argv)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("dropfl: error: "), err  # exactly one line
    assert says in lines[0], lines[0]
    assert started == []                    # no broker, no agent, no coordinator
    assert listing(tmp_path) == before      # nothing written: no run directory, no trial.json, no agents/


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_before_anything_starts_or_is_written(case, no_start, tmp_path):
    extra, files, says = BAD[case]
    for name, text in files.items():
        _write(tmp_path, name, text)
    _refused([*BASE, "--out", "run", *extra], tmp_path, no_start, says)


def test_no_agents_given(no_start, tmp_path):
    _refused(["trial", "--model", "logreg"], tmp_path, no_start, "--agents is required")


def _a_run(tmp_path: Path) -> Path:
    """A directory that holds a run (a finished round in metrics.jsonl), and a trial's files."""
    run = tmp_path / "run"
    (run / "agents" / "client-0").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"round": 0}\n')
    (run / "agents" / "client-0" / "agent.json").write_text("{}")
    (run / "trial.json").write_text("{}")
    return run


def test_an_existing_run_is_refused_without_overwrite_or_resume(no_start, tmp_path):
    _a_run(tmp_path)
    _refused([*BASE, "--out", "run"], tmp_path, no_start, "--out run already holds a run; add --resume to continue "
                                                          "it or --overwrite to replace it")


@pytest.mark.parametrize("bad", [["--deadline", "-1"], ["--availability", "bounded"], ["--model", "nope"]])
def test_overwrite_touches_nothing_on_bad_input(bad, no_start, tmp_path):
    _a_run(tmp_path)
    _refused([*BASE, "--out", "run", "--overwrite", *bad], tmp_path, no_start, "dropfl: error: ")


RESUME_BAD = {  # id: (argv after --resume run, what trial.json holds or None (the run's own), what the line says)
    "flags-given": (["--rounds", "3", "--upload-extension", "1"], None, "leave out --upload-extension, --rounds"),
    "overwrite": (["--overwrite"], None, "leave out --overwrite"),
    "no-trial-json": ([], "missing", "not a `dropfl trial` run directory"),
    "damaged": ([], "[1, 2]", "trial.json is damaged"),
    "bad-saved-option": ([], {"coordinator": {"upload_extension_s": -1}},
                         "field.upload_extension_s must be a finite number ≥ 0 (got -1 in run/trial.json)"),
    "bad-outage-flag": (["--broker-outage-timeout", "0"], None, "field.broker_outage_timeout_s must be"),
    "no-checkpoint": ([], None, "--resume: run/checkpoint.pt does not exist"),
}


@pytest.mark.parametrize("case", sorted(RESUME_BAD))
def test_resume_bad_input(case, no_start, tmp_path):
    argv, saved, says = RESUME_BAD[case]
    run = tmp_path / "run"
    run.mkdir()
    opts = {"agents": 3, "profiles": ["mains"]}
    if saved == "missing":
        pass
    elif isinstance(saved, str):
        (run / "trial.json").write_text(saved)
    else:
        (run / "trial.json").write_text(json.dumps(opts | (saved or {})))
    (run / "trial-config.json").write_text(json.dumps({"data": {"clients": 3}, "model": {"model": "logreg"}}))
    if case != "no-checkpoint":
        (run / "checkpoint.pt").write_bytes(b"")  # something to resume (read only once the options are checked)
    _refused(["trial", "--resume", "run", *argv], tmp_path, no_start, says)


def test_the_issues_case_in_a_real_process(tmp_path):
    """`dropfl trial --availability bounded` as a user runs it: one line, exit 2, and no broker (the trial logs
    `broker URL` once its broker runs), no run directory."""
    run = subprocess.run(CLI + [*BASE, "--availability", "bounded", "--out", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [run.stderr.strip()] and run.stderr.startswith("dropfl: error: --availability")
    assert "broker" not in run.stderr.split("not from a model")[0]
    assert list(tmp_path.iterdir()) == []


# --- 3. --help: only what a trial uses ---

def _help() -> str:
    code, out, _ = call(["trial", "--help"])
    assert code == 0
    return out


def test_help_lists_what_a_trial_uses_and_nothing_else():
    text = _help()
    for flag in PASSED_ON:
        assert f"  {flag} " in text, flag
    for flag in ["--broker ", "--broker-config", "--availability", "--min-active", "--tau-max", "--trace ",
                 "--engine", "--slices", "--sim-device", "--ray-address", "--clock-profile", "--clients", "--period"]:
        assert flag not in text, flag
    for flag in ["--agents", "--profiles", "--heartbeat ", "--max-slowdown", "--broker-dir", "--links", "--resume",
                 "--overwrite", "--dataset", "--model", "--algo", "--rounds", "--out", "--dashboard"]:
        assert flag in text, flag
    # defaults as a trial has them, not as `dropfl coordinator` or `dropfl sim` say
    assert "per-round deadline in seconds (default: 30)" in " ".join(text.split())
    assert "(default: --agents)" in text and "runs/trial-<algo>-<dataset>-a<agents>-s<seed>" in text
    for group in ["trial:", "broker and links:", "coordinator:", "data:", "model:", "train:", "strategy:", "run:"]:
        assert f"\n{group}\n" in text, group
    assert "\navailability:\n" not in text and "\nclock:\n" not in text


def test_the_trial_help_of_every_passed_on_option_is_the_coordinators_or_the_trials_own():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    trial, coord = sub["trial"]._option_string_actions, sub["coordinator"]._option_string_actions
    for flag in PASSED_ON:
        want = trial_cli.TRIAL_DEFAULTS[flag][1] if flag in trial_cli.TRIAL_DEFAULTS else coord[flag].help
        assert trial[flag].help == want and trial[flag].dest == coord[flag].dest, flag


# --- 4. a real trial: the options in the coordinator's field.json, and kept for --resume ---

@needs_mosquitto
def test_a_trial_hands_its_coordinator_options_to_the_coordinator(tmp_path, monkeypatch):
    out = tmp_path / "run"
    given = {"--upload-extension": 1.5, "--heartbeat-timeout": 6.0, "--round-wait": 0.5, "--wait-timeout": 90.0,
             "--chunk-bytes": 100000, "--broker-outage-timeout": 120.0, "--deadline": 25.0, "--run-id": "cli-test"}
    cmd = CLI + ["trial", "--agents", "2", "--rounds", "2", "--algo", "fedavg", "--model", SETTINGS["model"],
                 "--seed", str(SETTINGS["seed"]), "--steps", "1", "--threads", "1", "--profiles", "mains",
                 "--out", str(out), "--no-progress", *[f"{k}={v}" for k, v in given.items()]]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:] + (out / "coordinator.log").read_text()[-3000:]
    field = json.loads((out / "field.json").read_text())
    for flag, v in given.items():
        assert field[FIELD_OPTIONS[flag][0]] == v, flag
    saved = json.loads((out / "trial.json").read_text())
    assert (saved["deadline_s"], saved["broker_outage_timeout_s"]) == (25.0, 120.0)
    assert saved["coordinator"] == {FIELD_OPTIONS[k][0]: v for k, v in given.items()
                                    if k not in ("--deadline", "--broker-outage-timeout")}

    seen = {}  # --resume passes the same options on (the run itself replaced: it is finished)
    monkeypatch.setattr(trial_cli, "run_trial", lambda *a, **kw: seen.update(args=a, kw=kw) or "stub")
    monkeypatch.chdir(tmp_path)
    code, _, err = call(["trial", "--resume", str(out), "--broker-outage-timeout", "60"])
    assert code == 0, err
    assert seen["kw"]["coordinator"] == saved["coordinator"] and seen["kw"]["broker_outage_timeout_s"] == 60.0
    assert seen["args"][3] == 25.0 and seen["kw"]["resume"] is True


def test_the_checks_above_would_see_a_start(no_start):
    """Valid input with nothing replaced: the trial gets as far as its broker, which `no_start` records."""
    code, _, err = call([*BASE, "--out", "run"])
    assert code == 1 and no_start == ["mosquitto"], err
