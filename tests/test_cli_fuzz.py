"""Fuzz test of the `dropfl` command line (hypothesis, in-process through `coordinator.cli.main`).

Random argument lists for every subcommand (the subcommand's real option names, from the argparse parser,
with random values), random config files (TOML/JSON) for `dropfl sim` and `dropfl client`, and random
traces. For every case:

  (a) no traceback, and the exit code is 0, 1 or 2;
  (b) on a non-zero exit the last line of stderr is one line `dropfl: error: ...` (ours or argparse's),
      and never `internal error` (an unexpected exception: a bug);
  (c) nothing is written outside the case's own directory (the process runs with cwd, HOME, XDG_* and
      TMPDIR in the test's tmp dir; the rest of the tmp tree is compared before and after);
  (d) an existing run directory is byte-for-byte unchanged unless --resume/--overwrite and valid input;
  (e) on a non-zero exit nothing in the case's own directory was created or changed either: bad input is
      refused before the first write (no partial output file, no temporary left beside the inputs).

Cheap on purpose: flags that would make a run expensive (rounds, clients, model, steps, engine, threads)
get only cheap or invalid values, `trial`/`coordinator`/`client` never reach a broker (their run
functions are replaced by stubs after the CLI's own validation), `links` is only parsed, and
`reproduce` always runs with --report-only. Reproducible: derandomize=True.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coordinator import cli
from coordinator.config import SECTIONS
from edge_client import datasets, logs

# random cases per test beyond the @example ones: 60 (`make test`, CI); `make test-fast` (the edit loop) sets
# DROPFL_FUZZ_EXAMPLES=20: the same properties and every @example, fewer random cases
FUZZ = settings(max_examples=int(os.environ.get("DROPFL_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True,
                database=None, suppress_health_check=list(HealthCheck))

# --- the session: a real tiny run, a sandbox, stubs for everything that would reach a broker ---

TINY_RUN = ["sim", "--dataset", "fmnist", "--clients", "4", "--model", "logreg", "--steps", "1", "--rounds", "2",
            "--no-progress"]


def _hash_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _listing(root: Path, skip: Path | None = None) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if skip is not None and (d == skip or skip in d.parents):
            dirnames[:] = []
            continue
        for n in dirnames + filenames:
            p = d / n
            if skip is not None and p == skip:
                continue
            st_ = p.lstat()
            out[str(p.relative_to(root))] = (st_.st_size, st_.st_mtime_ns, p.is_dir())
    return out


class Sandbox:
    def __init__(self, base: Path):
        self.base = base
        self.run = base / "RUN"
        self.n = 0
        self.run_hash: dict[str, str] = {}

    def case_dir(self) -> Path:
        self.n += 1
        d = self.base / "cases" / f"c{self.n}"
        d.mkdir(parents=True)
        (d / "afile.txt").write_text("not a directory\n")
        (d / "adir").mkdir()
        return d


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    base = tmp_path_factory.mktemp("clifuzz")
    env = {"HOME": base / "home", "XDG_CACHE_HOME": base / "home" / ".cache",
           "XDG_CONFIG_HOME": base / "home" / ".config", "XDG_DATA_HOME": base / "home" / ".local",
           "TMPDIR": base / "tmp"}
    for p in env.values():
        p.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, str(v))
    mp.setattr(tempfile, "tempdir", str(env["TMPDIR"]))
    repo = Path(__file__).resolve().parents[1]
    outside_before = {p: sorted(os.listdir(p)) for p in (repo, repo / "runs") if p.is_dir()}
    b = Sandbox(base)
    old_cwd = os.getcwd()
    os.chdir(base)
    try:
        code, _, err = _call(["sim", *TINY_RUN[1:], "--out", str(b.run)])
        assert code == 0, err
        b.run_hash = _hash_tree(b.run)
        yield b
    finally:
        os.chdir(old_cwd)
        logs.detach_run_files()
        mp.undo()
    for p, names in outside_before.items():
        assert sorted(os.listdir(p)) == names, f"the fuzz wrote into {p}"


def _call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            code = e.code if isinstance(e.code, int) else 2
        finally:
            logs.detach_run_files()
            torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


def check(box: Sandbox, argv: list[str], case: Path, *, run_may_change: bool = False) -> tuple[int, str]:
    """Run `argv` with cwd = case and assert properties (a)-(e); returns (exit code, stderr)."""
    before = _listing(box.base, skip=case)
    inputs = _listing(case)
    old = os.getcwd()
    os.chdir(case)
    mp = pytest.MonkeyPatch()
    mp.setattr(tempfile, "tempdir", str(case))
    try:
        code, _, err = _call(argv)
    finally:
        os.chdir(old)
        mp.undo()
    show = f"argv={argv!r}\nstderr={err[-2000:]}"
    assert "Traceback" not in err, show                                          # (a)
    assert code in (0, 1, 2), f"exit {code}: {show}"                             # (a)
    if code != 0:
        lines = [x for x in err.split("\n") if x.strip()]  # "\n" only: \x85 or \u2028 in a value is no new line
        assert lines and lines[-1].startswith("dropfl: error: "), show           # (b)
        assert "internal error" not in lines[-1], show                           # (b): a bug
        left = _listing(case)   # (e) refused: nothing written, not even next to the inputs
        touched = sorted(k for k in set(inputs) | set(left) if inputs.get(k) != left.get(k))
        assert not touched, f"refused, yet wrote {touched[:5]}; {show}"
    after = _listing(box.base, skip=case)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    # (d) below decides about the run directory; HOME and TMPDIR (caches: matplotlib's fonts) may be written
    changed = {k for k in changed if k.split(os.sep)[0] not in ("RUN", "home", "tmp")}
    assert not changed, f"written outside the case directory: {sorted(changed)[:5]}; {show}"  # (c)
    if not run_may_change:
        assert _hash_tree(box.run) == box.run_hash, f"the existing run directory changed; {show}"  # (d)
    shutil.rmtree(case, ignore_errors=True)
    if os.environ.get("FUZZ_STATS"):
        with open(os.environ["FUZZ_STATS"], "a") as f:
            f.write(json.dumps([argv[0], code, (err.strip().splitlines() or [""])[-1][:150]]) + "\n")
    return code, err


# --- values ---

NUMBERS = st.one_of(
    st.integers(-5, 5).map(str), st.integers(-2 ** 70, 2 ** 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "-0", "0.0", "1_000", "0x10", " 3 ", "1e-320", "", "abc"]))
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"), max_size=10)
PATHS = st.sampled_from(["missing", "missing/deeper/x.csv", "afile.txt", "afile.txt/below", "adir", "", ".",
                         "ünïcødé dir", "{RUN}", "{RUN}/config.json", "{RUN}/metrics.jsonl", "{RUN}/checkpoint.pt",
                         "{RUN}/participation.csv"])
VALUES = st.one_of(NUMBERS, TEXT, PATHS)
TYPED = {int: st.one_of(st.integers(-3, 50), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, 1, 2 ** 63])).map(str),
         float: st.one_of(st.floats(-10, 10), st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "1", "0.5", "1e-300"]).map(float)
                          ).map(repr)}
PATH_OPTS = {"--out", "--config", "--data-dir", "--trace", "--device-trace", "--clock-profile", "--results",
             "--dir", "--broker-config", "--links", "--broker-dir"}
# flags that could make a run expensive: cheap or invalid values only
CHEAP = {
    "--rounds": st.sampled_from(["1", "2", "0", "-1", "nan", "1.5", "", "9" * 30]),
    "--clients": st.sampled_from(["1", "2", "4", "6", "0", "-3", "x", "9" * 30]),
    "--agents": st.sampled_from(["1", "4", "0", "-3", "x"]),
    "--steps": st.sampled_from(["1", "2", "0", "-1", "x"]),
    "--epochs": st.sampled_from(["0", "-1", "x", "1e3"]),
    "--model": st.sampled_from(["logreg", "mlp", "vgg11", "", "ünï", "LOGREG"]),
    "--engine": st.sampled_from(["loop", "batch", "", "x"]),
    "--threads": st.sampled_from(["1", "0", "-1", "x", "9" * 30]),
    "--dataset": st.sampled_from(["fmnist", "cifar10", "svhn", "", "ü"]),
    "--trials": st.sampled_from(["1", "0", "-1", "x"]),
    "--wait-timeout": st.sampled_from(["0.5", "0", "-1", "nan", "inf", "x"]),
    "--horizon": st.sampled_from(["10", "0", "-5", "nan", "inf", "1e400", "x"]),
}
SKIP = {"-h", "--help", "--debug", "--resume", "--overwrite"}


def _fill(v: str, case: Path, box: Sandbox) -> str:
    return v.replace("{RUN}", str(box.run))


def _options(parser) -> dict[str, object]:
    return {o: a for o, a in parser._option_string_actions.items() if o not in SKIP}


def _subparsers(parser) -> dict:
    for a in parser._actions:
        if a.__class__.__name__ == "_SubParsersAction":
            return a.choices
    return {}


SUBS = _subparsers(cli.build_parser())


@st.composite
def flag_args(draw, parser) -> list[str]:
    opts = _options(parser)
    argv: list[str] = []
    names = draw(st.lists(st.sampled_from(sorted(opts)), max_size=6)) if opts else []
    for name in names:
        action = opts[name]
        if action.nargs == 0:
            argv.append(name)
            continue
        if name in CHEAP:
            value = draw(CHEAP[name])
        elif name in PATH_OPTS:
            value = draw(PATHS)
        elif action.choices:
            value = draw(st.one_of(st.sampled_from(sorted(map(str, action.choices))), TEXT))
        elif action.type in (int, float) and draw(st.integers(0, 3)):  # mostly a number of the right type
            value = draw(TYPED[action.type])
        else:
            value = draw(VALUES)
        argv += [name, value] if draw(st.booleans()) else [f"{name}={value}"]
    if draw(st.integers(0, 9)) == 0:  # a stray positional or an unknown option now and then
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--no-such-option", "extra", "-x", "--"])))
    return argv


# sim: every run cheap (these come first; the fuzzed flags may override them, with cheap values only)
SIM_BASE = ["--clients", "4", "--model", "logreg", "--steps", "1", "--rounds", "1", "--threads", "1",
            "--engine", "loop", "--no-progress", "--out", "out"]


def _sim_argv(fuzzed: list[str], box: Sandbox, case: Path, head=("sim",)) -> list[str]:
    return [*head, *SIM_BASE, *[_fill(a, case, box) for a in fuzzed]]


# --- 1. flags of every subcommand ---

@FUZZ
@given(fuzzed=flag_args(SUBS["sim"]))
@example(fuzzed=["--lr", "nan"])
@example(fuzzed=["--out", "afile.txt/below"])
@example(fuzzed=["--out", "{RUN}"])
@example(fuzzed=["--availability", "replay", "--trace", "{RUN}/checkpoint.pt"])
@example(fuzzed=["--availability", "device-trace", "--device-trace", "{RUN}/config.json"])
@example(fuzzed=["--clock-profile", "{RUN}/checkpoint.pt"])
@example(fuzzed=["--data-dir", "afile.txt", "--dataset", "cifar10"])
@example(fuzzed=["--seed", "99999999999999999999999"])
def test_sim_flags(box, fuzzed):
    case = box.case_dir()
    check(box, _sim_argv(fuzzed, box, case), case)


@FUZZ
@given(sub=st.sampled_from(["trace", "provision", "report", "reproduce", "links"]), data=st.data())
def test_other_subcommand_flags(box, monkeypatch, sub, data):
    import coordinator.cli.links as links_cli
    monkeypatch.setattr(links_cli, "_cli", lambda args: 0)  # links: parsing only (needs root and namespaces)
    case = box.case_dir()
    parser = SUBS[sub]
    argv = [sub]
    inner = _subparsers(parser)
    if inner:
        action = data.draw(st.sampled_from(sorted(inner)))
        argv.append(action)
        parser = inner[action]
    positionals = [a for a in parser._actions if not a.option_strings and a.dest not in ("help",)]
    for a in positionals:
        if a.choices:
            argv.append(data.draw(st.one_of(st.sampled_from(sorted(a.choices)), TEXT)))
        elif a.dest in ("runs", "path", "pickle", "dir"):
            argv.append(data.draw(PATHS))
        elif a.dest == "out":
            argv.append(data.draw(st.sampled_from(["new.csv", "adir", "afile.txt/below", "missing/x.csv"])))
        else:
            argv.append(data.draw(TEXT))
    if data.draw(st.integers(0, 5)) == 0 and argv[1:]:  # sometimes leave out a positional
        argv.pop()
    argv += data.draw(flag_args(parser))
    if sub == "reproduce":
        argv += ["--report-only", "--no-progress"]
    if sub == "provision" and argv[1:2] == ["init"] and data.draw(st.booleans()):
        argv[2:3] = ["newbroker"]
    check(box, [_fill(a, case, box) for a in argv], case)


# --- 2. config files for dropfl sim ---

SIM_KEYS = {name: [f.name for f in __import__("dataclasses").fields(factory())] for name, factory in SECTIONS.items()}
SCALARS = st.one_of(st.integers(-3, 40), st.integers(-2 ** 80, 2 ** 80), st.floats(allow_nan=True),
                    st.booleans(), st.text(max_size=8), st.sampled_from(["", "\x00", "a\x00b", "ü" * 30, "fmnist",
                                                                          "logreg", "replay", "afile.txt"]))
JSONISH = st.recursive(st.one_of(st.none(), SCALARS),
                       lambda inner: st.one_of(st.lists(inner, max_size=3),
                                               st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                       max_leaves=6)


@st.composite
def sim_config(draw) -> dict:
    cfg: dict = {}
    for section in draw(st.lists(st.sampled_from([*SIM_KEYS, "trainig", ""]), max_size=4, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            cfg[section] = draw(JSONISH)  # a section that is not a table
            continue
        keys = SIM_KEYS.get(section, ["x"]) + ["clinets", "ünknown"]
        cfg[section] = draw(st.dictionaries(st.sampled_from(keys), JSONISH, max_size=4))
    return cfg


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {_toml_value(x)}"
                               for k, x in v.items() if x is not None) + "}"
    return '""'


def to_toml(cfg: dict) -> str:
    lines = []
    for section, values in cfg.items():
        if not isinstance(values, dict):
            if values is not None:
                lines.append(f"{json.dumps(section, ensure_ascii=False)} = {_toml_value(values)}")
            continue
        lines.append(f"[{json.dumps(section, ensure_ascii=False)}]")
        lines += [f"{json.dumps(k, ensure_ascii=False)} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


GARBAGE = st.one_of(st.binary(max_size=40), st.sampled_from([b"", b"\xff\xfe\x00garbage", b"[1, 2]", b"3", b"null",
                                                            b'"text"', b"[[1]]", b"[{}]", b"= = =", b"\x00" * 8]))


def _write_config(case: Path, cfg, kind: str, raw: bytes | None) -> Path:
    path = case / ("cfg.json" if kind == "json" else "cfg.toml")
    if raw is not None:
        path.write_bytes(raw)
    elif kind == "json":
        path.write_text(json.dumps(cfg, ensure_ascii=False))  # NaN/Infinity for non-finite floats
    else:
        path.write_text(to_toml(cfg))
    return path


@FUZZ
@given(cfg=sim_config(), kind=st.sampled_from(["json", "toml"]), raw=st.one_of(st.none(), st.none(), GARBAGE))
@example(cfg={}, kind="json", raw=b"\xff\xfe\x00garbage")
@example(cfg={}, kind="json", raw=b"[1, 2]")
@example(cfg={}, kind="json", raw=b"3")
@example(cfg={}, kind="json", raw=b"[{}]")
@example(cfg={"data": {"data_dir": "a\x00b"}}, kind="json", raw=None)
@example(cfg={"clock": {"profile": "a\x00b"}}, kind="toml", raw=None)
@example(cfg={"availability": {"kind": "replay", "trace": "\x00"}}, kind="json", raw=None)
@example(cfg={"run": {"seed": 2 ** 80}}, kind="toml", raw=None)
@example(cfg={"train": {"lr": float("nan")}}, kind="json", raw=None)
def test_sim_config_file(box, cfg, kind, raw):
    case = box.case_dir()
    path = _write_config(case, cfg, kind, raw)
    check(box, _sim_argv(["--config", str(path)], box, case), case)


# --- 3. traces for --availability replay / device-trace ---

CELL = st.one_of(st.integers(-3, 6).map(str), st.sampled_from(["", "nan", "inf", "-1", "1e400", "9" * 25, "x", "ü",
                                                                "participated", "unavailable", "dropped",
                                                                "not_selected", "battery", "0.5", "1", "0"]))
PARTICIPATION_HEADERS = ["round,client,status,reason", "round,client,status", "client,round,status,reason", "",
                         "round;client;status;reason", "ROUND,CLIENT,STATUS,REASON"]
DEVICE_HEADERS = ["device,t_s,online,battery_pct,charging,uplink_Bps,downlink_Bps", "device,t_s,online",
                  "device,t_s", "t_s,device,online,battery_pct", ""]


@st.composite
def trace_file(draw, headers) -> bytes:
    if draw(st.integers(0, 7)) == 0:
        return draw(GARBAGE)
    header = draw(st.sampled_from(headers))
    width = max(1, header.count(",") + 1)
    rows = draw(st.lists(st.lists(CELL, min_size=max(0, width - 1), max_size=width + 1), max_size=8))
    text = header + "\n" + "".join(",".join(r) + "\n" for r in rows)
    return text.encode()


@FUZZ
@given(kind=st.sampled_from(["replay", "device-trace"]), data=st.data())
@example(kind="replay", data=None)
@example(kind="device-trace", data=None)
def test_sim_traces(box, kind, data):
    case = box.case_dir()
    if data is None:  # the explicit examples: garbage bytes
        content = b"\xff\xfe\x00\x01garbage\n"
    else:
        content = data.draw(trace_file(PARTICIPATION_HEADERS if kind == "replay" else DEVICE_HEADERS))
    (case / "trace.csv").write_bytes(content)
    flag = "--trace" if kind == "replay" else "--device-trace"
    extra = [] if data is None else data.draw(st.lists(st.sampled_from(
        ["--min-battery", "50", "--require-charging", "--min-uplink", "1e9", "--round-seconds", "1e300",
         "--start-seconds", "-1e300", "--min-active", "9"]), max_size=3))
    check(box, _sim_argv(["--availability", kind, flag, "trace.csv", *extra], box, case), case)


# --- 4. the existing run directory: untouched without --resume/--overwrite, and with --resume on bad input ---

BAD = st.sampled_from([["--lr", "nan"], ["--clients", "0"], ["--model", "mlp"], ["--algo", "nope"],
                       ["--availability", "replay"], ["--clock-profile", "missing.json"], ["--seed", "-1"],
                       ["--dataset", "cifar10"], ["--batch-size", "7"], ["--overwrite"], ["--partition", "iid"],
                       ["--config", "{RUN}/checkpoint.pt"], ["--data-dir", "adir"], ["--threads", "0"]])


@FUZZ
@given(fuzzed=flag_args(SUBS["sim"]), bad=BAD, resume=st.booleans())
def test_existing_run_untouched(box, fuzzed, bad, resume):
    case = box.case_dir()
    fuzzed = [a for a in fuzzed if a != "--out" and not a.startswith("--out=")]
    argv = ["sim", *TINY_RUN[1:], "--threads", "1", *[_fill(a, case, box) for a in [*fuzzed, *bad]],
            "--out", str(box.run)]
    if resume or bad == ["--overwrite"]:  # --overwrite is bad input only beside --resume (alone it replaces RUN)
        argv.append("--resume")
    code, err = check(box, argv, case)
    assert code != 0, f"{argv!r} should have failed: {err}"


# --- 5. dropfl coordinator / trial / client: validation only, never a broker ---

@pytest.fixture()
def no_network(monkeypatch):
    """Replace what would connect: the field run (after check_out), the trial's processes, the agent's loop."""
    import coordinator.cli.coordinator as coord_cli
    import coordinator.cli.trial as trial_cli
    import edge_client.agent as agent_pkg
    from coordinator.rundir import check_out

    def field_stub(cfg, fc, out, resume=False, progress=True, overwrite=False):
        # what reaches the network must be valid: a NaN deadline or an infinite wait would hang the run
        for name in ("deadline_s", "heartbeat_timeout_s", "wait_timeout_s", "round_wait_s"):
            v = getattr(fc, name)
            assert math.isfinite(v) and v >= 0 and (v > 0 or name in ("wait_timeout_s", "round_wait_s")), (name, v)
        assert fc.chunk_bytes >= 1 and fc.wait_agents >= 0, fc
        check_out(out, resume, overwrite)

    def trial_stub(cfg, out, profiles, deadline_s, heartbeat_s, max_slowdown, progress, links=None,
                   broker_dir=None, broker_outage_timeout_s=300.0, resume=False, overwrite=False, coordinator=None,
                   checked=False, restart_agents="on-failure", restart_delay_s=1.0):
        assert checked  # the CLI ran check_trial: everything a trial is given, before the run starts or writes
        assert restart_agents in ("on-failure", "no") and 0 < restart_delay_s <= 15, (restart_agents, restart_delay_s)
        assert math.isfinite(broker_outage_timeout_s) and broker_outage_timeout_s > 0, broker_outage_timeout_s
        assert all(math.isfinite(v) for v in (deadline_s, heartbeat_s, max_slowdown)), (deadline_s, heartbeat_s)
        assert deadline_s > 0 and heartbeat_s > 0 and max_slowdown >= 0, (deadline_s, heartbeat_s, max_slowdown)
        # the coordinator's other field options: as its own checks would have them (FIELD_LIMITS)
        from coordinator.cli.coordinator import FIELD_LIMITS
        for name, v in (coordinator or {}).items():
            if name in FIELD_LIMITS:
                assert math.isfinite(v) and v >= 0 and (v > 0 or "gt" not in FIELD_LIMITS[name]), (name, v)
        return "stub"

    def agent_run(self):  # what Agent.run does before it waits on the broker
        try:
            self.link.mqtt.connect_async(*self.link.brokers.address, keepalive=self.cfg.agent.keepalive_s)
        finally:
            self.heartbeat._trace_file.close()

    monkeypatch.setattr(coord_cli, "run_field", field_stub)
    monkeypatch.setattr(trial_cli, "run_trial", trial_stub)
    monkeypatch.setattr(datasets, "load", _cached_load)  # check_trial reads the dataset; once here, not per case
    monkeypatch.setattr(agent_pkg.Agent, "run", agent_run)
    monkeypatch.setattr(agent_pkg.signal, "signal", lambda *a: None)


@FUZZ
@given(sub=st.sampled_from(["coordinator", "trial"]), data=st.data())
@example(sub="coordinator", data=None)
@example(sub="trial", data=None)
def test_field_flags(box, no_network, sub, data):
    case = box.case_dir()
    if data is None:
        fuzzed = ["--deadline", "nan", "--heartbeat" if sub == "trial" else "--wait-timeout", "inf"]
    else:
        fuzzed = data.draw(flag_args(SUBS[sub]))
    if sub == "trial":  # no --engine: a trial refuses the simulation's options
        argv = ["trial", "--agents", "4", *TRIAL_BASE, *[_fill(a, case, box) for a in fuzzed]]
    else:
        argv = _sim_argv(fuzzed, box, case, head=(sub,))
    check(box, argv, case)


TRIAL_BASE = [a for i, a in enumerate(SIM_BASE) if "--engine" not in SIM_BASE[max(i - 1, 0):i + 1]]
_cached_load = functools.lru_cache(maxsize=2)(datasets.load)


@pytest.mark.parametrize("fuzzed", [
    ["--availability", "bounded"], ["--engine", "loop"], ["--broker", "mqtt://127.0.0.1:1"],
    ["--upload-extension", "1.5", "--heartbeat-timeout", "3", "--round-wait", "2", "--run-id=-x"],
    ["--heartbeat-timeout", "0.1"], ["--wait-agents", "5"], ["--out", "{RUN}"], ["--out", "{RUN}", "--overwrite"],
    ["--resume", "{RUN}"], ["--resume", "adir"], ["--config", "{RUN}/config.json"], ["--links", "afile.txt"],
    ["--broker-dir", "adir"], ["--model", "vgg11", "--dataset", "mnist"]])
def test_trial_examples(box, no_network, fuzzed):
    """The trial's own cases: its coordinator options, and what it refuses before anything starts or is written."""
    case = box.case_dir()
    code, err = check(box, ["trial", "--agents", "4", *TRIAL_BASE, *[_fill(a, case, box) for a in fuzzed]], case,
                      run_may_change="--overwrite" in fuzzed)
    ok = fuzzed[0] in ("--upload-extension", "--config") or "--overwrite" in fuzzed  # a sim run's config.json: ok
    assert code == (0 if ok else 2), err


def _agent_keys() -> dict[str, list[str]]:
    import dataclasses

    from edge_client.agent.config import AgentConfig
    return {f.name: [g.name for g in dataclasses.fields(f.default_factory())] for f in dataclasses.fields(AgentConfig)}


AGENT_KEYS = _agent_keys()
AGENT_BASE = {"agent": {"client": 0, "out": "agentout"}, "data": {"clients": 4}, "model": {"model": "logreg"},
              "battery": {"source": "mains"}}
AGENT_VALUES = st.one_of(JSONISH, st.sampled_from(["../escape", "a/b", "+", "#", "client-1", "", "mqtt://127.0.0.1:1",
                                                   "mqtts://127.0.0.1:1", "tcp://", "model", "trace", "psutil"]))


@st.composite
def agent_config(draw) -> dict:
    cfg = json.loads(json.dumps(AGENT_BASE))
    for section in draw(st.lists(st.sampled_from([*AGENT_KEYS, "agentt"]), max_size=3, unique=True)):
        keys = AGENT_KEYS.get(section, ["x"]) + ["unknown"]
        values = draw(st.dictionaries(st.sampled_from(keys), AGENT_VALUES, max_size=4))
        if section == "agent":
            values.pop("out", None)  # stays in the case directory
        cfg.setdefault(section, {}).update(values)
    return cfg


@FUZZ
@given(cfg=agent_config(), kind=st.sampled_from(["json", "toml"]), raw=st.one_of(st.none(), st.none(), GARBAGE))
@example(cfg=AGENT_BASE | {"agent": {"client": 0, "device_id": "../escape"}}, kind="json", raw=None)
@example(cfg=AGENT_BASE | {"agent": {"client": 0, "out": "agentout", "threads": 0}}, kind="json", raw=None)
@example(cfg=AGENT_BASE | {"agent": {"client": 0, "out": "agentout", "keepalive_s": -1}}, kind="json", raw=None)
@example(cfg=AGENT_BASE | {"agent": {"client": 0, "out": "agentout", "broker": "mqtt://:x"}}, kind="toml", raw=None)
@example(cfg=AGENT_BASE | {"battery": {"source": "trace", "trace": "afile.txt"}}, kind="toml", raw=None)
@example(cfg={}, kind="toml", raw=b"\xff\xfe\x00garbage")
def test_client_config(box, no_network, cfg, kind, raw):
    case = box.case_dir()
    path = _write_config(case, cfg, kind, raw)
    check(box, ["client", "--config", str(path)], case)


# --- 6. trace import-fedscale with odd pickles ---

PICKLES = st.one_of(
    st.dictionaries(st.integers(0, 3), st.fixed_dictionaries({"active": st.lists(st.floats(0, 50), max_size=2),
                                                              "inactive": st.lists(st.floats(0, 50), max_size=2),
                                                              "finish_time": st.floats(1, 100)}), max_size=3),
    st.dictionaries(st.one_of(st.integers(-2, 5), st.text(max_size=3)),
                    st.one_of(st.fixed_dictionaries({"active": st.lists(st.floats(-10, 100), max_size=3),
                                                     "inactive": st.lists(st.floats(-10, 100), max_size=3),
                                                     "finish_time": st.one_of(st.floats(1, 200), st.sampled_from(
                                                         [0, -1, float("nan"), float("inf"), "x", None]))}),
                              JSONISH), max_size=3),
    JSONISH)


@FUZZ
@example(obj={0: {"active": [1.0], "inactive": [5.0], "finish_time": 10.0}}, flags=["--horizon"], data=None)
@example(obj={0: {"active": [1.0], "inactive": [5.0], "finish_time": 10.0}}, flags=["--max-devices"], data=None)
@given(obj=PICKLES, flags=st.lists(st.sampled_from(["--horizon", "--max-devices"]), max_size=2, unique=True),
       data=st.data())
def test_trace_import(box, obj, flags, data):
    case = box.case_dir()
    (case / "t.pkl").write_bytes(pickle.dumps(obj))
    argv = ["trace", "import-fedscale", "t.pkl", "out.csv"]
    for f in flags:
        if data is None:  # the explicit examples: inf (never ended: OverflowError), -1 (silently all but one)
            argv += [f, "inf" if f == "--horizon" else "-1"]
        else:
            argv += [f, data.draw(CHEAP["--horizon"] if f == "--horizon" else st.sampled_from(["1", "0", "-1", "x"]))]
    code, err = check(box, argv, case)
    if data is None:
        assert code == 2, err


# --- regressions found by the fuzzer, as plain tests ---

@pytest.mark.parametrize("extra, message", [
    (["--broker", "mqtt://127.0.0.1:99999"], "--broker: broker 'mqtt://127.0.0.1:99999': expected"),
    (["--deadline", "nan"], "field.deadline_s must be a finite number > 0 (got nan from --deadline)"),
    (["--wait-timeout", "-1"], "field.wait_timeout_s must be a finite number ≥ 0 (got -1.0 from --wait-timeout)"),
])
def test_coordinator_field_options_checked_before_writing(box, no_network, extra, message):
    case = box.case_dir()
    code, err = check(box, ["coordinator", *SIM_BASE, *extra], case)
    assert code == 2 and message in err and not (case / "out").exists()


# --- plugin names and plugin options (an Options dataclass: docs/extending.md) ---

@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """tests/plugin_fixtures.py's plugins, good and bad, on sys.path as PYTHONPATH would put them (outside the
    sandbox; no bytecode written); nothing is registered into dropfl's registries."""
    import sys

    from plugin_fixtures import BROKEN, MOD, SYNTAX, write_plugins

    src = write_plugins(tmp_path_factory.mktemp("fuzzplugins"))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(src))
    mp.setattr(sys, "dont_write_bytecode", True)
    yield MOD, BROKEN, SYNTAX
    mp.undo()
    for m in (MOD, BROKEN, SYNTAX):
        sys.modules.pop(m, None)


PLUGIN_ATTRS = ["FedAvgM", "Plain", "NotADataclass", "ListOption", "Required", "NoOptionsParameter", "NoWeighting",
                "Markov", "markov_factory", "MarkovNoOptionsParameter", "Missing", "BUILT", ""]
OPTION_KEYS = ["momentum", "nesterov", "schedule", "clip", "label", "p_off", "p_on"] * 3 + ["momentun", "", " momentum",
                                                                                      "a=b", "ü"]
OPTION_TEXT = st.one_of(NUMBERS, TEXT, st.sampled_from(["true", "false", "yes", "none", "null", "halving", "constant",
                                                        "0.5", "1.5", "0", "1", "-0.1", "1e400"]))


@st.composite
def plugin_flags(draw, mod: str, broken: str, syntax: str) -> tuple[list[str], dict]:
    """(flags, [strategy]/[availability] tables for a config file): a plugin of some module per kind, its options."""
    module = st.sampled_from([mod] * 6 + [broken, syntax, "no_such_module_qq", ""])
    argv: list[str] = []
    tables: dict = {}
    for kind, flag, opt_flag in (("strategy", "--algo", "--strategy-option"),
                                 ("availability", "--availability", "--availability-option")):
        if draw(st.integers(0, 4)):
            name = draw(st.one_of(st.builds(lambda m, a: f"{m}:{a}", module, st.sampled_from(PLUGIN_ATTRS)),
                                  st.sampled_from(["fedavg", "mimic", "static", "always", f"{mod}"])))
            argv += [flag, name]
        for _ in range(draw(st.integers(0, 3))):
            pair = f"{draw(st.sampled_from(OPTION_KEYS))}={draw(OPTION_TEXT)}"
            argv += [opt_flag, pair if draw(st.integers(0, 9)) else pair.partition("=")[0]]   # now and then no '='
        if draw(st.integers(0, 3)) == 0:
            tables[kind] = {"options": draw(st.one_of(
                st.dictionaries(st.sampled_from(OPTION_KEYS), SCALARS, max_size=3), JSONISH))}
    return argv, tables


@FUZZ
@given(data=st.data())
@example(data=None)
def test_plugin_names_and_options(box, plugin_path, data):
    mod, broken, syntax = plugin_path
    case = box.case_dir()
    if data is None:   # a valid plugin with valid options from a flag and a config file: a run
        flags, tables = ["--algo", f"{mod}:FedAvgM", "--strategy-option", "momentum=0.5"], {
            "availability": {"kind": f"{mod}:Markov", "options": {"p_on": 1}}}
    else:
        flags, tables = data.draw(plugin_flags(mod, broken, syntax))
    if tables:
        (case / "plugin.json").write_text(json.dumps(tables))
        flags = ["--config", "plugin.json", *flags]
    code, err = check(box, _sim_argv(flags, box, case), case)
    if data is None:
        assert code == 0, err
    last = err.strip().splitlines()[-1] if code else ""
    if "-option " in last or ".options" in last:   # an error about an option names the plugin it is for
        names = [v for a, v in zip(flags, flags[1:]) if a in ("--algo", "--availability")]
        names += [t["kind"] for t in tables.values() if isinstance(t, dict) and "kind" in t] + ["fedavg", "always"]
        assert any(n and n in last for n in names) or "KEY=VALUE" in last or "must be a table" in last, last
