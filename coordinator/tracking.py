"""Experiment tracking: `--track tensorboard` and `--track mlflow` mirror a run's config and its per-round
metrics into TensorBoard event files and an MLflow file store, so that runs can be watched and compared in
the tools people already use. metrics.jsonl stays the record; the trackers are observers of the round loop
(`run_rounds(..., observers=...)`) and get every row as it is written.

Where (`--track-dir DIR`, default: the run directory RUN):

    tensorboard   RUN/tb                  or DIR/tb/<run name>   (one TensorBoard run per run directory)
    mlflow        RUN/mlruns (file store) or DIR/mlruns          (experiment "dropfl", run name = <run name>,
                                                                  tag dropfl.run_dir = the run's absolute path)

What: the resolved config as hyperparameters (TensorBoard hparams and a `config` text; MLflow params, keys
"section.field"), and every numeric field of each metrics row (accuracy, loss, train_loss, participants,
available, uploads, seconds, bytes, ...) as a scalar at step = round. None and NaN (no evaluation that round)
are left out, as in metrics.jsonl.

--resume (the run continues from checkpoint round c, so rounds > c are computed again):
  tensorboard  a new event file with purge_step = c + 1: TensorBoard hides the earlier session's events of
               the rounds that are computed again (its own mechanism for restarts), so no step is shown twice;
               rounds ≤ c missing from the event files (tracking turned on at resume) are written from
               metrics.jsonl.
  mlflow       the run directory's newest MLflow run continues (the same run id) if it holds no step > c;
               MLflow cannot delete metric values, so if it does, a new MLflow run takes over, gets rounds ≤ c
               from metrics.jsonl, and the old one is marked deleted (`mlflow gc` removes it, the UI can
               restore it). Params already logged stay; a schedule setting changed at resume (--rounds ...) is
               recorded as a tag "resumed.<key>".

MLflow 3 keeps its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is set;
mlflow-skinny has no database backend, so this module sets it (a user's own setting wins).

A tracker that fails mid-run (a full disk) is switched off with one warning: a field trial of hours does not
stop for its mirror; metrics.jsonl has everything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path

from coordinator.errors import UserError

log = logging.getLogger("dropfl.tracking")

TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # name → the module it needs
INSTALL = "pip install 'dropfl[tracking]'"
EXPERIMENT = "dropfl"
RUN_TAG = "dropfl.run_dir"


def parse(value: str | None, where: str = "") -> list[str]:
    """`run.track` ("tensorboard,mlflow") as a list of tracker names, checked; None or "none" → [] ("none"
    turns off the tracking a config file asks for, e.g. a run's config.json at --resume)."""
    if value is None or str(value).strip() == "none":
        return []
    names = [s.strip() for s in str(value).split(",")]
    bad = [s for s in names if s not in TRACKERS]
    if bad or not names:
        raise UserError(f"run.track must be a comma-separated list of {', '.join(TRACKERS)} (got {value!r}"
                        f"{' ' + where if where else ''}); e.g. --track tensorboard --track mlflow, or none")
    return list(dict.fromkeys(names))


def locations(out: str | Path, track_dir: str | None) -> dict[str, Path]:
    """Where each tracker writes, for the run directory `out`."""
    run = Path(out)
    if track_dir is None:
        return {"tensorboard": run / "tb", "mlflow": run / "mlruns"}
    base = Path(track_dir)
    return {"tensorboard": base / "tb" / run.resolve().name, "mlflow": base / "mlruns"}


def check(names: list[str], out: str | Path, track_dir: str | None, resume: bool, overwrite: bool) -> None:
    """Before anything is written: the trackers' packages are installed, and a shared --track-dir does not
    already hold TensorBoard events under this run's name (unless the run is replaced or resumed)."""
    import importlib.util

    if track_dir is not None and not names:
        log.warning("--track-dir %s has no effect without --track", track_dir)
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise UserError(f"--track {name}: the {TRACKERS[name]} package is not installed; {INSTALL}")
    tb = locations(out, track_dir)["tensorboard"]
    if "tensorboard" in names and track_dir is not None and not (resume or overwrite) and _event_files(tb):
        raise UserError(f"--track-dir {track_dir}: {tb} already holds TensorBoard events of a run named "
                        f"{tb.name}; choose another --track-dir or --out, or --overwrite to replace them")
    for name in names:
        where = locations(out, track_dir)[name]
        p = where
        while not p.exists() and p.parent != p:
            p = p.parent
        if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
            raise UserError(f"--track {name}: cannot write to {where} ({p} is not a writable directory); "
                            f"choose another --track-dir")


def _event_files(d: Path) -> list[Path]:
    return sorted(d.glob("events.out.tfevents.*")) if d.is_dir() else []


def flat_config(cfg_dict: dict) -> dict[str, object]:
    """{"section.field": value} of the resolved config."""
    return {f"{s}.{k}": v for s, sec in cfg_dict.items() for k, v in sec.items()}


def scalars(row: dict) -> dict[str, float]:
    """The numeric fields of a metrics row (not the round itself, not None/NaN, not strings or booleans)."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


class TensorBoardTracker:
    """TensorBoard event files through torch.utils.tensorboard.SummaryWriter."""

    name = "tensorboard"

    def __init__(self, logdir: Path, config: dict, start: int, past_rows: list[dict]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        had = bool(_event_files(logdir))
        have = {s for s in _logged_steps(logdir) if s < start} if start > 0 else set()
        # purge_step: TensorBoard hides earlier events at steps ≥ start (a resumed run's repeated rounds; a
        # replaced or never-started run's events, start = 0)
        self.writer = SummaryWriter(str(logdir), purge_step=start if had else None, flush_secs=30)
        if start == 0 or not had:  # a new run, or tracking turned on at resume: the config as hparams and text
            flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.items()}
            for s in hparams(flat, {"accuracy": 0.0, "loss": 0.0}):
                self.writer.file_writer.add_summary(s)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
        for row in past_rows:
            if row["round"] not in have:
                self(row)

    def __call__(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, row["round"])
        self.writer.flush()  # live: rounds take seconds, a flush is cheap

    def close(self, status: str) -> None:
        self.writer.close()


def _logged_steps(logdir: Path) -> set[int]:
    """Steps of the "participants" scalar (every row has it) already in `logdir`, after TensorBoard's purges."""
    if not _event_files(logdir):
        return set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {e.step for e in ea.Scalars("participants")} if "participants" in ea.Tags()["scalars"] else set()


class MlflowTracker:
    """An MLflow run in a local file store (no server), through MlflowClient."""

    name = "mlflow"

    def __init__(self, store: Path, run_dir: Path, config: dict, start: int, past_rows: list[dict]):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT)
        old = self._previous(exp_id, run_dir) if start > 0 else None
        have = self._steps(old) if old else set()
        if old and max(have, default=-1) >= start:  # rounds after the checkpoint were logged: MLflow keeps values
            log.info("mlflow: run %s holds rounds after the checkpoint (round %d); a new MLflow run takes over "
                     "and the old one is marked deleted", old.info.run_id, start - 1)
            self.client.delete_run(old.info.run_id)
            old, have = None, set()
        params = {k: str(v)[:6000] for k, v in config.items()}
        if old:
            self.run_id = old.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            for k, v in params.items():
                if old.data.params.get(k, v) != v:
                    self.client.set_tag(self.run_id, f"resumed.{k}", v)
            params = {k: v for k, v in params.items() if k not in old.data.params}
        else:
            run = self.client.create_run(exp_id, run_name=run_dir.name, tags={RUN_TAG: str(run_dir)})
            self.run_id = run.info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        for row in past_rows:
            if row["round"] not in have:
                self(row)

    def _previous(self, exp_id: str, run_dir: Path):
        """The newest active MLflow run of this run directory (compared in Python: a path may hold quotes)."""
        runs = self.client.search_runs([exp_id], order_by=["attributes.start_time DESC"])
        return next((r for r in runs if r.data.tags.get(RUN_TAG) == str(run_dir)), None)

    def _steps(self, run) -> set[int]:
        return {m.step for key in run.data.metrics for m in self.client.get_metric_history(run.info.run_id, key)}

    def __call__(self, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, row["round"])
                                                    for k, v in scalars(row).items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class _Guarded:
    """A tracker whose failure mid-run switches it off with one warning instead of ending the run."""

    def __init__(self, tracker):
        self.tracker, self.failed = tracker, False

    def __call__(self, row: dict) -> None:
        if self.failed:
            return
        try:
            self.tracker(row)
        except Exception as e:  # any library error: the run goes on, metrics.jsonl has every row
            self.failed = True
            log.warning("--track %s: logging round %d failed (%s: %s); this tracker is off for the rest of the "
                        "run, metrics.jsonl has every round", self.tracker.name, row.get("round", -1),
                        type(e).__name__, str(e)[:200])


@contextlib.contextmanager
def trackers(cfg, run_dir: Path, checkpoint: dict | None):
    """The observers for `run_rounds`, open for the run and closed (MLflow status FINISHED, FAILED or KILLED)
    after it. `checkpoint`: the checkpoint a resumed run continues from (None: a new run)."""
    from coordinator.rundir import read_metrics

    names = parse(cfg.run.track)
    if not names:
        yield []
        return
    start = checkpoint["round"] + 1 if checkpoint is not None else 0
    metrics = run_dir / "metrics.jsonl"
    past = [r for r in read_metrics(metrics, tolerate_torn_tail=True) if r["round"] < start] \
        if start and metrics.exists() else []
    where = locations(run_dir, cfg.run.track_dir)
    config = flat_config(cfg.to_dict())
    opened = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(where[name], config, start, past))
            else:
                opened.append(MlflowTracker(where[name], run_dir.resolve(), config, start, past))
            log.info("%s in %s", name, where[name])
    except Exception as e:
        for t in opened:
            t.close("FAILED")
        raise UserError(f"--track: could not open the tracker in {where[names[len(opened)]]} "
                        f"({type(e).__name__}: {str(e)[:200]}); fix it or leave out --track") from None
    status = "FAILED"
    try:
        yield [_Guarded(t) for t in opened]
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        for t in opened:
            try:
                t.close(status)
            except Exception as e:  # closing must not hide the run's own outcome
                log.warning("--track %s: closing failed (%s: %s)", t.name, type(e).__name__, str(e)[:200])
