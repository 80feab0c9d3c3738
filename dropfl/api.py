"""The entry points of the public API (docs/api.md): `simulate`, `replay`, `field`, and `RunDirectory`.

Each checks its input exactly as the matching `dropfl` command does, with the command's own functions
(`coordinator.config.resolve`/`validate`, `runsetup.setup_run`, `cli.coordinator.field_config`), before
anything is written, and raises `UserError` with the line the command prints after `dropfl: error: `.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping
from pathlib import Path

from coordinator import config as _config
from coordinator import errors
from coordinator.config import SimConfig
from coordinator.errors import UserError
from dropfl import _guard

PathLike = str | Path
ConfigLike = SimConfig | Mapping | PathLike | None


def _algos() -> list[str]:
    from coordinator.strategies import STRATEGIES
    return list(STRATEGIES)


def load_config(config: ConfigLike = None) -> SimConfig:
    """A checked `SimConfig` from a `SimConfig` (copied, never changed), a mapping of sections as in a config
    file ({"data": {"clients": 4}, ...}), the path of a TOML/JSON config file (a run's config.json too), or
    None (the defaults). The checks are `dropfl sim`'s (coordinator/config.py `validate`); bad input raises
    UserError with the command's message."""
    algos = _algos()
    if config is None:
        cfg = SimConfig()
    elif isinstance(config, SimConfig):
        cfg = copy.deepcopy(config)
    elif isinstance(config, (str, Path)):
        return _config.resolve(argparse.Namespace(config=str(config)), algos)   # `dropfl sim --config FILE`
    elif isinstance(config, Mapping):
        data = _config.upgrade_renamed(dict(config), "config")
        cfg = SimConfig(**_config.fill_sections(_config.SECTIONS, data, UserError, where="config"))
    else:
        raise UserError(f"config must be a SimConfig, a mapping of sections or a config file's path "
                        f"(got {type(config).__name__})")
    _config.validate(cfg, algos)
    for line in _config.inert_settings(cfg):   # an option that does nothing here: one warning, as the CLI's
        _config.log.warning("%s", line)
    return cfg


def simulate(config: ConfigLike = None, out: PathLike | None = None, *, resume: bool = False,
             overwrite: bool = False, progress: bool = False) -> RunDirectory:
    """Run a simulation, as `dropfl sim`, and return its run directory.

    `config`: see `load_config`. `out`: the run directory (default: `config.run.out`, else `dropfl sim`'s
    runs/<algo>-<availability>-<dataset>-s<seed>, relative to the working directory). `resume`, `overwrite`:
    as `--resume` and `--overwrite` (a directory that holds a run is never touched without one of them).
    `progress`: the progress bar / per-evaluation lines on stderr.

    Raises UserError for bad input (nothing written), RunFailure where the run failed in a way the user can act
    on, FloatingPointError where the model diverged (recorded in the run directory's diverged.json). With the
    batched engine (the default) the call must not run when the script is imported again by the engine's worker
    processes: see `MainGuardError` (docs/api.md)."""
    _guard.check_not_bootstrapping("simulate")
    cfg = load_config(config)
    return _run_sim(cfg, out, resume=resume, overwrite=overwrite, progress=progress)


def _run_sim(cfg: SimConfig, out: PathLike | None, *, resume: bool, overwrite: bool, progress: bool,
             what: str = "simulate") -> RunDirectory:
    from coordinator.cli.sim import default_out

    out = str(out) if out is not None else cfg.run.out or default_out(cfg)
    cfg.run.out = out
    if cfg.train.engine == "batched" and cfg.train.device != "cuda":   # worker processes, started by spawn
        _guard.check_caller(what)
    from coordinator.sim.run import run_sim
    from edge_client import logs

    errors.current_run_dir = None
    try:
        rundir = run_sim(cfg, out, resume=resume, progress=progress, overwrite=overwrite)
    finally:
        logs.detach_run_files()   # the caller's next run must not log into this run's files
    return RunDirectory(rundir.path)


def replay(trace: PathLike, out: PathLike | None = None, *, config: ConfigLike = None, algo: str | None = None,
           selection: str = "auto", resume: bool = False, overwrite: bool = False,
           progress: bool = False) -> RunDirectory:
    """Replay a recorded participation log in simulation (`dropfl sim --availability replay --trace ...`).

    `trace`: a run directory, its participation.csv, or its columnar participation/ (a simulation's or a field
    trial's). `config`: default the recorded run's config.json (beside the log); `algo`: another strategy on the
    same availability. `selection`: "auto", "log" (the recorded selection, exact) or "strategy"
    (`--replay-selection`). The rest as `simulate`."""
    _guard.check_not_bootstrapping("replay")
    path = Path(trace)
    if path.is_dir() and path.name != "participation":
        if (path / "participation.csv").exists():
            path = path / "participation.csv"
        elif (path / "participation").is_dir():
            path = path / "participation"
        else:
            raise UserError(f"--trace: {trace} holds no participation log (participation.csv or participation/); "
                            f"give a run directory or its log")
    if config is None:
        saved = path.with_name("config.json")
        if not saved.is_file():
            raise UserError(f"--trace: {path} has no config.json beside it; pass config= (the recorded run's "
                            f"settings)")
        config = saved
    cfg = load_config(config)
    cfg.availability.kind, cfg.availability.trace = "replay", str(path)
    cfg.availability.options = {}   # the recorded availability model's own options (a plugin's): not replay's
    cfg.availability.replay_selection = selection
    if algo is not None and algo != cfg.strategy.algo:
        cfg.strategy.algo, cfg.strategy.options = algo, {}   # the recorded strategy's options are its own
    _config.validate(cfg, _algos())   # the changed fields, checked as flags would be
    return _run_sim(cfg, out, resume=resume, overwrite=overwrite, progress=progress, what="replay")


def field(config: ConfigLike, out: PathLike, field_config=None, *, broker_config: PathLike | None = None,
          resume: bool = False, overwrite: bool = False, progress: bool = False) -> RunDirectory:
    """A field run: the round loop over MQTT with real edge agents (`dropfl coordinator`), until it ends.

    `field_config`: a `FieldConfig` (broker URL, deadline, agents to wait for, ...; default: its defaults, or on
    `resume` the run's field.json); the options `dropfl coordinator` has flags for are checked as the flags are.
    `broker_config`: a provisioned broker's coordinator.json (`--broker-config`). Needs a broker and agents
    (docs/field-mode.md). Raises as `simulate`, and RunFailure after a broker outage longer than its timeout."""
    from coordinator.cli import coordinator as cli_coordinator
    from coordinator.field.connection import FieldConfig
    from coordinator.field.run import run_field
    from edge_client import logs

    cfg = load_config(config)
    cli_coordinator.check_field_mode(cfg)
    out = str(out)
    cfg.run.out = out
    given = field_config or FieldConfig()
    default = FieldConfig()
    flags = {f"field.{dest}": getattr(given, dest) for dest, _, _ in cli_coordinator.FIELD_OPTIONS.values()
             if getattr(given, dest) != getattr(default, dest)}
    ns = argparse.Namespace(broker_config=str(broker_config) if broker_config else None, **flags)
    fc = cli_coordinator.field_config(ns, Path(out), resume)
    if broker_config is None:
        for f in ("username", "password", "ca_file"):
            if getattr(given, f) != getattr(default, f):
                setattr(fc, f, getattr(given, f))
    fc.max_tensor_bytes = given.max_tensor_bytes
    errors.current_run_dir = None
    try:
        run_field(cfg, fc, out, resume=resume, progress=progress, overwrite=overwrite)
    finally:
        logs.detach_run_files()
    return RunDirectory(out)


class RunDirectory:
    """A run directory read back (docs/run-directory.md): its config, metrics and participation log. Works while
    the run is still being written (a half-written last metrics line is left out)."""

    def __init__(self, path: PathLike):
        from coordinator.dashboard.rundata import RUN_MARKERS, is_run_dir

        self.path = Path(path)
        if not is_run_dir(self.path):
            raise UserError(f"{path} holds no run (none of {', '.join(RUN_MARKERS)}); give the --out directory "
                            f"of a run")

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    def config_dict(self) -> dict:
        """config.json as written (every section and field)."""
        p = self.path / "config.json"
        try:
            return json.loads(p.read_text())
        except OSError as e:
            raise UserError(f"{p}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise UserError(f"{p} is damaged ({e}); restore it") from None

    def config(self) -> SimConfig:
        """config.json as a checked SimConfig (what `simulate` would run again)."""
        return load_config(self.path / "config.json")

    def metrics(self) -> list[dict]:
        """metrics.jsonl's rows, one per finished round (schema in docs/run-directory.md)."""
        from coordinator.rundir import read_metrics

        p = self.path / "metrics.jsonl"
        return read_metrics(p, tolerate_torn_tail=True) if p.exists() else []

    @property
    def final(self) -> dict | None:
        """The last evaluated round's metrics row (round, accuracy, loss, uploads, ...), or None."""
        rows = [r for r in self.metrics() if r.get("accuracy") is not None]
        return rows[-1] if rows else None

    @property
    def finished(self) -> bool:
        """Whether the run wrote its final model (model.pt)."""
        return (self.path / "model.pt").exists()

    def participation(self) -> list[dict]:
        """The participation log's rows, {round, client, status, reason} (rounds and clients as int), from
        participation.csv or the columnar participation/; statuses and reasons as in docs/traces.md."""
        from coordinator.availability import columnar
        from coordinator.availability.participation import read_rows

        if (self.path / columnar.DIR).is_dir():
            rows = columnar.to_rows(*columnar.read_columnar(self.path / columnar.DIR))
        elif (self.path / "participation.csv").exists():
            rows = read_rows(self.path / "participation.csv")
        else:
            return []
        return [{**r, "round": int(r["round"]), "client": int(r["client"])} for r in rows]

    def participation_summary(self) -> dict:
        """What `dropfl trace show` prints: rounds, clients, counts per status and per reason, participants per
        round."""
        from coordinator.cli.trace import summarise
        return summarise(self.path)

    def model_state(self) -> dict:
        """The final global model's state_dict (model.pt); load it into `edge_client.models.build_model(...)`."""
        import torch

        p = self.path / "model.pt"
        if not p.exists():
            raise UserError(f"{p} does not exist: the run has not finished")
        return torch.load(p, weights_only=True)
