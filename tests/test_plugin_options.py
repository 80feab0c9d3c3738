"""A plugin's own options (an `Options` dataclass: edge_client/options.py, coordinator/config.py `check_options`):
set from the command line (--strategy-option / --availability-option KEY=VALUE) and from config files
([strategy.options]), converted by their types, checked before anything is written, recorded in config.json, so a
plugin run reruns, resumes and replays from the CLI as a built-in one; listed by `dropfl plugins`. And the warning
for a built-in option that does nothing for the chosen strategy or availability model (`inert_settings`), from the
one table of `opt(..., applies=)`, which is checked here against what each built-in really reads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from plugin_fixtures import BROKEN, MOD, SYNTAX, write_plugins

from coordinator import cli, config
from coordinator.availability import models as av
from coordinator.strategies import STRATEGIES

ALGO, MARKOV, FACTORY = f"{MOD}:FedAvgM", f"{MOD}:Markov", f"{MOD}:markov_factory"


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    src = write_plugins(tmp_path / "src")
    monkeypatch.syspath_prepend(str(src))
    for m in (MOD, BROKEN, SYNTAX):
        monkeypatch.delitem(sys.modules, m, raising=False)
    yield src
    for m in (MOD, BROKEN, SYNTAX):
        sys.modules.pop(m, None)


def _sim(out: Path, *extra: str) -> int:
    return cli.main(["sim", "--out", str(out), "--clients", "4", "--rounds", "3", "--steps", "2", "--batch-size", "8",
                     "--model", "logreg", "--engine", "loop", "--threads", "1", "--no-progress", *extra])


def _model(run: Path) -> dict:
    return torch.load(run / "model.pt", weights_only=True)


def _same(a: Path, b: Path) -> bool:
    x, y = _model(a), _model(b)
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


def _built():
    return sys.modules[MOD].BUILT


# --- options reach the plugin and the run directory ----------------------------------------------------------------

def test_options_from_flags_reach_the_plugins_and_config_json(plugins, tmp_path):
    out = tmp_path / "run"
    assert _sim(out, "--algo", ALGO, "--strategy-option", "momentum=0.25", "--strategy-option", "nesterov=yes",
                "--strategy-option", "clip=none", "--strategy-option", "schedule=halving",
                "--availability", MARKOV, "--availability-option", "p_off=0.5") == 0
    saved = json.loads((out / "config.json").read_text())
    # every option the plugin ran with, converted by its type, the defaults filled in
    assert saved["strategy"]["options"] == {"momentum": 0.25, "nesterov": True, "schedule": "halving", "clip": None,
                                            "label": "m"}
    assert saved["availability"]["options"] == {"p_off": 0.5, "p_on": 0.5}
    built = dict(_built())
    assert built["FedAvgM"].momentum == 0.25 and built["FedAvgM"].nesterov is True
    assert type(built["FedAvgM"]).__name__ == "Options" and built["Markov"].p_off == 0.5
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["available"] < 4 for r in rows[1:])   # the Markov model, with p_off 0.5, took clients away


def test_an_option_changes_the_run_and_momentum_zero_is_fedavg_bit_for_bit(plugins, tmp_path):
    assert _sim(tmp_path / "fedavg", "--algo", "fedavg") == 0
    assert _sim(tmp_path / "m0", "--algo", ALGO, "--strategy-option", "momentum=0") == 0
    assert _sim(tmp_path / "m5", "--algo", ALGO, "--strategy-option", "momentum=0.5") == 0
    assert _same(tmp_path / "fedavg", tmp_path / "m0")          # v = 0·v + mean Δ: FedAvg's step exactly
    assert not _same(tmp_path / "m0", tmp_path / "m5")


def test_options_from_a_config_file_and_flags_over_them(plugins, tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(f'[strategy]\nalgo = "{ALGO}"\n[strategy.options]\nmomentum = 0.5\nlabel = "file"\n'
                 f'[availability]\nkind = "{FACTORY}"\n[availability.options]\np_on = 1\n')
    args = cli.build_parser().parse_args(["sim", "--config", str(f), "--strategy-option", "label=flag"])
    cfg = config.resolve(args, list(STRATEGIES))
    assert cfg.strategy.options == {"momentum": 0.5, "nesterov": False, "schedule": "constant", "clip": None,
                                    "label": "flag"}
    assert cfg.availability.options == {"p_off": 0.3, "p_on": 1.0}       # an int is fine for a float
    assert type(cfg.availability.options["p_on"]) is float


def test_a_run_with_plugin_options_reruns_resumes_replays_and_reports_from_the_cli(plugins, tmp_path):
    run = tmp_path / "run"
    opts = ["--algo", ALGO, "--strategy-option", "momentum=0.5", "--availability", MARKOV,
            "--availability-option", "p_off=0.4"]
    assert _sim(run, *opts) == 0
    saved = run / "config.json"
    # rerun: the run's config.json as it is
    assert cli.main(["sim", "--config", str(saved), "--out", str(tmp_path / "again"), "--no-progress"]) == 0
    assert _same(run, tmp_path / "again")
    # resume: two rounds, then on to three with the run's own config
    short = tmp_path / "short"
    assert _sim(short, *opts, "--rounds", "2") == 0
    assert cli.main(["sim", "--config", str(short / "config.json"), "--out", str(short), "--rounds", "3",
                     "--resume", "--no-progress"]) == 0
    assert _same(run, short)
    # resuming with other options is refused, naming them
    assert cli.main(["sim", "--config", str(short / "config.json"), "--out", str(short), "--rounds", "4",
                     "--strategy-option", "momentum=0.6", "--resume", "--no-progress"]) == 2
    # replay: the recorded participation, the run's strategy options; the Markov model's options are not replay's
    replayed = tmp_path / "replayed"
    assert cli.main(["sim", "--config", str(saved), "--availability", "replay", "--trace",
                     str(run / "participation.csv"), "--out", str(replayed), "--no-progress"]) == 0
    assert _same(run, replayed)
    again = json.loads((replayed / "config.json").read_text())
    assert again["strategy"]["options"]["momentum"] == 0.5 and again["availability"]["options"] == {}
    # another strategy on the same participation: the plugin's options stay with the plugin
    mifa = tmp_path / "mifa"
    assert cli.main(["sim", "--config", str(saved), "--algo", "mifa", "--availability", "replay", "--trace",
                     str(run / "participation.csv"), "--out", str(mifa), "--no-progress"]) == 0
    assert json.loads((mifa / "config.json").read_text())["strategy"]["options"] == {}
    assert cli.main(["report", str(run), str(mifa), "--out", str(tmp_path / "report"), "--no-progress"]) == 0
    assert any((tmp_path / "report").iterdir())


def test_the_api_takes_options_and_replay_leaves_the_recorded_models_options_out(plugins, tmp_path):
    import dropfl

    cfg = dropfl.load_config({"strategy": {"algo": ALGO, "options": {"momentum": 0.5}},
                              "availability": {"kind": MARKOV, "options": {"p_on": 0.25}}})
    assert cfg.strategy.options["momentum"] == 0.5 and cfg.availability.options == {"p_off": 0.3, "p_on": 0.25}
    with pytest.raises(dropfl.UserError, match=r"strategy\.options\.momentum: .*FedAvgM's option momentum takes a "
                                               r"float \(a finite number\) \(got \"0\.5\"\)"):
        dropfl.load_config({"strategy": {"algo": ALGO, "options": {"momentum": "0.5"}}})


def test_the_trial_takes_strategy_options_and_refuses_availability_options(plugins, tmp_path, monkeypatch, capsys):
    from coordinator.cli import trial

    got = {}

    def run_trial(cfg, out, *args, **kw):   # the trial's own checks ran; stop before any broker starts
        got["cfg"] = cfg
        return "stub"

    monkeypatch.setattr(trial, "run_trial", run_trial)
    monkeypatch.setattr(trial, "check_trial", lambda *a, **k: None)
    out = tmp_path / "trial"
    assert cli.main(["trial", "--agents", "2", "--algo", ALGO, "--strategy-option", "momentum=0.1", "--model",
                     "logreg", "--out", str(out)]) == 0
    assert got["cfg"].strategy.options["momentum"] == 0.1
    capsys.readouterr()
    assert cli.main(["trial", "--agents", "2", "--availability-option", "p_on=1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--availability-option p_on=1: a field trial's availability comes from its" in err[0], err


def test_the_field_coordinator_writes_the_options_into_its_config_json(plugins, tmp_path):
    from coordinator import runsetup
    from edge_client import logs

    cfg = config.SimConfig()
    cfg.data.clients, cfg.model.model, cfg.strategy.algo = 3, "logreg", ALGO
    cfg.strategy.options = {"momentum": 0.3}
    config.validate(cfg)
    try:
        run = runsetup.setup_run(cfg, str(tmp_path / "field"), mode="field")
    finally:
        logs.detach_run_files()
    assert run.strategy.options.momentum == 0.3
    assert json.loads((tmp_path / "field" / "config.json").read_text())["strategy"]["options"]["momentum"] == 0.3


# --- dropfl plugins -------------------------------------------------------------------------------------------------

def test_dropfl_plugins_shows_a_plugins_options_with_their_defaults(plugins, capsys):
    assert cli.main(["plugins", "strategy", ALGO]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"strategy {ALGO}: module {MOD}")
    assert out[1:] == ["  --strategy-option momentum=FLOAT  (default 0.9): server momentum beta in [0, 1)",
                       "  --strategy-option nesterov=BOOL  (default false)",
                       "  --strategy-option schedule=constant|halving  (default constant)",
                       "  --strategy-option clip=FLOAT|none  (default none)",
                       "  --strategy-option label=STR  (default m)"]
    assert cli.main(["plugins", "availability", MARKOV]) == 0
    assert "  --availability-option p_off=FLOAT  (default 0.3): P(on -> off) per round" in capsys.readouterr().out
    assert cli.main(["plugins", "strategy", "fedavg"]) == 0
    assert "no options of its own" in capsys.readouterr().out


def test_dropfl_plugins_lists_an_installed_plugins_options(plugins, capsys):
    info = plugins / "dropfl_opt_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dropfl-opt-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[dropfl.strategies]\nfedavgm = {ALGO}\n")
    assert cli.main(["plugins", "strategy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:1] == ["fedavgm"])
    assert lines[i + 1].strip().startswith("--strategy-option momentum=FLOAT  (default 0.9)")


# --- errors: one line naming the plugin and what to fix, nothing written -------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--algo", ALGO, "--strategy-option", "momentum=x"],
     f"--strategy-option momentum=x: {ALGO}'s option momentum takes a float (a finite number) (got \"x\")"),
    (["--algo", ALGO, "--strategy-option", "momentum=nan"], "momentum takes a float"),
    (["--algo", ALGO, "--strategy-option", "nesterov=2"], "nesterov takes true or false"),
    (["--algo", ALGO, "--strategy-option", "schedule=cos"], "schedule takes one of: constant, halving (got \"cos\")"),
    (["--algo", ALGO, "--strategy-option", "momentum=none"], "momentum takes a float"),
    (["--algo", ALGO, "--strategy-option", "momentun=0.5"],
     f"--strategy-option momentun=0.5: {ALGO} has no option \"momentun\" (did you mean momentum?); its options: "
     f"momentum (float, default 0.9), nesterov (bool, default false), schedule (constant|halving, default "
     f"constant), clip (float|none, default none), label (str, default m)"),
    (["--algo", ALGO, "--strategy-option", "momentum=1.5"],
     f"--strategy-option momentum=1.5: {ALGO}'s options are not valid: momentum must be in [0, 1) (got 1.5)"),
    (["--algo", ALGO, "--strategy-option", "momentum"], "--strategy-option \"momentum\": give KEY=VALUE"),
    (["--algo", "fedavg", "--strategy-option", "momentum=0.5"],
     "--strategy-option momentum=0.5: the strategy fedavg takes no options"),
    (["--algo", f"{MOD}:Plain", "--strategy-option", "momentum=0.5"],
     f"declare an Options dataclass on {MOD}:Plain"),
    (["--algo", f"{MOD}:NotADataclass"], f"{MOD}:NotADataclass\" from --algo (module {MOD} "),
    (["--algo", f"{MOD}:NotADataclass"], "its Options is the class Options, not a @dataclass class"),
    (["--algo", f"{MOD}:ListOption"], "its option layers has the type list[int], which an option cannot take"),
    (["--algo", f"{MOD}:Required"], f"strategy.options: {MOD}:Required's option momentum is required"),
    (["--algo", f"{MOD}:NoOptionsParameter"],
     "it is built as NoOptionsParameter(options=NoOptionsParameter.Options(...)), but its signature "
     "NoOptionsParameter(*, weighting='uniform') does not take that"),
    (["--algo", f"{MOD}:NoWeighting"], "add a keyword parameter weighting, a classmethod from_config"),
    (["--availability", f"{MOD}:MarkovNoOptionsParameter"], "add a keyword parameter options to its __init__"),
    (["--availability", MARKOV, "--availability-option", "p_on=0"], f"{MARKOV}'s options are not valid: p_off "
                                                                    f"and p_on must be in (0, 1]"),
    (["--availability", "static", "--availability-option", "p=0.5"], "the availability static takes no options"),
    (["--algo", f"{BROKEN}:FedAvgM", "--strategy-option", "momentum=0.5"],
     f"module {BROKEN} does not import (ModuleNotFoundError"),
    (["--algo", f"{SYNTAX}:FedAvgM"], f"module {SYNTAX} does not import (SyntaxError"),
])
def test_a_bad_plugin_or_option_is_one_line_before_anything_is_written(plugins, tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    capsys.readouterr()
    assert _sim(out, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dropfl: error: ") and needle in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("toml,needle", [
    ('[strategy]\nalgo = "ALGO"\n[strategy.options]\nmomentum = "0.5"\n',
     'strategy.options.momentum in FILE: ALGO\'s option momentum takes a float (a finite number) (got "0.5")'),
    ('[strategy]\nalgo = "ALGO"\n[strategy.options]\nnesterov = 1\n', "nesterov takes true or false (got 1)"),
    ('[strategy]\nalgo = "ALGO"\noptions = 3\n', "strategy.options must be a table of option = value"),
    ('[strategy]\nalgo = "ALGO"\n[strategy.options]\nbogus = 1\n', 'strategy.options.bogus in FILE: ALGO has no '
                                                                    'option "bogus"'),
])
def test_options_in_a_config_file_are_checked_like_flags(plugins, tmp_path, capsys, toml, needle):
    f = tmp_path / "run.toml"
    f.write_text(toml.replace("ALGO", ALGO))
    capsys.readouterr()
    assert cli.main(["sim", "--config", str(f), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle.replace("FILE", str(f)).replace("ALGO", ALGO) in err[0], err
    assert not (tmp_path / "run").exists()


# --- options that do nothing: one warning each -----------------------------------------------------------------------

def _resolve(argv: list[str], caplog) -> tuple[config.SimConfig, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dropfl.config"):
        cfg = config.resolve(cli.build_parser().parse_args(["sim", *argv]), list(STRATEGIES))
    return cfg, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_option_that_does_nothing_is_one_warning(plugins, tmp_path, caplog):
    _, said = _resolve(["--availability", "static", "--tau-max", "5", "--algo", "mimic", "--mu", "0.1",
                        "--feddd-d-max", "0.5"], caplog)
    assert said == [
        'strategy.mu 0.1 from --mu does nothing for strategy.algo "mimic" (it applies to fedprox): leave it out',
        'strategy.feddd_d_max 0.5 from --feddd-d-max does nothing for strategy.algo "mimic" (it applies to feddd): '
        'leave it out',
        'availability.tau_max 5 from --tau-max does nothing for availability.kind "static" (it applies to bounded): '
        'leave it out']
    for quiet in (["--algo", "fedprox", "--mu", "0.1"],              # it applies
                  ["--algo", "mimic", "--mu", "0.001"],              # its default
                  ["--availability", "bounded", "--tau-max", "5"],
                  ["--algo", f"{MOD}:Plain", "--weighting", "samples"]):   # a plugin without Options gets weighting
        assert _resolve(quiet, caplog)[1] == [], quiet
    # a plugin with Options gets only its options; an Availability subclass min_active and first_round_all
    assert _resolve(["--algo", ALGO, "--server-lr", "0.5"], caplog)[1] == [
        f'strategy.server_lr 0.5 from --server-lr does nothing for strategy.algo "{ALGO}" (it applies to fedavg, '
        f'full, fedprox, scaffold, fdms, mimic, mimic-client, fedcs; {ALGO}\'s own settings are its options: '
        f'`dropfl plugins strategy {ALGO}`): leave it out']
    assert _resolve(["--availability", MARKOV, "--min-active", "2"], caplog)[1] == []
    assert len(_resolve(["--availability", MARKOV, "--p", "0.5"], caplog)[1]) == 1
    assert _resolve(["--availability", FACTORY, "--p", "0.5"], caplog)[1] == []   # a callable may read any


def test_a_config_files_options_are_quiet_where_a_flag_chose_another_model(plugins, tmp_path, caplog):
    f = tmp_path / "run.toml"
    f.write_text('[availability]\nkind = "bounded"\ntau_max = 5\n[strategy]\nalgo = "fedprox"\nmu = 0.1\n')
    assert _resolve(["--config", str(f)], caplog)[1] == []
    # a run's config with another strategy or availability given as a flag: the file's options are the run's
    assert _resolve(["--config", str(f), "--availability", "static", "--algo", "mifa"], caplog)[1] == []
    # the file's own contradiction is said
    f.write_text('[availability]\nkind = "static"\ntau_max = 5\n')
    assert _resolve(["--config", str(f)], caplog)[1] == [
        f'availability.tau_max 5 in {f} does nothing for availability.kind "static" (it applies to bounded): leave '
        f'it out']


class _Reads:
    """A config section that records which fields are read."""

    def __init__(self, section):
        object.__setattr__(self, "_section", section)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._section, name)


def _applies(section: str, name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(config.SECTIONS[section]()) if name in (f.metadata.get("applies") or ())}


def test_the_table_says_what_each_builtin_strategy_reads():
    declared = {f.name for f in dataclasses.fields(config.StrategyConfig) if f.metadata.get("applies")}
    for name in STRATEGIES.registered():
        s = _Reads(config.StrategyConfig())
        STRATEGIES[name].from_config(s)
        assert s.read & declared == _applies("strategy", name), name


def test_the_table_says_what_each_builtin_availability_model_reads():
    declared = {f.name for f in dataclasses.fields(config.AvailabilityConfig) if f.metadata.get("applies")}
    for name in av.AVAILABILITY.registered():
        cfg = config.SimConfig()
        a = _Reads(cfg.availability)
        cfg.availability = a
        try:
            av.build(av.AVAILABILITY[name], cfg)
        except Exception:   # replay and device-trace: no trace to read; what they read came first
            pass
        read = a.read & declared
        if name == "always":   # built with them, as every Availability, but everyone is available anyway
            read -= {"min_active", "first_round_all"}
        assert read == _applies("availability", name), name


def test_help_names_the_algorithms_an_option_applies_to(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--mu MU fedprox: proximal coefficient μ" in text
    assert "--tau-max TAU_MAX bounded: maximum period" in text
    assert "--strategy-option KEY=VALUE an option of a plugin strategy that declares an Options dataclass" in text


def test_the_option_table_names_only_builtins():
    strategies, models = set(STRATEGIES.registered()), set(av.AVAILABILITY.registered())
    for section, names in (("strategy", strategies), ("availability", models)):
        for f in dataclasses.fields(config.SECTIONS[section]()):
            assert set(f.metadata.get("applies") or ()) <= names, f.name


def test_resolve_without_a_config_file_reads_no_options(caplog):
    cfg, said = _resolve([], caplog)
    assert cfg.strategy.options == {} and cfg.availability.options == {} and said == []
    assert config.resolve(argparse.Namespace(), list(STRATEGIES)).strategy.options == {}
