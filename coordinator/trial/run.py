"""`dropfl trial`: a one-machine field trial. Starts a private mosquitto on a free loopback port (generated
config in a temp directory), N edge agents with heterogeneous modelled batteries (each its own process
group), and the coordinator; waits for the run; stops everything on Ctrl-C or error (no orphans).

Run directory: the coordinator's (config.json, metrics.jsonl, participation.csv, field.jsonl,
checkpoint.pt, model.pt, model.onnx) plus `agents/<id>/{agent.json,agent.log,trace.csv}`,
`device_trace.csv` (every agent's own availability trace, docs/traces.md), `coordinator.log`, and what
`dropfl trial --resume RUN` needs to start the same trial again: `trial-config.json` (the run's config)
and `trial.json` (the trial's own options, `TrialOptions`).
Replay: `dropfl sim --availability replay --trace RUN/participation.csv` with the same options.

Check first, then write (ARCHITECTURE principle 8): `check_trial` checks everything a trial is given (the run
directory, the coordinator's setup of the run, mosquitto, --broker-dir, --links) before anything is written
or started; `run_trial` calls it first unless its caller (the CLI, before it serves the dashboard) already did.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from coordinator import config
from coordinator.errors import RunFailure, UserError
from coordinator.rundir import CHECKPOINT, check_out, load_checkpoint_file
from coordinator.trial.supervise import POLICIES, Supervisor

log = logging.getLogger("dropfl.trial")

PROFILES = ("steady", "low", "charger", "mains", "flat")
DEFAULT_PROFILES = ("steady", "low", "charger", "mains")
TRIAL_JSON, TRIAL_CONFIG = "trial.json", "trial-config.json"
# what else a trial leaves in its run directory: --overwrite removes these too (and the agents' directories
# it made); the coordinator removes its own files (coordinator/rundir.py RUN_FILES)
TRIAL_FILES = (TRIAL_JSON, TRIAL_CONFIG, "device_trace.csv", "coordinator.log", "links.json")


@dataclass
class TrialOptions:
    """A trial's own options (`dropfl trial` flags beyond the run's config), saved as RUN/trial.json at the
    first start so that `dropfl trial --resume RUN` starts the same trial again. Paths are absolute."""

    agents: int
    profiles: list[str]
    deadline_s: float = 30.0
    heartbeat_s: float = 0.5
    max_slowdown: float = 0.0
    links: str | None = None
    broker_dir: str | None = None
    broker_outage_timeout_s: float = 300.0
    # the other `dropfl coordinator` field options given (FieldConfig names: heartbeat_timeout_s, run_id, ...)
    coordinator: dict = field(default_factory=dict)
    # the agents' supervision (coordinator/trial/supervise.py); a trial.json written before them: the defaults
    restart_agents: str = "on-failure"
    restart_delay_s: float = 1.0

    def save(self, out: Path) -> None:
        tmp = out / (TRIAL_JSON + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(out / TRIAL_JSON)

    @classmethod
    def load(cls, out: Path) -> TrialOptions:
        path = out / TRIAL_JSON
        try:
            opts = cls(**json.loads(path.read_text()))
            if not isinstance(opts.agents, int) or isinstance(opts.agents, bool) or opts.agents < 1 or \
                    not isinstance(opts.profiles, list) or not opts.profiles or \
                    any(p not in PROFILES for p in opts.profiles):
                raise ValueError(f"agents {opts.agents!r}, profiles {opts.profiles!r}")
            if not isinstance(opts.coordinator, dict) or set(opts.coordinator) - set(coordinator_flags()):
                raise ValueError(f"coordinator {opts.coordinator!r}")
            if opts.restart_agents not in POLICIES or not isinstance(opts.restart_delay_s, (int, float)) or \
                    not 0 < opts.restart_delay_s <= 15:
                raise ValueError(f"restart_agents {opts.restart_agents!r}, restart_delay_s {opts.restart_delay_s!r}")
        except (OSError, ValueError, TypeError) as e:  # TypeError: not an object, or keys TrialOptions lacks
            raise UserError(f"--resume: {path} is damaged ({type(e).__name__}: {str(e)[:80]}); restore it "
                            f"(it holds the trial's options: --agents, --profiles, --deadline, ...)") from None
        return opts


def battery_profile(i: int, seed: int, kind: str) -> tuple[dict, dict]:
    """(battery section, policy section) of agent i. Capacity 100 J, so 1 W drains 1 %/s: the
    dynamics play out within seconds, as a short trial's rounds do.

    steady:  60–100 %, slow drain, never plugged — usually available throughout.
    low:     starts just above the 20 % minimum, drains 1–2 %/s, plugged in from 8 s to 14 s of every
             20 s — drops out for `battery`, comes back after charging.
    charger: policy requires charging; plugged 0–3 s of every 6 s — drops out for `charging`.
    mains:   no battery, always available.
    flat:    5 %, never plugged — never available (`battery`); a known dropout for tests."""
    rng = np.random.default_rng([seed, i, 0xBA7])
    base = {"source": "model", "capacity_j": 100.0, "train_w": 20.0, "charge_w": 10.0}
    if kind == "steady":
        return base | {"start_pct": float(rng.uniform(60, 100)), "idle_w": float(rng.uniform(0.2, 0.5))}, {}
    if kind == "low":
        return base | {"start_pct": float(rng.uniform(22, 30)), "idle_w": float(rng.uniform(1, 2)),
                       "plugged": [[8.0, 14.0]], "plug_period_s": 20.0}, {}
    if kind == "charger":
        return base | {"start_pct": float(rng.uniform(50, 90)), "idle_w": 0.5, "plugged": [[0.0, 3.0]],
                       "plug_period_s": 6.0}, {"require_charging": True}
    if kind == "flat":
        return base | {"start_pct": 5.0, "idle_w": 0.0}, {}
    return {"source": "mains"}, {}


def agent_config(cfg: config.SimConfig, i: int, broker: str, out: Path, profile: str, heartbeat_s: float,
                 slowdown: float) -> dict:
    battery, policy = battery_profile(i, cfg.run.seed, profile)
    d = cfg.data
    return {"agent": {"client": i, "broker": broker, "heartbeat_s": heartbeat_s, "out": str(out),
                      "threads": 1, "slowdown_s_per_step": slowdown, "exit_when_done": True},
            "data": {"dataset": d.dataset, "data_dir": d.data_dir, "partition": d.partition, "clients": d.clients,
                     "shards_per_client": d.shards_per_client, "dirichlet_alpha": d.dirichlet_alpha,
                     "seed": cfg.run.seed},
            "model": {"model": cfg.model.model, "dropout": cfg.model.dropout},
            "policy": {"min_battery_pct": 20.0} | policy, "battery": battery}


def _stop_group(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after timeout_s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # children of the group that outlived their leader
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process group at once, then wait for (or SIGKILL) each."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        _stop_group(p)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def coordinator_flags() -> dict[str, str]:
    """{FieldConfig name: flag} of `dropfl coordinator`'s field options (coordinator/cli/coordinator.py
    FIELD_OPTIONS, the one table of them): how a trial passes them on to its coordinator."""
    from coordinator.cli.coordinator import FIELD_OPTIONS

    return {dest: flag for flag, (dest, _, _) in FIELD_OPTIONS.items()}


def heartbeat_timeout(heartbeat_s: float) -> float:
    """A trial's --heartbeat-timeout unless one is given: ten of the agents' heartbeats, at least 5 s."""
    return max(10 * heartbeat_s, 5.0)


def coordinator_command(out: Path, broker_url: str, deadline_s: float, heartbeat_s: float,
                        broker_outage_timeout_s: float, options: dict | None = None, resume: bool = False,
                        overwrite: bool = False, broker_config: Path | None = None, progress: bool = True) -> list[str]:
    """The trial's `dropfl coordinator` command line: its config is RUN/trial-config.json, its broker the trial's;
    every field option in `options` ({FieldConfig name: value}) as its flag, `--flag=value` (a value may start
    with '-'). The heartbeat timeout follows the agents' heartbeat unless `options` gives one."""
    flags = coordinator_flags()
    given = {"deadline_s": deadline_s, "heartbeat_timeout_s": heartbeat_timeout(heartbeat_s),
             "broker_outage_timeout_s": broker_outage_timeout_s} | (options or {})
    cmd = [sys.executable, "-m", "coordinator.cli", "coordinator", "--config", str(out / TRIAL_CONFIG),
           "--broker", broker_url, "--out", str(out)]
    cmd += [f"{flags[dest]}={v}" for dest, v in given.items()]
    cmd += ["--resume"] if resume else ["--overwrite"] if overwrite else []
    if broker_config is not None:  # the coordinator's account; --broker above keeps it on 127.0.0.1
        cmd += ["--broker-config", str(broker_config)]
    return cmd + ([] if progress else ["--no-progress"])


def check_trial(cfg: config.SimConfig, out: Path, links: str | Path | None = None,
                broker_dir: str | Path | None = None, resume: bool = False, overwrite: bool = False) -> None:
    """Everything a trial is given, checked before anything is written or started (UserError if not):
    the run directory (a run there only with --overwrite or --resume), what the coordinator checks when it
    sets up the run (runsetup.setup_run in field mode: strategy, dataset, binding, model, the checkpoint to
    resume, --track), that mosquitto is installed, the --broker-dir and the --links file."""
    from coordinator import runsetup

    n = cfg.data.clients
    if cfg.availability.kind != "always":
        raise UserError(f"--availability {cfg.availability.kind}: a field trial's availability comes from its "
                        f"agents (their batteries, --profiles), not from a model; leave it out")
    if broker_dir and links:
        raise UserError("--broker-dir cannot be combined with --links (the provisioned broker's listener is its own)")
    check_out(out, resume=resume, overwrite=overwrite)
    if mosquitto_exe() is None:
        raise UserError("mosquitto not found: install the Debian package (apt-get install mosquitto)")
    if broker_dir:
        _check_broker_dir(Path(broker_dir))
    if links:
        from coordinator.field.netem import Links, check_support, load_links
        Links(load_links(links, n))  # the plan, for 1..MAX_AGENTS agents (nothing is set up yet)
        check_support()  # root, ip, tc
        if resume:
            _links_record(out)
    # the coordinator's own setup checks (runsetup.check_run, mode "field"), here before the broker starts
    runsetup.check_run(cfg, str(out), mode="field", resume=resume, overwrite=overwrite, keep_dataset=False)


def mosquitto_exe() -> str | None:
    from coordinator.trial.broker import MOSQUITTO

    return shutil.which("mosquitto") or (MOSQUITTO if os.path.exists(MOSQUITTO) else None)


def _check_broker_dir(root: Path) -> None:
    """--broker-dir: a broker directory (`dropfl provision init`) with its settings and the coordinator's
    account, read only (the trial adds missing device bundles later, after every check)."""
    from provisioning import broker as prov

    try:
        prov.load_settings(prov.BrokerDir(root.resolve()))
        creds = json.loads((root / "coordinator.json").read_text())
        missing = [k for k in ("broker", "username", "password") if k not in creds]
        if missing:
            raise ValueError(f"coordinator.json lacks {', '.join(missing)}")
    except prov.ProvisionError as e:
        raise UserError(f"--broker-dir: {e}") from None
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"--broker-dir {root}: not a whole broker directory ({type(e).__name__}: {str(e)[:100]}); "
                        f"make one with `dropfl provision init DIR`") from None


def run_trial(cfg: config.SimConfig, out: Path, profiles: list[str], deadline_s: float, heartbeat_s: float,
              max_slowdown: float, progress: bool, links: str | Path | None = None,
              broker_dir: str | Path | None = None, broker_outage_timeout_s: float = 300.0,
              resume: bool = False, overwrite: bool = False, coordinator: dict | None = None,
              checked: bool = False, restart_agents: str = "on-failure", restart_delay_s: float = 1.0) -> str:
    """Run a trial in `out`. `resume`: the trial in `out` again from its last checkpoint (a new private
    broker, the same agent configs but for the broker's address, the coordinator with --resume); else a new
    trial, whose config is saved in `out`/trial-config.json first. Its options go to `out`/trial.json either way.
    `overwrite`: replace the run in `out` (the coordinator's --overwrite). `coordinator`: the coordinator's other
    field options ({FieldConfig name: value}, e.g. {"upload_extension_s": 2.0}). `checked`: `check_trial` ran
    already (the CLI's), else it runs first: nothing is written or started before it passes. `restart_agents`,
    `restart_delay_s`: how the agents are supervised while the coordinator runs (coordinator/trial/supervise.py)."""
    from coordinator.field.netem import Links, load_links
    from coordinator.trial.broker import Mosquitto
    from coordinator.trial.tls import ProvisionedBroker, device_agent_keys, write_private

    n = cfg.data.clients
    if not checked:
        check_trial(cfg, out, links, broker_dir, resume, overwrite)
    coordinator = dict(coordinator or {})
    # --- everything checked: from here on the run directory and the broker directory (bundles) are written ---
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # what check_out cannot know before it tries (root in /proc, say)
        raise UserError(f"--out {out}: cannot create the run directory ({e.strerror}); choose another --out") from None
    tls = device_agent_keys(broker_dir, n) if broker_dir else None  # agent i: device client-<i>'s bundle keys
    net = Links(load_links(links, n)) if links else None  # link emulation (coordinator/field/netem.py)
    links_before = _links_record(out) if net and resume else {}  # the interrupted sessions' link record
    if overwrite and not resume:
        _remove_trial_files(out)
    # what `dropfl trial --resume` needs, before anything starts
    TrialOptions(n, list(profiles), deadline_s, heartbeat_s, max_slowdown,
                 str(Path(links).resolve()) if links else None,
                 str(Path(broker_dir).resolve()) if broker_dir else None, broker_outage_timeout_s,
                 coordinator, restart_agents, restart_delay_s).save(out)
    if not resume:
        (out / TRIAL_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    procs: list[subprocess.Popen] = []   # the agents' current processes, then the coordinator's
    supervisor = Supervisor(restart_agents, restart_delay_s)
    logs = []
    old = signal.signal(signal.SIGTERM, _interrupt)
    py = [sys.executable, "-m", "coordinator.cli"]
    try:
        with tempfile.TemporaryDirectory(prefix="dropfl-trial-") as tmp, (net or contextlib.nullcontext()), \
                (ProvisionedBroker(broker_dir) if broker_dir
                 else Mosquitto(workdir=tmp, hosts=net.hosts if net else ())) as broker:
            # where the trial runs: info lines on stderr (hidden by --quiet, kept by --no-progress) and in the logs
            log.info("broker %s", broker.url, extra={"fields": {"broker": broker.url}})
            try:  # processes stop before the broker does: agents still publish their offline status
                for i in range(n):
                    adir = out / "agents" / f"client-{i}"
                    adir.mkdir(parents=True, exist_ok=True)
                    slow = max_slowdown * i / max(n - 1, 1)
                    url = f"mqtt://{net.host_address(i)}:{broker.port}" if net else broker.url
                    ac = agent_config(cfg, i, url, adir, profiles[i % len(profiles)], heartbeat_s, slow)
                    if tls:  # device_id, mqtts:// broker, password (so the file is 0600), ca_file
                        ac["agent"] |= tls[i]
                        write_private(adir / "agent.json", json.dumps(ac, indent=2) + "\n")
                    else:
                        (adir / "agent.json").write_text(json.dumps(ac, indent=2) + "\n")
                    if resume:  # keep the first session's own availability trace (the agent starts a new one)
                        _keep_trace(adir)
                    logs.append(open(adir / "agent.log", "a" if resume else "w"))
                    prefix = net.exec_prefix(i) if net else []  # inside agent i's network namespace
                    procs.append(supervisor.add(f"client-{i}", _agent_starter(
                        prefix + py + ["client", "--config", str(adir / "agent.json")], logs[-1], adir)))
                logs.append(open(out / "coordinator.log", "a" if resume else "w"))
                cmd = coordinator_command(out, broker.url, deadline_s, heartbeat_s, broker_outage_timeout_s,
                                          coordinator, resume, overwrite,
                                          broker.coordinator_json if broker_dir else None, progress)
                coord = subprocess.Popen(cmd, stdout=logs[-1], stderr=None if progress else subprocess.STDOUT,
                                         start_new_session=True)
                procs.append(coord)
                if net:  # trace time 0 = the first session's coordinator start; a resumed trial goes on from
                    net.start_clock(links_before.get("clock_s", 0.0))  # the trace time the last one reached
                log.info("started %d agents and the coordinator; logs in %s", n, out)
                while (rc := coord.poll()) is None:   # the agents supervised while the coordinator runs
                    supervisor.poll()
                    procs[:n] = supervisor.procs
                    time.sleep(0.2)
                if supervisor.restarts:
                    log.info("agents restarted: %s", ", ".join(f"{k} {v}x" for k, v in supervisor.restarts.items()),
                             extra={"fields": {"restarts": supervisor.restarts}})
                if rc != 0:
                    raise RunFailure(f"the coordinator failed (exit {rc}); see {out / 'coordinator.log'}"
                                     + (_resume_hint(out) if rc == 1 else ""))
                for p in procs[:-1]:  # agents exit on the coordinator's "finished"; give them a moment
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                _stop_all(procs)
                if net:
                    _write_links_record(out, net, links_before)
    finally:
        _stop_all(procs)
        for f in logs:
            f.close()
        signal.signal(signal.SIGTERM, old)
    merge_traces(out)
    return summarize(out)


def _agent_starter(cmd: list[str], logfile, adir: Path):
    """Start agent `cmd` with its output in `logfile` (open, appended to). A restart says so in the log first and
    keeps the earlier session's own trace as trace.<k>.csv (the agent starts a new trace.csv)."""
    starts = [0]

    def start() -> subprocess.Popen:
        if starts[0]:
            logfile.write(f"--- restarted by dropfl trial's supervisor ({time.strftime('%H:%M:%S')}) ---\n")
            logfile.flush()
            _keep_trace(adir)
        starts[0] += 1
        return subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    return start


def _links_record(out: Path) -> dict:
    """RUN/links.json of the sessions before a resume: {} if none; a record from before dropfl kept the trace
    clock (no "clock_s") resumes the trace at 0, as that session did, and says so."""
    path = out / "links.json"
    if not path.is_file():
        return {}
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--resume {out}: {path} is damaged ({type(e).__name__}); restore it, or move it away to "
                        f"start the link trace again at 0") from None
    if "clock_s" not in rec:
        log.warning("%s has no trace clock (written before dropfl kept one): the link trace starts again at 0", path)
    return rec


def _write_links_record(out: Path, net, before: dict) -> None:
    """RUN/links.json: the plan, every event applied in every session (trace time `at_s`), each session's span
    of trace time, and `clock_s`, the trace time reached, where `dropfl trial --resume` goes on. Nothing of
    an earlier session is dropped; written whole, then renamed (a crash leaves the old record)."""
    now = net.trace_time()
    sessions = before.get("sessions", [])
    if now is not None:
        sessions = sessions + [{"from_s": round(net.clock_from_s, 3), "to_s": round(now, 3)}]
    rec = net.plan.to_json() | {
        "applied": before.get("applied", []) + [{"at_s": at} | vars(e) for at, e in net.applied],
        "sessions": sessions, "clock_s": round(now, 3) if now is not None else before.get("clock_s", 0.0)}
    tmp = out / "links.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1) + "\n")
    tmp.replace(out / "links.json")


def _resume_hint(out: Path) -> str:
    """After a coordinator that failed (a broker outage, say): how to go on, if any round is checkpointed."""
    try:
        t = load_checkpoint_file(out / CHECKPOINT)["round"] if (out / CHECKPOINT).exists() else None
    except UserError:
        t = None
    if t is None:
        return ""
    return f"; rounds 0..{t} are checkpointed: `dropfl trial --resume {out}` continues the trial from there"


def _remove_trial_files(out: Path) -> None:
    """--overwrite: the trial's own files, and the agents' directories it made (those holding an agent.json),
    never anything else."""
    for name in TRIAL_FILES:
        (out / name).unlink(missing_ok=True)
    for adir in sorted((out / "agents").glob("*/")) if (out / "agents").is_dir() else []:
        if (adir / "agent.json").is_file():
            shutil.rmtree(adir, ignore_errors=True)


def _keep_trace(adir: Path) -> None:
    """Move an agent's trace.csv of an earlier session to trace.<k>.csv (the first free k)."""
    trace = adir / "trace.csv"
    if trace.exists():
        k = 1
        while (adir / f"trace.{k}.csv").exists():
            k += 1
        trace.replace(adir / f"trace.{k}.csv")


def merge_traces(out: Path) -> Path:
    """All agents' own traces in one device-trace CSV (docs/traces.md), ordered by device then time."""
    from edge_client.agent.heartbeat import TRACE_FIELDS

    rows = []
    for p in sorted((out / "agents").glob("*/trace.csv")):
        with open(p, newline="") as f:
            rows.extend(csv.DictReader(f))
    dest = out / "device_trace.csv"
    with open(dest, "w", newline="") as f:
        w = csv.DictWriter(f, TRACE_FIELDS, restval="")  # the agents' trace.csv columns (temp_c: optional)
        w.writeheader()
        w.writerows(rows)
    return dest


def summarize(out: Path) -> str:
    from coordinator.availability.participation import read_rows

    counts: dict[str, int] = {}
    for r in read_rows(out / "participation.csv"):
        key = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
        counts[key] = counts.get(key, 0) + 1
    rounds = [json.loads(line) for line in open(out / "field.jsonl") if '"event": "round"' in line]
    over = sorted(r["overhead_s"] for r in rounds if r.get("overhead_s") is not None)
    lines = [f"run directory: {out}", "participation: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    if over:
        lines.append(f"round overhead (wall time − slowest participant's download+train+upload): median "
                     f"{1000 * over[len(over) // 2]:.1f} ms, max {1000 * over[-1]:.1f} ms over {len(over)} rounds")
    return "\n".join(lines)
