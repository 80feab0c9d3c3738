"""A Flower run as a dropfl run directory (docs/run-directory.md, docs/flower.md).

`RunRecorder` writes, with dropfl's own writers (coordinator/rundir.py `RunDir`, its participation log, reports
log and metrics writer), what `dropfl report`, `dropfl dashboard` and `dropfl sim --availability replay` read:

    config.json        the dropfl config of the federation (dataset, partition, clients, seed, model, strategy,
                       availability, train settings): `dropfl sim --config RUN/config.json` runs it in dropfl
    participation.csv  one row per client per round, the schema of docs/traces.md (from `WithDropouts`' rounds)
    reports.jsonl      one row per round; every participant's report is null (Flower's replies carry no
                       dropfl ClientReport: no measured compute time or link rates)
    metrics.jsonl      round, lr, uploads, client_uploads, available, selected, participants, train_loss (the
                       participants' mean `train_loss` metric), accuracy and loss (the ServerApp's `evaluate_fn`
                       MetricRecord keys `accuracy` and `loss`, on rounds it returns them), seconds, elapsed
    model.pt           the final global model (the ArrayRecord as the config's model's state_dict)
    flower.json        the Flower side: flwr version, the strategy class, the node id ↔ partition id map
    log.txt, log.jsonl the run's log (dropfl's loggers)

No checkpoint.pt: a Flower run is not resumed by dropfl (`--resume` has nothing to continue).

`under_dropfl(strategy, context)` is the one line a ServerApp adds: when the run config has `dropfl-config`
(`dropfl flower run` passes it), the strategy runs under that config's availability (`WithDropouts`), and with
`dropfl-out` its run directory is written; without `dropfl-config` the strategy is returned as it is.
"""

from __future__ import annotations

import logging

from dropfl.flower.availability import FlowerRound, WithDropouts, from_config
from dropfl.flower.federation import config_of

log = logging.getLogger("dropfl.flower")

CONFIG_KEY, OUT_KEY, OVERWRITE_KEY = "dropfl-config", "dropfl-out", "dropfl-overwrite"


class _Unmeasured:
    """A participant's entry in reports.jsonl: Flower's reply carried no ClientReport (written as null)."""

    report = None


class RunRecorder:
    """Writes a dropfl run directory for a Flower run; `WithDropouts(recorder=...)` calls it each round.

    `config`: the federation's dropfl config (SimConfig, mapping, or file), checked as `dropfl sim` checks it.
    `out`: the directory; one that holds a run is refused unless `overwrite` (coordinator/rundir.py `check_out`),
    before anything is written."""

    def __init__(self, out, config, *, overwrite: bool = False, strategy: object = None):
        import flwr

        import dropfl
        from coordinator.rundir import RunDir, check_out
        from edge_client import logs

        self.cfg = dropfl.load_config(config)
        path = check_out(out, resume=False, overwrite=overwrite)
        self.rundir = RunDir(path, overwrite=overwrite)
        logs.attach_run_files(path)
        self.rundir.write_json("config.json", self.cfg.to_dict())
        self.flower = {"flwr": flwr.__version__, "strategy": _name(strategy), "nodes": None}
        self.rundir.write_json("flower.json", self.flower)
        self.participation = self.rundir.participation_log()
        self.reports = self.rundir.reports_log()
        self.metrics = self.rundir.metrics_writer()

    @property
    def path(self):
        return self.rundir.path

    def __call__(self, rnd: FlowerRound, row: dict) -> None:
        self.reports.write_round(rnd.round, {p: _Unmeasured for p in sorted(rnd.participated)}, [])
        self.participation.write_round(rnd.round, self.cfg.data.clients, rnd.avail, rnd.selected, rnd.participated,
                                       rnd.dropped)
        self.metrics.write(row)

    def finish(self, result, nodes=None) -> None:
        """model.pt from the final ArrayRecord; flower.json with the node map; the run's log files closed."""
        from coordinator.errors import UserError
        from dropfl.flower.federation import federation
        from edge_client import logs

        try:
            if result.arrays is not None and len(result.arrays):
                model = federation(self.cfg.to_dict()).model()
                try:
                    model.load_state_dict(result.arrays.to_torch_state_dict())
                except RuntimeError as e:
                    why = " ".join(str(e).split())[:200]
                    raise UserError(f"the app's model is not --model {self.cfg.model.model} of the dropfl config "
                                    f"({why}); build it with dropfl.flower.federation") from None
                self.rundir.save_model(model)
            if nodes is not None:
                self.flower["nodes"] = {str(p): nodes.node(p) for p in nodes.partitions()}
                self.rundir.write_json("flower.json", self.flower)
        finally:
            logs.detach_run_files()

    def close(self) -> None:
        """The run's log files closed (WithDropouts.start calls it however the run ends)."""
        from edge_client import logs

        logs.detach_run_files()


def under_dropfl(strategy, context, *, availability=None):
    """The ServerApp's strategy under dropfl, as its run config says (module docstring): `WithDropouts` over the
    availability of `dropfl-config` (or `availability`, any dropfl source), recording into `dropfl-out` if set."""
    cfg_value = context.run_config.get(CONFIG_KEY)
    if not cfg_value:
        return strategy
    import dropfl

    cfg = dropfl.load_config(config_of(cfg_value))
    _check_strategy(strategy, cfg)
    source = availability if availability is not None else from_config(cfg)
    out = context.run_config.get(OUT_KEY)
    if not out:
        return WithDropouts(strategy, source, clients=cfg.data.clients)
    recorder = RunRecorder(out, cfg, overwrite=bool(context.run_config.get(OVERWRITE_KEY, False)), strategy=strategy)
    return WithDropouts(strategy, source, clients=cfg.data.clients, recorder=recorder)


def _name(strategy) -> str | None:
    if strategy is None:
        return None
    cls = type(strategy)
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_strategy(strategy, cfg) -> None:
    """Flower's FedAvg averages the replies' weights weighted by `num-examples`: dropfl's fedavg with weighting
    samples. Said once where the config, which config.json records, says otherwise."""
    from flwr.serverapp.strategy import FedAvg

    if type(strategy) is FedAvg and (cfg.strategy.algo, cfg.strategy.weighting) != ("fedavg", "samples"):
        log.warning("the ServerApp runs Flower's FedAvg (weights averaged by num-examples), the dropfl config says "
                    "--algo %s --weighting %s; config.json records the config (for dropfl's equal: --algo fedavg "
                    "--weighting samples)", cfg.strategy.algo, cfg.strategy.weighting)
